"""`sparkfleet unlock <inventory>`: remove the operator lock a deploy that died left behind.

A deploy holds the fleet's operator lock on every host while it changes it
(:mod:`sparkfleet.oplock`) and gives it back as it ends. A controller that was killed
(kill -9, a closed laptop, a lost link) gives nothing back, and every later deploy stops
at the lock, naming it. This shows who holds it on each host and since when, and whether
that pyinfra still runs (known only on the controller that took it), then removes exactly
the locks it showed: one a new deploy took meanwhile stays. A holder that still runs on
this controller is left alone unless --force. ``--show`` only shows.

Exit status 0 when no host is locked any more (``--show``: when every host answered); 1
when a lock stays (a host unreachable, a holder that still runs).
"""

from __future__ import annotations

import argparse
from typing import Any

import gevent

from sparkfleet import oplock
from sparkfleet.status import opened


def _show(target) -> dict[str, Any]:
    try:
        return oplock.ask(target, "show", {})
    except Exception as exc:  # noqa: BLE001 - a host that cannot answer is a row to show
        return {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}


def _give(target, run: str) -> dict[str, Any]:
    try:
        return oplock.give(target, run)
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}


def unlock(state, show_only: bool = False, force: bool = False) -> tuple[list[str], bool, bool]:
    """The report's lines, whether every host is free at the end, and whether every host answered."""
    hosts = list(state.inventory)
    live = [h for h in hosts if h in state.active_hosts]
    jobs = {h.name: gevent.spawn(_show, h) for h in live}
    gevent.joinall(list(jobs.values()))
    lines: dict[str, str] = {}
    free = answered = True
    removals = {}
    for h in hosts:
        answer = jobs[h.name].value if h.name in jobs else {"error": "unreachable"}
        if "error" in answer:
            lines[h.name] = f"{h.name}: {answer['error']}: its lock, if any, stays (a reboot of the host frees it)"
            free = answered = False
            continue
        holder = oplock.Holder.of(answer["held"])
        if holder is None:
            lines[h.name] = f"{h.name}: free"
            continue
        runs = oplock.still_runs(holder)
        lines[h.name] = f"{h.name}: held by {holder.describe(answer['now'])}, " + (
            "which still runs on this controller" if runs else
            "which no longer runs on this controller (a deploy from here takes it over)" if runs is False else
            "taken on another controller (whether it still runs is known only there)")
        if show_only or (runs and not force):
            if not show_only:
                lines[h.name] += ": kept (let it end, or stop it; --force removes it anyway)"
            free = False
            continue
        removals[h.name] = gevent.spawn(_give, h, holder.run)  # exactly the run shown
    gevent.joinall(list(removals.values()))
    for name, job in removals.items():
        answer = job.value
        if "error" in answer:
            lines[name] += f": could not remove it: {answer['error']}"
            free = False
        elif answer.get("done"):
            lines[name] += ": removed"
        else:  # another run took it between the look and the removal
            now = oplock.Holder.of(answer["held"])
            lines[name] += f": not removed, a new deploy holds it now: {now.describe(answer['now']) if now else 'free'}"
            free = free and now is None
    return list(lines.values()), free, answered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparkfleet unlock", description=__doc__.split("\n\n")[0])
    parser.add_argument("inventory", help="the pyinfra inventory the deploy ran with, e.g. inventory/sparks.py")
    parser.add_argument("--show", action="store_true", help="show who holds the lock on each host, remove nothing")
    parser.add_argument("--force", action="store_true",
                        help="remove it even where its pyinfra still runs on this controller")
    args = parser.parse_args(argv)
    state, _ = opened("sparkfleet unlock", args.inventory)
    lines, free, answered = unlock(state, show_only=args.show, force=args.force)
    print("\n".join(lines))
    return 0 if (answered if args.show else free) else 1
