"""Detached long-running host tasks: progress, failure log tails, and re-attaching."""

from __future__ import annotations

import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
from pyinfra.api.exceptions import OperationError

from sparkfleet import tasks


class LocalHost:
    """Just enough of a pyinfra host to run shell commands on this machine."""

    name = "local"
    print_prefix = "[local] "

    def run_shell_command(self, command, print_output=False, _timeout=60, **_):
        text = command.get_raw_value() if hasattr(command, "get_raw_value") else str(command)
        proc = subprocess.run(["sh", "-c", text], capture_output=True, text=True, timeout=60)
        return proc.returncode == 0, SimpleNamespace(stdout_lines=proc.stdout.splitlines(),
                                                     stderr_lines=proc.stderr.splitlines())


@pytest.fixture(autouse=True)
def fast(monkeypatch, tmp_path):
    monkeypatch.setattr(tasks, "TASK_DIR", str(tmp_path / "tasks"))
    monkeypatch.setattr(tasks, "POLL_EVERY_S", 0.05)
    monkeypatch.setattr(tasks, "PROGRESS_EVERY_S", 0.2)
    monkeypatch.setattr(tasks.remote, "connector_arguments", lambda host: {})


def test_progress_is_reported_while_the_task_runs(caplog):
    caplog.set_level("INFO", logger="pyinfra")
    tasks.run_detached(LocalHost(), "slow", "for i in 1 2 3 4 5 6; do echo step $i; sleep 0.15; done")
    progress = [r.message for r in caplog.records if "slow: running for" in r.message]
    assert progress, caplog.text
    assert any("step" in line for line in progress)
    assert "slow: done" in caplog.text


def test_a_failing_task_shows_the_tail_of_its_log():
    with pytest.raises(OperationError) as caught:
        tasks.run_detached(LocalHost(), "broken", "echo first; echo 'disk quota exceeded' >&2; exit 3")
    message = str(caught.value)
    assert "exit 3" in message and "disk quota exceeded" in message


def test_a_task_still_running_from_an_interrupted_run_is_attached_not_restarted(tmp_path):
    marker = tmp_path / "starts"
    command = f"echo x >> {marker}; sleep 1"
    first = threading.Thread(target=tasks.run_detached, args=(LocalHost(), "once", command))
    first.start()
    time.sleep(0.3)
    tasks.run_detached(LocalHost(), "once", command)  # a second run while the first goes on
    first.join()
    assert marker.read_text().count("x") == 1


def test_a_changed_command_is_a_new_task_not_the_finished_old_one(tmp_path):
    out = tmp_path / "out"
    tasks.run_detached(LocalHost(), "fetch", f"echo rev-a > {out}")
    tasks.run_detached(LocalHost(), "fetch", f"echo rev-b > {out}")
    assert out.read_text().strip() == "rev-b"


def test_a_pid_from_another_boot_is_not_attached_to(tmp_path):
    marker = tmp_path / "ran"
    command = f"echo yes > {marker}"
    base = f"{tasks.TASK_DIR}/stale-" + __import__("hashlib").sha256(command.encode()).hexdigest()[:12]
    (tmp_path / "tasks").mkdir(exist_ok=True)
    # A live pid (ours) recorded in a different boot, and an old success code.
    open(base + ".pid", "w").write(f"{__import__('os').getpid()} some-other-boot\n")
    open(base + ".rc", "w").write("0\n")
    tasks.run_detached(LocalHost(), "stale", command)
    assert marker.read_text().strip() == "yes"
