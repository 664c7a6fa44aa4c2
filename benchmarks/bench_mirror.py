#!/usr/bin/env python3
"""The mirror on the simulated fleet: what crosses the "WAN", and how long it takes.

    python3 benchmarks/bench_mirror.py [--hosts 4] [--repeat 1]     # as root

For each scenario it boots a fresh simulated fleet (nothing cached on any host), runs the
real deploy (``pyinfra -y <testbed inventory> deploy.py``) and measures:

* bytes the testbed's hub served (its ``/_testbed/stats``) / the profile's artifact size
  (the files of the repositories the default profile fetches, at their pinned revisions);
* blob bytes the testbed's registry served for the serving image (its access log) / the
  image's blob size;
* the wall time of the download steps, as the deploy's own report measures it (first
  download operation started -> last one ended, all hosts: the mirror's setup and the
  image copy, the image pulls, the weight downloads), and of the whole deploy.

Scenarios: N hosts with the mirror (the default, fleet_mirror=auto), N hosts
downloading directly (fleet_mirror=none), and 1 host with the mirror. With
``--wan 100mbit`` the testbed's upstream (hub, registry) reaches the hosts through a
limited link while the hosts' LAN stays fast, as for a real fleet; without it upstream is
as fast as the LAN and the 2-core machine's CPU is what the hosts share. The fleet it
leaves up is the last one booted (`sparkfleet testbed down` removes it). It replaces any
fleet that is up (SPARKFLEET_TESTBED_INSTANCE=N picks another, independent testbed).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOAL = 1.5  # download steps, N hosts / 1 host
STEP = re.compile(r"download steps took ([\d.]+) s: (.*)")


def hub(tb, method: str, path: str) -> dict:
    import requests

    session = requests.Session()
    session.trust_env = False
    response = session.request(method, f"{tb.hub_url}/_testbed/{path}", timeout=10)
    response.raise_for_status()
    return response.json()


def artifact_bytes(tb) -> tuple[int, list[str]]:
    """Bytes of the repositories the default profile fetches, at the pinned revisions."""
    import runpy

    from sparkfleet.config import validate_host_data
    from sparkfleet.testbed.hubservice import REPOS_DIR

    defaults = {k: v for k, v in runpy.run_path(str(REPO / "group_data" / "all.py")).items() if not k.startswith("__")}
    settings = validate_host_data("bench", {**defaults, **tb.data})
    total = 0
    for repo in settings.repos_to_fetch:
        root = REPOS_DIR / repo / settings.revision(repo)
        total += sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return total, settings.repos_to_fetch


def scenario(hosts: int, mirror: bool, wan: str | None) -> dict:
    from sparkfleet.testbed import fleet, paths

    tb = fleet.up(hosts)
    tb.set_wan_rate(wan)
    size, repos = artifact_bytes(tb)
    hub(tb, "POST", "reset")
    mark = tb.registry_mark()
    cmd = [sys.executable, "-m", "pyinfra", "-y", str(paths.INVENTORY.relative_to(REPO)), "deploy.py"]
    if not mirror:
        cmd += ["--data", "fleet_mirror=none"]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - started
    out = done.stdout + done.stderr
    if done.returncode != 0:
        print(out[-4000:], file=sys.stderr)
        raise SystemExit(f"the deploy failed on {hosts} host(s), mirror={mirror}")
    steps = STEP.search(out)
    if not steps:
        print(out[-3000:], file=sys.stderr)
        raise SystemExit("the deploy printed no download report")
    parts = dict((name.strip(), float(s)) for name, s in re.findall(r"([a-z ]+) ([\d.]+) s", steps.group(2)))
    registry = tb.registry_stats(mark)
    return {
        "hosts": hosts, "mirror": mirror, "repos": repos, "artifact_bytes": size,
        "hub_bytes": hub(tb, "GET", "stats")["total"],
        "image_bytes": tb.image["blob_bytes"],
        "registry_bytes": registry["by_repo"].get("sparkfleet/vllm-sim", 0),
        "download_s": float(steps.group(1)), "steps": parts, "deploy_s": wall,
    }


def median_run(runs: list[dict]) -> dict:
    best = sorted(runs, key=lambda r: r["download_s"])[len(runs) // 2]
    return {**best, "download_s": statistics.median(r["download_s"] for r in runs),
            "deploy_s": statistics.median(r["deploy_s"] for r in runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4, help="fleet size to compare with 1 host (default 4)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per scenario; medians are printed")
    ap.add_argument("--wan", metavar="RATE", help="model the internet link: limit hub/registry -> hosts to "
                    "RATE (tc syntax, e.g. 100mbit); the LAN between hosts stays unlimited. Default: none "
                    "(upstream is as fast as the LAN)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the simulated fleet needs network namespaces and systemd-nspawn")
    n = args.hosts
    plan = [(n, True), (n, False), (1, True)]
    results: dict[tuple[int, bool], list[dict]] = {key: [] for key in plan}
    for _ in range(args.repeat):
        for key in plan:
            print(f"... {key[0]} host(s), {'mirror' if key[1] else 'direct'}", file=sys.stderr, flush=True)
            results[key].append(scenario(*key, args.wan))
    rows = {key: median_run(runs) for key, runs in results.items()}
    first = rows[plan[0]]
    print(f"sparkfleet mirror, simulated fleet ({os.cpu_count()} CPU cores), "
          f"medians of {args.repeat} run(s) per scenario; internet link: "
          + (f"{args.wan} (hub/registry -> hosts; LAN unlimited)" if args.wan else "unlimited (as fast as the LAN)"))
    print(f"artifacts of the default profile: {', '.join(first['repos'])} = {first['artifact_bytes']:,} B; "
          f"serving image: {first['image_bytes']:,} B of layers\n")
    print(f"{'scenario':<30} {'hosts':>5} {'hub B / artifacts':>18} {'registry B / image':>19} "
          f"{'download s':>15} {'deploy s':>9}")
    for key in plan:
        r = rows[key]
        label = "mirror (fleet_mirror)" if r["mirror"] else "direct (fleet_mirror=none)"
        print(f"{label:<30} {r['hosts']:>5} {r['hub_bytes'] / r['artifact_bytes']:>17.2f}x "
              f"{r['registry_bytes'] / r['image_bytes']:>18.2f}x {r['download_s']:>15.1f} {r['deploy_s']:>9.1f}")
    many, one = rows[(n, True)], rows[(1, True)]
    ratio = many["download_s"] / one["download_s"]
    print(f"\ndownload steps, {n} hosts / 1 host (mirror): {ratio:.2f}x "
          f"(goal <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'})")
    for step in ("mirror", "image", "weights"):
        a, b = many["steps"].get(step), one["steps"].get(step)
        if a is not None and b is not None:
            print(f"  {step:<13} {a:6.1f} s on {n} hosts, {b:6.1f} s on 1 host")
    print(f"upstream hub bytes, {n} hosts: {rows[(n, True)]['hub_bytes']:,} B with the mirror, "
          f"{rows[(n, False)]['hub_bytes']:,} B direct "
          f"({rows[(n, False)]['hub_bytes'] / max(1, rows[(n, True)]['hub_bytes']):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
