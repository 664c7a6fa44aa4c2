"""The one place the checks read host data.

Key names and defaults match ``group_data/all.py`` / ``sparkfleet.config.Settings``
where those define them; the defaults here only matter when a deploy file runs without
the project's group data (tests, a foreign inventory). The keys marked *(checks only)*
are not in ``Settings`` yet.
"""

from __future__ import annotations

import ipaddress
import re
import time
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Union

CHECK_NAMES = ("smoke", "decode", "e2e", "agent")
RUNNERS = ("docker", "host")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

DEFAULTS: Mapping[str, Any] = {
    "port": 8000,
    "served_model_name": "qwen",
    "bind_address": "0.0.0.0",
    "checks": [],  # what deploy.py runs after a deploy
    "bench": ["smoke", "decode", "e2e"],  # what checks/bench.py runs
    "bench_runs": 3,
    "bench_warmup": 1,
    "bench_max_tokens": 256,
    "agent_state_db": None,
    "agent_sessions": 10,
    "agent_max_context_tokens": 16384,
    "run_id": None,
    "results_dir": "results",
    # (checks only) a user prompt added to the decode bank as workload "user"
    "bench_prompt": None,
    # (checks only) tokens per regenerated agent turn (the seeds' hermes_bench: 200)
    "agent_max_tokens": 200,
    # (checks only) per-request timeout of the on-host bench, seconds
    "bench_timeout_s": 600,
    # (checks only) "docker": run in the serving image (python3 + prometheus_client);
    # "host": the host's own python3 (needs prometheus_client), for hosts without the image
    "bench_runner": "docker",
    # (checks only) host directory for the bench program, the state.db snapshot and results
    "bench_dir": "/var/lib/sparkfleet/bench",
}


def parse_check_names(value: Union[str, Sequence[str], None]) -> List[str]:
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
    checks: List[str]
    bench: List[str]
    bench_runs: int
    bench_warmup: int
    bench_max_tokens: int
    agent_state_db: Optional[str]
    agent_sessions: int
    agent_max_context_tokens: int
    run_id: Optional[str]
    results_dir: str
    bench_prompt: Optional[str]
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
    """Read the checks' settings from ``host.data`` (anything with ``.get``)."""
    values = {key: data.get(key, default) for key, default in DEFAULTS.items()}
    values["checks"] = parse_check_names(values["checks"])
    values["bench"] = parse_check_names(values["bench"])
    for key in ("port", "bench_runs", "bench_warmup", "bench_max_tokens", "agent_sessions",
                "agent_max_context_tokens", "agent_max_tokens", "bench_timeout_s"):
        values[key] = int(values[key])
    if values["bench_runner"] not in RUNNERS:
        raise ValueError(f"bench_runner={values['bench_runner']!r}; use one of {', '.join(RUNNERS)}")
    if values["run_id"] is not None:
        values["run_id"] = str(values["run_id"])
        if not _RUN_ID.match(values["run_id"]):
            raise ValueError(f"run_id={values['run_id']!r}: use letters, digits and ._- (it names a directory)")
    if not str(values["bench_dir"]).startswith("/"):
        raise ValueError(f"bench_dir={values['bench_dir']!r} must be an absolute path on the host")
    return BenchSettings(**values)


_PROCESS_RUN_ID: Optional[str] = None


def run_id_for(settings: BenchSettings) -> str:
    """``--data run_id=...``, else one timestamp chosen once per pyinfra process, so every
    host of a run writes into the same ``results/<run-id>/``."""
    global _PROCESS_RUN_ID
    if settings.run_id:
        return settings.run_id
    if _PROCESS_RUN_ID is None:
        _PROCESS_RUN_ID = time.strftime("%Y%m%d-%H%M%S")
    return _PROCESS_RUN_ID
