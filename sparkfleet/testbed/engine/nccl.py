"""NCCL between simulated Sparks: the transport it would pick and the bandwidth it would reach.

The simulated image has no torch: ``runtime/linkcheck.py`` calls :func:`all_gather` here
(named by ``SPARKFLEET_NCCL_STANDIN``). The members really meet over the link (a TCP
rendezvous on the master address, a payload each way, so a cut link fails as NCCL's
bootstrap does); what a ConnectX-7 would do is decided as NCCL decides it on a Spark:

* **RoCE (NET/IB)** when IB is not disabled, ``/dev/infiniband`` is there, ``NCCL_IB_HCA``
  names a device, ``NCCL_IB_GID_INDEX`` is the RoCE v2 GID of the link's IPv4 address
  (:data:`ROCE_V2_IPV4_GID_INDEX`, the table the testbed's ``show_gids`` prints) and every
  member's netdev carries RoCE's 4096-byte path MTU (jumbo frames, the same MTU at each
  end); otherwise **NET/Socket**, without an error: the silent fallback of the field.
* **Bus bandwidth** from the link itself: the netdev's speed in sysfs (the veth's, which
  the container sees) times :data:`LINK_FACTOR`, the testbed's one factor from the veth
  to the ConnectX-7 it stands for, times the transport's efficiency. RoCE's keeps a
  healthy link just above NVIDIA's 21.875 GB/s floor (which is 87.5% of 200 Gb/s);
  sockets reach a fraction of it.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

from .flags import NCCL_VERSION

#: The simulated link is a 10 Gb/s veth standing for a 200 Gb/s ConnectX-7 cable.
LINK_FACTOR = 20
#: Where the RoCE v2 GID of the link's IPv4 address sits on a Spark (0/1: link-local v1/v2,
#: 2/3: the IPv4-mapped v1/v2), as the testbed's show_gids lists it.
ROCE_V2_IPV4_GID_INDEX = 3
#: NCCL's default GID index when NCCL_IB_GID_INDEX is unset.
NCCL_DEFAULT_GID_INDEX = 0
#: RoCE's 4096-byte path MTU needs a netdev MTU above it plus RoCE's headers.
ROCE_MIN_NETDEV_MTU = 4200
#: Share of line rate all_gather reaches (assumed): RoCE a little above NVIDIA's floor (87.5%),
#: NCCL's socket transport a fraction of it over the same port.
EFFICIENCY = {"IB": 0.92, "Socket": 0.16}
PAYLOAD_BYTES = 1 << 20


def _netdev(interface: str, name: str) -> int:
    try:
        with open(f"/sys/class/net/{interface}/{name}") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return 0


def roce_ready(env: dict[str, str], interface: str) -> tuple[bool, str]:
    """Whether this member's NCCL could use RoCE, and why not."""
    gid = int(env.get("NCCL_IB_GID_INDEX") or NCCL_DEFAULT_GID_INDEX)
    mtu = _netdev(interface, "mtu")
    if env.get("NCCL_IB_DISABLE") == "1":
        return False, "NCCL_IB_DISABLE=1"
    if not os.path.exists("/dev/infiniband/uverbs0") or not env.get("NCCL_IB_HCA"):
        return False, "no RoCE device (/dev/infiniband, NCCL_IB_HCA)"
    if gid != ROCE_V2_IPV4_GID_INDEX:
        return False, f"GID index {gid} is not the RoCE v2 GID of the link's address"
    if mtu < ROCE_MIN_NETDEV_MTU:
        return False, f"MTU {mtu} on {interface} is below RoCE's 4096-byte path MTU"
    return True, ""


def _exchange(sock: socket.socket, mine: dict) -> dict:
    """Send our line and a payload while reading theirs (one JSON line, then the payload):
    both ends send at once, so sending waits on no read (small buffers at MTU 1500)."""
    sender = threading.Thread(target=sock.sendall, args=(json.dumps(mine).encode() + b"\n" + b"\0" * PAYLOAD_BYTES,),
                              daemon=True)
    sender.start()
    buf = b""
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the peer closed the connection during the collective")
        buf += chunk
    line, rest = buf.split(b"\n", 1)
    left = PAYLOAD_BYTES - len(rest)
    while left > 0:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the collective")
        left -= len(chunk)
    sender.join(timeout=sock.gettimeout())
    return json.loads(line)


def _meet(rank: int, world: int, master: str, port: int, timeout_s: float, mine: dict) -> list[dict]:
    """Every member's line: rank 0 gathers them and sends the list back (a two-member pair:
    one connection)."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        srv = socket.create_server((master, port), reuse_port=False)
        srv.settimeout(timeout_s)
        lines, conns = [mine], []
        try:
            while len(conns) < world - 1:
                conn, _ = srv.accept()
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                lines.append(_exchange(conn, mine))
                conns.append(conn)
            for conn in conns:
                conn.sendall(json.dumps(lines).encode() + b"\n")
                conn.close()
        finally:
            srv.close()
        return lines
    last = ""
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection((master, port), timeout=2.0)
            break
        except OSError as exc:
            last = str(exc)
            time.sleep(0.5)
    else:
        raise TimeoutError(f"NCCL bootstrap: no connection to {master}:{port} after {timeout_s:g} s ({last})")
    conn.settimeout(max(1.0, deadline - time.monotonic()))
    _exchange(conn, mine)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    conn.close()
    return json.loads(buf)


def all_gather(rank: int, world: int, master: str, port: int, timeout_s: float, env: dict[str, str]) -> dict:
    """linkcheck.py's answer for this member: transport, bus bandwidth, NCCL version."""
    interface = env.get("NCCL_SOCKET_IFNAME", "").lstrip("=^").split(",")[0]
    ok, why = roce_ready(env, interface)
    mine = {"rank": rank, "roce": ok, "why": why, "mtu": _netdev(interface, "mtu")}
    lines = _meet(rank, world, master, port, timeout_s, mine)
    mtus = {line["mtu"] for line in lines}
    transport = "IB" if all(line["roce"] for line in lines) and len(mtus) == 1 else "Socket"
    speed = _netdev(interface, "speed") * LINK_FACTOR  # Mb/s of the cable the veth stands for
    busbw = speed * 1e6 / 8 / 1e9 * EFFICIENCY[transport]
    reasons = [f"rank {line['rank']}: {line['why']}" for line in lines if line["why"]]
    if len(mtus) > 1:
        reasons.append(f"the members' MTUs differ ({', '.join(str(m) for m in sorted(mtus))})")
    return {"transport": transport, "busbw_gbs": round(busbw, 2), "nccl": NCCL_VERSION, "speed_mbps": speed,
            "fallback": "; ".join(reasons)}
