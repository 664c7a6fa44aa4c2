"""Inventories without a fleet: the project's defaults and hosts that look like pyinfra's."""

from __future__ import annotations

import runpy
import socket
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def defaults() -> dict:
    """group_data/all.py of this project."""
    data = runpy.run_path(str(ROOT / "group_data" / "all.py"))
    return {k: v for k, v in data.items() if not k.startswith("__")}


def fleet(*hosts: tuple[str, dict], groups: dict[str, list[str]] | None = None):
    """Hosts (name, data over the defaults) with the attributes validation reads."""
    out = []
    for name, data in hosts:
        merged = {**defaults(), **data}
        out.append(SimpleNamespace(name=name, groups=[g for g, members in (groups or {}).items() if name in members],
                                   data=SimpleNamespace(dict=lambda m=merged: m, get=merged.get)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fake_state(names: list, data: dict | None = None, **groups: list[str]):
    """A real pyinfra State of ``@fake/...`` hosts over the project's defaults (and ``data``),
    connected and current (``ctx_state``) while in use: inventory groups as keyword arguments,
    e.g. ``pair_a=["@fake/spark-1", "@fake/spark-2"]``."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all
    from pyinfra.context import ctx_state

    shared = {**defaults(), "fake_delay": 0, "fake_delay_jitter": 0, **(data or {})}
    inventory = Inventory((list(names), shared), **{group: (members, {}) for group, members in groups.items()})
    state = State(inventory, Config())
    with ctx_state.use(state):
        connect_all(state)
        yield state
