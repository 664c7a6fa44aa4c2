"""One operator at a time, on three simulated Sparks (issue 24, case 6).

In file order on the session's fleet: a deploy holds the operator lock while it runs and
leaves none behind, also on a host that failed; a converged run does not take it; a second deploy started while a slow rolling
change holds the fleet stops on every host before touching anything, naming who holds it
since when (``--dry`` only warns); the slow one, killed with SIGKILL mid-rollout, leaves its
lock, which `sparkfleet unlock` shows and removes, and the fleet converges; the lock of a
dead deploy of this controller is taken over by the next one. The fleet ends serving the
defaults.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time

import pytest

from sparkfleet import oplock
from sparkfleet.hostpaths import OPERATOR_LOCK, SERVE_ENV
from tests.e2e.conftest import INVENTORY, REPO_ROOT

pytestmark = pytest.mark.e2e

#: Each restart of the slow change takes 90 s to READY: its rollout holds the fleet for
#: minutes, and its first turn is under way while the second deploy tries.
SLOW = '{"SIM_READY_DELAY_S": "90"}'
ME = f"{getpass.getuser()}@{socket.gethostname()}"


def lock(testbed, name: str) -> dict | None:
    text = testbed.exec(name, f"cat {OPERATOR_LOCK} 2>/dev/null").stdout
    return json.loads(text) if text.strip() else None


def started_at(testbed, name: str) -> str:
    return testbed.exec(name, "systemctl show sparkfleet-serve -p ExecMainStartTimestampMonotonic --value").stdout.strip()


def sparkfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sparkfleet", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def wait_for(what: str, check, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_deploy_holds_the_lock_while_it_runs_and_leaves_none(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert re.search(r"operator lock: one deploy at a time\s+3\s+-\s+-\s+3", out), out[-3000:]  # no change
    assert [lock(testbed, n) for n in testbed.names] == [None] * 3


def test_a_converged_run_asks_each_host_one_command_and_leaves_the_lock_alone(testbed, run_pyinfra):
    """Nothing to change, so nothing to lock: the lock file is not written (a take or a
    give-back rewrites it), and each host sees one sudo, its read."""
    touched = {n: testbed.exec(n, f"stat -c %y {OPERATOR_LOCK}").stdout for n in testbed.names}
    # --sync before the cursor and before the read: journald may write a line of the run
    # before this one after the cursor, or one of this run after the read (a loaded machine).
    cursor = {n: testbed.exec(n, "journalctl --sync; journalctl -n 0 --show-cursor --no-pager"
                              ).stdout.split("-- cursor: ")[-1].strip() for n in testbed.names}
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0 and not re.search(r"\[spark-\d(?:\.local)?\] Success", out), out[-4000:]
    for name in testbed.names:
        assert testbed.exec(name, f"stat -c %y {OPERATOR_LOCK}").stdout == touched[name]
        # No match beside --after-cursor: journalctl (systemd 252) then skips the first
        # matching entry after the cursor, here the run's one sudo. Filtered here instead.
        logged = testbed.exec(name, f"journalctl --sync; journalctl --after-cursor {shlex.quote(cursor[name])} "
                                    "-o short --no-pager").stdout
        ran = [line for line in logged.splitlines() if re.search(r" sudo\[\d+\]: .*COMMAND=", line)]
        # Each command's start says which it is (the read's own line is long and continued).
        assert len(ran) == 1, "\n".join(line[:600] for line in ran)


def test_a_host_that_fails_later_in_the_run_gives_the_lock_back(testbed, run_pyinfra):
    failing = testbed.names[1]
    with testbed.switched(failing, gpu="NVIDIA H100 80GB HBM3"):
        result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "preflight failed" in out, out[-3000:]
    assert [lock(testbed, n) for n in testbed.names] == [None] * 3


def test_a_second_deploy_stops_naming_the_holder_and_a_killed_ones_lock_is_removed(testbed, run_pyinfra,
                                                                                   tmp_path):
    first, *others = testbed.names
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "slow-deploy.log").open("w")
    slow = subprocess.Popen(["pyinfra", "-y", INVENTORY, "deploy.py", "--data", f"vllm_env={SLOW}"],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        # It holds every host, and its first host's turn is under way.
        wait_for("the slow deploy's lock on every host",
                 lambda: all((lock(testbed, n) or {}).get("pid") == slow.pid for n in testbed.names))
        wait_for(f"the slow deploy's turn on {first}",
                 lambda: "SIM_READY_DELAY_S" in testbed.exec(first, f"cat {SERVE_ENV}").stdout)
        held = lock(testbed, first)
        before = {n: started_at(testbed, n) for n in others}

        second = run_pyinfra("deploy.py", "--data", "max_num_seqs=2", timeout=300)
        out = second.stdout + second.stderr
        assert second.returncode != 0, out[-4000:]
        who = f"{ME} (pyinfra pid {slow.pid}, run {held['run']}: deploy.py) since "
        for name in testbed.names:
            shown = testbed.inventory_name(name)
            assert f"[{shown}] operator lock: another deploy is changing this fleet, so nothing was changed on " \
                   "any host:" in out, out[-4000:]
            assert re.search(rf"\[{re.escape(shown)}\]\s+- {re.escape(who)}\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC "
                             r"\(\d+m?\d*s ago\)", out), out[-4000:]
            assert f"[{shown}] Wait for it to end; if it no longer runs (killed, its controller gone): " \
                   f"sparkfleet unlock {INVENTORY}" in out
        assert not re.search(r"\[spark-\d(?:\.local)?\] Success", out), out[-4000:]  # no operation ran
        assert [lock(testbed, n)["run"] for n in testbed.names] == [held["run"]] * 3  # still the slow one's
        assert {n: started_at(testbed, n) for n in others} == before

        # --dry takes nothing, and says who holds the fleet.
        dry = run_pyinfra("deploy.py", "--data", "max_num_seqs=2", "--dry")
        out = dry.stdout + dry.stderr
        assert dry.returncode == 0, out[-4000:]
        for name in testbed.names:
            assert f"[{testbed.inventory_name(name)}] operator lock: held by {who}" in out, out[-4000:]
        assert [lock(testbed, n)["run"] for n in testbed.names] == [held["run"]] * 3

        assert slow.poll() is None, "the slow deploy ended before it could be killed mid-run"
        slow.send_signal(signal.SIGKILL)  # a controller gone mid-rollout: nothing is given back
        slow.wait(timeout=30)
    finally:
        if slow.poll() is None:
            slow.kill()
            slow.wait()
        log.close()
    assert [lock(testbed, n)["pid"] for n in testbed.names] == [slow.pid] * 3
    for name in testbed.names:  # the second deploy's data reached no host
        assert "SF_MAX_NUM_SEQS=2" not in testbed.exec(name, f"cat {SERVE_ENV}").stdout

    # The documented recovery: see whose lock it is, remove it, deploy.
    shown = sparkfleet("unlock", INVENTORY, "--show")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    for name in testbed.names:
        assert re.search(rf"^{re.escape(testbed.inventory_name(name))}: held by {re.escape(who)}.*which no longer "
                         "runs on this controller", shown.stdout, re.M), shown.stdout
    assert [lock(testbed, n)["pid"] for n in testbed.names] == [slow.pid] * 3
    removed = sparkfleet("unlock", INVENTORY)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert removed.stdout.count(": removed") == 3, removed.stdout
    assert [lock(testbed, n) for n in testbed.names] == [None] * 3
    again = run_pyinfra("deploy.py")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert "taken over" not in out
    for name in testbed.names:
        assert "SIM_READY_DELAY_S" not in testbed.exec(name, f"cat {SERVE_ENV}").stdout
    assert [lock(testbed, n) for n in testbed.names] == [None] * 3


def test_the_lock_of_a_dead_deploy_of_this_controller_is_taken_over(testbed, run_pyinfra):
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = json.dumps({"run": "deadbeef0001", "user": "ana", "controller": socket.gethostname(),
                         "machine": oplock.machine_id(), "pid": gone.pid, "what": "deploy.py", "since": time.time()})
    for name in testbed.names:
        testbed.exec(name, f"echo '{record}' > {OPERATOR_LOCK}", check=True)
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert re.search(rf"operator lock: taken over from ana@{re.escape(socket.gethostname())} \(pyinfra pid "
                     rf"{gone.pid}, run deadbeef0001: deploy.py\) since .*, whose pyinfra no longer runs on this "
                     "controller", out), out[-4000:]
    assert [lock(testbed, n) for n in testbed.names] == [None] * 3
