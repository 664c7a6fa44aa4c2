"""Long host-side steps (image pulls, downloads, builds) with progress and log tails.

pyinfra prints a command's output only when it ends. A 60 GiB download or a 40 GiB pull
takes many minutes, so these run detached on the host (they also survive a dropped SSH
connection and are picked up again by the next run instead of being started twice),
while the controller polls them and prints one progress line per host at a steady pace.
A failure shows the last lines of the task's log.
"""

from __future__ import annotations

import hashlib
import shlex
import time
from typing import Callable

import gevent
from pyinfra import logger
from pyinfra.api import FunctionCommand
from pyinfra.api.exceptions import OperationError

from sparkfleet import remote

TASK_DIR = "/var/lib/sparkfleet/tasks"
PROGRESS_EVERY_S = 15.0
POLL_EVERY_S = 2.0


def shell(host, command: str, timeout: int = 60) -> tuple[bool, list[str]]:
    """Run ``command`` on ``host`` as the deploy does (sudo included); (ok, stdout lines)."""
    done = remote.run(host, command, timeout=timeout)
    return done.ok, done.stdout


def run_detached(
    host,
    name: str,
    command: str,
    describe_progress: Callable[[object], str] | None = None,
    timeout_s: float = 6 * 3600,
) -> None:
    """Run ``command`` on ``host`` as task ``name`` and wait for it, printing progress.

    ``command`` is a shell command whose every variable part the caller has quoted.
    """
    # The task is named by what it runs: a changed revision or image is a new task, never
    # mistaken for a finished old one.
    base = f"{TASK_DIR}/{name}-{hashlib.sha256(command.encode()).hexdigest()[:12]}"
    q = shlex.quote
    boot_id = "$(cat /proc/sys/kernel/random/boot_id)"
    start = (
        f"mkdir -p {TASK_DIR} && "
        # A task still running from an interrupted run is waited on, not started twice;
        # its pid counts only within the same boot (pids are reused after a reboot).
        f"if [ -f {q(base + '.pid')} ] && [ \"$(cut -d' ' -f2 {q(base + '.pid')})\" = \"{boot_id}\" ] "
        f"&& kill -0 \"$(cut -d' ' -f1 {q(base + '.pid')})\" 2>/dev/null; then echo attached; "
        f"else rm -f {q(base + '.rc')}; "
        # A subshell, so that an `exit` in the command still records its status.
        f"setsid sh -c {q(f'( {command} ) > {base}.log 2>&1; echo $? > {base}.rc.tmp && mv {base}.rc.tmp {base}.rc; rm -f {base}.pid')} "
        f"< /dev/null > /dev/null 2>&1 & echo \"$! {boot_id}\" > {q(base + '.pid')}; echo started; fi"
    )
    ok, lines = shell(host, start)
    if not ok:
        raise OperationError(f"could not start {name}: {' '.join(lines)}")
    started = time.monotonic()
    last_report = started
    while True:
        ok, lines = shell(host, f"cat {q(base + '.rc')} 2>/dev/null || echo running")
        state = lines[-1].strip() if lines else "running"
        if state != "running":
            break
        now = time.monotonic()
        if now - started > timeout_s:
            raise OperationError(f"{name} did not finish within {timeout_s:.0f} s")
        if now - last_report >= PROGRESS_EVERY_S:
            last_report = now
            detail = describe_progress(host) if describe_progress else _last_log_line(host, base)
            logger.info(f"{host.print_prefix}{name}: running for {now - started:.0f} s — {detail}")
        gevent.sleep(POLL_EVERY_S)  # yields to the other hosts' greenlets
    if state != "0":
        _, tail = shell(host, f"tail -n 20 {q(base + '.log')} 2>/dev/null")
        raise OperationError(
            f"{name} failed (exit {state}); last lines of {base}.log:\n    " + "\n    ".join(tail)
        )
    logger.info(f"{host.print_prefix}{name}: done in {time.monotonic() - started:.0f} s")


def _last_log_line(host, base: str) -> str:
    # Progress bars redraw with \r: keep the last redraw of the last line.
    _, lines = shell(host, f"tail -c 400 {shlex.quote(base + '.log')} 2>/dev/null | tr '\\r' '\\n' | grep -v '^$' | tail -n 1")
    return lines[-1].strip()[:160] if lines else "no output yet"


def detached(name: str, command: str, describe_progress=None, timeout_s: float = 6 * 3600) -> FunctionCommand:
    """The pyinfra command that runs :func:`run_detached` on the current host."""

    def _run(state, host):
        run_detached(host, name, command, describe_progress, timeout_s)
        return True

    return FunctionCommand(_run, (), {})
