"""sparkfleet's own facts: what pyinfra's built-in facts do not read.

Where pyinfra has a fact the steps use it directly (``server.Arch``, ``server.Which``,
``files.File``, ``docker.DockerSystemInfo``, ``docker.DockerImage``,
``hardware.NetworkDevices``, ``files.Directory``); the files, units and trees the deploy
manages are read through :mod:`sparkfleet.snapshot`, one command per host and run. Each fact here answers one question,
cheaply; a program it needs that is missing makes it its default (``requires_command``),
not an error.
"""

from __future__ import annotations

import json
import re
import shlex

from pyinfra.api import FactBase

from sparkfleet import hostpaths

#: The manifest types a registry may answer for the serving image.
MANIFEST_ACCEPT = (
    "application/vnd.docker.distribution.manifest.v2+json,application/vnd.oci.image.manifest.v1+json,"
    "application/vnd.docker.distribution.manifest.list.v2+json,application/vnd.oci.image.index.v1+json"
)

# --- the host (preflight) ------------------------------------------------------------


#: What nvidia-smi says when the driver's userspace was updated and its kernel module was not
#: reloaded (a driver update without a reboot): every new GPU container fails the same way.
NVML_MISMATCH = "Driver/library version mismatch"


class Gpu(FactBase["dict[str, object] | None"]):
    """The first GPU as ``nvidia-smi`` reports it, or None without a working nvidia-smi.

    A driver updated without a reboot answers NVML's version mismatch: then the name fields
    are empty and ``mismatch`` holds the loaded kernel module's version and the library's
    ("" where unread)."""

    def requires_command(self) -> str:
        return "nvidia-smi"

    def command(self) -> str:
        # A driver that does not answer is an answer too: its message parses as no GPU,
        # and the preflight says what to do. On a mismatch, the version of the kernel module
        # still loaded (the library's is in nvidia-smi's message).
        return (
            "o=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>&1); "
            f'echo "$o"; case "$o" in *{shlex.quote(NVML_MISMATCH)}*) echo "kernel_module=$('
            "cat /sys/module/nvidia/version 2>/dev/null || grep -o '  [0-9][0-9.]*  ' /proc/driver/nvidia/version "
            "2>/dev/null | head -n 1 | tr -d ' ')\";; esac; true"
        )

    def process(self, output):
        if any(NVML_MISMATCH in line for line in output):
            found = dict(line.strip().split("=", 1) for line in output if line.startswith("kernel_module="))
            library = next((line.split(":", 1)[1].strip() for line in output
                            if line.startswith("NVML library version:")), "")
            return {"name": "", "compute_cap": "", "driver_version": "",
                    "mismatch": {"kernel_module": found.get("kernel_module", ""), "library": library}}
        for line in output:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[0]:
                return {"name": parts[0], "compute_cap": parts[1], "driver_version": parts[2]}
        return None


class FreeSpace(FactBase["dict[str, object]"]):
    """Free bytes and mount point of the filesystem that holds (or will hold) ``path``."""

    @staticmethod
    def default():
        return {"mount": "?", "free": 0}

    def command(self, path: str) -> str:
        # The path may not exist yet: ask about its nearest existing parent.
        return (
            f"p={shlex.quote(path)}; while [ ! -e \"$p\" ]; do p=$(dirname \"$p\"); done; "
            "df -P -B1 \"$p\" | tail -n 1"
        )

    def process(self, output):
        fields = output[-1].split() if output else []
        if len(fields) < 6:
            return {"mount": "?", "free": 0}
        return {"mount": fields[5], "free": int(fields[3])}


class Memory(FactBase["dict[str, int]"]):
    """MemTotal and MemAvailable in bytes (pyinfra's ``hardware.Memory`` has no MemAvailable)."""

    @staticmethod
    def default():
        return {}

    def command(self) -> str:
        return "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo"

    def process(self, output):
        values = {}
        for line in output:
            key, rest = line.split(":", 1)
            values[key] = int(rest.split()[0]) * 1024
        return values


class BootTarget(FactBase[str]):
    """The target the host boots to (``systemctl get-default``): DGX OS boots to the desktop,
    ``graphical.target``, whose session holds memory the engine could have."""

    @staticmethod
    def default():
        return ""

    def requires_command(self) -> str:
        return "systemctl"

    def command(self) -> str:
        return "systemctl get-default 2>/dev/null || true"

    def process(self, output):
        return output[0].strip() if output else ""


# --- weights -------------------------------------------------------------------------


class CachedSnapshot(FactBase["str | None"]):
    """The commit of a complete cached snapshot of ``repo_id@revision`` whose every blob
    was verified at its present size, or None."""

    def command(self, hf_home: str, repo_id: str, revision: str) -> str:
        marker = shlex.quote(hostpaths.snapshot_marker(hf_home, repo_id, revision))
        snapshot = shlex.quote(hostpaths.repo_cache_dir(hf_home, repo_id) + "/snapshots") + '/"$c"'
        records = shlex.quote(f"{hf_home}/sparkfleet/verified")
        # No marker, or a marker naming a snapshot that is gone: not cached. fetch_weights.py
        # records each blob's size once it matched its hash: a blob missing, truncated or
        # grown since shows here without reading it.
        return (
            f'c=$(cat {marker} 2>/dev/null) && [ -n "$c" ] && [ -d {snapshot} ] || exit 0; '
            f'find {snapshot}/ ! -type d | while read -r f; do b=$(readlink -f "$f"); '
            f's=$(stat -c %s "$b" 2>/dev/null) && [ "$(cat {records}/"${{b##*/}}" 2>/dev/null)" = "$s" ] '
            '|| { echo unverified; break; }; done; echo "commit=$c"'
        )

    def process(self, output):
        if "unverified" in output:
            return None
        commits = [line[len("commit="):] for line in output if line.startswith("commit=")]
        return commits[0] if commits else None


class HeldArtifacts(FactBase["dict"]):
    """What this host holds from downloads and pulls: runtime/fetch_weights.py's completion
    markers (``repo--name@revision`` -> commit) and the digests of the ``images`` (local
    names) it has. ``{"markers": {...}, "images": {name: [sha256:...]}}``."""

    @staticmethod
    def default():
        return {"markers": {}, "images": {}}

    def command(self, hf_home: str, images: list[str]) -> str:
        q = shlex.quote
        markers = q(hostpaths.snapshot_markers_dir(hf_home))
        inspect = "".join(
            f"docker image inspect --format '{{{{range .RepoDigests}}}}{{{{println .}}}}{{{{end}}}}' {q(name)} "
            f"2>/dev/null | sed -n {q('s|.*@|image ' + name + ' |p')}; "
            for name in images
        )
        return (f'for f in {markers}/*; do [ -f "$f" ] && echo "marker ${{f##*/}} $(head -n 1 "$f")"; done; '
                f"{inspect}true")

    def process(self, output):
        held = self.default()
        for line in output:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "marker" and len(parts[2]) == 40:
                held["markers"][parts[1]] = parts[2]
            elif len(parts) == 3 and parts[0] == "image" and parts[2].startswith("sha256:"):
                held["images"].setdefault(parts[1], []).append(parts[2])
        return held


# --- the service ---------------------------------------------------------------------


class UnitState(FactBase["dict[str, str]"]):
    """ActiveState, SubState, start time, restart count and unit file state of a unit (what
    ``systemd.SystemdStatus`` does not read: READY watches NRestarts)."""

    @staticmethod
    def default():
        return {}

    def requires_command(self, unit: str) -> str:
        return "systemctl"

    def command(self, unit: str) -> str:
        return (f"systemctl show {shlex.quote(unit)} -p ActiveState -p SubState -p ExecMainStartTimestampMonotonic "
                "-p NRestarts -p UnitFileState")

    def process(self, output):
        return dict(line.split("=", 1) for line in output if "=" in line)


#: vLLM's start-up lines, newest last, and what each says of the phase it is in.
ENGINE_PHASES = (
    (re.compile(r"Loading safetensors.*?(\d+)% Completed"), "loading weights {0}%"),
    (re.compile(r"Loading weights took ([\d.]+) seconds"), "weights loaded in {0} s"),
    (re.compile(r"Compiling a graph|torch\.compile|compiled graph"), "torch.compile"),
    (re.compile(r"Available KV cache memory|GPU KV cache size"), "KV cache"),
    (re.compile(r"Capturing CUDA graphs"), "capturing CUDA graphs"),
    (re.compile(r"Graph capturing finished|init engine .* took"), "warming up"),
    (re.compile(r"Free memory on device .* is less than desired"), "refused: not enough memory"),
)


def engine_phase(lines: list[str]) -> str:
    """The phase the newest of vLLM's start-up ``lines`` names ("" before any)."""
    for line in reversed(lines):
        for pattern, phase in ENGINE_PHASES:
            found = pattern.search(line)
            if found:
                return phase.format(*found.groups())
    return ""


class EnginePhase(FactBase[str]):
    """Where the serving unit's current start is, from its journal (vLLM's own lines)."""

    @staticmethod
    def default():
        return ""

    def requires_command(self, unit: str) -> str:
        return "journalctl"

    def command(self, unit: str) -> str:
        q = shlex.quote(unit)
        return (f"i=$(systemctl show -p InvocationID --value {q}); [ -n \"$i\" ] && "
                f"journalctl _SYSTEMD_INVOCATION_ID=$i -o cat --no-pager 2>/dev/null | "
                "grep -E 'Loading|Compiling|compile|KV cache|CUDA graphs|Graph capturing|init engine|Free memory' "
                "| tail -n 3 || true")

    def process(self, output):
        return engine_phase(output)


class ServedAnswer(FactBase["str | None"]):
    """The served model's answer to a one-token ``prompt``, or None if it does not answer."""

    def requires_command(self, address: str, port: int, model: str, prompt: str) -> str:
        return "curl"

    def command(self, address: str, port: int, model: str, prompt: str) -> str:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        # The key travels in a 0600 header file, never on the command line. A server
        # that does not answer yet is an answer (empty): the caller polls.
        return (
            f"curl -sS -m 10 -H @{hostpaths.AUTH_HEADER} -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)} http://{address}:{port}/v1/completions || true"
        )

    def process(self, output):
        try:
            return json.loads("\n".join(output))["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None


class ServedModels(FactBase["list[str]"]):
    """The model names the API lists (empty when it does not answer)."""

    @staticmethod
    def default():
        return []

    def requires_command(self, address: str, port: int) -> str:
        return "curl"

    def command(self, address: str, port: int) -> str:
        return f"curl -sS -m 5 -H @{hostpaths.AUTH_HEADER} http://{address}:{port}/v1/models || true"

    def process(self, output):
        try:
            return [model["id"] for model in json.loads("\n".join(output))["data"]]
        except (ValueError, KeyError, TypeError):
            return []


# --- addresses ------------------------------------------------------------------------


class Listeners(FactBase["dict[int, list[dict[str, object]]]"]):
    """Who listens on each of ``ports`` (TCP), in one ``ss`` for all of them:
    ``{port: [{"name": "haproxy", "pid": 812, "unit": "haproxy.service", "container": False}]}``.

    ``unit`` is the last part of the process's cgroup (its systemd unit, or ``init.scope``
    for a socket systemd itself holds); ``container`` says it runs in ``container`` (the
    container's processes carry its id in their cgroup path, under either cgroup driver).
    A port nobody listens on is absent."""

    @staticmethod
    def default():
        return {}

    def requires_command(self, ports: list[int], container: str) -> str:
        return "ss"

    def command(self, ports: list[int], container: str) -> str:
        match = " or ".join(f"sport = :{int(port)}" for port in sorted(set(ports)))
        return (
            f"echo \"container $(docker inspect -f '{{{{.Id}}}}' {shlex.quote(container)} 2>/dev/null)\"; "
            f"ss -Hltnp '( {match} )' | while read -r _ _ _ local _ users; do "
            "for p in $(echo \"$users\" | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do "
            "echo \"listen ${local##*:} $p $(sed -n 's/^0:://p; s/^[0-9]*:name=systemd://p' /proc/$p/cgroup "
            "2>/dev/null | head -n 1) $(cat /proc/$p/comm 2>/dev/null)\"; done; done"
        )

    def process(self, output):
        container = ""
        found: dict[int, list[dict[str, object]]] = {}
        for line in output:
            fields = line.split(None, 4)
            if fields[:1] == ["container"]:
                container = fields[1] if len(fields) > 1 else ""
            elif fields[:1] == ["listen"] and len(fields) >= 4 and fields[1].isdigit() and fields[2].isdigit():
                cgroup = fields[3] if fields[3].startswith("/") else ""
                name = fields[4] if len(fields) > 4 else fields[3] if not cgroup else "?"
                holder = {"name": name.strip(), "pid": int(fields[2]), "unit": cgroup.rstrip("/").rsplit("/", 1)[-1],
                          "container": bool(container) and container in cgroup}
                holders = found.setdefault(int(fields[1]), [])
                if holder not in holders:  # IPv4 and IPv6 sockets of one process
                    holders.append(holder)
        return found


def _ports(spec: str) -> tuple[range, ...] | None:
    """The ports a firewall's port expression names ("8000", "8000-8100", "{ 80, 443 }",
    "80,443", "8000:8100"); None when it names them otherwise (a set, a service name)."""
    found = []
    for part in re.split(r"[,\s{}]+", spec.strip()):
        if not part:
            continue
        bounds = re.fullmatch(r"(\d+)(?:[-:](\d+))?", part)
        if not bounds:
            return None
        found.append(range(int(bounds[1]), int(bounds[2] or bounds[1]) + 1))
    return tuple(found) or None


#: An accept rule that opens every port (from some source or interface): ``ALL``.
ALL = (range(1, 65536),)


def _nft_accepts(rule: str) -> tuple[range, ...] | None:
    """The TCP ports an nftables rule accepts new connections to (ALL: every port), None
    when it accepts none (not an accept, established traffic only, loopback, UDP, ICMP)."""
    words = rule.split()
    if not words or words[-1] != "accept" or re.search(r"\b(ct state|iif|iifname)\b.*\b(established|\"?lo\"?)\b",
                                                       rule):
        return None
    if re.search(r"\b(udp|icmp|icmpv6|ipv6-icmp)\b", rule):
        return None
    dport = re.search(r"dport\s+(\{[^}]*\}|\S+)", rule)
    if not dport:
        return ALL
    return _ports(dport[1]) or ALL  # a named set, a map: not read, taken as open


class Firewall(FactBase["dict[str, object]"]):
    """What filters new incoming TCP connections: ``{"ufw": {"active", "incoming", "allowed"},
    "chains": [{"chain", "policy", "accepted"}]}``.

    ``ufw``: whether ``ufw status verbose`` says active, its default for incoming ("deny",
    "reject", "allow") and the port ranges its ALLOW rules open (to anywhere from some source).
    ``chains``: each nftables base chain on the input hook whose policy drops, with the ranges
    its accept rules (and the chains they jump to) open (``nft``; without it ``iptables -S``,
    whose ``INPUT`` chain is read alike). A rule or a set it cannot read counts as open:
    a firewall is reported only when it surely blocks.
    """

    @staticmethod
    def default():
        return {"ufw": None, "chains": []}

    def command(self) -> str:
        return ("PATH=$PATH:/usr/sbin:/sbin; if command -v ufw >/dev/null; then echo '## ufw'; "
                "ufw status verbose 2>&1; fi; if command -v nft >/dev/null; then echo '## nft'; "
                "nft -s list ruleset 2>&1; elif command -v iptables >/dev/null; then echo '## iptables'; "
                "iptables -S 2>&1; fi; true")

    def process(self, output):
        sections: dict[str, list[str]] = {}
        current: list[str] = []
        for line in output:
            if line.startswith("## "):
                current = sections.setdefault(line[3:].strip(), [])
            else:
                current.append(line)
        chains = (_nft_chains(sections["nft"]) if "nft" in sections else
                  _iptables_chains(sections["iptables"]) if "iptables" in sections else [])
        return {"ufw": _ufw(sections["ufw"]) if "ufw" in sections else None, "chains": chains}


def _ufw(lines: list[str]) -> dict[str, object] | None:
    status = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Status:")), None)
    if status is None:  # not root, or ufw broken: unread
        return None
    default = next((line for line in lines if line.startswith("Default:")), "")
    incoming = re.search(r"(\w+) \(incoming\)", default)
    allowed: list[range] = []
    rules = lines[next((i for i, line in enumerate(lines) if line.startswith("--")), len(lines)) + 1:]
    for rule in rules:
        columns = re.split(r"\s{2,}", rule.strip())
        if len(columns) < 3 or not columns[1].startswith("ALLOW") or columns[1].endswith("OUT"):
            continue
        to = re.sub(r" \(v6\)| on \S+", "", columns[0]).strip()
        if to == "Anywhere":
            allowed += ALL
            continue
        spec = to.split()[-1]
        port, _, proto = spec.partition("/")
        if proto in ("", "tcp"):
            allowed += _ports(port) or ()  # an application profile (OpenSSH): its ports are unread
    return {"active": status == "active", "incoming": incoming[1] if incoming else "", "allowed": allowed}


def _nft_chains(lines: list[str]) -> list[dict[str, object]]:
    tables: dict[str, dict[str, dict[str, object]]] = {}
    table = chain = None
    for line in lines:
        text = line.strip()
        if text.startswith("table "):
            table, chain = " ".join(text.split()[1:3]), None
            tables.setdefault(table, {})
        elif text.startswith("chain ") and table:
            chain = text.split()[1]
            tables[table][chain] = {"hook": "", "policy": "accept", "rules": []}
        elif table and chain and text.startswith("type "):
            hook = re.search(r"\bhook (\w+)", text)
            policy = re.search(r"\bpolicy (\w+)", text)
            tables[table][chain].update(hook=hook[1] if hook else "", policy=policy[1] if policy else "accept")
        elif text == "}":
            chain = None if chain else chain
        elif table and chain and text:
            tables[table][chain]["rules"].append(text)
    found = []
    for name, chains in tables.items():
        for chain_name, c in chains.items():
            if c["hook"] == "input" and c["policy"] != "accept":
                found.append({"chain": f"{name} {chain_name}", "policy": c["policy"],
                              "accepted": _opened(chains, chain_name, _nft_accepts)})
    return found


def _opened(chains: dict[str, dict], name: str, accepts, seen: frozenset = frozenset()) -> list[range]:
    """The ranges chain ``name``'s rules accept, following its jumps (ALL for a jump nowhere)."""
    opened: list[range] = []
    for rule in chains.get(name, {}).get("rules", []):
        jump = re.search(r"(?:\bjump|\bgoto|-j)\s+(\S+)", rule)
        if jump and jump[1] not in ("ACCEPT", "DROP", "REJECT", "RETURN", "LOG"):
            target = jump[1]
            opened += ALL if target not in chains else [] if target in seen else \
                _opened(chains, target, accepts, seen | {name})
            continue
        opened += accepts(rule) or ()
    return opened


def _iptables_accepts(rule: str) -> tuple[range, ...] | None:
    if not rule.endswith("-j ACCEPT") or re.search(r"-i lo\b|--ctstate|--state|-p (udp|icmp)", rule):
        return None
    dport = re.search(r"--dports? (\S+)", rule)
    return (_ports(dport[1]) or ALL) if dport else ALL


def _iptables_chains(lines: list[str]) -> list[dict[str, object]]:
    chains: dict[str, dict[str, object]] = {}
    for line in lines:
        words = line.split()
        if len(words) >= 2 and words[0] in ("-P", "-N"):
            chains.setdefault(words[1], {"policy": words[2].lower() if len(words) > 2 else "", "rules": []})
        elif len(words) >= 2 and words[0] == "-A":
            chains.setdefault(words[1], {"policy": "", "rules": []})["rules"].append(line.strip())
    policy = chains.get("INPUT", {}).get("policy", "accept")
    if policy in ("accept", ""):
        return []
    return [{"chain": "iptables INPUT", "policy": policy, "accepted": _opened(chains, "INPUT", _iptables_accepts)}]


class SshServerAddress(FactBase[str]):
    """The address this host was reached at over SSH ($SSH_CONNECTION's third field; run
    it with _sudo=False, sudo drops the variable), or "" (not SSH, or unknown)."""

    @staticmethod
    def default():
        return ""

    def command(self) -> str:
        return 'echo "${SSH_CONNECTION:-}"'

    def process(self, output):
        fields = output[0].split() if output else []
        return fields[2] if len(fields) >= 3 else ""


class RouteSource(FactBase[str]):
    """This host's source address on its route to ``address`` ("" when it has none)."""

    @staticmethod
    def default():
        return ""

    def command(self, address: str) -> str:
        return f"ip route get {shlex.quote(address)} 2>/dev/null | sed -n 's/.* src \\([^ ]*\\).*/\\1/p' | head -n 1"

    def process(self, output):
        return output[0].strip() if output else ""


class RouteSources(FactBase["dict[str, str]"]):
    """This host's source address on its route to each of ``addresses`` (one command for
    the whole fleet); an address it has no route to is absent."""

    @staticmethod
    def default():
        return {}

    def command(self, addresses: list[str]) -> str:
        quoted = " ".join(shlex.quote(a) for a in addresses)
        return (f"for a in {quoted}; do s=$(ip route get \"$a\" 2>/dev/null | "
                "sed -n 's/.* src \\([^ ]*\\).*/\\1/p' | head -n 1); echo \"$a $s\"; done")

    def process(self, output):
        pairs = (line.split() for line in output)
        return {p[0]: p[1] for p in pairs if len(p) == 2}


# --- GPU access, the image store (the serving host as it is) ------------------------------

GPUS_ALL = "--gpus all"
CDI_ALL = "--device nvidia.com/gpu=all"
GPU_FLAGS = (GPUS_ALL, CDI_ALL)  # the first that works is used


class GpuAccess(FactBase["dict[str, object]"]):
    """How docker gives this host's containers the GPU.

    With ``image`` on the host, a GPU container of it runs ``nvidia-smi -L`` with each of
    :data:`GPU_FLAGS` (the truth). Without, the evidence: the legacy hook and whether
    dockerd started after it appeared, ``nvidia-cdi-hook``, a CDI spec for
    ``nvidia.com/gpu``, docker's version and CDI spec dirs. Returns ``{"works": [flags],
    "probed": bool, "evidence": {...}}``.
    """

    @staticmethod
    def default():
        return {"works": [], "probed": False, "evidence": {}}

    def requires_command(self, image: str) -> str:
        return "docker"

    def command(self, image: str) -> str:
        q = shlex.quote
        probes = "".join(
            f"docker run --rm --pull never {flag} --entrypoint nvidia-smi {q(image)} -L 2>/dev/null "
            f"| grep -q '^GPU ' && echo {q('works=' + flag)}; "
            for flag in GPU_FLAGS
        )
        return (
            "echo docker=$(docker version --format '{{.Server.Version}}' 2>/dev/null); "
            "echo cdi_dirs=$(docker info --format '{{json .CDISpecDirs}}' 2>/dev/null); "
            "echo cdi_spec=$(grep -ls 'nvidia.com/gpu' /etc/cdi/* /var/run/cdi/* 2>/dev/null | head -n 1); "
            "echo cdi_hook=$(command -v nvidia-cdi-hook); "
            "h=$(command -v nvidia-container-runtime-hook); echo hook=$h; "
            # dockerd registers the hook's --gpus driver only if the hook was there at its start.
            "s=$(systemctl show docker.service -p ExecMainStartTimestamp --value 2>/dev/null); "
            'if [ -n "$h" ] && [ -n "$s" ] && [ "$(stat -c %Z "$h")" -lt "$(date -d "$s" +%s)" ]; '
            "then echo hook_registered=yes; fi; "
            f"if docker image inspect --format . {q(image)} >/dev/null 2>&1; then echo probed=yes; {probes}fi; true"
        )

    def process(self, output):
        evidence: dict[str, str] = {}
        works: list[str] = []
        for line in output:
            key, _, value = line.strip().partition("=")
            if key == "works":
                works.append(value)
            elif key:
                evidence[key] = value
        probed = evidence.pop("probed", "") == "yes"
        if not probed:
            works = [flag for flag in GPU_FLAGS if _evidently_works(flag, evidence)]
        return {"works": works, "probed": probed, "evidence": evidence}


def _evidently_works(flag: str, ev: dict[str, str]) -> bool:
    cdi = bool(ev.get("cdi_spec")) and ev.get("cdi_dirs", "") not in ("", "null", "[]")
    if flag == GPUS_ALL:
        # Docker 28 maps --gpus to CDI only from 29 on (moby #50228).
        major = ev.get("docker", "").split(".")[0]
        docker_maps_gpus_to_cdi = major.isdigit() and int(major) >= 29 and bool(ev.get("cdi_hook"))
        return ev.get("hook_registered") == "yes" or (docker_maps_gpus_to_cdi and cdi)
    return cdi


class ContainerdRoot(FactBase[str]):
    """containerd's root directory (where Docker's containerd image store keeps images)."""

    @staticmethod
    def default():
        return "/var/lib/containerd"

    def requires_command(self) -> str:
        return "containerd"

    def command(self) -> str:
        return "containerd config dump 2>/dev/null | sed -n \"s/^root = ['\\\"]\\(.*\\)['\\\"]$/\\1/p\" || true"

    def process(self, output):
        return output[0].strip() if output and output[0].startswith("/") else self.default()


#: Reads the image's manifest from its registry on the host (stdlib only; anonymous or
#: bearer-token auth as registries answer): prints the compressed bytes of its layers
#: and config, for arm64 when the reference is a multi-platform index.
_MANIFEST_SIZE_PY = r"""
import json, re, sys, urllib.error, urllib.parse, urllib.request
base, repo, ref, accept = sys.argv[1:5]
token = None
def get(ref):
    global token
    while True:
        headers = {"Accept": accept, **({"Authorization": "Bearer " + token} if token else {})}
        req = urllib.request.Request(f"{base}/v2/{repo}/manifests/{ref}", headers=headers)
        try:
            return json.load(urllib.request.urlopen(req, timeout=20))
        except urllib.error.HTTPError as err:
            challenge = err.headers.get("WWW-Authenticate", "")
            if err.code != 401 or token is not None or not challenge.lower().startswith("bearer "):
                raise
            params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
            realm = params.pop("realm")
            doc = json.load(urllib.request.urlopen(realm + "?" + urllib.parse.urlencode(params), timeout=20))
            token = doc.get("token") or doc.get("access_token") or ""
doc = get(ref)
if "manifests" in doc:
    children = doc["manifests"]
    arm = [m for m in children if m.get("platform", {}).get("architecture") == "arm64"]
    doc = get((arm or children)[0]["digest"])
print("compressed", doc["config"]["size"] + sum(layer["size"] for layer in doc["layers"]))
"""


class ManifestSize(FactBase["int | None"]):
    """Compressed bytes of ``path:reference`` in the registry at ``url`` (None if unread)."""

    def requires_command(self, url: str, path: str, reference: str) -> str:
        return "python3"

    def command(self, url: str, path: str, reference: str) -> str:
        q = shlex.quote
        return (
            f"timeout 60 python3 -c {q(_MANIFEST_SIZE_PY)} {q(url)} {q(path)} {q(reference)} "
            f"{q(MANIFEST_ACCEPT)} 2>/dev/null || true"
        )

    def process(self, output):
        for line in output:
            key, _, value = line.partition(" ")
            if key == "compressed" and value.strip().isdigit():
                return int(value)
        return None


class NewLines(FactBase["dict"]):
    """The lines of an event log (``log``) the deploy has not reported yet (it keeps their
    count in ``reported``): {"lines": [...], "total": n}."""

    @staticmethod
    def default():
        return {"lines": [], "total": 0}

    def command(self, log: str, reported: str) -> str:
        return (
            f"n=$(cat {reported} 2>/dev/null || echo 0); t=$(cat {log} 2>/dev/null | wc -l); "
            f'echo "total $t"; [ "$t" -gt "$n" ] && tail -n $((t - n)) {log}; true'
        )

    def process(self, output):
        total = int(output[0].split()[1]) if output and output[0].startswith("total ") else 0
        return {"lines": [line.strip() for line in output[1:] if line.strip()], "total": total}


class BootReport(FactBase["dict"]):
    """This boot's id, the one the last deploy saw, and when they differ the previous boot's
    last kernel and GPU errors (NVIDIA's Xid lines, driver faults) from the journal:
    {"boot": id, "seen": id or "", "errors": [...]}."""

    @staticmethod
    def default():
        return {"boot": "", "seen": "", "errors": []}

    def command(self) -> str:
        seen = hostpaths.BOOT_SEEN
        return (
            f"b=$(cat /proc/sys/kernel/random/boot_id); s=$(cat {seen} 2>/dev/null); echo \"boot $b\"; "
            f'echo "seen $s"; if [ -n "$s" ] && [ "$s" != "$b" ]; then '
            "journalctl -b -1 -p err --no-pager -q -o short-iso -n 200 2>/dev/null "
            "| grep -Ei 'xid|nvrm|nvidia|gpu|kernel|oom|panic|mce|hardware' | tail -n 10; fi; true"
        )

    def process(self, output):
        report = {"boot": "", "seen": "", "errors": []}
        for line in output:
            if line.startswith("boot "):
                report["boot"] = line[5:].strip()
            elif line.startswith("seen "):
                report["seen"] = line[5:].strip()
            elif line.strip():
                report["errors"].append(line.strip())
        return report


# --- the ConnectX-7 link (pair members) ------------------------------------------------
# The netdevs' MTU, state and addresses are pyinfra's ``hardware.NetworkDevices``.


class RoceNetdevs(FactBase["list[dict[str, object]]"]):
    """The RoCE devices as ``ibdev2netdev`` maps them, in its order:
    ``[{"hca": "rocep1s0f1", "netdev": "enp1s0f1np1", "up": True}, ...]`` ([] without it)."""

    @staticmethod
    def default():
        return []

    def requires_command(self) -> str:
        return "ibdev2netdev"

    def command(self) -> str:
        return "ibdev2netdev"

    def process(self, output):
        # mlx5's tool: "rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)"
        found = []
        for line in output:
            parts = line.split()
            if len(parts) == 6 and parts[1] == "port" and parts[3] == "==>":
                found.append({"hca": parts[0], "netdev": parts[4], "up": parts[5] == "(Up)"})
        return found


class RoceGids(FactBase["list[dict[str, object]]"]):
    """The RoCE GID tables as ``show_gids`` (mlx5's tools, beside ``ibdev2netdev``) prints
    them from ``/sys/class/infiniband/<hca>/ports/<p>/gids`` and ``gid_attrs/types``:
    ``[{"hca": "rocep1s0f1", "port": 1, "index": 3, "gid": "...:ffff:c0a8:6401",
    "ipv4": "192.168.100.1", "version": "v2", "netdev": "enp1s0f1np1"}, ...]``."""

    @staticmethod
    def default():
        return []

    def requires_command(self) -> str:
        return "show_gids"

    def command(self) -> str:
        return "show_gids"

    def process(self, output):
        # DEV PORT INDEX GID [IPv4] VER DEV; the IPv4 column is empty for a non-IPv4 GID.
        found = []
        for line in output:
            parts = line.split()
            if len(parts) not in (6, 7) or not parts[1].isdigit() or not parts[2].isdigit():
                continue
            ipv4 = parts[4] if len(parts) == 7 else ""
            found.append({"hca": parts[0], "port": int(parts[1]), "index": int(parts[2]), "gid": parts[3],
                          "ipv4": ipv4, "version": parts[-2], "netdev": parts[-1]})
        return found


class Answers(FactBase[bool]):
    """Whether ``address`` answers one ping of ``size`` payload bytes sent out of
    ``interface`` (``dont_fragment``: as one unfragmented packet, proving the path's MTU)."""

    @staticmethod
    def default():
        return False

    def requires_command(self, interface: str, address: str, size: int = 56, dont_fragment: bool = False) -> str:
        return "ping"

    def command(self, interface: str, address: str, size: int = 56, dont_fragment: bool = False) -> str:
        q = shlex.quote
        df = " -M do" if dont_fragment else ""
        return f"ping -c 1 -W 2{df} -s {int(size)} -I {q(interface)} {q(address)} >/dev/null 2>&1 && echo yes || echo no"

    def process(self, output):
        return bool(output) and output[-1].strip() == "yes"
