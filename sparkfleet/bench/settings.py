"""The checks' view of the validated settings (sparkfleet.config.Settings)."""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .onhost.schema import CHECK_NAMES

RUNNERS = ("docker", "host")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

def parse_check_names(value: str | Sequence[str] | None) -> list[str]:
    """``"smoke,decode"`` (what ``--data checks=...`` gives) or a list; validated, in order."""
    if value is None or value is False:
        return []
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",") if n.strip()]
    else:
        names = [str(n).strip() for n in value if str(n).strip()]
    unknown = [n for n in names if n not in CHECK_NAMES]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {', '.join(CHECK_NAMES)}")
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class BenchSettings:
    port: int
    served_model_name: str
    bind_address: str
    checks: list[str]
    bench: list[str]
    bench_runs: int
    bench_warmup: int
    bench_max_tokens: int
    agent_state_db: str | None
    agent_sessions: int
    agent_max_context_tokens: int
    run_id: str | None
    results_dir: str
    bench_prompt: str | None
    agent_max_tokens: int
    bench_timeout_s: int
    bench_runner: str
    bench_dir: str

    @property
    def base_url(self) -> str:
        """Where the bench on the host reaches its own server.

        A wildcard bind (0.0.0.0 / ::) or loopback is reached on 127.0.0.1; a server bound
        to one address only answers there.
        """
        address = ipaddress.ip_address(self.bind_address)
        if address.is_unspecified or address.is_loopback:
            return f"http://127.0.0.1:{self.port}"
        host = f"[{address}]" if address.version == 6 else str(address)
        return f"http://{host}:{self.port}"


def bench_settings(data: Any) -> BenchSettings:
    """The checks' view of a host's validated settings.

    ``data`` is a validated ``Settings`` (what deploy files pass, from ``fleet_settings()``)
    or a plain mapping, validated here over the project defaults of group_data/all.py.
    """
    from sparkfleet.config import Settings, project_defaults, validate_host_data

    if not isinstance(data, Settings):
        data = validate_host_data("checks", {**project_defaults(), **dict(data)})
    return BenchSettings(**{name: getattr(data, name) for name in BenchSettings.__dataclass_fields__})


_PROCESS_RUN_ID: str | None = None


def run_id_for(settings: BenchSettings) -> str:
    """``--data run_id=...``, else one timestamp chosen once per pyinfra process, so every
    host of a run writes into the same ``results/<run-id>/``."""
    global _PROCESS_RUN_ID
    if settings.run_id:
        return settings.run_id
    if _PROCESS_RUN_ID is None:
        _PROCESS_RUN_ID = time.strftime("%Y%m%d-%H%M%S")
    return _PROCESS_RUN_ID
