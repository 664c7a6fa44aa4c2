"""``make test``: the whole suite as four pytest runs side by side, each with its own fleet.

The end-to-end tests spend much of their time waiting on simulated hosts (engines loading,
units restarting, READY polls): with three shards the two cores were idle 46% of the
time. So four fleets of four testbed instances (``SPARKFLEET_TESTBED_INSTANCE`` N to N+3)
share two cores. Shards 1 to 3 run the
modules listed in ``SHARDS``; the last shard runs every other test, so a new test file is
never left out. Each shard keeps pytest's order of files: within a shard the modules that
boot a fleet of their own still run after those on the session's fleet.

    python tests/shards.py [pytest arguments, given to every shard]

Each shard's output streams live, every line prefixed with its number. At the end the
failures and reruns of every shard are listed again, so the last lines of a long log say
what failed and what passed only the second time (tests/e2e/conftest.py: one rerun);
the exit status is non-zero when any shard failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The modules of shards 1 to 3; the last shard runs every other test. Balanced by what
#: each shard took in ``make test`` (two cores, four shards side by side): in CI on
#: 2026-12-05 26.7 / 28.4 / 28.9 / 31.0 min, so host_tasks (~1.6 min, the session's fleet)
#: and the int8 lm-head kernels' test (~1 min, no fleet) moved from the rest to shard 1;
#: then here 32.4 / 31.6 / 31.2 / 34.3 (a slower day), so the real vLLM check (~1.7 min, no
#: fleet) moves from the rest to shard 3. With the tests' own looks at a host by nsenter
#: instead of SSH and sudo (sparkfleet/testbed/fleet.py), 23.7 / 22.5 / 24.9 / 26.0.
#: Shard 1: deploy, endpoint_rollout, host_tasks, image_patches; 2: endpoint,
#: endpoint_monitor, faults, fleet_checks, serving_host; 3: dgx_os_login, fleet_lock,
#: mirror_fleet, pair_*; the rest: the tests without a fleet, operator_lock,
#: rollout_faults, stack_upgrade, wedge. A module on the session's fleet must sort before a
#: shard's modules that boot their own (fleet_lock, mirror_fleet, pair_*, serving_host):
#: those replace the session's fleet.
SHARDS = (
    ("tests/e2e/test_deploy.py", "tests/e2e/test_endpoint_rollout.py", "tests/e2e/test_host_tasks.py",
     "tests/e2e/test_image_patches.py", "tests/runtime/test_int8_lmhead.py"),
    ("tests/e2e/test_endpoint.py", "tests/e2e/test_endpoint_monitor.py", "tests/e2e/test_faults.py",
     "tests/e2e/test_fleet_checks.py", "tests/e2e/test_serving_host.py"),
    ("tests/e2e/test_dgx_os_login.py", "tests/e2e/test_fleet_lock.py", "tests/e2e/test_mirror_fleet.py",
     "tests/e2e/test_pair_link.py", "tests/e2e/test_pair_serving.py", "tests/runtime/test_serve_check_real_vllm.py"),
)


def commands(extra: list[str]) -> list[list[str]]:
    listed = [path for shard in SHARDS for path in shard]
    missing = [path for path in listed if not (REPO / path).is_file()]
    if missing:
        raise SystemExit(f"tests/shards.py: SHARDS names {', '.join(missing)}, which do not exist")
    twice = sorted({path for path in listed if listed.count(path) > 1})
    if twice:
        raise SystemExit(f"tests/shards.py: SHARDS names {', '.join(twice)} in more than one shard")
    pytest = [sys.executable, "-m", "pytest", "-raR", "--durations=25", *extra]
    # sorted: pytest's own order of the files of one directory.
    return [*([*pytest, *sorted(shard)] for shard in SHARDS),
            [*pytest, "tests", *(f"--ignore={path}" for path in listed)]]


def instances() -> list[int]:
    base = int(os.environ.get("SPARKFLEET_TESTBED_INSTANCE", "0") or 0)
    last = 9 - len(SHARDS)  # sparkfleet/testbed/paths.py: instances 0..9
    if not 0 <= base <= last:
        raise SystemExit(f"SPARKFLEET_TESTBED_INSTANCE={base}: the {len(SHARDS) + 1} shards use it and the "
                         f"{len(SHARDS)} after it, so 0..{last}")
    return [base + i for i in range(len(SHARDS) + 1)]


def _stream(number: int, proc: subprocess.Popen, lock: threading.Lock, ended: dict[int, float],
            failures: list[str]) -> None:
    assert proc.stdout is not None
    reruns = False  # in the rerun summary, which also names each rerun's final outcome
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[{number}] {line}")
            sys.stdout.flush()
        if line.startswith("=") and "summary info" in line:
            reruns = "rerun test summary" in line
        # The summaries: one line a rerun, a failure; "tests/" keeps a captured log line out
        if line.startswith("RERUN tests/") or (not reruns and line.startswith(("FAILED tests/", "ERROR tests/"))):
            failures.append(f"[{number}] {line.rstrip()}")
    ended[number] = time.monotonic()  # its output closes as it exits


def main(extra: list[str]) -> int:
    lock = threading.Lock()
    started = time.monotonic()
    runs = []
    ended: dict[int, float] = {}
    failures: list[str] = []
    for number, (command, instance) in enumerate(zip(commands(extra), instances()), 1):
        env = {**os.environ, "SPARKFLEET_TESTBED_INSTANCE": str(instance), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, bufsize=1)
        reader = threading.Thread(target=_stream, args=(number, proc, lock, ended, failures), daemon=True)
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
        print(f"shard {number} (testbed instance {instance}): {'passed' if codes[number] == 0 else 'FAILED'} "
              f"in {(ended[number] - started) / 60:.1f} min")
    print(f"all {len(runs)} shards done in {minutes:.1f} min")
    for line in sorted(failures):  # threads append as lines arrive: sort by shard
        print(line)
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
