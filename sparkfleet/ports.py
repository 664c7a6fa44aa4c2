"""Who may connect to a port on the host: who listens on it, and which firewall lets new
connections to it through. The preflight judges both before a service binds its ports.
"""

from __future__ import annotations

import re
import shlex

from pyinfra.api import FactBase


class Listeners(FactBase["dict[int, list[dict[str, object]]]"]):
    """Who listens on each of ``ports`` (TCP), in one ``ss`` for all of them:
    ``{port: [{"name": "haproxy", "pid": 812, "unit": "haproxy.service", "cgroup": "/system.slice/haproxy.service"}]}``.

    ``cgroup`` is the process's cgroup path (a container's processes carry its id in it,
    under either cgroup driver: :func:`in_container`), ``unit`` its last part (the systemd
    unit, or ``init.scope`` for a socket systemd itself holds). A port nobody listens on
    is absent."""

    @staticmethod
    def default():
        return {}

    def requires_command(self, ports: list[int]) -> str:
        return "ss"

    def command(self, ports: list[int]) -> str:
        match = " or ".join(f"sport = :{int(port)}" for port in sorted(set(ports)))
        # One awk reads each holder's cgroup and name: no process per port and pid.
        return f"ss -Hltnp '( {match} )' | awk {shlex.quote(_HOLDERS)}"

    def process(self, output):
        found: dict[int, list[dict[str, object]]] = {}
        for line in output:
            fields = line.split(None, 4)
            if fields[:1] == ["listen"] and len(fields) >= 4 and fields[1].isdigit() and fields[2].isdigit():
                cgroup = fields[3] if fields[3].startswith("/") else ""
                name = fields[4] if len(fields) > 4 else fields[3] if not cgroup else "?"
                holder = {"name": name.strip(), "pid": int(fields[2]), "unit": cgroup.rstrip("/").rsplit("/", 1)[-1],
                          "cgroup": cgroup}
                holders = found.setdefault(int(fields[1]), [])
                if holder not in holders:  # IPv4 and IPv6 sockets of one process
                    holders.append(holder)
        return found


#: ss's lines in, "listen PORT PID CGROUP NAME" out: the cgroup v2 path (0::) or v1's
#: systemd hierarchy, whichever /proc/PID/cgroup lists first.
_HOLDERS = r"""{
  port = $4; sub(/.*:/, "", port); users = $0
  while (match(users, /pid=[0-9]+/)) {
    pid = substr(users, RSTART + 4, RLENGTH - 4); users = substr(users, RSTART + RLENGTH)
    if ((port " " pid) in seen) continue
    seen[port " " pid] = 1; cgroup = ""; name = ""; f = "/proc/" pid "/cgroup"
    while ((getline line < f) > 0)
      if (cgroup == "" && line ~ /^(0::|[0-9]+:name=systemd:)/) { sub(/^[0-9]+:[^:]*:/, "", line); cgroup = line }
    close(f); f = "/proc/" pid "/comm"; getline name < f; close(f)
    print "listen", port, pid, cgroup, name
  }
}"""


#: A container's processes carry its id in their cgroup path, under either cgroup driver
#: (``/system.slice/docker-<id>.scope``, ``/docker/<id>``).
_CONTAINER_CGROUP = re.compile(r"docker[-/][0-9a-f]{12,}")


def in_container(holders: dict[int, list[dict]], container_id: str) -> dict[int, list[dict]]:
    """``holders`` (:class:`Listeners`) with ``container``: whether each runs in the
    container of that id ("" when there is none)."""
    return {port: [h | {"container": bool(container_id) and container_id in str(h.get("cgroup", ""))} for h in found]
            for port, found in holders.items()}


def in_other_container(holders: dict[int, list[dict]]) -> bool:
    """Whether a holder (:func:`in_container`'s) runs in some container other than the one given."""
    return any(not h["container"] and _CONTAINER_CGROUP.search(str(h.get("cgroup", "")))
               for found in holders.values() for h in found)


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
