"""A shaped fleet (``up --bandwidth-scale``) moves bytes at the rates it says, and its
counters count them: host to host over the NIC, over a pair's link, and from the hub
over the WAN; the hosts are told nothing of it.

Needs root (marked e2e); fails - does not skip - without it. Boots its own fleet of two
paired hosts (replacing any fleet of this instance) and removes it at the end. ~1 minute.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from sparkfleet.testbed import checkpoints, fleet, paths
from sparkfleet.testbed.proc import missing_tools

pytestmark = pytest.mark.e2e

#: Rates a 400th of a real fleet's (WAN 2.5, LAN 25, CX-7 500 Mbit/s): low enough that two
#: cores keep up with the pair link while other tests run.
SCALE = 400
#: The shaped rate, within this share (tc htb on veth measured within ~5% here).
TOLERANCE = 0.15
SENDER, RECEIVER = "spark-1", "spark-2"
LINK = {SENDER: "192.168.177.1", RECEIVER: "192.168.177.2"}

RECEIVE = r"""
import socket, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5201)); s.listen(1); s.settimeout(60)
c, _ = s.accept(); c.settimeout(60); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.monotonic()
    n += len(b)
print(n, time.monotonic() - t0)
"""
SEND = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], 5201), timeout=30)
left = int(sys.argv[2]); buf = bytes(1 << 20)
while left > 0:
    c.sendall(buf[:min(left, len(buf))]); left -= len(buf)
c.close()
"""
#: A range of a hub file, timed from the request to the last byte.
DOWNLOAD = r"""
import sys, time, urllib.request
req = urllib.request.Request(sys.argv[1], headers={"Range": "bytes=0-%d" % (int(sys.argv[2]) - 1)})
t0 = time.monotonic(); n = len(urllib.request.urlopen(req, timeout=60).read())
print(n, time.monotonic() - t0)
"""


@pytest.fixture(scope="module")
def tb():
    if os.geteuid() != 0:
        pytest.fail("the shaping test needs root", pytrace=False)
    if missing_tools():
        pytest.fail(f"missing tools for the testbed: {missing_tools()}", pytrace=False)
    # artifact_scale 3000: a padded INT4 repo (~21 MB) to download from; the image is
    # larger than its share already, so it stays unpadded.
    bed = fleet.up(2, login_kind="root", names="plain", n_pairs=1, bandwidth_scale=SCALE, artifact_scale=3000)
    try:
        yield bed
    finally:
        fleet.down()


def transfer(tb, address: str, nbytes: int) -> tuple[int, float]:
    """Send *nbytes* from SENDER to RECEIVER at *address*: (bytes received, seconds)."""
    got = {}

    def receive():
        got["done"] = tb.exec(RECEIVER, ["python3", "-c", RECEIVE], via="nsenter", timeout=90)

    listener = threading.Thread(target=receive)
    listener.start()
    time.sleep(1.0)  # the listener binds well within this
    tb.exec(SENDER, ["python3", "-c", SEND, address, str(nbytes)], via="nsenter", timeout=90, check=True)
    listener.join(timeout=90)
    n, seconds = got["done"].stdout.split()
    return int(n), float(seconds)


def assert_rate(what: str, nbytes: int, seconds: float, kbit: int) -> None:
    measured = nbytes * 8 / seconds / 1000
    assert abs(measured / kbit - 1) <= TOLERANCE, f"{what}: {measured:.0f} kbit/s, shaped to {kbit} kbit/s"


def test_the_hosts_are_not_told(tb):
    assert tb.shaping["rates"] == {"scale": SCALE, "wan_kbit": 2500, "lan_kbit": 25000, "cx7_kbit": 500000}
    text = tb.hosts_json.read_text()
    assert not any(word in text for word in ("shaping", "bandwidth", "artifact_scale", "kbit"))


def test_lan_between_hosts(tb):
    before = tb.traffic()
    n, seconds = transfer(tb, tb.host(RECEIVER).address, 6_000_000)
    moved = tb.traffic() - before
    assert n == 6_000_000
    assert_rate("LAN", n, seconds, tb.shaping["rates"]["lan_kbit"])
    assert n <= moved.hosts[SENDER]["egress"] <= 1.06 * n
    assert n <= moved.hosts[RECEIVER]["ingress"] <= 1.06 * n
    assert moved.wan == 0 and moved.hosts[SENDER]["cx7_egress"] < 10_000


def test_pair_link(tb):
    for name, address in LINK.items():  # what the deploy's netplan step would assign
        tb.exec(name, f"ip addr add {address}/24 dev enp1s0f1np1", via="nsenter", check=True)
    before = tb.traffic()
    n, seconds = transfer(tb, LINK[RECEIVER], 60_000_000)
    moved = tb.traffic() - before
    assert_rate("ConnectX-7", n, seconds, tb.shaping["rates"]["cx7_kbit"])
    assert n <= moved.hosts[SENDER]["cx7_egress"] <= 1.06 * n
    assert moved.hosts[SENDER]["egress"] < 100_000  # not over the NIC


def test_wan_from_the_hub(tb):
    revision = tb.state.data["_model_revisions"][checkpoints.INTEL]
    url = f"{paths.HUB_URL}/{checkpoints.INTEL}/resolve/{revision}/{checkpoints.PADDING_FILE}"
    before = tb.traffic()
    done = tb.exec(RECEIVER, ["python3", "-c", DOWNLOAD, url, "1500000"], via="nsenter", timeout=60, check=True)
    moved = tb.traffic() - before
    n, seconds = int(done.stdout.split()[0]), float(done.stdout.split()[1])
    assert n == 1_500_000
    assert_rate("WAN", n, seconds, tb.shaping["rates"]["wan_kbit"])
    assert moved.hub == n and moved.registry == 0
    assert n <= moved.wan_wire <= 1.08 * n
    assert n <= moved.hosts[RECEIVER]["ingress"] <= 1.08 * n


def test_ssh_is_not_the_wans(tb):
    """pyinfra's SSH is the LAN's: a command returns quickly while the WAN is busy."""
    revision = tb.state.data["_model_revisions"][checkpoints.INTEL]
    url = f"{paths.HUB_URL}/{checkpoints.INTEL}/resolve/{revision}/{checkpoints.PADDING_FILE}"
    busy = threading.Thread(target=tb.exec, args=(RECEIVER, ["python3", "-c", DOWNLOAD, url, "1500000"]),
                            kwargs={"via": "nsenter", "timeout": 60})
    busy.start()
    time.sleep(1.0)
    started = time.monotonic()
    tb.exec(RECEIVER, "head -c 1000000 /dev/zero", timeout=30, check=True)
    took = time.monotonic() - started
    busy.join(timeout=60)
    # 1 MB through the 2.5 Mbit/s WAN takes 3.2 s; the LAN's 25 Mbit/s 0.32 s, + the login.
    assert took < 2.0, f"an SSH command took {took:.2f} s while the WAN was busy"
