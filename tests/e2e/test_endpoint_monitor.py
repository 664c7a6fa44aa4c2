"""The fleet monitor on the session's simulated fleet (issue 29): after a deploy, Prometheus on
the endpoint's host scrapes every engine (with the fleet key), HAProxy's exporter and every
host's node exporter; each listens only where it should; an engine that stops fires its
alerts (engine down, out of the endpoint's rotation), `sparkfleet status` shows them, a node
exporter that stops fires its own, memory that fills fires both memory alerts, an engine
that wedges where its watchdog cannot act fires "no progress", a filesystem that fills fires
its own, and a converged re-run changes nothing. The acceptance alert fires in
test_endpoint_rollout.py, on a fleet that serves a speculative profile."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from support.failures import changes

from sparkfleet import haproxy
from sparkfleet.hostpaths import NODE_EXPORTER_UNIT, UNIT, WATCHDOG_UNIT
from sparkfleet.testbed import login, paths

pytestmark = pytest.mark.e2e

MONITOR = "spark-1"
MONITOR_NAME = login.inventory_name(MONITOR, login.DEFAULT_NAMES)
#: Fast enough for a test: scrapes every 2 s, an alert after 6 s of its fault, no progress
#: over 10 s a wedge.
DATA = ("--data", f"fleet_endpoint={MONITOR_NAME}", "--data", "monitor_scrape_interval_s=2",
        "--data", "alert_for_s=6", "--data", "wedge_timeout_s=10")


def ask(path: str, body: str = "", timeout: int = 5, code: bool = True) -> str:
    """A request to the host's own engine, with the key's 0600 header file (never in argv);
    prints its HTTP status when ``code``. No single quote: it runs inside them too."""
    show = ' -w "%{http_code}"' if code else ""
    return (f'curl -s -m {timeout} -H @/etc/sparkfleet/api-auth.header -H "Content-Type: application/json" '
            f'-o /dev/null{show} -d "{body}" http://127.0.0.1:8000{path}')
INVENTORY = str(paths.INVENTORY.relative_to(paths.REPO_ROOT))


def api(testbed, path: str) -> dict:
    """Prometheus' API, asked on the monitor host (it answers on loopback only)."""
    out = testbed.exec(MONITOR, f"curl -s -m 5 http://127.0.0.1:9090{path}").stdout
    return json.loads(out or "{}")


def targets(testbed) -> dict[tuple[str, str], str]:
    found = api(testbed, "/api/v1/targets").get("data", {}).get("activeTargets", [])
    return {(t["labels"]["job"], t["labels"]["host"]): t["health"] for t in found}


def firing(testbed, name: str, label: str = "host") -> set[str]:
    alerts = api(testbed, "/api/v1/alerts").get("data", {}).get("alerts", [])
    return {a["labels"].get(label) for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"}


def wait(check, timeout: float, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def test_prometheus_scrapes_every_target_and_an_alert_fires_on_its_fault(testbed, run_pyinfra):
    started = time.monotonic()
    result = run_pyinfra("deploy.py", *DATA)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    names = [testbed.inventory_name(n) for n in testbed.names]
    want = {**{("engine", n): "up" for n in names}, **{("node", n): "up" for n in names},
            ("haproxy", MONITOR_NAME): "up"}
    seen = wait(lambda: targets(testbed) == want and targets(testbed), 120)
    assert seen == want, (targets(testbed), testbed.exec(MONITOR, "systemctl status prometheus --no-pager; "
                                                                  "journalctl -u prometheus --no-pager -n 30").stdout)
    print(f"deployed and every target up after {time.monotonic() - started:.1f} s: {sorted(want)}")

    # Where things listen: the node exporter on the host's fleet address, Prometheus on loopback.
    listening = testbed.exec(testbed.names[1], "ss -Hltn").stdout
    address = testbed.host(testbed.names[1]).address
    assert f"{address}:9100" in listening and "*:9100" not in listening and "0.0.0.0:9100" not in listening
    assert "127.0.0.1:9090" in testbed.exec(MONITOR, "ss -Hltn").stdout
    # The key: in a 0600 file of the prometheus user, in no configuration and no argv.
    key = testbed.api_key_file.read_text().strip()
    mode = testbed.exec(MONITOR, "stat -c '%a %U' /etc/prometheus/sparkfleet-api-key").stdout.strip()
    assert mode == "600 prometheus"
    shown = testbed.exec(MONITOR, "cat /etc/prometheus/prometheus.yml /etc/default/prometheus; "
                                  "ps -eo args | grep -e prometheus -e node-exporter").stdout
    assert key not in shown and "--web.listen-address=127.0.0.1:9090" in shown

    # A converged re-run changes nothing on any host (no restart, no reload).
    pid = testbed.exec(MONITOR, "systemctl show -p MainPID --value prometheus").stdout.strip()
    again = run_pyinfra("deploy.py", *DATA)
    text = again.stdout + again.stderr
    assert again.returncode == 0 and changes(text) == [], text[-3000:]
    assert testbed.exec(MONITOR, "systemctl show -p MainPID --value prometheus").stdout.strip() == pid

    # A member down: its engine stops; the alert fires after alert_for_s, and status shows it.
    down = testbed.names[2]
    down_name = testbed.inventory_name(down)
    testbed.exec(down, "systemctl stop sparkfleet-serve", check=True)
    stopped = time.monotonic()
    try:
        assert wait(lambda: down_name in firing(testbed, "SparkfleetEngineDown"), 60), \
            api(testbed, "/api/v1/alerts")
        fired_s = time.monotonic() - stopped
        assert firing(testbed, "SparkfleetEngineDown") == {down_name}
        # The endpoint's checks take it out too: that alert names the member, on the endpoint's host.
        assert wait(lambda: haproxy.server_name(down_name) in firing(testbed, "SparkfleetMemberOutOfRotation",
                                                                     "server"), 60), api(testbed, "/api/v1/alerts")
        status = subprocess.run(["sparkfleet", "status", INVENTORY, *DATA], cwd=paths.REPO_ROOT,
                                capture_output=True, text=True, timeout=120)
        assert re.search(rf"fleet monitor on {re.escape(MONITOR_NAME)} \(Prometheus 127\.0\.0\.1:9090\): "
                         r"\d+ alerts? firing", status.stdout), status.stdout[-3000:]
        assert re.search(rf"^    SparkfleetEngineDown {re.escape(down_name)} \(critical, since ", status.stdout,
                         re.M), status.stdout[-3000:]
        print(f"engine stopped on {down_name}: SparkfleetEngineDown firing after {fired_s:.1f} s "
              f"(scrape 2 s, for 6 s)")
    finally:
        testbed.exec(down, "systemctl start sparkfleet-serve")
    assert wait(lambda: targets(testbed).get(("engine", down_name)) == "up", 120), targets(testbed)
    assert wait(lambda: not firing(testbed, "SparkfleetEngineDown"), 60)

    # A host's node exporter stops: Prometheus cannot scrape it, and that alert names the host.
    quiet = testbed.names[1]
    quiet_name = testbed.inventory_name(quiet)
    testbed.exec(quiet, f"systemctl stop {NODE_EXPORTER_UNIT}", check=True)
    try:
        assert wait(lambda: quiet_name in firing(testbed, "SparkfleetExporterDown"), 60), \
            api(testbed, "/api/v1/alerts")
    finally:
        testbed.exec(quiet, f"systemctl start {NODE_EXPORTER_UNIT}")
    assert wait(lambda: not firing(testbed, "SparkfleetExporterDown"), 60), api(testbed, "/api/v1/alerts")

    # Memory fills on a host, as the kernel reports it (its /proc files laid over, as
    # test_wedge.py does): 10 GiB available, under alert_memory_available_gib (12) and above
    # the watchdog's stop (8); stalls that PSI's "full" total counts at half the time. Both
    # memory alerts name the host; the engine serves on.
    tight = testbed.names[1]
    tight_name = testbed.inventory_name(tight)
    stalls = ('t=1; while :; do printf "some avg10=0.00 avg60=0.00 avg300=0.00 total=%d\\n'
              'full avg10=0.00 avg60=0.00 avg300=0.00 total=%d\\n" $t $t > /run/sf-test-psi; '
              "t=$((t + 500000)); sleep 1; done")
    laid = testbed.exec(tight, "printf 'MemTotal:       127606784 kB\\nMemFree:        10485760 kB\\n"
                               "MemAvailable:   10485760 kB\\n' > /run/sf-test-meminfo && : > /run/sf-test-psi && "
                               f"systemd-run --quiet --unit=sf-test-stalls /bin/sh -c '{stalls}' && "
                               "mount --bind /run/sf-test-meminfo /proc/meminfo && "
                               "mount --bind /run/sf-test-psi /proc/pressure/memory && echo ok")
    try:
        assert laid.stdout.strip() == "ok", laid.stdout + laid.stderr
        for alert in ("SparkfleetMemoryLow", "SparkfleetMemoryStall"):
            assert wait(lambda alert=alert: tight_name in firing(testbed, alert), 90), \
                (alert, api(testbed, "/api/v1/alerts"))
        assert testbed.exec(tight, "systemctl is-active sparkfleet-serve").stdout.strip() == "active"
    finally:
        testbed.exec(tight, "umount /proc/pressure/memory; umount /proc/meminfo; systemctl stop sf-test-stalls; true")
    assert wait(lambda: not firing(testbed, "SparkfleetMemoryLow"), 60), api(testbed, "/api/v1/alerts")

    # An engine wedges (/health answers, no token comes) where its watchdog cannot act (its
    # service stopped) while a request waits on it: "no progress" names the host.
    stuck = testbed.names[2]
    stuck_name = testbed.inventory_name(stuck)
    testbed.exec(stuck, f"systemctl stop {WATCHDOG_UNIT}", check=True)
    try:
        assert testbed.exec(stuck, ask("/_sim/wedge")).stdout == "200"
        body = '{"model": "qwen", "prompt": "Tell me about Paris.", "max_tokens": 64}'
        testbed.exec(stuck, f"printf '%s' '{body}' > /run/sf-test-body && systemd-run --quiet --unit=sf-test-waits "
                            + ask("/v1/completions", "@/run/sf-test-body", 300, code=False), check=True)
        assert wait(lambda: stuck_name in firing(testbed, "SparkfleetNoProgress"), 90), api(testbed, "/api/v1/alerts")
        assert firing(testbed, "SparkfleetNoProgress") == {stuck_name}
    finally:
        testbed.exec(stuck, f"systemctl stop sf-test-waits; systemctl restart {UNIT}; "
                            f"systemctl start {WATCHDOG_UNIT}; true")
    assert wait(lambda: not firing(testbed, "SparkfleetNoProgress"), 60), api(testbed, "/api/v1/alerts")
    assert wait(lambda: targets(testbed).get(("engine", stuck_name)) == "up", 180), targets(testbed)

    # A filesystem fills: a small one mounted on the host, named as a disk's (ext4) in the
    # mount tables the node exporter reads (/proc/1/mounts up to 1.5, /proc/1/mountinfo
    # since; laid over), 95 % used. The alert names the host and its mount point.
    full = testbed.names[1]
    full_name = testbed.inventory_name(full)
    laid = testbed.exec(full, "mkdir -p /srv/sf-test-disk && mount -t tmpfs -o size=64m sf-test-disk /srv/sf-test-disk "
                              "&& fallocate -l 61m /srv/sf-test-disk/fill "
                              "&& sed 's| /srv/sf-test-disk tmpfs | /srv/sf-test-disk ext4 |' /proc/1/mounts "
                              "> /run/sf-test-mounts "
                              "&& sed 's|^\\(.* /srv/sf-test-disk .* - \\)tmpfs |\\1ext4 |' /proc/1/mountinfo "
                              "> /run/sf-test-mountinfo "
                              "&& mount --bind /run/sf-test-mounts /proc/1/mounts "
                              "&& mount --bind /run/sf-test-mountinfo /proc/1/mountinfo && echo ok")
    try:
        assert laid.stdout.strip() == "ok", laid.stdout + laid.stderr
        assert wait(lambda: full_name in firing(testbed, "SparkfleetDiskFilling"), 90), \
            (api(testbed, "/api/v1/alerts"), testbed.exec(full, "grep sf-test /proc/1/mounts").stdout)
        assert firing(testbed, "SparkfleetDiskFilling", "mountpoint") == {"/srv/sf-test-disk"}
    finally:
        testbed.exec(full, "umount /proc/1/mountinfo; umount /proc/1/mounts; umount /srv/sf-test-disk; "
                           "rmdir /srv/sf-test-disk; true")
    assert wait(lambda: not firing(testbed, "SparkfleetDiskFilling"), 60), api(testbed, "/api/v1/alerts")
