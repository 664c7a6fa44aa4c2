#!/usr/bin/env python3
"""Collecting a bench on N simulated hosts vs 1: hosts run in parallel, so ~the same time.

    sparkfleet testbed up --hosts 3
    pyinfra -y inventory/testbed.py deploy.py          # every host READY
    python3 benchmarks/bench_fleet_collect.py [--bench decode] [--repeat 2]

Runs ``pyinfra -y inventory/testbed.py checks/bench.py`` on one host (``--limit``) and on
every host of the simulated fleet, alternately, and prints the wall time of each
(connect, upload, bench in the serving image, fetch, report: everything a user waits
for) with the ratio N hosts / 1 host. Target: at most 1.3.

It uses the fleet that is up; it changes nothing on the hosts but the bench directory
(``/var/lib/sparkfleet/bench``) and leaves its results in ``results/collect-*``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOSTS_FILE = REPO / ".testbed" / "hosts.json"
TARGET = 1.3


def collect(hosts: list, limit: str | None, bench: str, runs: int, max_tokens: int, tag: str) -> dict:
    run_id = f"collect-{tag}-{dt.datetime.now().strftime('%H%M%S')}"
    cmd = [
        sys.executable, "-m", "pyinfra", "-y", "inventory/testbed.py", "checks/bench.py",
        "--data", f"bench={bench}", "--data", f"bench_runs={runs}", "--data", "bench_warmup=1",
        "--data", f"bench_max_tokens={max_tokens}", "--data", f"run_id={run_id}",
    ]
    if limit:
        cmd += ["--limit", limit]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    run_dir = REPO / "results" / run_id
    results = {}
    for host in hosts if not limit else [limit]:
        path = run_dir / f"{host}.json"
        results[host] = json.loads(path.read_text()) if path.exists() else {"status": "missing"}
    bad = {h: r.get("reason") or r["status"] for h, r in results.items() if r.get("status") != "ok"}
    if proc.returncode != 0 or bad:
        print(proc.stdout[-3000:] + proc.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"{run_id}: pyinfra exited {proc.returncode}; failed hosts: {bad}")

    def on_host_s(r: dict) -> float:
        start = dt.datetime.fromisoformat(r["started_at"])
        end = dt.datetime.fromisoformat(r["finished_at"])
        return (end - start).total_seconds()

    return {"run_id": run_id, "wall_s": wall, "hosts": len(results),
            "on_host_s": max(on_host_s(r) for r in results.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="decode", help="checks to collect (default decode)")
    ap.add_argument("--runs", type=int, default=2, help="measured runs per workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2, help="alternating 1-host / N-host rounds")
    args = ap.parse_args()
    if not HOSTS_FILE.exists():
        raise SystemExit(f"{HOSTS_FILE} is missing: `sparkfleet testbed up --hosts 3` and deploy first")
    # By inventory name: what --limit matches and the results are named by.
    hosts = [h.get("inventory_name", h["name"]) for h in json.loads(HOSTS_FILE.read_text())["hosts"]]
    if len(hosts) < 2:
        raise SystemExit("the simulated fleet has one host: `sparkfleet testbed up --hosts 3`")
    print(f"fleet: {len(hosts)} hosts ({', '.join(hosts)}); bench={args.bench}, {args.runs} runs x "
          f"{args.max_tokens} tokens + 1 warm-up per workload\n")
    print(f"{'round':>5}  {'hosts':>5}  {'wall s':>8}  {'on-host bench s':>15}  run")
    one, many = [], []
    for i in range(1, args.repeat + 1):
        for limit, bucket in ((hosts[0], one), (None, many)):
            r = collect(hosts, limit, args.bench, args.runs, args.max_tokens, "1" if limit else str(len(hosts)))
            bucket.append(r)
            print(f"{i:>5}  {r['hosts']:>5}  {r['wall_s']:8.2f}  {r['on_host_s']:15.2f}  {r['run_id']}")
    t1 = statistics.median(r["wall_s"] for r in one)
    tn = statistics.median(r["wall_s"] for r in many)
    ratio = tn / t1
    print(f"\nmedian wall: 1 host {t1:.2f} s, {len(hosts)} hosts {tn:.2f} s -> ratio {ratio:.3f} "
          f"(target <= {TARGET}) {'OK' if ratio <= TARGET else 'MISS'}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
