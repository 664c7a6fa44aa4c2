"""Simulated pairs: two testbed hosts cabled by a ConnectX-7 link, as Sparks bought in pairs.

``sparkfleet testbed up --hosts 4 --pairs 2`` pairs spark-1 + spark-2 and spark-3 + spark-4.
On a Spark the ConnectX-7 shows two netdevs per QSFP port (``enp1s0f0np0`` /
``enP2p1s0f0np0`` for the first, ``enp1s0f1np1`` / ``enP2p1s0f1np1`` for the second) with
the RoCE devices ``rocep1s0f0`` / ``roceP2p1s0f0`` / ``rocep1s0f1`` / ``roceP2p1s0f1``. A
paired host here gets:

* the cabled port (the second, as in NVIDIA's two-Spark playbook): each of its two netdevs
  is one end of a veth pair whose other end is the same name in the peer's namespace,
  MTU 9000, link up, **no address** (the deploy's netplan step gives it one);
* the other port's two netdevs, down (no cable);
* ``/usr/bin/ibdev2netdev`` printing the four RoCE devices as mlx5's tool does, each with
  its netdev's live state (``(Up)`` / ``(Down)``), and ``/usr/sbin/show_gids`` their GID
  tables (the RoCE v2 GID of the link's IPv4 address at index 3, once it has one);
* ``/dev/infiniband/`` (``uverbs0..3``, ``rdma_cm``: character devices with the kernel's
  numbers, made at boot by ``sparkfleet-sim-cx7.service``) for ``docker run --device``, and
  the cabled netdevs' ``/sys/class/net/<netdev>/speed`` reading 200000 (bound over the
  veth's 10000 on the host; containers and ``ethtool`` still see the veth's).
  Nothing behind them: no process here opens them, NCCL's traffic is the sockets of the
  veth link.

The links live in the hosts' namespaces, so deleting a namespace removes them; ``remove_all``
also deletes them by name first, for ``down`` and for the cleanup at the next ``up``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import network, paths, simhw
from .engine.nccl import LINK_FACTOR
from .proc import TestbedError, log, run
from .state import HostState

MTU = 9000
#: (RoCE device, netdev) of a Spark's ConnectX-7, in ibdev2netdev's order.
ROCE_NETDEVS = (
    ("rocep1s0f0", "enp1s0f0np0"),
    ("rocep1s0f1", "enp1s0f1np1"),
    ("roceP2p1s0f0", "enP2p1s0f0np0"),
    ("roceP2p1s0f1", "enP2p1s0f1np1"),
)
#: The cabled QSFP port's netdevs (veth to the peer) and RoCE devices (NCCL_IB_HCA).
CABLED = ("enp1s0f1np1", "enP2p1s0f1np1")
CABLED_HCAS = ("rocep1s0f1", "roceP2p1s0f1")
UNCABLED = tuple(n for _, n in ROCE_NETDEVS if n not in CABLED)
#: The netdev the deploy addresses and NCCL/GLOO use (the first of the cabled port).
INTERFACE = CABLED[0]
#: The veth's 10 Gb/s times the testbed's one link factor: the ConnectX-7's 200 Gb/s.
LINK_SPEED_MBPS = 10000 * LINK_FACTOR

IBDEV2NETDEV = """#!/bin/sh
# Simulated ibdev2netdev (sparkfleet testbed): the ConnectX-7's RoCE devices and the
# netdevs they map to, with each netdev's live state, as mlx5's tool prints them.
for pair in {pairs}; do
    dev=${{pair%%:*}}; net=${{pair#*:}}
    [ -e /sys/class/net/$net ] || continue
    state=Down
    [ "$(cat /sys/class/net/$net/operstate 2>/dev/null)" = up ] && state=Up
    echo "$dev port 1 ==> $net ($state)"
done
""".format(pairs=" ".join(f"{d}:{n}" for d, n in ROCE_NETDEVS))

#: Simulated show_gids: each RoCE device's GID table as mlx5's tool prints it from sysfs
#: (/sys/class/infiniband/<hca>/ports/1/gids, gid_attrs/types): 0/1 the link-local RoCE v1/v2
#: GIDs, and once its netdev has an IPv4 address, 2/3 that address IPv4-mapped (v1/v2), as
#: on a Spark: index 3 is the one NCCL needs (engine/nccl.py, ROCE_V2_IPV4_GID_INDEX).
SHOW_GIDS = """#!/bin/sh
# Simulated show_gids (sparkfleet testbed): RoCE GID tables, read live from the netdevs.
printf 'DEV\tPORT\tINDEX\tGID\t\t\t\t\tIPv4  \t\tVER\tDEV\n'
printf -- '---\t----\t-----\t---\t\t\t\t\t------------  \t---\t---\n'
n=0
for pair in {pairs}; do
    dev=${{pair%%:*}}; net=${{pair#*:}}
    [ -e /sys/class/net/$net ] || continue
    mac=$(cat /sys/class/net/$net/address 2>/dev/null || echo 00:00:00:00:00:00)
    ll=fe80:0000:0000:0000:$(echo 0200$mac | tr -d : | sed 's/\\(....\\)/\\1:/g; s/:$//')
    printf '%s\t1\t0\t%s\t\t\tv1\t%s\n' $dev $ll $net
    printf '%s\t1\t1\t%s\t\t\tv2\t%s\n' $dev $ll $net
    n=$((n + 2))
    ip4=$(ip -4 -o addr show dev $net 2>/dev/null | awk '{{split($4, a, "/"); print a[1]; exit}}')
    [ -n "$ip4" ] || continue
    hex=$(echo $ip4 | awk -F. '{{printf "%02x%02x:%02x%02x", $1, $2, $3, $4}}')
    printf '%s\t1\t2\t0000:0000:0000:0000:0000:ffff:%s\t%s  \tv1\t%s\n' $dev $hex $ip4 $net
    printf '%s\t1\t3\t0000:0000:0000:0000:0000:ffff:%s\t%s  \tv2\t%s\n' $dev $hex $ip4 $net
    n=$((n + 2))
done
echo "n_gids_found=$n"
""".format(pairs=" ".join(f"{d}:{n}" for d, n in ROCE_NETDEVS))

CX7_STAND_INS = """#!/bin/sh
# Simulated ConnectX-7 (sparkfleet testbed). /dev/infiniband: the nodes a ConnectX-7 host
# has (uverbs char major 231, minors from 192; rdma_cm misc 10:58), for `docker run --device`.
mkdir -p /dev/infiniband
i=0
while [ $i -lt 4 ]; do
    [ -e /dev/infiniband/uverbs$i ] || mknod -m 0666 /dev/infiniband/uverbs$i c 231 $((192 + i))
    i=$((i + 1))
done
[ -e /dev/infiniband/rdma_cm ] || mknod -m 0666 /dev/infiniband/rdma_cm c 10 58
# The cabled netdevs' link speed as a ConnectX-7 reports it in sysfs (a veth says 10000).
mkdir -p /run/sparkfleet-sim
for net in {cabled}; do
    [ -e /sys/class/net/$net/speed ] || continue
    echo {speed} > /run/sparkfleet-sim/speed-$net
    mountpoint -q /sys/class/net/$net/speed || mount --bind /run/sparkfleet-sim/speed-$net /sys/class/net/$net/speed
done
""".format(cabled=" ".join(CABLED), speed=LINK_SPEED_MBPS)

CX7_UNIT = """[Unit]
Description=sparkfleet testbed: simulated ConnectX-7 (/dev/infiniband, link speed)
DefaultDependencies=no
After=local-fs.target
Before=docker.service multi-user.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/lib/sparkfleet-sim/cx7-stand-ins

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class Pair:
    """Two hosts joined by the simulated link; ``members[0]`` is the first (rank 0 by
    the testbed's convention; the deploy decides)."""

    members: tuple[str, str]

    def record(self) -> dict[str, object]:
        """The pair as hosts.json records it."""
        return {"members": list(self.members), "interface": INTERFACE, "netdevs": list(CABLED),
                "hcas": list(CABLED_HCAS), "mtu": MTU, "link_speed_mbps": LINK_SPEED_MBPS}


def plan(host_names: list[str], n_pairs: int) -> list[Pair]:
    """spark-1 + spark-2, spark-3 + spark-4, ... for *n_pairs* pairs."""
    if n_pairs < 0 or 2 * n_pairs > len(host_names):
        raise TestbedError(f"--pairs {n_pairs} needs {2 * n_pairs} hosts, the fleet has {len(host_names)} "
                           f"(use --hosts {max(2 * n_pairs, 1)} or more)")
    return [Pair((host_names[2 * i], host_names[2 * i + 1])) for i in range(n_pairs)]


def _ns(name: str) -> list[str]:
    return ["ip", "-n", paths.netns_name(name)]


def create_link(pair: Pair) -> None:
    """The cable: one veth pair per netdev of the cabled port, same name at both ends;
    the uncabled port's netdevs as dummies. Needs both hosts' namespaces."""
    a, b = pair.members
    for netdev in CABLED:
        run(["ip", "link", "add", "name", netdev, "netns", paths.netns_name(a), "mtu", str(MTU), "type", "veth",
             "peer", "name", netdev, "netns", paths.netns_name(b), "mtu", str(MTU)], timeout=15)
    for host in pair.members:
        for netdev in CABLED:
            run([*_ns(host), "link", "set", netdev, "up"], timeout=15)
        # No `dummy` module on every kernel: a veth pair inside the host, left down.
        run([*_ns(host), "link", "add", UNCABLED[0], "type", "veth", "peer", "name", UNCABLED[1]], timeout=15)


def provision(h: HostState) -> None:
    """The paired host's stand-ins, written into its root before it boots."""
    simhw.write_files(h.mnt, {
        "usr/bin/ibdev2netdev": (IBDEV2NETDEV, 0o755),
        "usr/sbin/show_gids": (SHOW_GIDS, 0o755),
        "usr/lib/sparkfleet-sim/cx7-stand-ins": (CX7_STAND_INS, 0o755),
        "etc/systemd/system/sparkfleet-sim-cx7.service": (CX7_UNIT, 0o644),
    })
    wants = h.mnt / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / "sparkfleet-sim-cx7.service"
    if not link.is_symlink():
        link.symlink_to("/etc/systemd/system/sparkfleet-sim-cx7.service")


def set_up(hosts: dict[str, HostState], pairs: list[Pair]) -> None:
    """Cable and provision every pair (hosts made and provisioned, not yet booted)."""
    for pair in pairs:
        create_link(pair)
        for name in pair.members:
            provision(hosts[name])
        log(f"pair {' + '.join(pair.members)}: {', '.join(CABLED)} (MTU {MTU})")


def remove_all() -> None:
    """Delete every link of ours by name, in every namespace of ours."""
    for ns in network.our_netns():
        for _, netdev in ROCE_NETDEVS:
            run(["ip", "-n", ns, "link", "del", netdev], timeout=15, check=False)
