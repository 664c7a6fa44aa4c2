#!/usr/bin/env python3
"""Download one Hugging Face repository into the HF cache, resumably, and mark it complete.

Runs inside the serving image (its huggingface_hub, ``HF_HOME=/hf``). The token, when
needed, arrives as ``HF_TOKEN`` in the environment, never on the command line. An
interrupted download resumes from the partial files on the next run; the completion
marker is written only after every file of the snapshot is in place, so its presence
is what "cached" means to the deploy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def marker_path(hf_home: str, repo_id: str, revision: str) -> Path:
    name = repo_id.replace("/", "--") + "@" + revision.replace("/", "%2F")
    return Path(hf_home) / "sparkfleet" / "complete" / name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo_id")
    parser.add_argument("--revision", default="main")
    parser.add_argument("--allow", action="append", default=None, help="only files matching these globs")
    args = parser.parse_args(argv)

    from huggingface_hub import snapshot_download

    hf_home = os.environ.get("HF_HOME", "/hf")
    started = time.monotonic()
    print(f"fetching {args.repo_id}@{args.revision} from {os.environ.get('HF_ENDPOINT', 'the hub')}", flush=True)
    path = snapshot_download(
        repo_id=args.repo_id,
        revision=args.revision,
        allow_patterns=args.allow,
        max_workers=4,
    )
    commit = Path(path).name
    marker = marker_path(hf_home, args.repo_id, args.revision)
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(commit + "\n")
    os.replace(tmp, marker)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    print(f"complete: {args.repo_id}@{commit} ({size / 2**30:.2f} GiB) in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
