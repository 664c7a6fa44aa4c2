#!/usr/bin/env python3
"""The serving container's entry point: patch the installed vLLM, then exec ``vllm serve``.

Run as ``python3 /host/serve.py`` with serve.env and secrets.env in the environment
(docs/architecture.md). Steps:

1. build the argv from the environment (``serve_args.build_serve_argv``) - before any
   patching, so a bad serve.env fails fast and touches nothing;
2. run each patch named in ``SF_PATCHES``, in order, as its own program with this
   interpreter, and log its outcome (applied / already present / skipped: not needed /
   failed). A failed patch stops the start with exit 1, except the tolerated ones
   (``fla_shmem``);
3. print the final command (argv only: the API key stays in ``VLLM_API_KEY``) and
   ``os.execvp`` it, so vLLM becomes the container's main process and gets its signals.

Nothing depends on the current directory: paths are relative to this file.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Mapping

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE / "patches"
sys.path[:0] = [str(HERE), str(PATCH_DIR)]

from _patchlib import STATUS_PREFIX, parse_status_line  # noqa: E402  (the patch protocol)
from serve_args import (  # noqa: E402
    TOLERATED_PATCHES,
    ServeEnvError,
    build_serve_argv,
    patches_for,
)

PATCH_TIMEOUT_S = 300
# Environment whose values must never show up in argv or the printed command.
SECRET_ENV = ("VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")

_LABELS = {
    "applied": "applied",
    "already-applied": "already present",
    "not-needed": "skipped (not needed)",
    "failed": "FAILED",
}


def log(msg: str) -> None:
    print(f"sparkfleet-serve: {msg}", flush=True)


def run_patch(name: str, env: Mapping[str, str]) -> tuple[str, str]:
    """Run one patch program; (outcome, detail). Anything off-protocol is a failure."""
    program = PATCH_DIR / f"{name}.py"
    if not program.is_file():
        return "failed", f"patch program {program} is missing"
    try:
        proc = subprocess.run(
            [sys.executable, str(program)],
            env=dict(env),
            cwd=str(HERE),
            capture_output=True,
            text=True,
            timeout=PATCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return "failed", f"timed out after {PATCH_TIMEOUT_S}s"
    status = None
    for line in proc.stdout.splitlines():
        if line.startswith(STATUS_PREFIX):
            status = line
        else:
            log(f"  [{name}] {line}")
    for line in proc.stderr.splitlines():
        log(f"  [{name}] {line}")
    if status is None:
        return "failed", f"exit {proc.returncode} without a status line"
    parsed = parse_status_line(status)
    if parsed is None or parsed[0] != name:
        return "failed", f"unreadable status line {status!r}"
    _, outcome, detail = parsed
    if (proc.returncode == 0) != (outcome != "failed"):
        return "failed", f"exit {proc.returncode} contradicts status {outcome!r}: {detail}"
    return outcome, detail


def apply_patches(names: list[str], env: Mapping[str, str]) -> bool:
    """Apply in order; False when a required patch failed (already logged)."""
    for name in names:
        outcome, detail = run_patch(name, env)
        log(f"patch {name}: {_LABELS.get(outcome, outcome)}: {detail}")
        if outcome == "failed":
            if name in TOLERATED_PATCHES:
                log(f"patch {name}: failure tolerated, serving without it")
                continue
            log(f"patch {name} is required for this profile; not starting vLLM")
            return False
    return True


def main() -> int:
    env = dict(os.environ)
    # The patched vLLM finds runtime/int8_lmhead.py here (the /host mount by default).
    env.setdefault("SPARKFLEET_RUNTIME_DIR", str(HERE))
    try:
        argv = build_serve_argv(env)
        patches = patches_for(env)
    except ServeEnvError as exc:
        log(f"invalid serve.env: {exc}")
        return 2
    leaked = [k for k in SECRET_ENV if env.get(k) and any(env[k] in a for a in argv)]
    if leaked:
        log(f"refusing to start: the value of {', '.join(leaked)} appears in the command line")
        return 2

    log(f"profile {env.get('SF_PROFILE') or '(unset)'}; patches: {', '.join(patches) or 'none'}")
    if not apply_patches(patches, env):
        return 1
    log(f"exec: {shlex.join(argv)}")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        log(f"cannot exec {argv[0]!r}: {exc}")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
