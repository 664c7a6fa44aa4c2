"""Inventories without a fleet: the project's defaults and hosts that look like pyinfra's."""

from __future__ import annotations

import hashlib
import runpy
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

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

    with tempfile.TemporaryDirectory() as tmp, mock.patch("sparkfleet.upstream.Upstream", StubUpstream):
        # The fleet lock: a file of its own, and an upstream that answers without a network.
        shared = {**defaults(), "fake_delay": 0, "fake_delay_jitter": 0, "fleet_lock_file": f"{tmp}/sparkfleet.lock",
                  **(data or {})}
        inventory = Inventory((list(names), shared), **{group: (members, {}) for group, members in groups.items()})
        state = State(inventory, Config())
        with ctx_state.use(state):
            connect_all(state)
            yield state


class StubUpstream:
    """sparkfleet.upstream.Upstream without a network: a commit and a digest made from the
    reference, 1 GiB each."""

    def model(self, endpoint: str, repo: str, revision: str, token: str | None) -> tuple[str, int]:
        return revision if len(revision) == 40 else hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest(), 1 << 30

    def image(self, registry_url: str, reference: str) -> tuple[str, int]:
        digest = reference.partition("@")[2]
        return digest or "sha256:" + hashlib.sha256(reference.encode()).hexdigest(), 1 << 30


def host_answering(**found: dict):
    """A host's ``get_fact`` for the snapshot's read: each item asked answered from
    ``found`` (e.g. ``files={path: [0o644, "root:root", sha]}``, ``texts={path: text}``),
    anything else as missing."""
    import json

    from sparkfleet import snapshot

    def get_fact(cls, want):
        asked = json.loads(want)
        return {k: {name: found.get(k, {}).get(name) for name in asked[k]} for k in snapshot._KINDS} | {"cpus": 2}

    return get_fact
