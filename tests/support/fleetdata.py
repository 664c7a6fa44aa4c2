"""Inventories without a fleet: the project's defaults and hosts that look like pyinfra's."""

from __future__ import annotations

import runpy
import socket
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
