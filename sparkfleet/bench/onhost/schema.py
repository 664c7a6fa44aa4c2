"""The two documents between the controller and the on-host program, defined once.

* **settings** (controller -> host): one JSON document, the program's only argument
  (``python3 -m <pkg> --settings JSON``). Every key is required and none has a default
  here: the defaults live in ``group_data/all.py`` alone, and the controller fills the
  document from the validated host settings (``sparkfleet.bench.deploy``).
* **result** (host -> controller): the file the program writes, schema ``SCHEMA``; the
  controller writes the same shape for a host that could not produce one.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass, fields

SCHEMA = "sparkfleet.bench/1"
CHECK_NAMES = ("smoke", "tools", "decode", "e2e", "agent")


@dataclass(frozen=True)
class ProgramSettings:
    base_url: str  # where the host's own server answers
    model: str  # served model name
    checks: list[str]
    out: str  # result JSON path on the host
    run_id: str
    host: str  # host name recorded in the result
    secrets_file: str  # VLLM_API_KEY=... (read, never printed)
    runs: int  # measured runs per decode workload
    warmup: int  # discarded runs per decode workload (and agent)
    max_tokens: int  # tokens per decode run
    prompt: str | None  # a user prompt added to the decode bank
    state_db: str | None  # the agent bench's state.db snapshot on the host
    agent_sessions: int
    agent_max_context_tokens: int
    agent_max_tokens: int
    timeout_s: float  # per request
    heartbeat_s: float  # progress line interval
    quiet: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ProgramSettings":
        """Parse and check the document; ValueError names every bad key."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"settings are not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("settings must be a JSON object")
        names = {f.name: f for f in fields(cls)}
        problems = [f"missing key {k!r}" for k in names if k not in data]
        problems += [f"unknown key {k!r}" for k in data if k not in names]
        for key, value in data.items():
            f = names.get(key)
            if f is None:
                continue
            kind = str(f.type)
            optional = kind.startswith("Optional")
            if value is None and optional:
                continue
            ok = {
                "str": isinstance(value, str), "Optional[str]": isinstance(value, str),
                "int": isinstance(value, int) and not isinstance(value, bool),
                "float": isinstance(value, (int, float)) and not isinstance(value, bool),
                "bool": isinstance(value, bool),
                "List[str]": isinstance(value, list) and all(isinstance(v, str) for v in value),
            }.get(kind, True)
            if not ok:
                problems.append(f"{key!r} must be {kind}, got {value!r}")
        if problems:
            raise ValueError("bad settings: " + "; ".join(problems))
        settings = cls(**data)
        unknown = [n for n in settings.checks if n not in CHECK_NAMES]
        if unknown or not settings.checks:
            raise ValueError(f"unknown or no checks {unknown or settings.checks}; known: {', '.join(CHECK_NAMES)}")
        if settings.runs < 1 or settings.warmup < 0 or settings.max_tokens < 2:
            raise ValueError("need runs >= 1, warmup >= 0, max_tokens >= 2")
        return settings


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_result(host: str, run_id: str) -> dict:
    """A result before any check ran: status ok until one fails."""
    return {"schema": SCHEMA, "run_id": run_id, "host": host, "status": "ok", "reason": None,
            "started_at": now_iso(), "checks": {}}


def failed_result(host: str, run_id: str, reason: str, checks: list[str] | None = None) -> dict:
    """The result of a host whose checks could not run (no per-check entries)."""
    return {**new_result(host, run_id), "status": "failed", "reason": reason,
            "requested_checks": list(checks or []), "started_at": None, "finished_at": now_iso()}
