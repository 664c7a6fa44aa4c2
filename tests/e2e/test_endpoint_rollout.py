"""Rolling changes on three simulated Sparks behind the fleet endpoint (HAProxy on spark-1).

The tests run in file order on the session's fleet: serve dense behind the endpoint, show
the batches under --dry, roll to dflash under a watcher that samples the endpoint's member
states, see the monitor's acceptance alert fire on a host whose drafter stops matching, then
roll a change the engine refuses and find it rolled back on the first host and the others
untouched; the last test leaves the fleet serving the defaults.
"""

from __future__ import annotations

import re

import pytest

from sparkfleet.testbed import login, paths, traffic
from tests.e2e.test_endpoint_monitor import api, ask, firing, wait
from tests.e2e.test_faults import TOO_LONG

pytestmark = pytest.mark.e2e

ROUTER = "spark-1"  # its testbed name; the inventory's is what the session fleet's names are
DATA = ("--data", f"fleet_endpoint={login.inventory_name(ROUTER, login.DEFAULT_NAMES)}")
SERVE_ENV = "/etc/sparkfleet/serve.env"
REPO_ROOT = paths.REPO_ROOT


def watcher(testbed) -> traffic.Watch:
    return traffic.Watch(traffic.Endpoint(testbed, ROUTER, testbed.api_key_file))


def started_at(testbed, name: str) -> str:
    return testbed.exec(name, "systemctl show sparkfleet-serve -p ExecMainStartTimestampMonotonic --value").stdout.strip()


def serve_env(testbed, name: str) -> str:
    return testbed.exec(name, f"cat {SERVE_ENV}").stdout


def said_by(out: str, name: str) -> str:
    """Every line of a run's output that names host ``name`` (a tail may hold none of them)."""
    return "\n".join(line for line in out.splitlines() if re.search(rf"\[{name}(?:\.local)?\]", line))[-6000:]


def test_the_fleet_serves_dense_behind_the_endpoint(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dense")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for name in testbed.names:
        assert "SF_PROFILE=dense" in serve_env(testbed, name)


def test_dry_shows_the_batches_and_changes_nothing(testbed, run_pyinfra):
    before = {n: started_at(testbed, n) for n in testbed.names}
    # A share of the fleet: 67% of 3 hosts is 2 per batch (rounded down).
    result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash", "--data", "rollout_batch=67%", "--dry")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    batches = dict(re.findall(r"\[(spark-\d)(?:\.local)?\] rolls in batch (\d)", out))
    assert batches == {"spark-1": "1", "spark-2": "1", "spark-3": "2"}, out[-4000:]
    assert {n: started_at(testbed, n) for n in testbed.names} == before


def test_a_rolling_switch_keeps_the_fleet_in_rotation_and_restarts_each_host_once(testbed, run_pyinfra):
    # From dense, as the first test left it; a rerun of this test finds dflash already there.
    if any("SF_PROFILE=dense" not in serve_env(testbed, n) for n in testbed.names):
        test_the_fleet_serves_dense_behind_the_endpoint(testbed, run_pyinfra)
    before = {n: started_at(testbed, n) for n in testbed.names}
    with watcher(testbed) as watch:
        result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in testbed.names:
        assert re.search(rf"\[{name}(?:\.local)?\] gate: smoke, tools, decode [\d.]+ tok/s, acceptance length \d", out), out[-4000:]
        assert re.search(rf"\[{name}(?:\.local)?\] gate passed; back in rotation", out), out[-4000:]
        assert "dflash" in serve_env(testbed, name)
        assert started_at(testbed, name) != before[name]
    # The watcher saw every host out of rotation at some point, and never all at once.
    full = [s for _, s in watch.samples if len(s) == 3]
    assert len(full) > 20, watch.samples[-5:]
    for name in testbed.names:
        assert any(s[name] != "UP" for s in full), f"{name} never left the rotation"
    assert all(any(state == "UP" for state in s.values()) for s in full), [s for s in full if "UP" not in s.values()]
    assert max(sum(state != "UP" for state in s.values()) for s in full) == 1  # rollout_batch 1
    # Each host restarted exactly once: a re-run restarts nothing.
    after = {n: started_at(testbed, n) for n in testbed.names}
    again = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert {n: started_at(testbed, n) for n in testbed.names} == after
    assert "rolls in batch" not in again.stdout + again.stderr


def test_a_drafter_that_stops_matching_fires_the_acceptance_alert(testbed, run_pyinfra):
    """The monitor (Prometheus on the endpoint's host) sees one host's acceptance length fall
    below rollout_min_acceptance while it serves; the others, idle, do not fire."""
    fast = ("--data", "monitor_scrape_interval_s=2", "--data", "alert_for_s=6",
            "--data", "alert_acceptance_window_s=30")
    result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash", *fast)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    drifted = testbed.names[2]
    name = testbed.inventory_name(drifted)
    testbed.exec(drifted, """printf '{"length": 1.1}' > /run/sf-test-accept""", check=True)
    assert testbed.exec(drifted, ask("/_sim/accept", "@/run/sf-test-accept")).stdout == "200"
    body = '{"model": "qwen", "prompt": "Write a story about Paris.", "max_tokens": 48}'
    testbed.exec(drifted, f"printf '%s' '{body}' > /run/sf-test-body && systemd-run --quiet --unit=sf-test-asks "
                          "/bin/sh -c 'for i in $(seq 40); do "
                          + ask("/v1/completions", "@/run/sf-test-body", 60, code=False) + "; done'", check=True)
    try:
        assert wait(lambda: name in firing(testbed, "SparkfleetAcceptanceLow"), 120), api(testbed, "/api/v1/alerts")
        assert firing(testbed, "SparkfleetAcceptanceLow") == {name}
    finally:
        testbed.exec(drifted, "systemctl stop sf-test-asks; systemctl restart sparkfleet-serve; true")
    # Serving again with its drafter as deployed, and back in the endpoint's rotation.
    health = "curl -s -o /dev/null -w '%{http_code}' -H @/etc/sparkfleet/api-auth.header http://127.0.0.1:8000/health"
    assert wait(lambda: testbed.exec(drifted, health).stdout == "200", 180, every=2)
    watcher(testbed).ep.wait_state(drifted, {"UP"}, 60)


def test_a_failed_rollout_is_rolled_back_on_the_first_host_and_stops(testbed, run_pyinfra):
    first, *others = testbed.names
    before = {n: started_at(testbed, n) for n in testbed.names}
    with watcher(testbed) as watch:
        result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash", "--data", f"extra_serve_args={TOO_LONG}",
                             "--data", "ready_timeout_s=120")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    # Named: the host, the step, the change, and the log tail.
    assert re.search(rf"\[{first}(?:\.local)?\].*rollout stopped at {first}(?:\.local)?, step READY", out), \
        out[-4000:]
    assert f"SF_EXTRA_ARGS '' -> {TOO_LONG!r}" in out
    assert "last lines of journalctl -u sparkfleet-serve.service" in out
    # The first host is rolled back and serving, back in rotation.
    assert "SF_EXTRA_ARGS=\n" in serve_env(testbed, first)
    assert started_at(testbed, first) != before[first]
    assert watch.ep.states().get(first) == "UP"
    for name in others:
        # Untouched: not restarted, its files put back to what it runs, never out of rotation.
        assert re.search(rf"\[{name}(?:\.local)?\].*not changed — the rollout stopped at {first}(?:\.local)? \(READY\)", out), \
            said_by(out, name)
        assert started_at(testbed, name) == before[name]
        assert "SF_EXTRA_ARGS=\n" in serve_env(testbed, name)
        assert all(s.get(name) == "UP" for _, s in watch.samples if s), name
    # Fixed data: the next run has nothing to roll (every host runs dflash), then back to defaults.
    again = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert {n: started_at(testbed, n) for n in others} == {n: before[n] for n in others}
    assert run_pyinfra("deploy.py", *DATA).returncode == 0
