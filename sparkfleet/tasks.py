"""Long host-side steps (image pulls, downloads, builds) with progress and log tails.

pyinfra prints a command's output only when it ends. A 60 GiB download or a 40 GiB pull
takes many minutes, so each runs on the host as a transient systemd unit (``systemd-run``):
systemd supervises it and journald keeps its output, it survives a dropped SSH connection,
and a re-run finds it by its name instead of starting it twice (systemd holds one unit of
a name). The controller polls the unit and prints one progress line per host at a steady
pace; a failure shows the last lines of the unit's journal.

The unit is started with ``--remain-after-exit`` and without ``--collect``: when the
command ends the unit stays loaded, "active (exited)" after success, "failed" with its exit
status otherwise, until the run that reads that result clears it (``stop`` or
``reset-failed``), so the next run starts afresh. With ``--collect`` a failed unit is
unloaded at once and its exit status is lost, both between two polls of a watching run
and for a step that ended while no run watched. A transient unit does not outlive a
reboot, so a unit is never mistaken for a step of an earlier boot.

The unit starts with systemd's clean environment and its command line is the caller's
command: a secret (the HF token) is read by the command from its 0600 file on the host,
never passed to ``systemd-run``.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import shlex
import signal
import time
from collections.abc import Callable

import gevent
from pyinfra import host, logger
from pyinfra.api import FunctionCommand, operation
from pyinfra.api.exceptions import OperationError

from sparkfleet import remote, snapshot
from sparkfleet.facts import NewLines
from sparkfleet.hostpaths import TASK_UNIT_PREFIX

PROGRESS_EVERY_S = 15.0
POLL_EVERY_S = 2.0
TAIL_LINES = 20
_PROPERTIES = "LoadState,ActiveState,SubState,Result,ExecMainStatus,SyslogIdentifier"


def unit_name(name: str, command: str) -> str:
    """The transient unit that runs ``command`` as task ``name``.

    Named by what it runs: a changed revision or image is a new unit, never mistaken for
    a finished old one.
    """
    digest = hashlib.sha256(command.encode()).hexdigest()[:12]
    return f"{TASK_UNIT_PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{digest}.service"


def start_detached(host, name: str, command: str) -> tuple[str, bool]:
    """Start ``command`` on ``host`` as task ``name`` unless its unit is loaded (running,
    or ended and not yet read); (the unit, whether it was found loaded). Does not wait."""
    unit = unit_name(name, command)
    q = shlex.quote
    # systemd expands $NAME in a unit's command line; "$$" is its escape for "$".
    argv = f"/bin/sh -c {q(command.replace('$', '$$'))}"
    tag = f"{unit.removesuffix('.service')}.{secrets.token_hex(4)}"
    start = (
        f"if [ \"$(systemctl show -P LoadState {unit})\" = not-found ]; then "
        f"systemd-run --quiet --unit={unit} --description={q('sparkfleet ' + name)} --remain-after-exit "
        f"--property=SyslogIdentifier={tag} {argv} 2>&1 && echo started; else echo found; fi"
    )
    done = remote.run(host, start)  # with the host's sudo: systemd-run needs root
    lines = done.stdout
    if not done.ok or not lines or lines[-1] not in ("started", "found"):
        raise OperationError(f"could not start {name} as {unit}: {' '.join(lines + done.stderr)}")
    return unit, lines[-1] == "found"


def run_detached(
    host,
    name: str,
    command: str,
    describe_progress: Callable[[object], str] | None = None,
    timeout_s: float = 6 * 3600,
    diagnose: Callable[[list[str]], str | None] | None = None,
) -> None:
    """Run ``command`` on ``host`` as task ``name`` and wait for it, printing progress.

    ``command`` is a shell command whose every variable part the caller has quoted. A
    unit of the same command that is running is waited on; one that ended while no run
    watched reports its result here (and is then cleared).

    A failure says what went wrong and what to do: the step's own last ``error: `` line
    (ERROR_PREFIX), else what ``diagnose`` makes of the log's tail, above that tail.
    """
    unit, found = start_detached(host, name, command)
    if found:
        logger.info(f"{host.print_prefix}{name}: found {unit} of an earlier run or step")
    started = time.monotonic()
    last_report = started
    while True:
        state = _unit_state(host, unit)
        if state.get("LoadState") == "not-found":
            raise OperationError(f"{name}: {unit} is gone before this run saw it end (stopped by hand, "
                                 "the host rebooted, or another run read its result)")
        if (state.get("ActiveState"), state.get("SubState")) in (("failed", "failed"), ("active", "exited")):
            break
        now = time.monotonic()
        if now - started > timeout_s:
            raise OperationError(f"{name} did not finish within {timeout_s:.0f} s; it goes on as {unit}")
        if now - last_report >= PROGRESS_EVERY_S:
            last_report = now
            detail = describe_progress(host) if describe_progress else _last_log_line(host, unit, state)
            logger.info(f"{host.print_prefix}{name}: running for {now - started:.0f} s — {detail}")
        gevent.sleep(POLL_EVERY_S)  # yields to the other hosts' greenlets
    if state["ActiveState"] == "failed":
        lines = _lines(_journal(host, unit, state, 500))
        remote.run(host, f"systemctl reset-failed {unit}")
        said = [line[len(ERROR_PREFIX):] for line in lines if line.startswith(ERROR_PREFIX)]
        tail = [line for line in lines if not line.startswith(ERROR_PREFIX)][-TAIL_LINES:]
        what = said[-1] if said else (diagnose(tail) if diagnose else None)
        raise OperationError(
            f"{name} failed ({_why(state)}){': ' + what if what else ''}\n"
            f"    last lines of journalctl -u {unit}:\n    " + "\n    ".join(tail)
        )
    _print_reports(host, name, unit, state)
    remote.run(host, f"systemctl stop {unit}")
    logger.info(f"{host.print_prefix}{name}: done in {time.monotonic() - started:.0f} s")


#: A step's output lines that begin so are shown in the deploy's output when it ends
#: (what a step found and did that the operator must know, e.g. a repaired file).
REPORT_PREFIX = "report: "
#: A failing step's line that begins so is its own diagnosis: "what went wrong — what to do".
ERROR_PREFIX = "error: "


def _lines(journal: list[str]) -> list[str]:
    """The journal's lines as a terminal shows them: a progress bar (tqdm, on stderr)
    redraws with \r and leaves no newline, so a line printed after it lands behind its
    last draw in one journal line."""
    lines = []
    for line in journal:
        line = line.rsplit("\r", 1)[-1]
        for prefix in (REPORT_PREFIX, ERROR_PREFIX):
            at = line.find(prefix)
            if at > 0 and line[:at].rstrip().endswith("]"):  # "... 4/5 [00:22<00:05,  5.70s/it]"
                line = line[at:]
        lines.append(line)
    return lines


def _print_reports(host, name: str, unit: str, state: dict[str, str]) -> None:
    for line in _lines(_journal(host, unit, state, 500)):
        if line.startswith(REPORT_PREFIX):
            logger.warning(f"{host.print_prefix}{name}: {line[len(REPORT_PREFIX):]}")


def _unit_state(host, unit: str) -> dict[str, str]:
    # Anyone may read a unit's state (systemd's D-Bus API): each poll costs no sudo.
    done = remote.run(host, f"systemctl show -p {_PROPERTIES} {unit}", as_login=True)
    # A failed poll (a dropped connection) reads as still running: the next one decides.
    return dict(line.split("=", 1) for line in done.stdout if "=" in line) if done.ok else {}


def _journal(host, unit: str, state: dict[str, str], lines: int) -> list[str]:
    """The last ``lines`` of this run of the unit's output, found by its own tag (a unit
    of an earlier sparkfleet has none: then all of the unit's)."""
    tag = state.get("SyslogIdentifier", "")
    match = f"SYSLOG_IDENTIFIER={shlex.quote(tag)}" if tag else f"_SYSTEMD_UNIT={unit}"
    # --sync first: journald may not yet have written the last lines of a step that just ended.
    return remote.run(host, f"journalctl --sync 2>/dev/null; journalctl -q -a -o cat --no-pager {match} -n {lines}").stdout


def _last_log_line(host, unit: str, state: dict[str, str]) -> str:
    # Progress bars redraw with \r: keep the last redraw of the last line.
    lines = [part for line in _journal(host, unit, state, 1) for part in line.split("\r") if part.strip()]
    return lines[-1].strip()[:160] if lines else "no output yet"


def _why(state: dict[str, str]) -> str:
    result, status = state.get("Result", ""), state.get("ExecMainStatus", "")
    if result == "exit-code":
        return f"exit {status}"
    if result in ("signal", "core-dump") and status.isdigit():
        try:
            return f"killed by {signal.Signals(int(status)).name}"
        except ValueError:
            return f"killed by signal {status}"
    return f"{result}, status {status}"


def detached(name: str, command: str, describe_progress=None, timeout_s: float = 6 * 3600,
             diagnose=None) -> FunctionCommand:
    """The pyinfra command that runs :func:`run_detached` on the current host."""

    def _run(state, host):
        run_detached(host, name, command, describe_progress, timeout_s, diagnose)
        return True

    return remote.callback(_run)


def started(name: str, command: str) -> FunctionCommand:
    """The pyinfra command that starts task ``name`` on the current host and goes on: a
    later :func:`detached` of the same name and command waits for it and reads its result."""

    def _start(state, host):
        unit, found = start_detached(host, name, command)
        logger.info(f"{host.print_prefix}{name}: {'runs' if found else 'started'} as {unit}")
        return True

    return remote.callback(_start)


def events_reported(name: str, log: str, reported: str, prefix: str, nothing: str):
    """:func:`events_said`, its log declared while the deploy plans: the host's snapshot
    reads it with the rest instead of in a command (and a sudo) of its own."""
    snapshot.expect(facts=[(NewLines, {"log": log, "reported": reported})])
    return events_said(name=name, log=log, reported=reported, prefix=prefix, nothing=nothing)


@operation()
def events_said(log: str, reported: str, prefix: str, nothing: str):
    """
    Say on the deploy's output the lines a host-side event log (``log``) gained since the
    last deploy, once: the host keeps how many it has shown in ``reported``.

    + prefix: what each line is said as (``watchdog: ``)
    + nothing: the noop's words when there is nothing new
    """
    events = snapshot.fact(NewLines, log=log, reported=reported)
    if not events["lines"]:
        host.noop(nothing)
        return
    for line in events["lines"]:
        logger.warning(f"{host.print_prefix}{prefix}{line}")
    yield f"echo {events['total']} > {shlex.quote(reported)}"
