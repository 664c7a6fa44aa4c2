"""How a pyinfra run from the project ends (config.py): an interrupted run and one that
selects no host exit non-zero; pyinfra's traceback file is private. Real pyinfra runs,
against @local or hosts it never connects to (no fleet)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pyinfra(cwd: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pyinfra", "-y", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen)


def test_a_limit_that_selects_no_host_fails_naming_it_and_the_hosts(tmp_path):
    inventory = tmp_path / "two.py"
    inventory.write_text('sparks = ["spark-a.local", "spark-b.local"]\n')  # never connected to
    for option in ("--limit", "--exclude"):
        pattern = "spark-9" if option == "--limit" else "spark-*"
        run = pyinfra(ROOT, str(inventory), "deploy.py", option, pattern)
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 2, out
        assert f"{option} {pattern} leaves no host of the inventory" in out, out
        assert "its hosts: spark-a.local, spark-b.local" in out, out


def test_an_inventory_without_hosts_fails_naming_it(tmp_path):
    run = pyinfra(ROOT, "inventory/no-such-file.py", "deploy.py")  # pyinfra: "neither an inventory file..."
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 2, out
    assert "the inventory inventory/no-such-file.py holds no host, so nothing ran" in out, out


def test_ctrl_c_exits_130_not_0(tmp_path):
    (tmp_path / "local.py").write_text('hosts = ["@local"]\n')
    # A step that cannot end before the signal, however loaded the machine.
    (tmp_path / "slow.py").write_text('from pyinfra.operations import server\n'
                                      'server.shell(name="a long step", commands=["sleep 120"])\n')
    run = pyinfra(ROOT, str(tmp_path / "local.py"), str(tmp_path / "slow.py"), start_new_session=True)
    # The signal must land in the step: once its sleep runs, as a terminal's Ctrl-C reaches
    # it (a command spawned after the signal never gets it). A loaded machine (CI runs three
    # fleets beside this) may take a minute to get there.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and run.poll() is None:
        if subprocess.run(["pgrep", "-g", str(run.pid), "-x", "sleep"], capture_output=True).returncode == 0:
            break
        time.sleep(0.2)
    else:
        os.killpg(run.pid, signal.SIGKILL)
        pytest.fail(f"pyinfra never started the step: {run.communicate()[0][-2000:]}")
    os.kill(run.pid, signal.SIGUSR1)  # what a stuck run waits on: every greenlet's stack, and it goes on
    time.sleep(2)
    os.killpg(run.pid, signal.SIGINT)  # the whole foreground group, its sleep too
    out, _ = run.communicate(timeout=60)
    assert run.returncode == 130, out
    assert "Interrupted (Ctrl-C)" in out and "Exiting upon user request" not in out, out
    assert "in run_shell_command" in out.split("Interrupted (Ctrl-C)")[0], out


def test_ctrl_c_in_code_that_ignores_errors_still_exits_130(tmp_path):
    """The signal can land in code whose errors Python ignores (a __del__, logging's lock
    release): the run still ends, with 130, and runs no further step."""
    (tmp_path / "local.py").write_text('hosts = ["@local"]\n')
    (tmp_path / "swallowed.py").write_text(
        "import os, signal\n"
        "from pyinfra.operations import server\n"
        "class Dropped:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "Dropped()\n"
        f'server.shell(name="after", commands=["touch {tmp_path}/ran"])\n')
    run = pyinfra(ROOT, str(tmp_path / "local.py"), str(tmp_path / "swallowed.py"))
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 130, out
    assert "Interrupted (Ctrl-C)" in out, out
    assert not (tmp_path / "ran").exists(), out


def test_the_traceback_of_an_internal_error_is_private(tmp_path):
    # pyinfra writes pyinfra-debug.log into its working directory: here, not the checkout.
    shutil.copy(ROOT / "config.py", tmp_path / "config.py")
    (tmp_path / "local.py").write_text('hosts = ["@local"]\n')
    # An exception in pyinfra's own run (here: an operation's condition) is an internal error.
    (tmp_path / "broken.py").write_text('from pyinfra.operations import server\n'
                                        'def bug():\n    raise RuntimeError("a bug")\n'
                                        'server.shell(name="step", commands=["true"], _if=bug)\n')
    run = pyinfra(tmp_path, "local.py", "broken.py", preexec_fn=lambda: os.umask(0o022))
    out, _ = run.communicate(timeout=120)
    assert run.returncode != 0 and "written to pyinfra-debug.log" in out, out
    log = tmp_path / "pyinfra-debug.log"
    assert "a bug" in log.read_text()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
