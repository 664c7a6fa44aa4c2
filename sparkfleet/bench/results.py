"""Result files on the controller: ``<results_dir>/<run-id>/<host>.json``.

A host file is whatever the on-host bench wrote (``onhost/schema.py``), plus
what only the controller knows (``host``, ``collected_at``). A host that could not
produce one — unreachable, failed before its checks, bench crashed — gets a file too,
with ``status: failed`` and the reason, so the report shows it as failed, not missing.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from .onhost.schema import SCHEMA, failed_result

REPORT_STEM = "fleet-report"


def safe_host_name(name: str) -> str:
    """A host name as a file name (``user@10.0.0.5:22`` -> ``user_10.0.0.5_22``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "host"


def run_dir(results_dir: str, run_id: str) -> Path:
    return Path(results_dir) / run_id


def result_path(directory: Path, host_name: str) -> Path:
    return directory / f"{safe_host_name(host_name)}.json"


def write_json(path: Path, data: dict) -> None:
    """Atomic: a report built while hosts still finish never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_run(directory: Path) -> dict[str, dict]:
    """host name -> result, for every host file of a run (report files are skipped)."""
    out: dict[str, dict] = {}
    for path in sorted(Path(directory).glob("*.json")):
        if path.name.startswith(".") or path.stem == REPORT_STEM:
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            out[path.stem] = failed_result(path.stem, directory.name, f"unreadable result file {path.name}: {exc}")
            continue
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            continue
        out[str(data.get("host") or path.stem)] = data
    return out
