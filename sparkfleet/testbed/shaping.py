"""Bandwidth shaped like a real fleet's, and the bytes that crossed each link.

``up(bandwidth_scale=F)`` (``sparkfleet testbed up --bandwidth-scale F``) divides a real
fleet's rates by one factor F, so their ratio stays: the WAN (1 Gb/s), each Spark's
NIC (10 GbE) and a pair's ConnectX-7 link (200 Gb/s). Where each limit sits:

* a host's NIC, both directions: egress on ``eth0`` in the host's namespace, ingress on
  the root side of its veth (``sfv-spark-i``), whose egress is what the host receives;
  host-to-host traffic is bridged, so it meets the sender's and the receiver's limits,
  as through a switch;
* the WAN: an htb class on the bridge device for what the hub and the registry send
  (matched by source address and port). The bridge device carries only what the
  controller sends, and only the artifacts' bytes are scaled: pyinfra's SSH and the apt
  repository's real-sized packages stay at the LAN's rate;
* a pair's link: egress on each cabled netdev in both members (the deploy uses the first).

Each limit is an htb class (this kernel has htb and [pb]fifo, not tbf, fq_codel or sfq)
with two children: SSH first (``prio 0``), everything else in a FIFO of ~50 ms at the
rate, so pyinfra's commands to a host do not wait behind a download into it longer than
behind a real switch's buffer. The hosts see nothing of it: no file, variable or address
changes.

:func:`counters` reads what crossed: the hub's and the registry's payload bytes (their
own counters: what "one copy" is measured in), the WAN class's wire bytes, and each
host's NIC and ConnectX-7 bytes (interface counters: headers included, ~5% over payload).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import pairs, paths
from .proc import TestbedError, run
from .state import HostState

#: A real fleet's rates (Mbit/s): WAN to the hub and registry, a Spark's 10 GbE, ConnectX-7.
REAL_MBIT = {"wan": 1_000, "lan": 10_000, "cx7": 200_000}
#: Upstream's services on the controller whose traffic is the WAN's.
WAN_PORTS = (paths.HUB_PORT, paths.REGISTRY_PORT)
#: htb class ids on the bridge: the WAN, and everything else (unshaped).
WAN_CLASS, OTHER_CLASS = "1:10", "1:99"
#: On a NIC: the link, SSH (first) and the rest under it.
LINK_CLASS, SSH_CLASS, BULK_CLASS = "1:1", "1:10", "1:20"
SSH_PORT = 22
#: Large enough not to shape: what else leaves the bridge device (SSH, apt, the hosts' replies).
UNSHAPED = "100gbit"


@dataclass(frozen=True)
class Rates:
    """The real rates divided by ``scale``, in kbit/s."""

    scale: float

    def kbit(self, link: str) -> int:
        return max(8, round(REAL_MBIT[link] * 1000 / self.scale))

    def bytes_per_s(self, link: str) -> float:
        return self.kbit(link) * 1000 / 8

    def record(self) -> dict[str, Any]:
        return {"scale": self.scale, **{f"{link}_kbit": self.kbit(link) for link in REAL_MBIT}}


def _tc(netns: str | None, *args: str) -> None:
    run([*(["ip", "netns", "exec", netns] if netns else []), "tc", *args], timeout=15)


def _burst(kbit: int) -> str:
    # ~1 ms of the rate, at least a GSO packet: short against any transfer here, long
    # enough that the timer's granularity does not eat the rate.
    return f"{max(64 * 1024, kbit * 1000 // 8 // 1000)}b"


def _fifo_bytes(kbit: int) -> str:
    return str(max(128 * 1024, kbit * 1000 // 8 // 20))  # ~50 ms at the rate


def _limit(dev: str, kbit: int, netns: str | None = None) -> None:
    """All of *dev*'s egress through one htb class of *kbit*; SSH served first."""
    burst = _burst(kbit)
    _tc(netns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", BULK_CLASS.split(":")[1])
    _tc(netns, "class", "replace", "dev", dev, "parent", "1:", "classid", LINK_CLASS, "htb", "rate", f"{kbit}kbit",
        "ceil", f"{kbit}kbit", "burst", burst, "cburst", burst, "quantum", "60000")
    for classid, share, prio in ((SSH_CLASS, 0.05, "0"), (BULK_CLASS, 0.95, "1")):
        _tc(netns, "class", "replace", "dev", dev, "parent", LINK_CLASS, "classid", classid, "htb",
            "rate", f"{max(8, round(kbit * share))}kbit", "ceil", f"{kbit}kbit", "burst", burst, "cburst", burst,
            "prio", prio, "quantum", "60000")
    _tc(netns, "qdisc", "replace", "dev", dev, "parent", BULK_CLASS, "handle", "20:", "bfifo",
        "limit", _fifo_bytes(kbit))
    for direction in ("sport", "dport"):
        _tc(netns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", direction, str(SSH_PORT), "0xffff", "flowid", SSH_CLASS)


def set_wan(kbit: int | None) -> None:
    """Limit what the hub and the registry send to *kbit* (None: no limit, no qdisc)."""
    dev = paths.BRIDGE
    run(["tc", "qdisc", "del", "dev", dev, "root"], timeout=15, check=False)
    if kbit is None:
        return
    burst = _burst(kbit)
    _tc(None, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", OTHER_CLASS.split(":")[1])
    _tc(None, "class", "add", "dev", dev, "parent", "1:", "classid", WAN_CLASS, "htb", "rate", f"{kbit}kbit",
        "ceil", f"{kbit}kbit", "burst", burst, "cburst", burst, "quantum", "60000")
    _tc(None, "qdisc", "add", "dev", dev, "parent", WAN_CLASS, "handle", "10:", "bfifo", "limit", _fifo_bytes(kbit))
    _tc(None, "class", "add", "dev", dev, "parent", "1:", "classid", OTHER_CLASS, "htb", "rate", UNSHAPED,
        "quantum", "60000")
    for port in WAN_PORTS:
        _tc(None, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "src", f"{paths.CONTROLLER_IP}/32", "match", "ip", "sport", str(port), "0xffff",
            "flowid", WAN_CLASS)


def apply(hosts: list[HostState], cabled: list[tuple[str, str]], rates: Rates) -> None:
    """Shape every host's NIC (both ways), every pair's link and the WAN at *rates*."""
    lan = rates.kbit("lan")
    for h in hosts:
        _limit("eth0", lan, netns=h.netns)
        _limit(h.veth, lan)
    for members in cabled:
        for name in members:
            for netdev in pairs.CABLED:
                _limit(netdev, rates.kbit("cx7"), netns=paths.netns_name(name))
    set_wan(rates.kbit("wan"))


# --- counters ----------------------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes so far; ``after - before`` gives what a run moved.

    ``hub``/``registry``: payload bytes upstream served (the hub's body bytes, the
    registry's blob bytes); ``wan``: their sum; ``wan_wire``: the WAN class's bytes on the
    wire (0 when unshaped). ``hosts[name]``: ``egress``/``ingress`` on the host's NIC and
    ``cx7_egress``/``cx7_ingress`` on its pair link (wire bytes)."""

    hub: int = 0
    registry: int = 0
    wan_wire: int = 0
    hosts: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def wan(self) -> int:
        return self.hub + self.registry

    def egress(self, name: str) -> int:
        """All a host sent: its NIC and its pair link."""
        h = self.hosts[name]
        return h["egress"] + h["cx7_egress"]

    def __sub__(self, before: "Traffic") -> "Traffic":
        return Traffic(
            hub=self.hub - before.hub, registry=self.registry - before.registry,
            wan_wire=self.wan_wire - before.wan_wire,
            hosts={n: {k: v - before.hosts.get(n, {}).get(k, 0) for k, v in c.items()} for n, c in self.hosts.items()},
        )

    def record(self) -> dict[str, Any]:
        return {"hub": self.hub, "registry": self.registry, "wan": self.wan, "wan_wire": self.wan_wire,
                "hosts": self.hosts}


def _sysfs_bytes(dev: str, which: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/{which}_bytes").read_text())


def _netns_tx_rx(netns: str, devs: tuple[str, ...]) -> tuple[int, int]:
    out = run(["ip", "-n", netns, "-j", "-s", "link", "show"], timeout=15, check=False).stdout
    tx = rx = 0
    for link in json.loads(out or "[]"):
        if link.get("ifname") in devs:
            stats = link.get("stats64", {})
            tx += stats.get("tx", {}).get("bytes", 0)
            rx += stats.get("rx", {}).get("bytes", 0)
    return tx, rx


def wan_wire_bytes() -> int:
    """The WAN class's bytes (0 when unshaped). From tc's text: its -j leaves out classes here."""
    out = run(["tc", "-s", "class", "show", "dev", paths.BRIDGE], timeout=15, check=False).stdout
    found = re.search(rf"^class htb {WAN_CLASS} .*\n Sent (\d+) bytes", out, re.M)
    return int(found.group(1)) if found else 0


def hub_bytes() -> int:
    import requests

    session = requests.Session()
    session.trust_env = False  # the hub is on our bridge, never behind a proxy
    answer = session.get(f"{paths.HUB_URL}/_testbed/stats", timeout=10)
    if answer.status_code != 200:
        raise TestbedError(f"hub stats: HTTP {answer.status_code}")
    return int(answer.json()["total"])


def counters(hosts: list[HostState], paired: set[str]) -> Traffic:
    from .registry import blob_stats

    traffic = Traffic(hub=hub_bytes(), registry=blob_stats(0)["total"], wan_wire=wan_wire_bytes())
    for h in hosts:
        # The root side's receive is the host's send, and the other way round.
        c = {"egress": _sysfs_bytes(h.veth, "rx"), "ingress": _sysfs_bytes(h.veth, "tx"),
             "cx7_egress": 0, "cx7_ingress": 0}
        if h.name in paired:
            c["cx7_egress"], c["cx7_ingress"] = _netns_tx_rx(h.netns, pairs.CABLED)
        traffic.hosts[h.name] = c
    return traffic
