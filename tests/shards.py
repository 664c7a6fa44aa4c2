"""``make test``: the whole suite as two pytest runs side by side, each with its own fleet.

The end-to-end tests spend most of their time waiting on simulated hosts (engines loading,
units restarting, READY polls), not computing, so two fleets of two testbed instances
(``SPARKFLEET_TESTBED_INSTANCE`` N and N+1) roughly halve the wall time even on two cores.
Shard 1 runs the modules listed in ``SHARD_1``; shard 2 runs every other test, so a new
test file is never left out. Each shard keeps pytest's order of files: within a shard the
modules that boot a fleet of their own still run after those on the session's fleet.

    python tests/shards.py [pytest arguments, given to both shards]

Each shard's output streams live, every line prefixed with its number; the exit status is
non-zero when either shard failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The two longest modules on a session fleet, about as long as all the rest: 35 minutes
#: on two cores with both shards running (the rest: 23, plus 13 for the module fleets).
SHARD_1 = (
    "tests/e2e/test_deploy.py",
    "tests/e2e/test_faults.py",
)


def commands(extra: list[str]) -> list[list[str]]:
    missing = [path for path in SHARD_1 if not (REPO / path).is_file()]
    if missing:
        raise SystemExit(f"tests/shards.py: SHARD_1 names {', '.join(missing)}, which do not exist")
    pytest = [sys.executable, "-m", "pytest", "-ra", "--durations=15", *extra]
    return [[*pytest, *SHARD_1], [*pytest, "tests", *(f"--ignore={path}" for path in SHARD_1)]]


def instances() -> tuple[int, int]:
    base = int(os.environ.get("SPARKFLEET_TESTBED_INSTANCE", "0") or 0)
    if not 0 <= base <= 8:
        raise SystemExit(f"SPARKFLEET_TESTBED_INSTANCE={base}: the shards use it and the next one, so 0..8")
    return base, base + 1


def _stream(number: int, proc: subprocess.Popen, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[{number}] {line}")
            sys.stdout.flush()


def main(extra: list[str]) -> int:
    lock = threading.Lock()
    started = time.monotonic()
    runs = []
    for number, (command, instance) in enumerate(zip(commands(extra), instances()), 1):
        env = {**os.environ, "SPARKFLEET_TESTBED_INSTANCE": str(instance), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, bufsize=1)
        reader = threading.Thread(target=_stream, args=(number, proc, lock), daemon=True)
        reader.start()
        runs.append((number, instance, proc, reader))
    codes = {}
    try:
        for number, _, proc, reader in runs:
            codes[number] = proc.wait()
            reader.join()
    except KeyboardInterrupt:  # each pytest tears its fleet down on its own interrupt
        for _, _, proc, _ in runs:
            proc.wait()
        raise
    minutes = (time.monotonic() - started) / 60
    for number, instance, _, _ in runs:
        print(f"shard {number} (testbed instance {instance}): {'passed' if codes[number] == 0 else 'FAILED'}")
    print(f"both shards done in {minutes:.1f} min")
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
