"""How a host reaches the others: the address the controller reached it at, its source
address on the route to a peer, and on a pair member the ConnectX-7 link (its RoCE
devices, their GIDs, a ping out of its interface).
"""

from __future__ import annotations

import ipaddress
import shlex

from pyinfra.api import FactBase


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


def _ip(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _route_command(addresses: list[str]) -> str:
    """One ``ip`` for every address (a loop of ``ip route get | sed | head`` started ~400
    programs on the hosts of a 16-host run): the addresses asked, then each route on one
    line. Only addresses go to ``ip -batch`` (anything else ends the batch); one without a
    route (unreachable) is skipped by -force."""
    valid = " ".join(shlex.quote(a) for a in addresses if _ip(a))
    asked = " ".join(shlex.quote(a) for a in addresses)
    return (f"echo asked {asked}; "
            + (f"printf 'route get %s\\n' {valid} | ip -o -force -batch - 2>/dev/null; " if valid else "")
            + "true")


def _src(fields: list[str]) -> str | None:
    """The ``src`` of one route's fields, None when it names none."""
    return fields[fields.index("src") + 1] if "src" in fields[:-1] else None


def _sources(output: list[str]) -> dict[str, str]:
    """Of the asked addresses, each one's source address on its route (``src``; the first
    route's), from :func:`_route_command`'s answer; an address without a route is absent."""
    asked = next((line.split()[1:] for line in output if line.startswith("asked ")), [])
    found: dict[object, str] = {}
    for line in output:
        fields = line.split()
        to = next((_ip(f) for f in fields[:2] if _ip(f)), None)  # "local ::1 ..." names its kind first
        if to is not None and (src := _src(fields)):
            found.setdefault(to, src)
    return {a: found[_ip(a)] for a in asked if _ip(a) in found}


class RouteSource(FactBase[str]):
    """This host's source address on its route to ``address`` ("" when it has none). Any
    login may ask the kernel: run it with _sudo=False (a sudo costs a password check)."""

    @staticmethod
    def default():
        return ""

    def command(self, address: str) -> str:
        return _route_command([address])

    def process(self, output):
        routes = (line.split() for line in output if not line.startswith("asked "))
        return next(filter(None, map(_src, routes)), "")


class RouteSources(FactBase["dict[str, str]"]):
    """This host's source address on its route to each of ``addresses`` (one command for
    the whole fleet); an address it has no route to is absent."""

    @staticmethod
    def default():
        return {}

    def command(self, addresses: list[str]) -> str:
        return _route_command(addresses)

    def process(self, output):
        return _sources(output)


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
