"""Long host steps as transient systemd units: progress, failure log tails, re-attaching,
results kept for the next run, sudo, and secrets kept out of the unit.

The steps need a host's systemd, so they run on spark-1 of the session's simulated
fleet (tests/e2e/conftest.py), the units cleaned up after each test.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from pyinfra.api.exceptions import OperationError

from sparkfleet import remote, tasks
from sparkfleet.hostpaths import TASK_UNIT_PREFIX
from sparkfleet.testbed.proc import wait_until

HOST = "spark-1"


@pytest.fixture(scope="module")
def tb(testbed):
    return testbed


class FleetHost:
    """Just enough of a pyinfra host to run shell commands on a simulated Spark over SSH."""

    name = HOST
    print_prefix = f"[{HOST}] "

    def __init__(self, tb):
        self.tb = tb

    def run_shell_command(self, command, print_output=False, _timeout=60, **_):
        text = command.get_raw_value() if hasattr(command, "get_raw_value") else str(command)
        proc = self.tb.exec(HOST, text, timeout=_timeout)
        return proc.returncode == 0, SimpleNamespace(stdout_lines=proc.stdout.splitlines(),
                                                     stderr_lines=proc.stderr.splitlines())


@pytest.fixture
def host(tb, monkeypatch):
    monkeypatch.setattr(tasks, "POLL_EVERY_S", 0.05)
    monkeypatch.setattr(tasks, "PROGRESS_EVERY_S", 0.5)
    monkeypatch.setattr(remote, "connector_arguments", lambda host: {})
    yield FleetHost(tb)
    # Whatever a test left (a unit it stopped watching) goes, so tests stay independent.
    tb.exec(HOST, f"for u in $(systemctl list-units --all --plain --no-legend '{TASK_UNIT_PREFIX}*' "
                  "| cut -d' ' -f1); do systemctl stop $u; systemctl reset-failed $u; done; rm -rf /tmp/tasks-test /var/tmp/tasks-test")


def sh(tb, command: str) -> str:
    proc = tb.exec(HOST, command)
    assert proc.returncode == 0, f"{command!r}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def unit_state(tb, name: str, command: str) -> str:
    return sh(tb, f"systemctl show -P ActiveState {tasks.unit_name(name, command)}").strip()


def test_progress_is_reported_while_the_task_runs(host, caplog):
    caplog.set_level("INFO", logger="pyinfra")
    tasks.run_detached(host, "slow", "for i in 1 2 3 4 5 6; do echo step $i; sleep 0.4; done")
    progress = [r.message for r in caplog.records if "slow: running for" in r.message]
    assert progress, caplog.text
    assert any("step" in line for line in progress)
    assert "slow: done" in caplog.text


def test_progress_shows_the_last_redraw_of_a_progress_bar(host, caplog):
    caplog.set_level("INFO", logger="pyinfra")
    # Long enough for progress lines under load (make test's two shards): each poll is an SSH round trip.
    tasks.run_detached(host, "bar", "printf 'bar 10%%\\rbar 20%%\\rbar 30%%\\n'; sleep 4")
    progress = [r.message for r in caplog.records if "bar: running for" in r.message]
    assert progress and progress[-1].endswith("bar 30%"), caplog.text


def test_a_failing_task_shows_the_tail_of_its_log(host, tb):
    command = "echo first; echo 'disk quota exceeded' >&2; exit 3"
    with pytest.raises(OperationError) as caught:
        tasks.run_detached(host, "broken", command)
    message = str(caught.value)
    assert "exit 3" in message and "disk quota exceeded" in message
    # The failure was read, so the unit is cleared: the next run tries again.
    assert unit_state(tb, "broken", command) == "inactive"


def test_the_tail_is_of_this_run_not_an_earlier_one_of_the_same_step(host, tb):
    sh(tb, "mkdir -p /tmp/tasks-test")
    command = "n=$(cat /tmp/tasks-test/n 2>/dev/null || echo 0); echo $((n+1)) > /tmp/tasks-test/n; echo attempt-$n; exit 1"
    for attempt in range(2):
        with pytest.raises(OperationError) as caught:
            tasks.run_detached(host, "retried", command)
        assert f"attempt-{attempt}" in str(caught.value)
    assert "attempt-0" not in str(caught.value)


def test_a_killed_task_says_by_what(host, tb):
    command = "echo going; kill -9 $$"
    with pytest.raises(OperationError) as caught:
        tasks.run_detached(host, "killed", command)
    assert "killed by SIGKILL" in str(caught.value)


class CutOff(Exception):
    pass


class CutOffHost(FleetHost):
    """A run whose controller goes away right after it started the step."""

    calls = 0

    def run_shell_command(self, command, print_output=False, _timeout=60):
        self.calls += 1
        if self.calls > 1:
            raise CutOff()
        return super().run_shell_command(command, print_output, _timeout)


def test_a_task_still_running_from_an_interrupted_run_is_attached_not_restarted(host, tb, caplog):
    caplog.set_level("INFO", logger="pyinfra")
    sh(tb, "mkdir -p /tmp/tasks-test")
    command = "echo x >> /tmp/tasks-test/starts; sleep 2"
    with pytest.raises(CutOff):
        tasks.run_detached(CutOffHost(tb), "once", command)
    assert unit_state(tb, "once", command) == "active"
    tasks.run_detached(host, "once", command)  # the next run, while the step goes on
    assert "once: found" in caplog.text and "once: done" in caplog.text
    assert sh(tb, "cat /tmp/tasks-test/starts").count("x") == 1


def test_a_task_that_ended_while_no_run_watched_reports_to_the_next_run(host, tb):
    # Started by a run that was cut off (here: started by hand as that run would have).
    sh(tb, "mkdir -p /tmp/tasks-test")
    ok = "echo x >> /tmp/tasks-test/ok"
    bad = "echo x >> /tmp/tasks-test/bad; echo 'no space left on device'; exit 28"
    for name, command in (("unwatched-ok", ok), ("unwatched-bad", bad)):
        sh(tb, f"systemd-run --quiet --unit={tasks.unit_name(name, command)} --remain-after-exit /bin/sh -c \"{command}\"")
    # Both ended, the failed one's output in its journal: journald can write it seconds
    # after the exit when the machine is loaded, and the report reads it from there.
    wait_until(lambda: sh(tb, f"systemctl show -P SubState {tasks.unit_name('unwatched-ok', ok)}").strip() == "exited"
               and "no space left on device" in sh(tb, "journalctl -q -a -o cat --no-pager "
                                                       f"_SYSTEMD_UNIT={tasks.unit_name('unwatched-bad', bad)}"),
               60, 0.5, "both unwatched tasks to end, with the failed one's output in the journal")
    tasks.run_detached(host, "unwatched-ok", ok)  # the finished step is not run again
    assert sh(tb, "cat /tmp/tasks-test/ok").count("x") == 1
    with pytest.raises(OperationError) as caught:
        tasks.run_detached(host, "unwatched-bad", bad)
    assert "exit 28" in str(caught.value) and "no space left on device" in str(caught.value)
    assert sh(tb, "cat /tmp/tasks-test/bad").count("x") == 1
    # Reported once: the run after that starts the step again.
    with pytest.raises(OperationError):
        tasks.run_detached(host, "unwatched-bad", bad)
    assert sh(tb, "cat /tmp/tasks-test/bad").count("x") == 2


def test_a_changed_command_is_a_new_task_not_the_finished_old_one(host, tb):
    sh(tb, "mkdir -p /tmp/tasks-test")
    tasks.run_detached(host, "fetch", "echo rev-a > /tmp/tasks-test/out")
    tasks.run_detached(host, "fetch", "echo rev-b > /tmp/tasks-test/out")
    assert sh(tb, "cat /tmp/tasks-test/out").strip() == "rev-b"


def test_a_unit_of_a_rebooted_host_is_not_waited_on(host, tb):
    # A step cut short by a reboot leaves nothing that looks running or finished: the
    # next run starts it again.
    sh(tb, "mkdir -p /var/tmp/tasks-test && rm -f /var/tmp/tasks-test/*")
    command = "echo x >> /var/tmp/tasks-test/ran; [ -f /var/tmp/tasks-test/rebooted ] || sleep 600"
    sh(tb, f"systemd-run --quiet --unit={tasks.unit_name('cut', command)} --remain-after-exit /bin/sh -c '{command}'")
    tb.restart_host(HOST)
    assert unit_state(tb, "cut", command) == "inactive"
    sh(tb, "touch /var/tmp/tasks-test/rebooted")
    tasks.run_detached(host, "cut", command)
    assert sh(tb, "cat /var/tmp/tasks-test/ran").count("x") == 2


def test_the_secret_a_task_reads_stays_out_of_the_unit(host, tb):
    secret = "hf_taskSecret0123456789"
    sh(tb, f"mkdir -p /tmp/tasks-test && (umask 077; echo HF_TOKEN={secret} > /tmp/tasks-test/hf.env)")
    command = ". /tmp/tasks-test/hf.env; echo token of ${#HF_TOKEN} characters; sleep 1.5"
    watcher = threading.Thread(target=tasks.run_detached, args=(host, "secret", command))
    watcher.start()
    time.sleep(0.8)
    unit = tasks.unit_name("secret", command)
    seen = sh(tb, f"systemctl show {unit}; cat /proc/[0-9]*/cmdline | tr '\\0' ' '; cat /proc/[0-9]*/environ | tr '\\0' ' '")
    watcher.join()
    seen += sh(tb, f"journalctl -a -o verbose --no-pager -u {unit}")
    assert "token of 23 characters" in seen  # the task did read it, on the host
    assert secret not in seen


def test_tasks_run_with_the_hosts_sudo(tb, monkeypatch):
    """Through a real pyinfra host that logs in as the fleet's login (an ordinary user whose
    sudo asks for a password): without the connector arguments systemd-run is refused."""
    monkeypatch.setattr(tasks, "POLL_EVERY_S", 0.05)
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all

    from sparkfleet.testbed import paths
    from sparkfleet.testbed.state import inventory_hosts

    name, data = next((n, d) for n, d in inventory_hosts(paths.HOSTS_JSON) if n == tb.inventory_name(HOST))
    assert data.get("_sudo") and data.get("_sudo_password")  # as DGX OS: password sudo
    sh(tb, "rm -f /tmp/tasks-sudo")
    for sudo in (False, True):
        state = State(Inventory(([(name, {**data, "_sudo": sudo})], {})), Config())
        connect_all(state)
        pyhost = state.inventory.get_host(name)
        try:
            if sudo:
                tasks.run_detached(pyhost, "as-root", "id -u > /tmp/tasks-sudo")
            else:
                with pytest.raises(OperationError, match="could not start"):
                    tasks.run_detached(pyhost, "as-root", "id -u > /tmp/tasks-sudo")
        finally:
            pyhost.disconnect()
    assert sh(tb, "cat /tmp/tasks-sudo").strip() == "0"
    sh(tb, "rm -f /tmp/tasks-sudo")
