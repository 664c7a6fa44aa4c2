"""A rolling change under load, on a 3-host simulated fleet behind the fleet endpoint.

    sudo .venv/bin/python benchmarks/bench_rollout.py [--reuse] [--data KEY=VALUE ...]
    sudo .venv/bin/python benchmarks/bench_rollout.py --section throughput

Section ``rollout`` (the default, with ``throughput`` after it under ``--section all``):
boots (or with ``--reuse`` reuses) the fleet, deploys profile dense with the endpoint on
spark-1, and runs concurrent streaming chats through the endpoint with the real ``openai``
client (no retries: every failure counts) for the whole time, while it

1. switches the profile dense -> dflash with a rolling deploy,
2. kills spark-3's engine (``docker kill``: systemd starts it again after RestartSec),
3. deploys settings the engine refuses at start (a max model length beyond the model's,
   which the command-line check cannot know): the rollout stops at
   its first host, rolls it back, and every host must still serve the old settings.

It prints, per phase, requests sent, failed (with their status or error), p50/p99 latency,
per-host share (the endpoint's own counters) and the time each host was out of rotation
(sampled every 0.25 s at the endpoint's exporter). Last line:
``failed requests: N; failed after kill: M`` — N over the rolling switch and the failed
rollout, M over requests started after the killed host left the rotation.

Section ``throughput``: aggregate tok/s (completion tokens from the stream's usage) and
per-host share through the endpoint, 1 host in rotation at concurrency 3 against 3 hosts at
concurrency 9; the target is a ratio >= 2.7.

Traffic goes only to the testbed's addresses; every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparkfleet.testbed import fleet, login, paths  # noqa: E402
from sparkfleet.testbed.traffic import Endpoint, Load, Request, Watch  # noqa: E402

ROUTER = "spark-1"  # testbed names; the inventory's are what the fleet's --names make them
ROUTER_NAME = login.inventory_name(ROUTER, login.DEFAULT_NAMES)
VICTIM = "spark-3"


@dataclass
class Phase:
    name: str
    start: float
    end: float = 0.0
    counters_before: dict[str, float] = field(default_factory=dict)
    counters_after: dict[str, float] = field(default_factory=dict)
    note: str = ""


def deploy(data: list[str], *extra: str) -> tuple[int, str]:
    cmd = ["pyinfra", "-y", str(paths.INVENTORY), "deploy.py", "--data", f"fleet_endpoint={ROUTER_NAME}"]
    for item in [*data, *extra]:
        cmd += ["--data", item]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout + done.stderr


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def report(phase: Phase, requests: list[Request], watch: Watch | None) -> list[Request]:
    # A request counts where it ended: one cut by the kill ends in the kill's phase.
    mine = [r for r in requests if phase.start <= r.end < phase.end]
    failed = [r for r in mine if r.error]
    latencies = [r.end - r.start for r in mine if not r.error]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1
    delta = {n: phase.counters_after.get(n, 0) - phase.counters_before.get(n, 0) for n in phase.counters_after}
    total = sum(delta.values()) or 1
    share = ", ".join(f"{n} {100 * v / total:.0f}%" for n, v in sorted(delta.items()))
    print(f"== {phase.name} ({phase.end - phase.start:.0f} s){': ' + phase.note if phase.note else ''}")
    print(f"   requests sent {len(mine)}, failed {len(failed)}"
          + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(errors.items()))})" if errors else ""))
    for r in failed[:10]:
        print(f"   failed: started {r.start - phase.start:+.1f} s, ended {r.end - phase.start:+.1f} s: {r.error}")
    print(f"   latency p50 {percentile(latencies, 0.5):.2f} s, p99 {percentile(latencies, 0.99):.2f} s")
    print(f"   per-host share: {share}")
    if watch is not None:
        out = watch.out_of_rotation(phase.start, phase.end)
        print("   out of rotation: " + ", ".join(f"{n} {s:.1f} s" for n, s in sorted(out.items())))
    return failed


def fleet_for(reuse: bool):
    if reuse:
        st = fleet.status()
        if st and len(st["hosts"]) >= 3 and all(h["pid"] and h["ssh"] for h in st["hosts"]):
            return fleet.load()
    return fleet.up(3)


def section_rollout(tb, ep: Endpoint, data: list[str], workers: int, max_tokens: int) -> tuple[int, str]:
    """Returns the exit status and the summary line (printed last)."""
    rc, out = deploy(data, "profile=dense")
    if rc != 0:
        print(out[-4000:])
        raise SystemExit("the dense deploy failed")
    phases: list[Phase] = []

    def begin(name: str) -> Phase:
        phase = Phase(name, time.monotonic(), counters_before=ep.counters())
        phases.append(phase)
        return phase

    def end(phase: Phase) -> None:
        phase.end = time.monotonic()
        phase.counters_after = ep.counters()

    with Watch(ep) as watch, Load(ep, workers, max_tokens) as load:
        time.sleep(5)  # steady state first
        phase = begin("rolling switch dense -> dflash")
        rc, out = deploy(data, "profile=dflash")
        end(phase)
        phase.note = f"deploy exit {rc}"
        if rc != 0:
            print(out[-4000:])
        switch = phase

        phase = begin(f"kill {VICTIM}'s engine")
        killed_at = time.monotonic()
        tb.exec(VICTIM, "docker kill --signal KILL sparkfleet-serve", check=True)
        left = watch.wait(lambda s: s.get(VICTIM) not in (None, "UP"), 30)
        back = watch.wait(lambda s: s.get(VICTIM) == "UP" and left is not None, 120)
        time.sleep(5)
        end(phase)
        phase.note = (f"out of rotation {left - killed_at:.1f} s after the kill" if left else "never left rotation")
        phase.note += f", back after {back - killed_at:.1f} s" if back else ", not back within 120 s"
        kill = phase

        phase = begin("rollout of settings the engine refuses at start (--max-model-len 300000)")
        rc, out = deploy(data, "profile=dflash", 'extra_serve_args=["--max-model-len", "300000"]',
                         "ready_timeout_s=60")
        time.sleep(3)
        end(phase)
        stopped = re.search(r"rollout stopped at (spark-\d)(?:\.local)?, step (READY|gate|back in rotation)", out)
        serving_old = all(
            "SF_EXTRA_ARGS=\n" in tb.exec(n, "cat /etc/sparkfleet/serve.env").stdout
            and "SF_PROFILE=dflash" in tb.exec(n, "cat /etc/sparkfleet/serve.env").stdout for n in tb.names)
        states = ep.states()
        phase.note = (f"deploy exit {rc}; " + (f"stopped at {stopped.group(1)} ({stopped.group(2)})" if stopped
                                               else "did not stop") +
                      f"; every host serves the old settings: {serving_old}; endpoint {states}")
        refused = phase

    requests = load.requests
    failed_switch = report(switch, requests, watch)
    failed_kill = report(kill, requests, watch)
    failed_refused = report(refused, requests, watch)
    after = [r for r in failed_kill if left is not None and r.start >= left]
    in_flight = [r for r in requests if r.start < killed_at < r.end]
    print(f"   kill: {len(in_flight)} request(s) in flight fleet-wide at the kill, {len(failed_kill)} failed "
          f"({len([r for r in failed_kill if r.start < killed_at])} of them in flight at the kill), "
          f"{len(after)} started after {VICTIM} left the rotation")
    ok = rc != 0 and stopped is not None and serving_old
    if not ok:
        print("   the refused rollout did not end with every host on the old settings")
    print(f"requests sent: {len(requests)}")
    summary = f"failed requests: {len(failed_switch) + len(failed_refused)}; failed after kill: {len(after)}"
    return (0 if ok and not failed_switch and not failed_refused and not after else 1), summary


def section_throughput(tb, ep: Endpoint, data: list[str], seconds: float, max_tokens: int) -> int:
    others = [n for n in tb.names if n != ROUTER]

    def measure(workers: int) -> tuple[float, str]:
        before = ep.counters()
        with Load(ep, workers, max_tokens, prompt="Write a long story about a lighthouse keeper.") as load:
            time.sleep(seconds)
        done = [r for r in load.requests if not r.error]
        failed = len(load.requests) - len(done)
        wall = max(r.end for r in done) - min(r.start for r in done)
        after = ep.counters()
        delta = {n: after.get(n, 0) - before.get(n, 0) for n in after}
        total = sum(delta.values()) or 1
        share = ", ".join(f"{n} {100 * v / total:.0f}%" for n, v in sorted(delta.items()))
        return sum(r.tokens for r in done) / wall, f"{len(done)} requests ({failed} failed), share {share}"

    for n in others:
        ep.set_state(n, "maint")
    try:
        one, info_one = measure(3)
    finally:
        for n in others:
            ep.set_state(n, "ready")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(s != "UP" for s in ep.states().values()):
        time.sleep(0.5)
    three, info_three = measure(9)
    ratio = three / one
    print(f"== fleet throughput through the endpoint ({seconds:.0f} s each, max_tokens {max_tokens})")
    print(f"   1 host, concurrency 3: {one:.1f} tok/s aggregate; {info_one}")
    print(f"   3 hosts, concurrency 9: {three:.1f} tok/s aggregate; {info_three}")
    print(f"   ratio {ratio:.2f}x (target >= 2.7x)")
    return 0 if ratio >= 2.7 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reuse", action="store_true", help="use this instance's fleet when it is up")
    parser.add_argument("--data", action="append", default=[], help="KEY=VALUE for every deploy")
    parser.add_argument("--section", choices=["rollout", "throughput", "all"], default="rollout")
    parser.add_argument("--workers", type=int, default=6, help="concurrent streams of the rollout load")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=30, help="length of each throughput measurement")
    args = parser.parse_args()
    tb = fleet_for(args.reuse)
    ep = Endpoint(tb, ROUTER, tb.api_key_file)
    rc, summary = 0, None
    if args.section in ("rollout", "all"):
        rc, summary = section_rollout(tb, ep, args.data, args.workers, args.max_tokens)
    if args.section in ("throughput", "all"):
        if args.section == "throughput":
            done, out = deploy(args.data)
            if done != 0:
                print(out[-4000:])
                raise SystemExit("the deploy failed")
        rc |= section_throughput(tb, ep, args.data, args.seconds, 256)
    if summary:
        print(summary)
    return rc


if __name__ == "__main__":
    sys.exit(main())
