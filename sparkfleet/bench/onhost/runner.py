"""Command line of the on-host bench: ``--settings JSON`` (schema.ProgramSettings), one
result file.

Exit status: 0 all checks passed, 1 a check failed (the result file says which and why),
2 no result file could be written (bad settings). The controller reads the file for 0
and 1, and reports the program's last stderr lines for anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

from .checks import CHECKS, BenchContext
from .client import BenchError, Client
from .progress import Progress
from .schema import ProgramSettings, new_result, now_iso

API_KEY_VAR = "VLLM_API_KEY"


def read_api_key(secrets_file: str | None) -> str | None:
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


def parse_args(argv: list[str] | None) -> ProgramSettings:
    ap = argparse.ArgumentParser(prog="sparkfleet-bench", description=__doc__)
    ap.add_argument("--settings", required=True, help="the settings document (JSON)")
    raw = ap.parse_args(argv).settings
    try:
        return ProgramSettings.from_json(raw)
    except ValueError as exc:
        ap.error(str(exc))
        raise  # not reached: ap.error exits 2


def run(s: ProgramSettings) -> dict:
    """Run the checks; always returns a result (status failed + reason on any failure)."""
    progress = Progress(quiet=s.quiet, every_s=s.heartbeat_s)
    result = new_result(s.host, s.run_id)
    result["settings"] = {
        "checks": s.checks, "runs": s.runs, "warmup": s.warmup, "max_tokens": s.max_tokens,
        "user_prompt": bool(s.prompt), "agent_sessions": s.agent_sessions,
        "agent_max_context_tokens": s.agent_max_context_tokens, "agent_max_tokens": s.agent_max_tokens,
    }
    client = Client(s.base_url, s.model, read_api_key(s.secrets_file), s.timeout_s)
    result["server"] = {"base_url": client.base_url, "model": s.model, "api_key": bool(client.api_key)}
    progress.log(f"checks {','.join(s.checks)} against {client.base_url} (model {s.model})")
    try:
        served = client.served_models()
        result["server"]["served_models"] = served
        if s.model not in served:
            raise BenchError(f"the server does not serve {s.model!r} (it serves {served})")
        try:
            result["server"]["version"] = client.get_json("/version").get("version")
        except (BenchError, ValueError, AttributeError):
            pass  # /version is vLLM's, not the OpenAI API's: nice to have
    except BenchError as exc:
        result.update(status="failed", reason=str(exc), finished_at=now_iso())
        progress.log(f"FAILED: {exc}")
        return result

    ctx = BenchContext(client=client, progress=progress, settings=s)
    for name in s.checks:
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
    result["finished_at"] = now_iso()
    return result


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    result = run(settings)
    try:
        write_json_atomic(settings.out, result)
    except OSError as exc:
        print(f"cannot write the result file {settings.out}: {exc}", file=sys.stderr, flush=True)
        return 2
    summary = {n: c["status"] for n, c in result["checks"].items()}
    print(f"bench result {result['status']}: {json.dumps(summary)} -> {settings.out}", flush=True)
    return 0 if result["status"] == "ok" else 1
