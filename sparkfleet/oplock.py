"""One operator at a time: a deploy holds its fleet while it changes it.

Two controllers (two laptops, two terminals) deploying one fleet at once would both pass,
both roll, their turns interleaved (two hosts out of rotation at once), and the fleet would
end on whichever wrote last. So a deploy takes the fleet's operator lock on every host of
the run before it changes any, and each host gives it back when pyinfra is done with it.

The lock lives on the hosts, not the controller: it must hold across controllers. It is one
small JSON record, :data:`~sparkfleet.hostpaths.OPERATOR_LOCK` in ``/run`` (tmpfs: a reboot
frees it), naming who holds it: user@controller, the controller's machine id, pyinfra's
pid, since when (the host's clock), the run's id and what it runs. Every take, give-back
and removal is one command under flock(2) on that file, so two runs racing for a host see
one winner. The file is emptied, never removed (a run waiting on the lock of a removed
file would take a lock nobody else sees): empty is free. It is group ``sudo``'s to write
(DGX OS's admins, who could write it through sudo anyway), so a take or a give runs as the
login: no sudo, whose password hash is the largest cost of a converged run on a host.
Root makes it so the first time after a boot, when the login cannot create it in ``/run``.

- Taken before the run's first change, not before its first operation: a run that has
  nothing to change (a converged re-run) takes and gives back nothing, so it costs each
  host one command, its read. The first command any operation has for any host takes it
  on every host the run still has operations for, all or nothing: the first of them first
  (two runs racing meet there), then the others at once. A host another run holds makes
  every host fail at its first change, naming who holds it since when and the fix; the
  hosts this run took are given back. Nothing has changed on any host before it.
- The run plans on each host's first read: a host whose read found another run's lock
  (not a dead run of this controller) stops every host at the lock's operation, even if
  that run has ended since, as what it changed may be missing from the plan. A dead run's
  lock found at the read is taken over there and then.
- The run itself passes again (a second deploy file in the same pyinfra command).
- It never expires: a READY wait or a drain legitimately takes many minutes. The lock of
  a run that provably died (this controller, its pid gone: kill -9, a crash) is taken over
  with a warning; any other is removed by ``sparkfleet unlock <inventory>``
  (:mod:`sparkfleet.unlock`), which shows whose it was.
- Given back from state callbacks, on each host as soon as pyinfra is done with it: its
  last operation ended, or it failed (pyinfra runs nothing more on a failed host). A
  killed controller gives nothing back (nor does a run pyinfra itself aborts: Ctrl-C,
  --fail-percent): that is what the two recoveries above are for.
- ``--dry`` takes nothing: it reads the lock and warns when another run holds it.
"""

from __future__ import annotations

import functools
import getpass
import json
import os
import shlex
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gevent
from pyinfra import host, logger
from pyinfra.api import StringCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.api.state import BaseStateCallback

from sparkfleet import remote, snapshot
from sparkfleet.hostpaths import OPERATOR_LOCK
from sparkfleet.perrun import once

_NOT_MINE = 77  # the lock program's exit when the login may not write the lock
#: Runs on the host (sh, with util-linux's flock: a python3 start cost a host ~20 ms, twice
#: per host and run) as the login, or as root where the login may not write the lock (exit
#: :data:`_NOT_MINE`). argv: the lock's path, the action (take, give, show), the run (the
#: taker's, or the one to give back), a dead run whose lock a take may replace, and the
#: taker's record as JSON without ``since``, which the host's clock adds. Records are
#: ``json.dumps(..., sort_keys=True)``: ``"run": "<id>"`` names the holder. Prints the host's
#: clock, whether it took or gave, then the record it found (empty: free).
_PROGRAM = r"""
f=$1 action=$2 run=$3 stale=$4 record=$5
umask 007
{ command exec 9<>"$f"; } 2>/dev/null || exit NOT_MINE
if [ "$(id -u)" = 0 ] && getent group sudo >/dev/null; then chgrp sudo "$f" && chmod 660 "$f" || exit 1; fi
flock 9 || exit 1
IFS= read -r held <&9 || :
case $held in *[![:space:]]*) ;; *) held= ;; esac
now=$(date +%s.%N)
did=0
holds() { case $held in *"\"run\": \"$1\""*) return 0 ;; esac; return 1; }
case $action in
take)
    if [ -z "$held" ] || { [ -n "$stale" ] && holds "$stale"; }; then
        printf '%s, "since": %s}\n' "${record%\}}" "$now" > "$f" && did=1
    elif holds "$run"; then
        did=1
    fi ;;
give)
    if [ -n "$held" ] && holds "$run"; then : > "$f" && did=1; fi ;;
esac
printf 'now %s\ndone %s\n%s\n' "$now" "$did" "$held"
""".replace("NOT_MINE", str(_NOT_MINE))


# --- who holds it ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """A run that holds (or asks for) the lock."""

    run: str
    user: str = "?"
    controller: str = "?"
    machine: str = ""  # the controller's machine id: a pid means something only there
    pid: int = 0
    what: str = ""  # the deploy files (never --data: it may carry a secret)
    since: float = 0.0  # the host's clock, when the host recorded it

    @classmethod
    def of(cls, record: Any) -> Holder | None:
        """The holder a record names; None when the lock is free."""
        if not isinstance(record, dict) or not record:
            return None
        known = {k: record[k] for k in cls.__dataclass_fields__ if k in record}
        try:
            return cls(**{**known, "run": str(known.get("run", "?")), "pid": int(known.get("pid") or 0),
                          "since": float(known.get("since") or 0.0)})
        except (TypeError, ValueError):
            return cls(run=str(record.get("run", "?")))

    def describe(self, now: float | None = None) -> str:
        """``ana@laptop-2 (pyinfra pid 4242, run 1a2b3c: deploy.py) since 2026-12-02 11:30:05 UTC (4m12s ago)``."""
        what = f": {self.what}" if self.what else ""
        text = f"{self.user}@{self.controller} (pyinfra pid {self.pid}, run {self.run}{what})"
        if self.since:
            text += " since " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
            if now is not None:
                text += f" ({_duration(now - self.since)} ago)"
        return text


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def machine_id() -> str:
    """This controller, as a pid's owner: its machine id (a hostname alone may repeat)."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            found = Path(path).read_text().strip()
        except OSError:
            continue
        if found:
            return found
    return f"node-{uuid.getnode():012x}"


def still_runs(holder: Holder) -> bool | None:
    """Whether the holder's pyinfra still runs: True or False on the controller that took
    it, None elsewhere (a pid means nothing on another machine). A reused pid reads as
    running: never taken over, removed with ``sparkfleet unlock`` instead."""
    if holder.machine != machine_id() or holder.pid <= 0:
        return None
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # killed, not yet reaped by its parent: a zombie runs nothing (Linux shows it)
        return Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@functools.cache
def _command_line() -> dict[str, Any]:
    """pyinfra's command line, parsed by its own options ({} under pyinfra's API). Click's
    current context is no help: the deploy file runs in a greenlet of its own."""
    import click
    import pyinfra

    if not pyinfra.is_cli:
        return {}
    from pyinfra_cli.cli import cli

    try:
        return dict(cli.make_context("pyinfra", sys.argv[1:], resilient_parsing=True).params)
    except (click.ClickException, click.exceptions.Exit):
        return {}


def _cli(name: str) -> Any:
    return _command_line().get(name)


def unlock_command() -> str:
    inventory = _cli("inventory")
    return f"sparkfleet unlock {shlex.quote(inventory) if inventory else '<inventory>'}"


# --- one host -------------------------------------------------------------------------------


def argv(path: str, action: str, arg: dict) -> list[str]:
    """The lock program's command on lock file ``path`` for ``action`` with ``arg``: take {"holder": {...},
    "stale": a dead run's id or ""}, give {"run": id}, show {}."""
    mine = {k: v for k, v in arg.get("holder", {}).items() if k != "since"}
    run = mine.get("run", arg.get("run", ""))
    return ["sh", "-c", _PROGRAM, "sh", path, action, run, arg.get("stale", ""),
            json.dumps(mine, sort_keys=True) if mine else ""]


def answer(lines: list[str]) -> dict:
    """The lock program's answer: ``held`` (the record found, None when free), ``now`` (the
    host's clock) and ``done``."""
    at = next((i for i, line in enumerate(lines) if line.startswith("now ")), len(lines))  # past any banner
    try:
        now, done = float(lines[at].removeprefix("now ")), lines[at + 1] == "done 1"
    except (ValueError, IndexError):
        raise OperationError(f"the lock program answered {' '.join(lines)[-300:]!r}") from None
    return {"held": _record("\n".join(lines[at + 2:])), "now": now, "done": done}


def ask(target, action: str, arg: dict) -> dict:
    """The lock program's :func:`answer` on ``target``: as the login, or through sudo where
    the login may not write the lock."""
    command = StringCommand(*map(shlex.quote, argv(OPERATOR_LOCK, action, arg)))
    done = remote.run(target, command, timeout=60, as_login=True, success_exit_codes=[0, _NOT_MINE])
    if not (done.ok and done.stdout):  # exit _NOT_MINE prints nothing
        done = remote.run(target, command, timeout=60)
    if not done.ok:
        raise OperationError(f"the lock program failed: {' '.join(done.stderr + done.stdout)[-300:] or 'no output'}")
    return answer(done.stdout)


def take(target, mine: Holder, stale: str = "") -> dict:
    """Take the lock on ``target`` for ``mine``; a provably dead holder's (``stale``, or one
    found there) is taken over, and the answer's ``took_over`` names it."""
    answer = ask(target, "take", {"holder": asdict(mine), "stale": stale})
    found = Holder.of(answer["held"])
    if not answer["done"] and found is not None and still_runs(found) is False:
        answer = ask(target, "take", {"holder": asdict(mine), "stale": found.run})
    if answer["done"] and found is not None and found.run != mine.run:
        answer["took_over"] = found
    return answer


def give(target, run: str) -> dict:
    """Give the lock on ``target`` back if ``run`` holds it (another run's stays)."""
    return ask(target, "give", {"run": run})


# --- the run --------------------------------------------------------------------------------


@dataclass
class _Run:
    mine: Holder
    taken: set[str] = field(default_factory=set)  # hosts this run holds now
    last_op: dict[str, str] = field(default_factory=dict)  # host -> its last operation
    failure: str = ""  # why every host stops here, when another run holds one
    read_held: dict[str, Holder] = field(default_factory=dict)  # host -> another run, at its first read
    read_dead: set[str] = field(default_factory=set)  # hosts whose first read found a dead run of ours
    done: set[str] = field(default_factory=set)  # hosts pyinfra is done with: never taken after
    errors: dict[str, str] = field(default_factory=dict)  # hosts that could not be asked


def _run(state) -> _Run:
    def made() -> _Run:
        operations = _cli("operations") or ()
        return _Run(Holder(run=uuid.uuid4().hex[:12], user=getpass.getuser(), controller=socket.gethostname(),
                           machine=machine_id(), pid=os.getpid(), what=" ".join(map(str, operations))))

    return once("operator lock", made, state)


def _take_all(state, run: _Run) -> None:
    """Take the lock on every host the run still has operations for, or on none
    (``run.failure`` says why)."""
    hosts = [h for h in state.inventory if h in state.active_hosts and h.name not in run.done]
    answers: dict[str, dict] = {}

    def one(target, stale: str = "") -> None:
        try:
            answers[target.name] = take(target, run.mine, stale)
        except OperationError as exc:  # remote.run's too: a timeout, a broken connection
            run.errors[target.name] = str(exc)

    others: dict[str, tuple[str, list[str]]] = {}  # run -> (who, since when), its hosts
    for name, found in sorted(run.read_held.items()):  # this run planned on what it changed
        others.setdefault(found.run, (found.describe(time.time()), []))[1].append(name)
    first, rest = hosts[0], hosts[1:]
    if not others and hosts:
        one(first)  # two runs racing meet on the first host: one of them stops there
        opened = answers.get(first.name)
        if opened is None or opened["done"]:
            dead = opened.get("took_over") if opened else None  # likely the holder of every host
            gevent.joinall([gevent.spawn(one, h, dead.run if dead else "") for h in rest])
    run.taken = {name for name, answer in answers.items() if answer["done"]}
    dead_runs: dict[str, str] = {}
    for name, answer in answers.items():
        found = Holder.of(answer["held"])
        if found is not None and not answer["done"]:
            others.setdefault(found.run, (found.describe(answer["now"]), []))[1].append(name)
        elif answer.get("took_over"):
            dead_runs.setdefault(found.run, found.describe(answer["now"]))
    if others:
        _give_all(state, run)
        holders = "\n".join(f"  - {who}, found on {', '.join(names)}" for who, names in others.values())
        run.failure = (f"operator lock: another deploy is changing this fleet, so nothing was changed on any "
                       f"host:\n{holders}\nWait for it to end; if it no longer runs (killed, its controller "
                       f"gone): {unlock_command()}")
    elif dead_runs:
        logger.warning("operator lock: taken over from " + "; ".join(dead_runs.values())
                       + ", whose pyinfra no longer runs on this controller")


def _give_all(state, run: _Run) -> None:
    targets = [state.inventory.get_host(name) for name in sorted(run.taken)]
    gevent.joinall([gevent.spawn(give_back, state, t) for t in targets])


def give_back(state, target) -> None:
    """Give ``target``'s lock back, if this run holds it; a failure only warns (the lock
    stays, and says whose it is)."""
    run = _run(state)
    if target.name not in run.taken:
        return
    run.taken.discard(target.name)
    try:
        give(target, run.mine.run)
    except OperationError as exc:  # remote.run's too: a timeout, a broken connection
        logger.warning(f"{target.print_prefix}operator lock: could not give it back ({exc}); "
                       f"once this deploy has ended: {unlock_command()}")


class _GiveBack(BaseStateCallback):
    """Each host gives the lock back as soon as pyinfra is done with it: after its last
    operation, or when it fails (pyinfra runs nothing more on a failed host)."""

    @staticmethod
    def operation_host_success(state, host, op_hash, retry_count=0):
        if _run(state).last_op.get(host.name) == op_hash:
            _done(state, host)

    @staticmethod
    def operation_host_error(state, host, op_hash, retry_count=0, max_retries=0):
        if not state.get_op_data_for_host(host, op_hash).global_arguments.get("_ignore_errors"):
            _done(state, host)


def _done(state, target) -> None:
    _run(state).done.add(target.name)
    give_back(state, target)


def _track(state, run: _Run) -> None:
    """From the lock's operation on: each host's last operation, and the callbacks that
    give the lock back after it."""
    run.last_op = {h.name: h.op_hash_order[-1] for h in state.inventory
                   if h in state.active_hosts and h.op_hash_order}
    state.add_callback_handler(_GiveBack())


def _take_before_changes(state, run: _Run, after: str) -> None:
    """Every host's operations after ``after`` take the lock (:func:`_take_all`, once for
    the run) before their first command, and fail the host where the run could not."""
    for target in state.inventory:
        if target not in state.active_hosts:
            continue
        order = target.op_hash_order
        for op_hash in order[order.index(after) + 1:] if after in order else order:
            data = state.get_op_data_for_host(target, op_hash)
            data.command_generator = _guarded(state, run, target, data.command_generator)


def _guarded(state, run: _Run, target, commands):
    def guarded():
        produced = commands()
        for command in produced:
            if target.name not in run.taken:
                once("operator lock taken", functools.partial(_take_all, state, run), state)
                if target.name not in run.taken:
                    produced.close()
                    yield _not_taken(run, target)
                    return
            yield command

    return guarded


def _not_taken(run: _Run, target):
    return remote.fail(run.failure or f"operator lock: could not take it on this host: "
                                      f"{run.errors.get(target.name, 'no answer')}")


# --- the operation --------------------------------------------------------------------------


def held(**op_args):
    """An operation, the deploy's first: from here the run's first change takes the operator
    lock on every host of the run, or every host fails at its first change, before any.
    ``--dry`` only reads it. The run plans on each host's first read: another run that held
    the lock then (and may have ended since) stops every host here, since what that run
    changed may be missing from the plan."""
    if _cli("dry"):
        _warn_if_held()
    else:
        _note_if_held()
    return _held(name="operator lock: one deploy at a time", **op_args)


snapshot.expect_first(texts=[OPERATOR_LOCK])  # --dry reads it: with every host's first read, not after


def _held_by_another() -> Holder | None:
    """Another run, as this host's first read found the lock (None: free, or this run's)."""
    found = Holder.of(_record(snapshot.text(OPERATOR_LOCK)))
    return found if found is not None and found.run != _run(host.state).mine.run else None


def _note_if_held() -> None:
    found = _held_by_another()
    if found is None:
        return
    if still_runs(found) is False:  # a dead run of this controller changed nothing since: taken over
        _run(host.state).read_dead.add(host.name)
    else:
        _run(host.state).read_held[host.name] = found


def _warn_if_held() -> None:
    found = _held_by_another()
    if found is not None:
        logger.warning(f"{host.print_prefix}operator lock: held by {found.describe(time.time())}: a deploy now "
                       f"would stop before changing anything (wait for it, or if it no longer runs: "
                       f"{unlock_command()})")


def _record(text: str | None) -> Any:
    """A lock file's record: None when empty (free), {"run": "?"} when it is no record."""
    try:
        found = json.loads(text) if text and text.strip() else None
    except ValueError:
        return {"run": "?"}
    return found if found is None or isinstance(found, dict) else {"run": "?"}


@operation(is_idempotent=False)
def _held():
    state = host.state
    if not state.is_executing:  # planning: nothing is taken (--dry never takes it)
        host.noop("taken on every host before the run's first change")
        return
    run = _run(state)

    def armed() -> None:
        _track(state, run)
        if run.read_held or run.read_dead:  # stops every host, or takes a dead run's lock over, now
            _take_all(state, run)
        else:
            _take_before_changes(state, run, after=host.executing_op_hash)

    once("operator lock armed", armed, state)  # by the first host to get here, for every host
    if host.name in run.taken:
        host.noop(f"this run holds the operator lock (run {run.mine.run})")
    elif run.failure or host.name in run.errors:
        yield _not_taken(run, host)
    else:
        host.noop("nothing changed yet: taken on every host before the run's first change")
