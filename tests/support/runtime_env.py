"""Helpers for tests of runtime/: profile serve.env fixtures and the runtime import path."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME_DIR = REPO / "runtime"
PATCH_DIR = RUNTIME_DIR / "patches"
ENV_DIR = REPO / "tests" / "runtime" / "envs"
PROFILES = ("dense", "dflash", "base", "mtp")


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a docker ``--env-file``: ``KEY=VALUE`` per line, ``#`` comments, no quoting
    (docker passes the rest of the line verbatim, JSON included)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line!r}"
        env[key.strip()] = value
    return env


def profile_env(profile: str) -> dict[str, str]:
    return read_env_file(ENV_DIR / f"{profile}.env")


def import_serve_args():
    """runtime/ is not a package (it is mounted as /host); import serve_args by path."""
    if str(RUNTIME_DIR) not in sys.path:
        sys.path.insert(0, str(RUNTIME_DIR))
    import serve_args

    return serve_args
