"""How a host reaches the others: the address the controller reached it at, its source
address on the route to a peer, and on a pair member the ConnectX-7 link (its RoCE
devices, their GIDs, a ping out of its interface).
"""

from __future__ import annotations

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


#: Of ``ip route get``'s answer, the source address (the first route's).
_SOURCE = "sed -n 's/.* src \\([^ ]*\\).*/\\1/p' | head -n 1"


class RouteSource(FactBase[str]):
    """This host's source address on its route to ``address`` ("" when it has none). Any
    login may ask the kernel: run it with _sudo=False (a sudo costs a password check)."""

    @staticmethod
    def default():
        return ""

    def command(self, address: str) -> str:
        return f"ip route get {shlex.quote(address)} 2>/dev/null | {_SOURCE}"

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
        return f"for a in {quoted}; do s=$(ip route get \"$a\" 2>/dev/null | {_SOURCE}); echo \"$a $s\"; done"

    def process(self, output):
        pairs = (line.split() for line in output)
        return {p[0]: p[1] for p in pairs if len(p) == 2}


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
