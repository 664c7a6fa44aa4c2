"""Rolling changes on three simulated Sparks behind the fleet endpoint (HAProxy on spark-1).

The tests run in file order on the session's fleet: serve dense behind the endpoint, show
the batches under --dry, roll to dflash under a watcher that samples the endpoint's member
states, then roll a change the engine refuses and find it rolled back on the first host and
the others untouched; the last test leaves the fleet serving the defaults.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import requests

from sparkfleet.testbed import paths
from tests.e2e.test_faults import TOO_LONG

pytestmark = pytest.mark.e2e

ROUTER = "spark-1"
DATA = ("--data", f"fleet_endpoint={ROUTER}")
SERVE_ENV = "/etc/sparkfleet/serve.env"
REPO_ROOT = paths.REPO_ROOT
STATUS = re.compile(r'^haproxy_server_status\{proxy="members",server="([^"]+)",state="([A-Z]+)"\} 1$', re.M)


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False  # test traffic goes to the testbed's addresses only
    return s


class Watcher:
    """Samples every member's state at the endpoint's exporter until stopped."""

    def __init__(self, testbed):
        self.url = f"http://{testbed.host(ROUTER).address}:8405/metrics"
        self.auth = {"Authorization": f"Bearer {(REPO_ROOT / '.sparkfleet' / 'api-key').read_text().strip()}"}
        self.samples: list[dict[str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def states(self) -> dict[str, str]:
        return dict(STATUS.findall(session().get(self.url, headers=self.auth, timeout=5).text))

    def _run(self):
        deadline = time.monotonic() + 1500  # bounded: longer than any rollout here
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                self.samples.append(self.states())
            except requests.RequestException:
                self.samples.append({})
            time.sleep(0.25)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)


def started_at(testbed, name: str) -> str:
    return testbed.exec(name, "systemctl show sparkfleet-serve -p ExecMainStartTimestampMonotonic --value").stdout.strip()


def serve_env(testbed, name: str) -> str:
    return testbed.exec(name, f"cat {SERVE_ENV}").stdout


def test_the_fleet_serves_dense_behind_the_endpoint(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dense")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for name in testbed.names:
        assert "SF_PROFILE=dense" in serve_env(testbed, name)


def test_dry_shows_the_batches_and_changes_nothing(testbed, run_pyinfra):
    before = {n: started_at(testbed, n) for n in testbed.names}
    result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash", "--data", "rollout_batch=2", "--dry")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    batches = dict(re.findall(r"\[(spark-\d)\] rolls in batch (\d)", out))
    assert batches == {"spark-1": "1", "spark-2": "1", "spark-3": "2"}, out[-4000:]
    assert {n: started_at(testbed, n) for n in testbed.names} == before


def test_a_rolling_switch_keeps_the_fleet_in_rotation_and_restarts_each_host_once(testbed, run_pyinfra):
    before = {n: started_at(testbed, n) for n in testbed.names}
    with Watcher(testbed) as watcher:
        result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in testbed.names:
        assert re.search(rf"\[{name}\] gate: smoke, tools, acceptance length \d", out), out[-4000:]
        assert re.search(rf"\[{name}\] gate passed; back in rotation", out), out[-4000:]
        assert "dflash" in serve_env(testbed, name)
        assert started_at(testbed, name) != before[name]
    # The watcher saw every host out of rotation at some point, and never all at once.
    full = [s for s in watcher.samples if len(s) == 3]
    assert len(full) > 20, watcher.samples[-5:]
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


def test_a_failed_rollout_is_rolled_back_on_the_first_host_and_stops(testbed, run_pyinfra):
    first, *others = testbed.names
    before = {n: started_at(testbed, n) for n in testbed.names}
    with Watcher(testbed) as watcher:
        result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash", "--data", f"extra_serve_args={TOO_LONG}",
                             "--data", "ready_timeout_s=120")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    # Named: the host, the step, the change, and the log tail.
    assert re.search(rf"\[{first}\].*rollout stopped at {first}, step READY", out), out[-4000:]
    assert f"SF_EXTRA_ARGS '' -> {TOO_LONG!r}" in out
    assert "Last log lines" in out
    # The first host is rolled back and serving, back in rotation.
    assert "SF_EXTRA_ARGS=\n" in serve_env(testbed, first)
    assert started_at(testbed, first) != before[first]
    assert watcher.states().get(first) == "UP"
    for name in others:
        # Untouched: not restarted, its files put back to what it runs, never out of rotation.
        assert re.search(rf"\[{name}\].*not changed — the rollout stopped at {first} \(READY\)", out), out[-4000:]
        assert started_at(testbed, name) == before[name]
        assert "SF_EXTRA_ARGS=\n" in serve_env(testbed, name)
        assert all(s.get(name) == "UP" for s in watcher.samples if s), name
    # Fixed data: the next run has nothing to roll (every host runs dflash), then back to defaults.
    again = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert {n: started_at(testbed, n) for n in others} == {n: before[n] for n in others}
    assert run_pyinfra("deploy.py", *DATA).returncode == 0
