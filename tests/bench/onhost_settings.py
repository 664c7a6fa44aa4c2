"""The on-host program's settings document for tests, filled the way the controller
fills it (defaults from group_data/all.py), with per-test overrides."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from sparkfleet.bench.deploy import program_settings
from sparkfleet.bench.onhost.schema import ProgramSettings
from sparkfleet.bench.settings import bench_settings


def settings(base_url: str = "http://127.0.0.1:9", **over: Any) -> ProgramSettings:
    s = program_settings(bench_settings({}), ["smoke"], "r1", "h", "/nonexistent/result.json", None,
                         "/nonexistent/secrets.env")
    return replace(s, **{"base_url": base_url, "quiet": True, **over})
