#!/usr/bin/env python3
"""The reference recipe's table, reproduced by sparkfleet's own benches on the simulated fleet.

    sparkfleet testbed up --hosts 1          # or let this script boot one (--boot)
    python3 benchmarks/bench_seeds_table.py [--host spark-1] [--runs 2]

Deploys each profile on one simulated host (one booted fleet shared by all profiles:
``base``, ``dflash``, ``mtp``, ``dense``, and ``dense`` with speculation off), runs
``checks/bench.py`` there (the decode bank, albond's end-to-end method, the agent-turn
replay of a synthetic Hermes state.db), measures per-stream decode speed at 1/2/3
concurrent streams on ``dense``, and prints the published table beside the measured one
with each cell's error. The last line reads ``worst cell error: X%``.

The published numbers are ``sparkfleet/bench/reference.py`` (GB10, c=1, temperature 0).
Leaves the host deployed with the default profile and the results in
``results/seeds-<profile>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from sparkfleet.bench.reference import PUBLISHED  # noqa: E402
from sparkfleet.testbed import paths  # noqa: E402 - SPARKFLEET_TESTBED_INSTANCE picks the fleet

# (row label, deploy data, benches)
PROFILES: list[tuple[str, list[str], str]] = [
    ("base", ["profile=base"], "decode"),
    ("dflash", ["profile=dflash"], "decode,e2e,agent"),
    ("mtp", ["profile=mtp"], "decode,agent"),
    ("dense", ["profile=dense"], "e2e,agent"),
    ("dense-nospec", ["profile=dense", "num_speculative_tokens=0"], "decode"),
]
COLUMNS = ["decode/prose", "decode/code", "decode/counting", "agent", "e2e"]
TITLES = {"decode/prose": "prose", "decode/code": "code", "decode/counting": "counting",
          "agent": "agent turns", "e2e": "albond e2e"}
# The announcement's per-stream table (dense, decode-only tok/s at 1, 2, 3 streams).
CONCURRENCY = {"prose": (48.8, 38.4, 30.8), "code": (66.9, 55.3, 43.0)}


EXTRA_DATA: list[str] = []


def pyinfra(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pyinfra", "-y", str(paths.INVENTORY), *args,
           *[a for d in EXTRA_DATA for a in ("--data", d)]]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def must(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")


def state_db(directory: Path) -> Path:
    """A synthetic Hermes state.db: ten tool-calling sessions (tests/bench/hermesdb.py)."""
    from bench import hermesdb

    path = directory / "state.db"
    conn = hermesdb.create(path)
    for i in range(10):
        hermesdb.add_session(conn, f"s{i}", 1000.0 + i, hermesdb.agent_session(f"t{i}"))
    conn.close()
    return path


def measure(label: str, data: list[str], benches: str, host: str, db: Path, runs: int) -> dict[str, dict]:
    t0 = time.monotonic()
    must(pyinfra("deploy.py", "--limit", host, "--data", "checks=", *[a for d in data for a in ("--data", d)]),
         f"deploy {label}")
    run_id = f"seeds-{label}"
    proc = pyinfra("checks/bench.py", "--limit", host, "--data", f"bench={benches}",
                   "--data", f"agent_state_db={db}", "--data", f"run_id={run_id}",
                   "--data", f"bench_runs={runs}", "--data", "bench_warmup=1",
                   *[a for d in data for a in ("--data", d)])
    must(proc, f"benches on {label}")
    result = json.loads((REPO / "results" / run_id / f"{host}.json").read_text())
    checks = result["checks"]
    cells: dict[str, dict] = {}
    for name, w in (checks.get("decode") or {}).get("workloads", {}).items():
        cells[f"decode/{name}"] = {"tok_s": w["decode_tok_s"]["median"], "acc": _acc(w)}
    if "e2e" in checks:
        cells["e2e"] = {"tok_s": checks["e2e"]["tok_s"], "acc": _acc(checks["e2e"])}
    if "agent" in checks:
        cells["agent"] = {"tok_s": checks["agent"]["decode_tok_s"]["median"], "acc": _acc(checks["agent"])}
    print(f"  {label}: deployed and measured in {time.monotonic() - t0:.0f} s", flush=True)
    return cells


def _acc(check: dict) -> float | None:
    acc = check.get("acceptance")
    return acc["mean_length"] if acc else None


def concurrency(host_address: str, streams: int, prompt: str, tokens: int = 200) -> float:
    """Median per-stream decode-only tok/s with ``streams`` requests at once."""
    from sparkfleet.bench.onhost.client import Client
    from sparkfleet.bench.onhost.timing import record_rates

    key = (REPO / paths.API_KEY_FILE).read_text().strip()
    client = Client(f"http://{host_address}:8000", "qwen", key, 120)
    rates: list[float] = []

    def one() -> None:
        rec = client.stream_completion(prompt, tokens, ignore_eos=True, min_tokens=tokens)
        rates.append(record_rates(rec)["decode_tok_s"])

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(rates)[len(rates) // 2]


def fmt(value: float | None, acc: float | None = None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}" + (f" (acc {acc:.2f})" if acc else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="spark-1")
    ap.add_argument("--runs", type=int, default=2, help="measured runs per decode workload")
    ap.add_argument("--boot", action="store_true", help="boot a one-host fleet first")
    ap.add_argument("--data", action="append", default=[], metavar="KEY=VALUE",
                    help="more data for every deploy, e.g. gpu_memory_utilization=0.6 on a busy machine")
    args = ap.parse_args()
    EXTRA_DATA.extend(args.data)
    os.chdir(REPO)
    if args.boot:
        must(subprocess.run(["sparkfleet", "testbed", "up", "--hosts", "1"], cwd=REPO, capture_output=True,
                            text=True, timeout=1800), "testbed up")
    hosts = json.loads(paths.HOSTS_JSON.read_text())["hosts"]
    chosen = next(h for h in hosts if args.host in (h["name"], h.get("inventory_name")))
    address = chosen["address"]
    # By inventory name: what --limit matches and the results are named by.
    args.host = chosen.get("inventory_name", chosen["name"])
    print(f"simulated fleet: {args.host} ({address}); one profile at a time", flush=True)

    measured: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="sparkfleet-seeds-") as tmp:
        db = state_db(Path(tmp))
        for label, data, benches in PROFILES:
            measured[label] = measure(label, data, benches, args.host, db, args.runs)
            if label == "dense":
                per_stream = {name: [concurrency(address, n, prompt) for n in (1, 2, 3)]
                              for name, prompt in (("prose", "Write a long essay about the history of tea."),
                                                   ("code", "Write a Python function that sorts a list."))}
        must(pyinfra("deploy.py", "--limit", args.host, "--data", "checks="), "deploy the default profile again")

    errors: list[float] = []
    width = 26
    print("\nthe reference recipe's table (published) against the simulated fleet (measured), tok/s\n")
    print(f"{'profile':<14}" + "".join(f"{TITLES[c]:>{width}}" for c in COLUMNS) + f"{'no-spec base':>{width}}")
    for label in ("base", "dflash", "mtp", "dense"):
        pub_row, got_row, err_row = f"{label:<14}", f"{'  measured':<14}", f"{'  error':<14}"
        published = dict(PUBLISHED[label])
        got = dict(measured[label])
        nospec_label = "dense-nospec" if label == "dense" else "base" if label == "base" else None
        if nospec_label:
            published["nospec"] = PUBLISHED[nospec_label]["decode/prose"]
            got["nospec"] = measured[nospec_label]["decode/prose"]
        for col in COLUMNS + ["nospec"]:
            ref = published.get(col)
            cell = got.get(col)
            if ref is None:
                pub_row += f"{'—':>{width}}"
                got_row += f"{fmt(cell['tok_s'], cell['acc']) if cell else '—':>{width}}"
                err_row += f"{'':>{width}}"
                continue
            pub_row += f"{fmt(ref[0], ref[1]):>{width}}"
            got_row += f"{fmt(cell['tok_s'], cell['acc']):>{width}}"
            err = abs(cell["tok_s"] / ref[0] - 1.0) * 100
            errors.append(err)
            err_row += f"{err:>{width - 1}.1f}%"
        print(pub_row)
        print(got_row)
        print(err_row)
    print("\nper-stream decode tok/s at 1/2/3 streams (dense): ratio to one stream, announcement vs measured")
    for name, rates in per_stream.items():
        pub = CONCURRENCY[name]
        print(f"  {name:<8} published {pub[0]:.1f}/{pub[1]:.1f}/{pub[2]:.1f} -> "
              f"{pub[1] / pub[0]:.2f}/{pub[2] / pub[0]:.2f};  measured "
              f"{rates[0]:.1f}/{rates[1]:.1f}/{rates[2]:.1f} -> {rates[1] / rates[0]:.2f}/{rates[2] / rates[0]:.2f}")
    print(f"\nworst cell error: {max(errors):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
