"""The watchdog on the session's simulated fleet (issue 29): an engine that keeps answering
/health and /v1/models but produces no token is seen within its bound, taken out of the
endpoint's rotation, restarted and back, under load through the endpoint; the next deploy
reports it. Memory pressure drains and stops the engine before the host runs out; a hard
reset comes back by itself, and status and the next deploy name its cause."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from sparkfleet.testbed import login, traffic
from tests.e2e.conftest import INVENTORY, REPO_ROOT

pytestmark = pytest.mark.e2e

ROUTER = "spark-1"
DATA = ("--data", f"fleet_endpoint={login.inventory_name(ROUTER, login.DEFAULT_NAMES)}")
WEDGE_TIMEOUT_S = 10
INTERVAL_S = 5
#: When a wedge leaves the rotation on a quiet host: the timeout, two ticks, one agent check.
BOUND_S = WEDGE_TIMEOUT_S + 2 * INTERVAL_S + 5
#: Asked on the host, with the key's 0600 header file: the key never reaches argv.
WEDGE = ("python3 -c \"import urllib.request as u; h=open('/etc/sparkfleet/api-auth.header').read().split(':',1); "
         "r=u.Request('http://127.0.0.1:8000/_sim/wedge', data=b'', headers={h[0]: h[1].strip()}); "
         "print(u.urlopen(r, timeout=5).status)\"")


def events(testbed, name: str) -> str:
    return testbed.exec(name, "cat /var/lib/sparkfleet/watchdog.log 2>/dev/null; true").stdout


def test_a_wedged_engine_is_drained_restarted_and_reported(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", *DATA, "--data", f"wedge_timeout_s={WEDGE_TIMEOUT_S}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    wedged = testbed.names[1]
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    assert ep.states() == {n: "UP" for n in testbed.names}
    before = events(testbed, wedged).count(" wedge ")
    with traffic.Watch(ep) as watch, traffic.Load(ep, workers=3) as load:
        time.sleep(3)
        assert testbed.exec(wedged, WEDGE).stdout.strip() == "200"
        wedged_at = time.monotonic()
        # /health and /v1/models still answer: HAProxy's own check keeps it UP.
        assert ep.states()[wedged] == "UP"
        # The bound is the wedge timeout, a timer tick and an agent check; a loaded machine
        # (CI runs three fleets on two cores) stretches each, so the wait allows twice that.
        out = watch.wait(lambda s: s.get(wedged) not in (None, "UP"), 2 * BOUND_S)
        assert out is not None, watch.samples[-3:]
        detected_s = out - wedged_at
        back = watch.wait(lambda s: s.get(wedged) == "UP" and (time.monotonic() > out + 1), 120)
        assert back is not None, watch.samples[-3:]
        time.sleep(3)  # traffic reaches the restarted engine again
    print(f"wedge seen and drained after {detected_s:.1f} s (bound {WEDGE_TIMEOUT_S} + {INTERVAL_S} s), "
          f"back after {back - out:.1f} s; {load.ok} requests ok, {len(load.failed)} failed")
    assert detected_s <= 2 * BOUND_S
    log = events(testbed, wedged)
    assert log.count(" wedge ") == before + 1 and "no progress" in log, log[-2000:]
    # Only requests that the wedged engine held when it restarted may fail; every request sent
    # after it left the rotation was served by the others.
    late = [r.error for r in load.requests if r.error and r.start > out + 1]
    assert late == [] and load.ok > 0, late[:5]
    assert len(load.failed) <= 3 + 3, load.failed  # at most what it held: its 3 sequences, the queue
    # The next deploy says what happened, once; its default bound comes back, nothing restarts.
    again = run_pyinfra("deploy.py", *DATA)
    text = again.stdout + again.stderr
    assert again.returncode == 0, text[-4000:]
    assert re.search(rf"\[{re.escape(testbed.inventory_name(wedged))}\] watchdog: .* wedge no progress", text), \
        text[-4000:]
    assert ep.states() == {n: "UP" for n in testbed.names}


#: A Spark's /proc/meminfo (MemTotal 121.7 GiB) with MemAvailable in GiB, and PSI's memory
#: line with ``full avg10``: laid over the host's own files (a bind mount, as LXCFS lays its
#: /proc/meminfo), as the kernel would print them while memory fills.
MEMINFO = "MemTotal:       127606784 kB\nMemFree:         {kib} kB\nMemAvailable:   {kib} kB\n"
PSI = "some avg10={some:.2f} avg60=0.00 avg300=0.00 total=1\nfull avg10={full:.2f} avg60=0.00 avg300=0.00 total=1\n"


def squeeze(testbed, name: str, available_gib: float, full: float) -> None:
    kib = int(available_gib * 1024 * 1024)
    testbed.exec(name, f"printf '{MEMINFO.format(kib=kib)}' > /run/sf-test-meminfo; "
                       f"printf '{PSI.format(some=2 * full, full=full)}' > /run/sf-test-psi")


def test_memory_pressure_drains_and_stops_the_engine_and_it_serves_again(testbed):
    squeezed = testbed.names[2]
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    squeeze(testbed, squeezed, 30.0, 0.0)
    short_before = events(testbed, squeezed).count("a start needs")
    mounted = testbed.exec(squeezed, "mount --bind /run/sf-test-meminfo /proc/meminfo && "
                                     "mount --bind /run/sf-test-psi /proc/pressure/memory && echo ok")
    assert mounted.stdout.strip() == "ok", mounted.stdout + mounted.stderr
    try:
        with traffic.Watch(ep) as watch, traffic.Load(ep, workers=3) as load:
            time.sleep(2 * INTERVAL_S)  # 30 GiB free, no stall: nothing happens
            assert ep.states()[squeezed] == "UP"
            squeeze(testbed, squeezed, 6.0, 25.0)  # memory fills: the host stalls
            pressed = time.monotonic()
            out = watch.wait(lambda s: s.get(squeezed) not in (None, "UP"), 2 * INTERVAL_S + 10)
            assert out is not None, watch.samples[-3:]
            deadline = time.monotonic() + 60
            while testbed.exec(squeezed, "systemctl is-active sparkfleet-serve; true").stdout.strip() == "active":
                assert time.monotonic() < deadline, "the engine was not stopped"
                time.sleep(1)
            stopped_s = time.monotonic() - pressed
            squeeze(testbed, squeezed, 60.0, 0.0)  # no stall, but something else still holds the memory
            deadline = time.monotonic() + 3 * INTERVAL_S + 10
            while events(testbed, squeezed).count("a start needs") == short_before:
                assert time.monotonic() < deadline, "the watchdog did not say why the engine stays stopped"
                time.sleep(1)
            assert testbed.exec(squeezed, "systemctl is-active sparkfleet-serve; true").stdout.strip() != "active"
            squeeze(testbed, squeezed, 118.0, 0.0)  # the squeeze is gone
            back = watch.wait(lambda s: s.get(squeezed) == "UP", 120)
            assert back is not None, watch.samples[-3:]
            time.sleep(3)
    finally:
        testbed.exec(squeezed, "umount /proc/pressure/memory; umount /proc/meminfo; true")
    print(f"memory pressure: drained after {out - pressed:.1f} s, engine stopped after {stopped_s:.1f} s, "
          f"back after {back - out:.1f} s; {load.ok} requests ok, {len(load.failed)} failed")
    log = events(testbed, squeezed)
    assert "drained and stopped the engine" in log and "started the engine again" in log, log[-2000:]
    assert log.count("a start needs") == short_before + 1, log[-2000:]  # said once, not at every look
    late = [r.error for r in load.requests if r.error and r.start > out + 1]
    assert late == [] and load.ok > 0, late[:5]


#: What the kernel logs when a GB10 is lost (NVIDIA's Xid 79), before the box freezes.
XID = "NVRM: Xid (PCI:000f:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sparkfleet", "status", INVENTORY, *args, *DATA], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ})


def test_a_hard_reset_comes_back_ready_by_itself_and_status_names_the_cause(testbed, run_pyinfra):
    """A host that froze and was reset (its last kernel lines an Xid): it boots, its engine
    starts by itself and the endpoint takes it back, with no deploy; `sparkfleet status`
    names the reboot and the Xid; the next deploy reports it and notes the new boot."""
    result = run_pyinfra("deploy.py", *DATA)  # the deploy notes the boot each host runs
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    reset = testbed.names[2]
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    with traffic.Watch(ep) as watch, traffic.Load(ep, workers=3) as load:
        time.sleep(3)
        cut = time.monotonic()
        testbed.hard_reset(reset, kernel_errors=[XID])  # returns once the host answers SSH again
        out = watch.first_out(reset, cut) or watch.wait(lambda s: s.get(reset) not in (None, "UP"), 60)
        assert out is not None, watch.samples[-3:]
        back = watch.wait(lambda s: s.get(reset) == "UP", 300)
        assert back is not None, watch.samples[-3:]
        time.sleep(3)
    print(f"hard reset: {reset} out of rotation {out - cut:.1f} s after the power cut, back in it after "
          f"{back - cut:.1f} s; {load.ok} requests ok, {len(load.failed)} failed")
    # Only what the reset host held when its power went may fail.
    late = [r.error for r in load.requests if r.error and r.start > out + 1]
    assert late == [] and load.ok > 0, late[:5]
    shown = status("--json")
    rows = {r["host"]: r for r in json.loads(shown.stdout)["hosts"]}
    name = testbed.inventory_name(reset)
    assert rows[name]["ready"] and rows[name]["rebooted"], rows[name]
    assert any(XID in line for line in rows[name]["rebooted"]["errors"]), rows[name]["rebooted"]
    assert [n for n, r in rows.items() if r["rebooted"]] == [name], rows
    assert f"{name}: rebooted since the last deploy" in status().stdout
    again = run_pyinfra("deploy.py", *DATA)
    said = again.stdout + again.stderr
    assert again.returncode == 0 and "rebooted since the last deploy" in said and XID in said, said[-4000:]
    rows = {r["host"]: r for r in json.loads(status("--json").stdout)["hosts"]}
    assert rows[name]["rebooted"] is None, rows[name]  # the deploy saw this boot
