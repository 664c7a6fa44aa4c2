"""Command line of the on-host bench: run the asked checks, write one result file.

Exit status: 0 all checks passed, 1 a check failed (the result file says which and why),
2 no result file could be written (bad arguments). The controller reads the file for 0
and 1, and reports the program's last stderr lines for anything else.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile
import traceback
from typing import List, Optional

from .checks import CHECKS, BenchContext
from .client import BenchError, Client
from .progress import Progress

SCHEMA = "sparkfleet.bench/1"
API_KEY_VAR = "VLLM_API_KEY"


def read_api_key(secrets_file: Optional[str]) -> Optional[str]:
    """The key from the environment (docker exec into the serving container) or secrets.env."""
    key = os.environ.get(API_KEY_VAR)
    if key:
        return key
    if secrets_file and os.path.exists(secrets_file):
        with open(secrets_file, encoding="utf-8") as handle:
            for line in handle:
                name, sep, value = line.strip().partition("=")
                # docker --env-file semantics: no quote processing, value verbatim.
                if sep and name.strip() == API_KEY_VAR:
                    return value.strip() or None
    return None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: str, data: dict) -> None:
    """Whole file or nothing: the controller may fetch it while a re-run writes."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".result-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="sparkfleet-bench", description=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="qwen", help="served model name")
    ap.add_argument("--checks", default="smoke", help="comma list of: " + ",".join(CHECKS))
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--run-id", default="")
    ap.add_argument("--host", default="", help="host name recorded in the result")
    ap.add_argument("--secrets-file", default="/etc/sparkfleet/secrets.env")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt", default=None, help="a user prompt added to the decode bank")
    ap.add_argument("--state-db", default=None)
    ap.add_argument("--agent-sessions", type=int, default=10)
    ap.add_argument("--agent-max-context-tokens", type=int, default=16384)
    ap.add_argument("--agent-max-tokens", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    ap.add_argument("--heartbeat", type=float, default=15.0, help="progress line interval, seconds")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        ap.error(f"unknown or no checks {unknown or names}; known: {', '.join(CHECKS)}")
    if args.runs < 1 or args.warmup < 0 or args.max_tokens < 2:
        ap.error("need --runs >= 1, --warmup >= 0, --max-tokens >= 2")
    args.check_names = names
    return args


def run(args: argparse.Namespace) -> dict:
    """Run the checks; always returns a result (status failed + reason on any failure)."""
    progress = Progress(quiet=args.quiet, every_s=args.heartbeat)
    result: dict = {
        "schema": SCHEMA,
        "run_id": args.run_id,
        "host": args.host,
        "status": "ok",
        "reason": None,
        "started_at": _now(),
        "checks": {},
        "settings": {
            "checks": args.check_names, "runs": args.runs, "warmup": args.warmup,
            "max_tokens": args.max_tokens, "user_prompt": bool(args.prompt),
            "agent_sessions": args.agent_sessions,
            "agent_max_context_tokens": args.agent_max_context_tokens,
            "agent_max_tokens": args.agent_max_tokens,
        },
    }
    client = Client(args.base_url, args.model, read_api_key(args.secrets_file), args.timeout)
    result["server"] = {"base_url": client.base_url, "model": args.model, "api_key": bool(client.api_key)}
    progress.log(f"checks {','.join(args.check_names)} against {client.base_url} (model {args.model})")
    try:
        served = client.served_models()
        result["server"]["served_models"] = served
        if args.model not in served:
            raise BenchError(f"the server does not serve {args.model!r} (it serves {served})")
        try:
            result["server"]["version"] = client.get_json("/version").get("version")
        except (BenchError, ValueError, AttributeError):
            pass  # /version is vLLM's, not the OpenAI API's: nice to have
    except BenchError as exc:
        result.update(status="failed", reason=str(exc), finished_at=_now())
        progress.log(f"FAILED: {exc}")
        return result

    ctx = BenchContext(
        client=client, progress=progress, runs=args.runs, warmup=args.warmup,
        max_tokens=args.max_tokens, user_prompt=args.prompt, state_db=args.state_db,
        agent_sessions=args.agent_sessions, agent_max_context_tokens=args.agent_max_context_tokens,
        agent_max_tokens=args.agent_max_tokens,
    )
    for name in args.check_names:
        smoke = result["checks"].get("smoke")
        if name != "smoke" and smoke and smoke["status"] != "ok":
            # A server that answers wrong is not worth timing.
            result["checks"][name] = {"status": "skipped", "reason": "smoke check failed"}
            continue
        try:
            outcome = CHECKS[name](ctx)
        except BenchError as exc:
            outcome = {"status": "failed", "reason": str(exc)}
        except Exception as exc:  # a bug here must not cost the host its result file
            traceback.print_exc()
            outcome = {"status": "failed", "reason": f"internal error: {type(exc).__name__}: {exc}"}
        if outcome["status"] == "failed":
            progress.log(f"{name}: FAILED: {outcome.get('reason')}")
        result["checks"][name] = outcome
    failed = [(n, c) for n, c in result["checks"].items() if c["status"] == "failed"]
    if failed:
        result["status"] = "failed"
        result["reason"] = "; ".join(f"{n}: {c.get('reason')}" for n, c in failed)
    result["finished_at"] = _now()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    result = run(args)
    try:
        write_json_atomic(args.out, result)
    except OSError as exc:
        print(f"cannot write the result file {args.out}: {exc}", file=sys.stderr, flush=True)
        return 2
    summary = {n: c["status"] for n, c in result["checks"].items()}
    print(f"bench result {result['status']}: {json.dumps(summary)} -> {args.out}", flush=True)
    return 0 if result["status"] == "ok" else 1
