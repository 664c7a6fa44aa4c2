"""The one per-run store: what a pyinfra run computes once, for every host that asks.

pyinfra plans every host in its own greenlet, so a store that is checked before and
filled after a lookup that yields would run that lookup once per host (N x (N-1)
commands on the mirror at N hosts, past sshd's MaxSessions 10 at 16 hosts). Here the
first host to ask computes while the others wait for its answer. It knows nothing of
the fleet: one host's modules (the snapshot) keep their per-run answers here too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import gevent.lock

T = TypeVar("T")


class _Run:
    def __init__(self) -> None:
        self.answers: dict[Any, tuple[bool, Any]] = {}
        self.locks: dict[Any, gevent.lock.Semaphore] = {}


#: One store per pyinfra State, gone with it (a State's id may be reused; the State may not).
_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def current_state():
    from pyinfra.context import ctx_state

    return ctx_state.get()  # the State itself, not pyinfra's proxy of it


def once(key: Any, compute: Callable[[], T], state=None) -> T:
    """``compute()``'s answer for ``key``, computed once per run: the first host to ask
    computes it while every other host's greenlet waits for that answer (or that error)."""
    from pyinfra.context import ContextObject

    if state is None or isinstance(state, ContextObject):  # pyinfra's proxy: the State behind it
        state = current_state()
    run = _RUNS.setdefault(state, _Run())
    if key not in run.answers:
        with run.locks.setdefault(key, gevent.lock.Semaphore()):
            if key not in run.answers:
                try:
                    run.answers[key] = (True, compute())
                except Exception as exc:
                    run.answers[key] = (False, exc)
    ok, answer = run.answers[key]
    if not ok:
        raise answer
    return answer
