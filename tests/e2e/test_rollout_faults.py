"""The rolling gate under what happens to real fleets (issue 24), on three simulated Sparks
behind the fleet endpoint (HAProxy on spark-1), with clients through it:

- a change of what clients and checks use (the API key and the port) rolls host by host,
  the endpoint's entry for each host moving with its turn;
- a turn cut off with its controller (drained, never put back) is ended by the next run;
- a host that dies in its turn stops the rollout at once, in a few readable lines.

The tests run in file order; the last leaves the fleet serving the defaults.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sparkfleet.testbed import login, traffic
from tests.e2e.conftest import INVENTORY, REPO_ROOT

pytestmark = pytest.mark.e2e

ROUTER = "spark-1"
DATA = ("--data", f"fleet_endpoint={login.inventory_name(ROUTER, login.DEFAULT_NAMES)}")
ROTATED = "ROTATEDkey0123456789abcdef0123"
PORT = 9001


class AnyKey(traffic.Endpoint):
    """The endpoint's metrics asked with whichever of two keys it answers (the fleet key
    changes at the first turn of a key change)."""

    def __init__(self, tb, key_files: list[Path]):
        super().__init__(tb, ROUTER, key_files[0])
        self.key_files = key_files

    def metrics(self) -> str:
        for key_file in self.key_files:
            answer = self.http.get(self.metrics_url, headers={"Authorization": f"Bearer {key_file.read_text().strip()}"})
            if answer.status_code != 401:
                return answer.text
        return ""


def started_at(testbed, name: str) -> str:
    return testbed.exec(name, "systemctl show sparkfleet-serve -p ExecMainStartTimestampMonotonic --value",
                        via="nsenter").stdout.strip()


def around_traceback(out: str) -> str:
    """The output around its first traceback (else its end), for an assertion's message."""
    at = out.find("Traceback")
    return out[max(0, at - 1500):at + 3000] if at >= 0 else out[-4000:]


def shown(testbed, name: str) -> str:
    return re.escape(testbed.inventory_name(name))


def servers(testbed) -> list[str]:
    """The server lines of HAProxy's configuration on the router."""
    text = testbed.exec(ROUTER, "grep -E '^ *server ' /etc/haproxy/haproxy.cfg").stdout
    return [line.split("#")[0].split()[2] for line in text.splitlines()]


def test_the_fleet_serves_behind_the_endpoint(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", *DATA)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


def test_a_new_key_and_port_roll_through_the_gate_with_the_endpoint_in_step(testbed, run_pyinfra, tmp_path):
    """Each host restarts on the new key and port in its turn; the endpoint moves its entry
    then (its key's backend, its port), so no host is ever taken out for a key or a port
    it does not run yet. New-key clients are served from the first turn on, old-key ones
    until the last host leaves; afterwards the old key is refused."""
    new_key = tmp_path / "rotated.key"
    new_key.write_text(ROTATED + "\n")
    old = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    new = traffic.Endpoint(testbed, ROUTER, new_key)
    watching = AnyKey(testbed, [testbed.api_key_file, new_key])
    before = {n: started_at(testbed, n) for n in testbed.names}
    done: dict[str, subprocess.CompletedProcess] = {}
    deploy = threading.Thread(target=lambda: done.setdefault("run", run_pyinfra(
        "deploy.py", *DATA, "--data", f"api_key={ROTATED}", "--data", f"port={PORT}")))
    with traffic.Watch(watching) as watch, traffic.Load(old, workers=2) as old_load:
        deploy.start()
        moved = watch.wait(lambda s: len(set(watching.backends().values())) == 2 and "UP" in s.values(), 600)
        assert moved is not None, watch.samples[-3:]
        with traffic.Load(new, workers=2) as new_load:
            deploy.join(timeout=900)
    out = done["run"].stdout + done["run"].stderr
    assert done["run"].returncode == 0, out[-4000:]
    for name in testbed.names:
        assert re.search(rf"\[{shown(testbed, name)}\] gate passed; back in rotation", out), out[-4000:]
        assert started_at(testbed, name) != before[name]
    # One host out at a time, and every host back: in the new key's backend, on the new port.
    full = [s for _, s in watch.samples if len(s) == 3]
    assert max(sum(state != "UP" for state in s.values()) for s in full) == 1, full[-5:]
    assert watching.states() == {n: "UP" for n in testbed.names}
    assert len(set(watching.backends().values())) == 1
    assert all(server.endswith(f":{PORT}") for server in servers(testbed)), servers(testbed)
    # New-key clients: never failed. Old-key clients: served until the last host's turn.
    assert new_load.ok > 0 and new_load.failed == [], new_load.failed[:5]
    last = testbed.names[-1]
    last_out = watch.first_out(last, after=moved)
    early = [r.error for r in old_load.requests if r.error and r.start < last_out - 1]
    assert old_load.ok > 0 and early == [], early[:5]
    assert old.http.get(f"{old.url}/v1/models", headers=old.auth).status_code == 401
    assert new.http.get(f"{new.url}/v1/models", headers=new.auth).status_code == 200
    # Converged: the same data again restarts nothing.
    after = {n: started_at(testbed, n) for n in testbed.names}
    again = run_pyinfra("deploy.py", *DATA, "--data", f"api_key={ROTATED}", "--data", f"port={PORT}")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert {n: started_at(testbed, n) for n in testbed.names} == after


def test_back_to_the_fleet_key_and_port(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", *DATA)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    assert ep.states() == {n: "UP" for n in testbed.names}
    assert all(server.endswith(":8000") for server in servers(testbed))


def _converged(testbed, run_pyinfra) -> None:
    """The fleet on the defaults, every member up: what the test changes from, whatever an
    earlier test (or this one's first try) left."""
    result = run_pyinfra("deploy.py", *DATA)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert traffic.Endpoint(testbed, ROUTER, testbed.api_key_file).states() == {n: "UP" for n in testbed.names}


def _deploy_until(pattern: str, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """A deploy whose output is read until a line matches ``pattern``; the rest is kept."""
    run = subprocess.Popen(["pyinfra", "-y", INVENTORY, "deploy.py", *args], cwd=REPO_ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    deadline = time.monotonic() + 600
    for line in run.stdout:
        lines.append(line)
        if re.search(pattern, line) or time.monotonic() > deadline:
            break
    return run, lines


def test_a_turn_cut_off_with_its_controller_is_ended_by_the_next_run(testbed, run_pyinfra):
    """Killed as the first host was drained: that host stays drained (HAProxy keeps the
    drain across reloads). The next run, with nothing to roll there, puts it back. (A
    second later its restart may have begun, on a loaded machine: a turn cut later is
    test_a_host_that_dies_in_its_turn_stops_the_rollout's.)"""
    first = testbed.names[0]
    run, lines = _deploy_until(rf"\[{shown(testbed, first)}\] drained", *DATA, "--data", "profile=dflash")
    run.kill()
    run.communicate(timeout=30)
    assert lines and "drained" in lines[-1], "".join(lines)[-3000:]
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    assert ep.states()[first] == "DRAIN"
    with traffic.Load(ep, workers=2) as load:
        result = run_pyinfra("deploy.py", *DATA)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    # Put back as such, or (when the cut run had already written its settings) rolled back
    # in its own turn: either way the run ends it and every member serves.
    assert (re.search(rf"{shown(testbed, first)}: put back in rotation — an earlier run drained it", out)
            or re.search(rf"\[{shown(testbed, first)}\] drained", out)), out[-4000:]
    assert ep.states() == {n: "UP" for n in testbed.names}
    assert load.ok > 0 and load.failed == [], load.failed[:5]


def test_a_host_that_dies_in_its_turn_stops_the_rollout(testbed, run_pyinfra):
    """spark-2 loses its power once restarted in its turn: the rollout stops there in a few
    lines (no page of SSH errors, no traceback), spark-3 is neither drained nor restarted,
    and once spark-2 is back a run with the defaults converges the fleet."""
    second, third = testbed.names[1], testbed.names[2]
    _converged(testbed, run_pyinfra)
    before = started_at(testbed, second), started_at(testbed, third)
    run, lines = _deploy_until(rf"\[{shown(testbed, second)}\] drained", *DATA, "--data", "profile=dflash")
    # The turn to cut: the run must still be in it (else it ended before the kill could land).
    assert run.poll() is None and lines and "drained" in lines[-1], "".join(lines)[-4000:]
    deadline = time.monotonic() + 120
    while started_at(testbed, second) == before[0] and time.monotonic() < deadline:
        time.sleep(0.5)
    testbed.kill_host(second)
    try:
        rest, _ = run.communicate(timeout=600)
    finally:
        testbed.start_host(second)
    out = "".join(lines) + rest
    assert run.returncode != 0
    assert "Traceback" not in out, around_traceback(out)
    said = [line for line in out.splitlines() if re.search(rf"\[{shown(testbed, second)}\]", line)]
    turn = next(i for i, line in enumerate(said) if "drained from the fleet endpoint" in line)
    # Restarting or waiting for READY when the power went: the step it names is either.
    assert re.search(r"rollout stopped at .*step (restart|READY): the host stopped answering over SSH", out), \
        out[-4000:]
    assert len(said[turn:]) <= 10, "\n".join(said[turn:])  # not a page of SSH errors
    assert re.search(rf"\[{shown(testbed, third)}\].*not changed — the rollout stopped at {shown(testbed, second)}",
                     out), out[-4000:]
    assert started_at(testbed, third) == before[1]
    result = run_pyinfra("deploy.py", *DATA)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    assert ep.states() == {n: "UP" for n in testbed.names}


def test_with_the_endpoint_host_unreachable_a_change_rolls_without_draining(testbed, run_pyinfra):
    """The endpoint's host (spark-1) cannot be reached: it fails; the others say the
    endpoint does not answer and roll without draining, with no traceback; `sparkfleet
    status` shows the hosts that answer and names the one that does not."""
    first, *others = testbed.names
    _converged(testbed, run_pyinfra)
    with testbed.unreachable(first):
        result = run_pyinfra("deploy.py", *DATA, "--data", "profile=dflash")
        status = subprocess.run(["sparkfleet", "status", INVENTORY, *DATA], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in out, around_traceback(out)
    for name in others:
        assert re.search(rf"\[{shown(testbed, name)}\] the fleet endpoint does not answer .*rolling without draining",
                         out), out[-4000:]
        assert re.search(rf"\[{shown(testbed, name)}\] gate passed", out), out[-4000:]
    assert status.returncode == 1 and "Traceback" not in status.stderr, status.stderr[-3000:]
    rows = {line.split()[0]: line for line in status.stdout.splitlines()[1:4]}
    assert "unreachable" in rows[testbed.inventory_name(first)], status.stdout
    for name in others:
        assert re.search(r"\sdflash\s.*\syes\s", rows[testbed.inventory_name(name)]), status.stdout
    result = run_pyinfra("deploy.py", *DATA)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    assert ep.states() == {n: "UP" for n in testbed.names}
