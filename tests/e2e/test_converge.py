"""A host never loses a working server: one deploy converges it from any state, a change
that does not get READY is rolled back on that host, crash loops end, and docker's own
stop/start brings the server back.

The tests share the session's fleet and leave it serving the defaults.
"""

from __future__ import annotations

import json
import re
import time

import pytest

pytestmark = pytest.mark.e2e

SERVE_ENV = "/etc/sparkfleet/serve.env"
CHANGED = re.compile(r"\[(spark-\d+)\] (Success|Error)")


def answer(testbed, name: str, port: int = 8000) -> str | None:
    body = json.dumps({"model": "qwen", "prompt": "What is the capital of France?", "max_tokens": 8})
    out = testbed.exec(name, f"curl -s -m 10 -H @/etc/sparkfleet/api-auth.header -H 'Content-Type: application/json' "
                             f"-d '{body}' http://127.0.0.1:{port}/v1/completions").stdout
    try:
        return json.loads(out)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError):
        return None


def unit(testbed, name: str) -> dict[str, str]:
    out = testbed.exec(name, "systemctl show sparkfleet-serve -p ActiveState -p SubState -p NRestarts "
                             "-p ExecMainStartTimestampMonotonic").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"not within {timeout} s: {what}")


def changed_hosts(output: str) -> set[str]:
    return {m.group(1) for m in CHANGED.finditer(output)}


def test_the_fleet_serves_the_defaults(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


def test_a_change_that_breaks_the_engine_is_rolled_back_on_every_host(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", "--data", "tool_call_parser=bogus", "--data", "ready_timeout_s=120",
                         "--data", "rollout=all")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    for name in testbed.names:
        # Named: the host, the change, the outcome; the old settings serve again.
        assert re.search(rf"\[{name}\].*rolled back: the last good settings serve again", out), out[-4000:]
        assert "SF_TOOL_CALL_PARSER 'qwen3_xml' -> 'bogus'" in out
        assert "SF_TOOL_CALL_PARSER=qwen3_xml" in testbed.exec(name, f"cat {SERVE_ENV}").stdout
        assert "Paris" in (answer(testbed, name) or "")
        assert unit(testbed, name)["ActiveState"] == "active"
    # What is on disk is what serves: the next deploy has nothing to do.
    again = run_pyinfra("deploy.py")
    assert again.returncode == 0 and changed_hosts(again.stdout + again.stderr) == set(), again.stdout[-3000:]


def test_a_host_with_nothing_good_before_is_left_stopped_not_crash_looping(testbed, run_pyinfra):
    fresh = testbed.names[2]
    testbed.exec(fresh, "rm -rf /var/lib/sparkfleet/last-good")  # as on a first deploy
    result = run_pyinfra("deploy.py", "--data", "tool_call_parser=bogus", "--data", "ready_timeout_s=120",
                         "--data", "rollout=all")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert re.search(rf"\[{fresh}\].*nothing else got READY on this host before, so sparkfleet-serve.service "
                     r"is stopped", out), out[-4000:]
    time.sleep(15)  # longer than RestartSec: a crash loop would have started again
    assert unit(testbed, fresh)["ActiveState"] in ("inactive", "failed")
    for name in testbed.names[:2]:
        assert "Paris" in (answer(testbed, name) or "")
    result = run_pyinfra("deploy.py")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "Paris" in (answer(testbed, fresh) or "")
    assert testbed.exec(fresh, "test -f /var/lib/sparkfleet/last-good/serving.rev && echo kept").stdout.strip() == "kept"


def test_a_crash_loop_ends_and_one_deploy_converges_the_host(testbed, run_pyinfra):
    name = testbed.names[1]
    # Something else takes the port while our server is down: the engine cannot bind.
    testbed.exec(name, "systemctl stop sparkfleet-serve && systemd-run --unit=sf-test-squatter "
                       "python3 -m http.server 8000 && sleep 1 && systemctl start sparkfleet-serve", check=True)
    # Bounded: after StartLimitBurst starts systemd gives up and shows failed.
    wait_until(lambda: unit(testbed, name)["ActiveState"] == "failed", 180, "the crash loop to end as failed")
    assert int(unit(testbed, name)["NRestarts"]) <= 5
    testbed.exec(name, "systemctl stop sf-test-squatter", check=True)
    # The deploy's own start is not blocked by that limit, and one run converges the host.
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Paris" in (answer(testbed, name) or "")
    again = run_pyinfra("deploy.py")
    assert again.returncode == 0 and changed_hosts(again.stdout + again.stderr) == set(), again.stdout[-3000:]


def test_a_host_restarting_on_its_own_runs_the_settings_on_disk_after_one_deploy(testbed, run_pyinfra):
    name = testbed.names[0]
    # The engine dies while a new setting is deployed: systemd's own restart races the deploy.
    testbed.exec(name, "docker kill --signal KILL sparkfleet-serve")
    result = run_pyinfra("deploy.py", "--data", "max_num_seqs=2")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    argv = testbed.exec(name, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
    assert "--max-num-seqs 2" in argv
    started = unit(testbed, name)["ExecMainStartTimestampMonotonic"]
    again = run_pyinfra("deploy.py", "--data", "max_num_seqs=2")
    assert again.returncode == 0 and changed_hosts(again.stdout + again.stderr) == set()
    assert unit(testbed, name)["ExecMainStartTimestampMonotonic"] == started
    assert run_pyinfra("deploy.py").returncode == 0


def test_docker_stopped_and_started_brings_the_server_back_without_a_deploy(testbed):
    name = testbed.names[2]
    testbed.exec(name, "systemctl stop docker.socket docker", check=True, timeout=120)
    assert unit(testbed, name)["ActiveState"] in ("inactive", "failed")
    testbed.exec(name, "systemctl start docker", check=True, timeout=120)
    assert "Paris" in wait_until(lambda: answer(testbed, name), 180, "the server to answer after docker start")
