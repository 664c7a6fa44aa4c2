"""The testbed network: bridge sfbr0 (10.213.0.1/24) and one netns + veth per host.

No NAT and no forwarding are set up: the hosts reach only the controller's bridge
address (where registry, hub and apt repo listen) and each other. Their default route
points at the bridge so that a misconfigured deploy fails fast instead of hanging.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import paths
from .proc import TestbedError, log, run


def _link_names() -> list[str]:
    out = run(["ip", "-j", "link", "show"], timeout=15).stdout
    return [l["ifname"] for l in json.loads(out or "[]")]  # noqa: E741


def link_exists(name: str) -> bool:
    return name in _link_names()


def netns_list() -> list[str]:
    out = run(["ip", "-j", "netns", "list"], timeout=15, check=False).stdout.strip()
    if not out:
        return []
    return [n["name"] for n in json.loads(out)]


def ensure_bridge() -> None:
    """Create sfbr0 with the controller address (idempotent)."""
    if not link_exists(paths.BRIDGE):
        run(["ip", "link", "add", paths.BRIDGE, "type", "bridge"], timeout=15)
    addr = f"{paths.CONTROLLER_IP}/{paths.NETMASK_BITS}"
    cur = run(["ip", "-j", "addr", "show", "dev", paths.BRIDGE], timeout=15).stdout
    have = {f"{a['local']}/{a['prefixlen']}" for l in json.loads(cur) for a in l.get("addr_info", [])}  # noqa: E741
    if addr not in have:
        run(["ip", "addr", "add", addr, "dev", paths.BRIDGE], timeout=15)
    run(["ip", "link", "set", paths.BRIDGE, "up"], timeout=15)
    # Never route the hosts' packets onward, even where the machine forwards between
    # its other interfaces: IPv4 checks this flag on the interface a packet came in on.
    Path(f"/proc/sys/net/ipv4/conf/{paths.BRIDGE}/forwarding").write_text("0\n")


def create_host_net(name: str, address: str) -> None:
    """netns sf-spark-i with eth0 = address/24, veth peer sfv-spark-i in sfbr0."""
    ns, veth = paths.netns_name(name), paths.veth_name(name)
    run(["ip", "netns", "add", ns], timeout=15)
    run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns], timeout=15)
    run(["ip", "link", "set", veth, "master", paths.BRIDGE], timeout=15)
    run(["ip", "link", "set", veth, "up"], timeout=15)
    nsrun = ["ip", "-n", ns]
    run([*nsrun, "link", "set", "lo", "up"], timeout=15)
    run([*nsrun, "addr", "add", f"{address}/{paths.NETMASK_BITS}", "dev", "eth0"], timeout=15)
    run([*nsrun, "link", "set", "eth0", "up"], timeout=15)
    run([*nsrun, "route", "add", "default", "via", paths.CONTROLLER_IP], timeout=15)


def set_host_link(name: str, up: bool) -> None:
    """Cut (or restore) a host's network by taking its veth down: the host keeps running
    but is unreachable, like a pulled cable."""
    run(["ip", "link", "set", paths.veth_name(name), "up" if up else "down"], timeout=15)


def netns_pids(ns: str) -> list[int]:
    cp = run(["ip", "netns", "pids", ns], timeout=15, check=False)
    return [int(p) for p in cp.stdout.split() if p.isdigit()]


def remove_host_net(ns: str) -> None:
    """Delete a host's netns (its eth0 goes with it, and so does the veth peer)."""
    run(["ip", "netns", "del", ns], timeout=15, check=False)
    # A stale /run/netns file whose bind mount is gone makes `ip netns del` fail: remove it.
    p = Path("/run/netns") / ns
    if p.exists():
        run(["umount", "-l", p], timeout=15, check=False)
        p.unlink(missing_ok=True)


def our_netns() -> list[str]:
    return [n for n in netns_list() if n.startswith(paths.NETNS_PREFIX)]


def our_links() -> list[str]:
    return [n.split("@")[0] for n in _link_names() if n.startswith(paths.VETH_PREFIX) or n == paths.BRIDGE]


def remove_all() -> None:
    """Remove every netns and link with our names (leftovers included)."""
    for ns in our_netns():
        log(f"deleting netns {ns}")
        remove_host_net(ns)
    for link in our_links():
        if link != paths.BRIDGE:
            run(["ip", "link", "del", link], timeout=15, check=False)
    if link_exists(paths.BRIDGE):
        run(["ip", "link", "del", paths.BRIDGE], timeout=15, check=False)
    left = our_netns() + our_links()
    if left:
        raise TestbedError(f"could not remove network objects: {', '.join(left)}")
