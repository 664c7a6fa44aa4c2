#!/usr/bin/env python3
"""The serving container's entry point: patch the installed vLLM, then exec ``vllm serve``.

Run as ``python3 /host/serve.py`` with serve.env in the environment and secrets.env
mounted read-only at ``SECRETS_FILE`` (so the API key is in no ``docker inspect``)
(docs/architecture.md). Steps:

1. build the argv from the environment (``serve_args.build_serve_argv``) - before any
   patching, so a bad serve.env fails fast and touches nothing;
2. run each patch named in ``SF_PATCHES``, in order, as its own program with this
   interpreter, and log its outcome (applied / already present / skipped: not needed /
   cannot apply). A patch that cannot apply stops the start with exit 1, except the
   tolerated ones (``fla_shmem``);
3. print the final command (argv only: the API key stays in ``VLLM_API_KEY``) and
   ``os.execvp`` it, so vLLM becomes the container's main process and gets its signals.

``python3 /host/serve.py --check`` runs step 2 without writing anything (each patch with
``--check``), then asks the image's vLLM whether it accepts step 1's argv
(vllm_cli.py); it needs serve.env and no GPU, and prints one JSON document: the vLLM
found, per patch its verdict (``would-apply``, ``already-present``, ``not-needed``,
``cannot-apply``), the file, the reason and, for ``cannot-apply``, the fix; and under
``args`` whether vLLM accepts the command, else what it said and the serve.env variable
that brought the word it refused - or, with ``checked: false``, why vLLM could not be
asked (a vLLM that cannot build its command line without a GPU: a warning, not a
refusal). It exits 1 when a required patch cannot apply or vLLM refuses the command:
the deploy runs it inside the image before it installs or restarts the unit
(sparkfleet/patchcheck.py).

Nothing depends on the current directory: paths are relative to this file.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

try:  # imported as the package runtime (controller, tests)
    from . import serve_args, vllm_cli
    from .patches import _patchlib as pl
except ImportError:  # run as /host/serve.py: this directory is sys.path[0]
    import serve_args
    import vllm_cli
    from patches import _patchlib as pl

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE / "patches"

PATCH_TIMEOUT_S = 300
#: The host's root-only secrets.env, mounted read-only: read here, handed to vLLM in its
#: environment only, never in the container's configuration.
SECRETS_FILE = "/run/sparkfleet/secrets.env"
# Environment whose values must never show up in argv or the printed command.
SECRET_ENV = ("VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")

_LABELS = {
    pl.APPLIED: "applied",
    pl.WOULD_APPLY: "would apply",
    pl.ALREADY: "already present",
    pl.NOT_NEEDED: "skipped (not needed)",
    pl.FAILED: "CANNOT APPLY",
}


def log(msg: str, to_stderr: bool = False) -> None:
    # --check keeps stdout for its one JSON document.
    print(f"sparkfleet-serve: {msg}", file=sys.stderr if to_stderr else sys.stdout, flush=True)


def run_patch(name: str, env: Mapping[str, str], check: bool = False) -> dict:
    """Run one patch program; its status object. Anything off-protocol cannot apply."""
    program = PATCH_DIR / f"{name}.py"

    def cannot(detail: str) -> dict:
        return {"name": name, "outcome": pl.FAILED, "file": None, "vllm": None, "detail": detail}

    if not program.is_file():
        return cannot(f"patch program {program} is missing")
    try:
        proc = subprocess.run(
            [sys.executable, str(program), *(["--check"] if check else [])],
            env=dict(env),
            cwd=str(HERE),
            capture_output=True,
            text=True,
            timeout=PATCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return cannot(f"timed out after {PATCH_TIMEOUT_S}s")
    status = None
    for line in proc.stdout.splitlines():
        if line.startswith(pl.STATUS_PREFIX):
            status = line
        else:
            log(f"  [{name}] {line}", check)
    for line in proc.stderr.splitlines():
        log(f"  [{name}] {line}", check)
    if status is None:
        return cannot(f"exit {proc.returncode} without a status line")
    parsed = pl.parse_status_line(status)
    if parsed is None or parsed["name"] != name:
        return cannot(f"unreadable status line {status!r}")
    if (proc.returncode == 0) != (parsed["outcome"] != pl.FAILED):
        return cannot(f"exit {proc.returncode} contradicts status {parsed['outcome']!r}: {parsed['detail']}")
    return parsed


def apply_patches(names: list[str], env: Mapping[str, str]) -> bool:
    """Apply in order; False when a required patch cannot apply (already logged)."""
    for name in names:
        status = run_patch(name, env)
        log(f"patch {name}: {_LABELS[status['outcome']]}: {status['detail']}")
        if status["outcome"] == pl.FAILED:
            if name in serve_args.TOLERATED_PATCHES:
                log(f"patch {name}: failure tolerated, serving without it")
                continue
            log(f"patch {name} is required for this profile; not starting vLLM")
            return False
    return True


def fix_for(name: str, names: list[str]) -> str:
    """What to do about a patch that cannot apply to this image's vLLM."""
    rest = ",".join(n for n in names if n != name)
    return (
        f"pin another image whose vLLM has {name}'s anchors (or already carries the fix), "
        f"or drop {name} from the patch plan (SF_PATCHES={rest})"
    )


def check_patches(names: list[str], env: Mapping[str, str]) -> dict:
    """The patch plan's verdicts, nothing written: the document ``--check`` prints."""
    found: dict = {"root": None, "version": None}
    try:
        vllm = pl.locate_vllm(None)
        found = {"root": str(vllm.root), "version": vllm.version}
    except pl.PatchFailed as exc:
        found["error"] = str(exc)
    verdicts = []
    for name in names:
        status = run_patch(name, env, check=True)
        verdict = {
            "name": name,
            "verdict": status["outcome"],
            "required": name not in serve_args.TOLERATED_PATCHES,
            "file": status["file"],
            "detail": status["detail"],
        }
        if status["outcome"] == pl.FAILED:
            verdict["fix"] = fix_for(name, names)
        verdicts.append(verdict)
    return {
        "vllm": found,
        "patches": verdicts,
        "ok": not any(v["verdict"] == pl.FAILED and v["required"] for v in verdicts),
    }


def check_main(env: dict[str, str]) -> int:
    # vLLM logs to stdout as it imports: keep stdout for the one JSON document.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        parts = serve_args.argv_parts(env)
        patches = serve_args.patches_for(env)
    except serve_args.ServeEnvError as exc:
        print(json.dumps({"error": f"invalid serve.env: {exc}", "ok": False}), file=out)
        return 2
    report = check_patches(patches, env)
    # The same command the start will exec, asked of the image's vLLM (vllm_cli.py).
    try:
        args = vllm_cli.check(parts)
    except Exception as exc:  # noqa: BLE001 - a verdict naming the crash, never a bare traceback
        args = {"ok": False, "var": None, "detail": f"the argument check crashed: {type(exc).__name__}: {exc}"}
    if not args.get("checked", True):
        log(f"warning: serving command {args['detail']}", to_stderr=True)
    report["args"] = {**args, "argv": [w for _, words in parts for w in words]}
    report["ok"] = report["ok"] and report["args"]["ok"]
    report["nccl"] = vllm_cli.image_nccl()  # a pair's cross-node CUDA graph floor (patchcheck.py)
    print(json.dumps(report, indent=2, sort_keys=True), file=out)
    out.flush()
    return 0 if report["ok"] else 1


def read_secrets(path: str = SECRETS_FILE) -> dict[str, str]:
    """KEY=VALUE lines of the mounted secrets file (none when it is not mounted)."""
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = {**os.environ, **read_secrets()}
    if argv == ["--check"]:
        return check_main(env)
    if argv:
        log(f"usage: serve.py [--check] (unknown arguments: {' '.join(argv)})")
        return 2
    # The patched vLLM finds runtime/int8_lmhead.py here (the /host mount by default),
    # and imports --middleware (key_guard) from here.
    env.setdefault("SPARKFLEET_RUNTIME_DIR", str(HERE))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    try:
        command = serve_args.build_serve_argv(env)
        patches = serve_args.patches_for(env)
    except serve_args.ServeEnvError as exc:
        log(f"invalid serve.env: {exc}")
        return 2
    leaked = [k for k in SECRET_ENV if env.get(k) and any(env[k] in a for a in command)]
    if leaked:
        log(f"refusing to start: the value of {', '.join(leaked)} appears in the command line")
        return 2

    log(f"profile {env.get('SF_PROFILE') or '(unset)'}; patches: {', '.join(patches) or 'none'}")
    if not apply_patches(patches, env):
        return 1
    log(f"exec: {shlex.join(command)}")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        log(f"cannot exec {command[0]!r}: {exc}")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
