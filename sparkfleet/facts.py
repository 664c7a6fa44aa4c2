"""sparkfleet's own facts: what pyinfra's built-in facts do not read.

Where pyinfra has a fact the steps use it directly (``server.Arch``, ``server.Which``,
``files.File``, ``docker.DockerSystemInfo``, ``docker.DockerImage``,
``hardware.NetworkDevices``, ``files.Directory``); the files, units and trees the deploy
manages are read through :mod:`sparkfleet.snapshot`, one command per host and run. Each fact here answers one question,
cheaply; a program it needs that is missing makes it its default (``requires_command``),
not an error. Three concerns have modules of their own: the GPU (:mod:`sparkfleet.gpu`),
who may connect to a port (:mod:`sparkfleet.ports`) and how a host reaches the others
(:mod:`sparkfleet.routes`).
"""

from __future__ import annotations

import json
import re
import shlex

from pyinfra.api import FactBase

from sparkfleet import hostpaths
from sparkfleet.hostread import HTTP_CLIENT

#: The manifest types a registry may answer for the serving image.
MANIFEST_ACCEPT = (
    "application/vnd.docker.distribution.manifest.v2+json,application/vnd.oci.image.manifest.v1+json,"
    "application/vnd.docker.distribution.manifest.list.v2+json,application/vnd.oci.image.index.v1+json"
)

# --- the host (preflight) ------------------------------------------------------------


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


class DockerAnswers(FactBase[bool]):
    """Whether the Docker daemon answers. The snapshot reader asks dockerd's Engine API
    ``/_ping`` in its own process: ``docker info`` (/info) and ``docker version`` (/version)
    both make dockerd start runc and docker-init for their versions, ~30 ms of a host's
    CPU. Alone (no reader), the CLI asks."""

    engine_path = ("/_ping", None)  # the body as it is: "OK"

    @staticmethod
    def default():
        return False

    def requires_command(self) -> str:
        return "docker"

    def command(self) -> str:
        return "docker version --format '{{.Server.Version}}' >/dev/null 2>&1 && echo OK || true"

    def process(self, output):
        return "OK" in (line.strip() for line in output)


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
        # No marker, or a marker naming a snapshot that is gone: not cached. fetch_weights.py
        # records each blob's size once it matched its hash: a blob missing, truncated or
        # grown since shows here without reading it. One python3 for every file: a shell
        # loop costs a host three processes per file (a checkpoint has ~50).
        args = (hostpaths.snapshot_marker(hf_home, repo_id, revision),
                hostpaths.repo_cache_dir(hf_home, repo_id) + "/snapshots", f"{hf_home}/sparkfleet/verified")
        return f"python3 -c {shlex.quote(_CACHED)} " + " ".join(map(shlex.quote, args))

    def process(self, output):
        if "unverified" in output:
            return None
        commits = [line[len("commit="):] for line in output if line.startswith("commit=")]
        return commits[0] if commits else None


_CACHED = r"""
import os, sys
marker, snapshots, records = sys.argv[1:]
try:
    commit = open(marker).read().strip()
except OSError:
    sys.exit()
snapshot = os.path.join(snapshots, commit)
if not commit or not os.path.isdir(snapshot):
    sys.exit()
for folder, _, names in os.walk(snapshot):
    for name in names:
        blob = os.path.realpath(os.path.join(folder, name))
        try:
            verified = open(os.path.join(records, os.path.basename(blob))).read().strip() == str(os.stat(blob).st_size)
        except OSError:
            verified = False
        if not verified:
            print("unverified")
            sys.exit()
print("commit=" + commit)
"""


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
        return (f'for f in {markers}/*; do [ -f "$f" ] && {{ l=; IFS= read -r l < "$f"; echo "marker ${{f##*/}} $l"; }}; '
                f"done; {inspect}true")

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
        # that does not answer yet is an answer (empty): the caller polls. Each poll waits
        # on the host up to ~5 s for the port to open (or a 503 to pass), asking every second:
        # READY is seen within a second of it, at one sudo per poll, not one per second.
        # vLLM binds its port before it builds the engine but listens only once it serves
        # (create_server_socket, then uvicorn), so a loading engine refuses at once: no poll
        # waits out -m 10 on a connection the engine does not accept.
        return (
            f"curl -sS -m 10 --retry 5 --retry-connrefused --retry-delay 1 --retry-max-time 5 "
            f"-H @{hostpaths.AUTH_HEADER} -H 'Content-Type: application/json' "
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

    def command(self, address: str, port: int) -> str:
        # The key travels in a 0600 header file, never on the command line. A python3
        # program, so the snapshot reader asks it in its own process (no curl started).
        return f"python3 -c {shlex.quote(_SERVED_MODELS)} {shlex.quote(address)} {int(port)} {hostpaths.AUTH_HEADER}"

    def process(self, output):
        try:
            return [model["id"] for model in json.loads("\n".join(output))["data"]]
        except (ValueError, KeyError, TypeError):
            return []


_SERVED_MODELS = HTTP_CLIENT + r"""
import sys
address, port, header_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    with open(header_file) as f:
        headers = [line.strip() for line in f if line.strip()]
    status, body = http_get((address, port), "/v1/models", headers, timeout=5)
except (OSError, ValueError, IndexError):
    sys.exit()
print(body.decode(errors="replace"))
"""


# --- the image store, the event log, the boot (the serving host as it is) -----------------


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
            # The shell's own read of the count (each program costs the host a fork and an exec).
            f"n=0; [ -r {reported} ] && read -r n < {reported}; t=$(wc -l 2>/dev/null < {log}) || t=0; "
            f'echo "total $t"; [ "$t" -gt "$n" ] && tail -n $((t - n)) {log}; true'
        )

    def process(self, output):
        total = int(output[0].split()[1]) if output and output[0].startswith("total ") else 0
        return {"lines": [line.strip() for line in output[1:] if line.strip()], "total": total}


#: Note the boot the host runs as the one a deploy saw (read when it runs: a deploy's own
#: reboot, a stack upgrade's, is seen by that deploy and reported by no later one).
NOTE_BOOT = (f"mkdir -p {hostpaths.BOOT_SEEN.rsplit('/', 1)[0]} && "
             f"cat /proc/sys/kernel/random/boot_id > {hostpaths.BOOT_SEEN}")


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
            f"read -r b < /proc/sys/kernel/random/boot_id; s=; [ -r {seen} ] && read -r s < {seen}; echo \"boot $b\"; "
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


def rebooted(report: dict) -> str | None:
    """How a :class:`BootReport` is said (the deploy's warning, status' line): None when the
    host has not rebooted since a deploy saw it; the errors follow, a line each."""
    if not report["seen"] or report["boot"] == report["seen"]:
        return None
    return (f"rebooted since the last deploy (boot {report['seen'][:8]} -> {report['boot'][:8]}); "
            + ("the previous boot's last kernel/GPU errors:" if report["errors"] else
               "the previous boot's journal has no kernel or GPU error (a clean reboot?)"))
