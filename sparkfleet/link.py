"""The ConnectX-7 link of a pair member: addressed with netplan, checked end to end.

Two Sparks of a pair are cabled QSFP to QSFP. Each ConnectX-7 port of a Spark shows two
netdevs whose names differ only in the PCIe domain (``enp1s0f1np1`` and its twin
``enP2p1s0f1np1``), each with its RoCE device (``rocep1s0f1``, ``roceP2p1s0f1``).
``ibdev2netdev`` says which port has the cable (its netdevs are ``Up``). As NVIDIA's
two-Spark playbook does, that port's ``enp…`` netdev gets the pair's address and both
twins get the MTU, in ``/etc/netplan/40-cx7.yaml`` (0600: netplan warns about wider
modes; no renderer, as in the playbook's: the host's own renders it); ``netplan apply``
runs only when that file changed. NCCL gets the RoCE devices of the Up netdevs
(``NCCL_IB_HCA``), NCCL/GLOO the interface (``NCCL_SOCKET_IFNAME``...).

:func:`problems` is the preflight's part (cable, names, RoCE devices, ``/dev/infiniband``);
:func:`checked` proves the link after both members applied it: address, MTU, carrier,
and every peer answering a ping, also as one unfragmented packet of the full MTU.
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import gevent
from pyinfra import host, logger
from pyinfra.api import deploy, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.api.host import Host
from pyinfra.facts.files import Directory, FileContents
from pyinfra.facts.hardware import NetworkDevices
from pyinfra.operations import files, server

from sparkfleet import container_runtime, remote
from sparkfleet.config import Settings
from sparkfleet.fleet import all_settings, host_mirror, mirror_route
from sparkfleet.hostpaths import LINK_CHECK, NETPLAN_CX7, RDMA_DEVICES, RUNTIME_DIR
from sparkfleet.mirror import local_image
from sparkfleet.pairs import Pair, PairMember
from sparkfleet.routes import Answers, RoceGids, RoceNetdevs, RouteSource

AUTO = "auto"
#: IPv4 (20) and ICMP (8) headers: the largest ping payload one packet of the MTU carries.
PING_HEADERS = 28
#: How long the check waits for networkd to bring the applied address up (~1 s measured).
SETTLE_S = 10
#: The live link differs from the netplan file (which the deploy keeps right).
APPLY_FIX = (f"{NETPLAN_CX7} has it; run `sudo netplan apply` on this host, and if it stays so, "
             "read `journalctl -u systemd-networkd`")


@dataclass(frozen=True)
class Link:
    """This member's end of the link: the netdev to address (``interface``, "" when no
    cabled port is up: :func:`problems` says so), its port's netdevs (``interface`` first),
    the RoCE devices for ``NCCL_IB_HCA`` (``hcas``, a comma list), and the addresses."""

    interface: str
    netdevs: tuple[str, ...]
    hcas: str
    address: str
    prefix_len: int
    mtu: int
    peers: tuple[tuple[str, str], ...]  # (inventory name, address) of every other member
    routes: tuple[tuple[str, str], ...] = ()  # (address, via): the fleet mirror, when a peer is it
    gid_index: int = 3  # NCCL_IB_GID_INDEX: the RoCE v2 GID of ``address`` (gid_index())


def twin(netdev: str) -> str:
    """The other netdev of the same port: ``enp1s0f1np1`` <-> ``enP2p1s0f1np1``."""
    if netdev.startswith("enP2p"):
        return "enp" + netdev[len("enP2p"):]
    if netdev.startswith("enp"):
        return "enP2p" + netdev[len("enp"):]
    return ""


def pick(roce: list[dict], interface: str, hcas: str) -> tuple[str, tuple[str, ...], str]:
    """(interface, its port's netdevs, NCCL_IB_HCA) from ``ibdev2netdev``'s devices and the
    ``pair_interface`` / ``pair_hcas`` settings ("auto": the cabled port, per ibdev2netdev)."""
    up = [d for d in roce if d["up"]]
    if interface == AUTO:
        # The playbook's names: the enp… netdev of the port, not its enP2p… twin.
        interface = next((d["netdev"] for d in up if d["netdev"].startswith("enp")), "")
    if hcas == AUTO:
        hcas = ",".join(d["hca"] for d in up)
    if not interface:
        return "", (), hcas
    other = twin(interface)
    return interface, (interface, other) if any(d["netdev"] == other for d in roce) else (interface,), hcas


#: Where two-Spark recipes pin NCCL_IB_GID_INDEX: used when the table has no RoCE v2 GID of
#: the link's address yet (the first deploy plans before netplan gives the port its address);
#: the link check's collective then proves it, and the next run reads the table.
SPARK_GID_INDEX = 3


def gid_index(gids: list[dict], hcas: str, address: str, setting: str | int) -> int:
    """NCCL_IB_GID_INDEX: ``pair_gid_index`` when set, else the index of the RoCE v2 GID
    that maps ``address`` (show_gids) on the first of ``hcas``, else :data:`SPARK_GID_INDEX`."""
    if setting != AUTO:
        return int(setting)
    first = hcas.split(",")[0]
    v2 = [g for g in gids if g["hca"] == first and g["version"] == "v2" and g["ipv4"]]
    exact = [g for g in v2 if g["ipv4"] == address]
    return int((exact or v2)[0]["index"]) if (exact or v2) else SPARK_GID_INDEX


def resolved(settings: Settings, pair: Pair) -> Link:
    """This host's end of ``pair``'s link, from its ``ibdev2netdev`` (read while planning)."""
    interface, netdevs, hcas = pick(host.get_fact(RoceNetdevs), settings.pair_interface, settings.pair_hcas)
    peers = tuple((name, address) for rank, (name, address) in enumerate(zip(pair.members, pair.addresses))
                  if rank != pair.rank)
    mirror = host_mirror()
    mirror = mirror.upstream if mirror and mirror.is_self else mirror  # where this host fetches from
    route = mirror_route(host.name, mirror) if mirror else None  # (this member's address, via)
    return Link(interface=interface, netdevs=netdevs, hcas=hcas, address=pair.address,
                prefix_len=pair.prefix_len, mtu=settings.pair_mtu, peers=peers,
                routes=((str(mirror.address), route[1]),) if route else (),
                gid_index=gid_index(host.get_fact(RoceGids), hcas, pair.address, settings.pair_gid_index))


def netplan(link: Link, group: str) -> str:
    """/etc/netplan/40-cx7.yaml for ``link``: the address on the interface, the MTU on
    both netdevs of the port, and a route over the link to a peer that is the fleet mirror."""
    lines = [
        f"# Rendered by sparkfleet (link.py): the ConnectX-7 link of {group}.",
        "network:",
        "  version: 2",
        "  ethernets:",
    ]
    for netdev in link.netdevs:
        lines += [f"    {netdev}:", "      dhcp4: false"]
        if netdev == link.interface:
            lines.append(f"      addresses: [{link.address}/{link.prefix_len}]")
            if link.routes:
                lines.append("      routes:")
                lines += [f"        - {{to: {address}/32, via: {via}}}" for address, via in link.routes]
        # optional: a peer that is off must not hold this host's boot (wait-online).
        lines += [f"      mtu: {link.mtu}", "      optional: true"]
    return "\n".join(lines) + "\n"


# --- preflight --------------------------------------------------------------------


def _cable_fix(pair: Pair) -> str:
    peers = " and ".join(m for rank, m in enumerate(pair.members) if rank != pair.rank)
    return (f"check the QSFP cable between this host and {peers} (reseat both ends); "
            "if the port stays Down, reboot both")


def judged(roce: list[dict], devices: dict, rdma_devices: bool, interface: str, hcas: str,
           pair: Pair) -> list[str]:
    """What is wrong with this host's side of the link, each with its fix (pure: facts in)."""
    found = []
    if not roce:
        found.append("ibdev2netdev lists no RoCE device (the ConnectX-7's RDMA driver is not loaded, or the "
                     "tool is missing): load it with `modprobe mlx5_ib` or reboot; DGX OS ships both")
    if not rdma_devices:
        found.append(f"{RDMA_DEVICES} is missing (NCCL's RoCE transport and the serving container need it): "
                     "load the ConnectX-7's RDMA driver (`modprobe mlx5_ib`) or reboot")
    if not roce:
        return found
    states = ", ".join(f"{d['netdev']} {'Up' if d['up'] else 'Down'}" for d in roce)
    name, _, hca_list = pick(roce, interface, hcas)
    if interface == AUTO and not name:
        found.append(f"no ConnectX-7 port is up (ibdev2netdev: {states}): {_cable_fix(pair)}")
        return found
    if interface != AUTO:
        if name not in devices:
            choices = ", ".join(d["netdev"] for d in roce if d["netdev"].startswith("enp"))
            found.append(f"pair_interface {name} is not a network device here (the ConnectX-7's are {choices}): "
                         "set pair_interface to the cabled one, or to auto")
            return found
        if not any(d["netdev"] == name for d in roce):
            found.append(f"pair_interface {name} has no RoCE device (ibdev2netdev: {states}): "
                         "name a ConnectX-7 netdev, or set pair_interface=auto")
        elif not any(d["netdev"] == name and d["up"] for d in roce):
            found.append(f"pair_interface {name} is Down (ibdev2netdev: {states}): {_cable_fix(pair)}, "
                         "or set pair_interface to the port that is Up (or auto)")
    listed = {d["hca"] for d in roce}
    unknown = [h for h in hca_list.split(",") if h and h not in listed]
    if hcas != AUTO and unknown:
        found.append(f"pair_hcas names {', '.join(unknown)}, which ibdev2netdev does not list "
                     f"({', '.join(sorted(listed))}): fix pair_hcas, or set it to auto")
    if not hca_list:
        found.append(f"no RoCE device is up for NCCL_IB_HCA (ibdev2netdev: {states}): {_cable_fix(pair)}")
    return found


def problems(settings: Settings, pair: Pair) -> list[str]:
    """The preflight's findings about this pair member's link (empty when it can be set up)."""
    return judged(host.get_fact(RoceNetdevs), host.get_fact(NetworkDevices), bool(host.get_fact(Directory,
                  path=RDMA_DEVICES)), settings.pair_interface, settings.pair_hcas, pair)


# --- configured, checked ------------------------------------------------------------


@deploy("ConnectX-7 link")
def configured(settings: Settings, pair: Pair) -> None:
    """The pair's address and MTU on this host's cabled port, by netplan; applied only
    when the file changed."""
    link = resolved(settings, pair)
    plan = files.put(
        name=f"{NETPLAN_CX7}: the pair's address and MTU on the cabled port",
        src=io.StringIO(netplan(link, pair.group)), dest=NETPLAN_CX7, mode="600", user="root", group="root",
    )
    server.shell(name="netplan apply", commands=["netplan apply"], _if=plan.did_change)


def link_problem(target, link: Link) -> str | None:
    """What is wrong with the link as ``target`` has it now (one line with its fix), or None."""
    devices = target.get_fact(NetworkDevices)
    device = devices.get(link.interface)
    if device is None:
        return f"{link.interface} is gone (expected the pair's link): check the ConnectX-7 and its driver, reboot"
    ipv4 = device.get("ipv4") or {}
    have = [f"{a['address']}/{a.get('mask_bits')}" for a in (ipv4, *ipv4.get("additional_ips", [])) if a]
    want = f"{link.address}/{link.prefix_len}"
    if want not in have:
        return (f"{link.interface} has {', '.join(have) or 'no IPv4 address'}, expected {want}: {APPLY_FIX}")
    if device.get("state") != "UP":
        peers = " and ".join(name for name, _ in link.peers)
        return (f"{link.interface} is {device.get('state')}, expected UP: check the QSFP cable to {peers} "
                "(reseat both ends), reboot if it stays down")
    for netdev in link.netdevs:
        mtu = devices.get(netdev, {}).get("mtu")
        if mtu != link.mtu:
            return f"{netdev} has MTU {mtu}, expected {link.mtu} (pair_mtu): {APPLY_FIX}"
    for address, via in link.routes:
        source = target.get_fact(RouteSource, address=address, _sudo=False)
        if source != link.address:
            return (f"the fleet mirror {address} is reached from {source or 'nowhere'}, expected over "
                    f"{link.interface} via {via} from {link.address}: {APPLY_FIX}")
    size = link.mtu - PING_HEADERS
    for name, address in link.peers:
        if not target.get_fact(Answers, interface=link.interface, address=address):
            return (f"{name} ({address}) does not answer ping on {link.interface}: check that its own link step "
                    "passed, the QSFP cable, and that both members have the same pair_subnet")
        if not target.get_fact(Answers, interface=link.interface, address=address, size=size, dont_fragment=True):
            return (f"{name} ({address}) answers on {link.interface} but not {size}-byte unfragmented pings: "
                    f"the path's MTU is below {link.mtu} (pair_mtu); give both ends MTU {link.mtu} (its own check "
                    "names its side) and any switch between them")
    return None


def _verified(state, host, link: Link) -> bool:  # state, host: pyinfra's callback arguments
    """Wait (bounded) for networkd to bring the applied link up; fail with its problem."""
    deadline = time.monotonic() + SETTLE_S
    while (problem := link_problem(host, link)) and time.monotonic() < deadline:
        gevent.sleep(1)
    if problem:
        raise OperationError(problem)
    return True


@operation(is_idempotent=False)
def checked(settings: Settings, pair: Pair):
    """
    Fail this host, naming the interface, what was expected and the fix, unless its end of
    the link has the pair's address, MTU and carrier and every peer answers over it (also
    with one unfragmented packet of the full MTU).

    + settings: validated settings (``pair_interface``, ``pair_hcas``, ``pair_mtu``)
    + pair: this host's pair (``fleet.host_pair()``)

    Runs after :func:`configured` on every member (pyinfra runs an operation on all hosts
    before the next); a link that already answers runs nothing.
    """
    link = resolved(settings, pair)
    if link_problem(host, link) is None:
        peers = ", ".join(f"{name} ({address})" for name, address in link.peers)
        host.noop(f"{link.interface} {link.address}/{link.prefix_len} MTU {link.mtu}, answering: {peers}")
        return
    yield remote.callback(_verified, link)


@deploy("ConnectX-7 link")
def joined(settings: Settings, pair: Pair) -> PairMember:
    """The link configured and proven; returns this member's part of its pair's engine
    (the interface and RoCE devices its NCCL, Gloo and vLLM use)."""
    configured(settings, pair)
    checked(name="ConnectX-7 link: address, MTU, every peer answers", settings=settings, pair=pair)
    return _member(settings, pair, resolved(settings, pair))


def _member(settings: Settings, pair: Pair, link: Link) -> PairMember:
    return PairMember(pair, interface=link.interface, hcas=link.hcas, gid_index=str(link.gid_index),
                      enforce_eager=settings.pair_enforce_eager,
                      disable_custom_all_reduce=settings.pair_disable_custom_all_reduce)


# --- measured: NCCL over the link, inside the image -----------------------------------------

CHECK_CONTAINER = "sparkfleet-link-check"
#: RoCE's 4096-byte path MTU needs a netdev MTU above it plus its headers (jumbo frames).
ROCE_MIN_MTU = 4200
_LINKCHECK = Path(__file__).resolve().parents[1] / "runtime" / "linkcheck.py"


def check_key(settings: Settings, pair: Pair) -> str:
    """Names one measurement of ``pair``: the same on every member (what the members agree
    on, each member's link settings, the check program), so all of them run it or none."""
    fleet = all_settings()
    each = [(name, str(fleet[name].pair_gid_index), fleet[name].pair_hcas, fleet[name].pair_interface)
            for name in pair.members if name in fleet]
    parts = [settings.image, pair.group, pair.members, pair.addresses, settings.pair_mtu, settings.pair_check_port,
             settings.pair_min_busbw_gbs, each, _LINKCHECK.read_bytes().hex()]
    return hashlib.sha256(json.dumps(parts, default=list).encode()).hexdigest()[:16]


def record_of(target) -> dict | None:
    """``target``'s last link check record (LINK_CHECK), None without one."""
    lines = target.get_fact(FileContents, path=LINK_CHECK)
    try:
        doc = json.loads("\n".join(lines or []))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def judged_measurement(found: dict, link: Link, floor: float, right_gid: int | None) -> str | None:
    """What the measured collective says is wrong (with the figure and the likely cause), or None."""
    figure = f"{found.get('busbw_gbs', 0):g} GB/s"
    peers = " and ".join(name for name, _ in link.peers)
    if found.get("error"):
        return (f"NCCL's all_gather with {peers} over {link.interface} failed: {found['error']}. Likely cause: "
                f"the peer's own link check failed, or the QSFP cable; the address, MTU and pings passed")
    transport = found.get("transport") or "no network transport"
    if transport != "IB":
        said = (f"NCCL's all_gather with {peers} ran over NET/{transport}, not RoCE, at {figure} "
                f"(floor {floor:g} GB/s, pair_min_busbw_gbs)")
        mtu = found.get("mtu")
        if right_gid is not None and right_gid != link.gid_index:
            cause = (f"NCCL_IB_GID_INDEX={link.gid_index}, but this host's RoCE v2 GID of {link.address} is index "
                     f"{right_gid} (show_gids). Fix: --data pair_gid_index={right_gid}, or auto")
        elif mtu is not None and mtu < ROCE_MIN_MTU:
            cause = (f"MTU {mtu} on {link.interface} (pair_mtu): RoCE's 4096-byte frames need jumbo frames. "
                     "Fix: --data pair_mtu=9000 (NVIDIA's playbook), on both members")
        else:
            cause = (f"GID index {link.gid_index} (pair_gid_index), the MTU at either end ({mtu}), {RDMA_DEVICES} or "
                     f"NCCL_IB_HCA={link.hcas}: the other member's check names its side")
        return f"{said}. Likely cause: {cause}"
    if float(found.get("busbw_gbs") or 0) < floor:
        speed = found.get("speed_mbps")
        return (f"NCCL's all_gather with {peers} over RoCE reached {figure}, below the floor of {floor:g} GB/s "
                f"(pair_min_busbw_gbs). Likely cause: the cable or port ({link.interface} reports "
                f"{speed or '?'} Mb/s; a ConnectX-7 negotiates 200000): reseat or replace the QSFP cable, no switch "
                "between the members; ~20.4 GB/s is a field figure of a healthy direct cable, lower the floor "
                "(data) if that is what you measure")
    return None


def _measure(state, host, settings: Settings, member: PairMember, link: Link, key: str) -> bool:
    """The deploy's measurement (its peers run theirs at the same time), with the GPU flag
    as the run has it by now (its runtime step may have changed it): fail with the figure
    and the likely cause."""
    problem = measure(host, settings, member, link, key, container_runtime.unit_gpu_flag(settings))
    if problem:
        raise OperationError(problem)
    return True


def proof(settings: Settings, pair: Pair) -> Callable[[Host], str | None]:
    """This member's measurement, to run later from another host's turn (a stack upgrade's
    gate, every member at once): called with this host, it answers None or the problem."""
    link = resolved(settings, pair)
    return partial(measure, settings=settings, member=_member(settings, pair, link), link=link,
                   key=check_key(settings, pair), gpu=container_runtime.unit_gpu_flag(settings))


def measure(host, settings: Settings, member: PairMember, link: Link, key: str, gpu: str) -> str | None:
    """Run linkcheck.py in the image on this member (its peers must run theirs at the same
    time), with ``gpu`` the host's GPU flag (read while planning), and record the result on
    the host; None, or the figure and the likely cause."""
    pair = member.pair
    q = shlex.quote
    env = {k: v for k, v in settings.serve_env(member).items() if k.startswith("NCCL_")}
    env_args = " ".join(f"-e {q(f'{k}={v}')}" for k, v in env.items())
    reference = local_image(settings)
    run = (f"docker rm -f {CHECK_CONTAINER} >/dev/null 2>&1; docker run --rm --pull never --name {CHECK_CONTAINER} "
           f"--network host --ipc host --ulimit memlock=-1:-1 --device {RDMA_DEVICES} --cap-add IPC_LOCK "
           f"{gpu} {env_args} -v {RUNTIME_DIR}:/host:ro --entrypoint python3 "
           f"{q(reference)} /host/linkcheck.py --rank {pair.rank} --world {pair.size} --master {pair.master_addr} "
           f"--port {settings.pair_check_port} --timeout 120")
    done = remote.run(host, run, timeout=240)
    try:
        found = json.loads(done.stdout[-1])
    except (ValueError, IndexError):
        found = {"error": " ".join((done.stdout + done.stderr)[-5:]) or "no answer"}
    gids = RoceGids().process(remote.run(host, "show_gids 2>/dev/null || true").stdout)
    right = gid_index(gids, link.hcas, link.address, AUTO) if gids else None
    problem = judged_measurement(found, link, settings.pair_min_busbw_gbs, right)
    record = {
        "checked_at": datetime.now(UTC).isoformat(timespec="seconds"), "key": key, "ok": problem is None,
        "pair": pair.group, "rank": pair.rank, "peers": [name for name, _ in link.peers],
        "interface": link.interface, "transport": found.get("transport") or "", "busbw_gbs": found.get("busbw_gbs"),
        "floor_gbs": settings.pair_min_busbw_gbs, "gid_index": link.gid_index, "mtu": found.get("mtu"),
        "nccl": found.get("nccl") or "", "image": reference, "problem": problem,
    }
    remote.run(host, f"mkdir -p {q(str(Path(LINK_CHECK).parent))} && cat > {q(LINK_CHECK)}",
               stdin=json.dumps(record, indent=1) + "\n")
    if problem:
        return problem
    host.log(f"NCCL over {link.interface}: RoCE, all_gather {found['busbw_gbs']:g} GB/s (floor "
             f"{settings.pair_min_busbw_gbs:g}), NCCL {record['nccl']}", logger.info)
    return None


@operation(is_idempotent=False)
def measured(settings: Settings, member: PairMember):
    """
    Prove NCCL uses RoCE on the link at the pair's floor: a short all_gather between the
    members inside the serving image (runtime/linkcheck.py), asserting the IB transport and
    the bus bandwidth, recorded in ``/var/lib/sparkfleet/link-check.json``.

    + settings: validated settings (``pair_min_busbw_gbs``, ``pair_check_port``, ``image``)
    + member: this host's part of its pair (``joined``)

    Every member runs it at once; a pair whose every member recorded a pass for the same
    image and link settings runs nothing.
    """
    pair = member.pair
    key = check_key(settings, pair)
    state = host.state
    records = [record_of(state.inventory.get_host(name)) for name in pair.members]
    if all(r and r.get("ok") and r.get("key") == key for r in records):
        mine = records[pair.rank] or {}
        host.noop(f"NCCL over {mine.get('interface')}: {mine.get('transport')} at {mine.get('busbw_gbs')} GB/s "
                  f"(floor {mine.get('floor_gbs')}), checked {mine.get('checked_at')}")
        return
    yield remote.callback(_measure, settings, member, resolved(settings, pair), key)
