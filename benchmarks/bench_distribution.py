"""How a first deploy's image and weights reach a growing fleet (issue 25).

    sudo SPARKFLEET_TESTBED_INSTANCE=N .venv/bin/python benchmarks/bench_distribution.py \\
        [--sizes 1,2,4,8,16] [--bandwidth-scale 100] [--artifact-scale 300] [--pairs 0] \\
        [--out benchmarks/results/distribution-DATE.json] [--replace]

For each size it boots a fresh simulated fleet shaped like a real one (``fleet.up`` with
``bandwidth_scale``: WAN 1 Gb/s, 10 GbE NICs both ways, ConnectX-7 200 Gb/s, all divided
by one factor; ``artifact_scale``: the image and checkpoints padded to their real sizes
divided by another), runs one first deploy (``pyinfra -y inventory/testbed.py
deploy.py``), and tears the fleet down (also on an error or Ctrl-C).

Defaults: rates / 100 (WAN 10, LAN 100, ConnectX-7 2000 Mbit/s) and sizes / 300 (image
70 MB, dense's hosted hybrid and drafter 246 MB: one copy 316 MB): bytes run 3x as fast as
on a real fleet (one copy over a NIC ~27 s, a real 10 GbE ~81 s; over the WAN ~270 s),
while the steps that move no bytes take what the 2-core machine gives 16 hosts at once, so
those steps weigh 3x more against the bytes than on a real fleet (the CPU column says how
busy the machine was). ``--bandwidth-scale 300`` gives bytes their real time, but not yet
faithfully at 16 hosts: the testbed pads each repository with one file, and olah moves a
file in 64 MiB blocks, which nothing scales; at / 300 a block takes minutes through a
shared relay, past the hosts' 120 s read timeout (distribution-2026-12-03-realtime.txt).
Padding in shard-sized files (a real shard ~5 GB) would keep the blocks in proportion.
The sizes are bounded by the machine: a host holds its copy in the state tmpfs (RAM),
~0.5 GB a host at sizes / 300 with the image unpacked.

Per size: the wall time; the image and weights phases: from the first start to the last
end, on any host, of the deploy's long steps (sparkfleet/tasks.py runs each as a transient
unit ``sparkfleet-task-<task>-<hash>``; its journal gives when it started and last wrote)
whose task matches ``--image-tasks`` / ``--weights-tasks`` (pyinfra's own output is no
clock: an operation's lines come when it ends, and transfers run inside few operations);
WAN bytes (what the hub and the registry served: payload, their own counters) and the
largest egress of any host (its NIC plus its pair link, interface counters), each also as
a multiple of one copy (``tb.one_copy_bytes()``: the image's blobs and what a dense host
fetches of each repository); and every 5 s of the deploy (``samples`` in the JSON) the
WAN's bytes on the wire, how busy the cores were and each host's CPU seconds, which say
whether a slow stretch waited on the WAN or on the cores. Last line:

``distribution: first deploy 8/1 = X.XX×, 16/1 = X.XX×, WAN = X.XX× one copy, max host
egress = X.XX× one copy`` (on one line; a size not run reads ``-``; WAN and egress the
largest over the sizes). The JSON (every raw number) goes to ``--out``, the table beside
it as ``.txt``; each run's output, each line timestamped as it arrived, and every
operation's start go to a log directory (its path is printed) and the JSON.

Run as root. It replaces this instance's fleet (``--replace`` when one is up): pick an
instance of your own with ``SPARKFLEET_TESTBED_INSTANCE=N``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_scale import host_cpu_s, write_json  # noqa: E402 - benchmarks/ is this script's own directory

INVENTORY = "inventory/testbed.py"  # reads this instance's hosts.json
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
OP_START = re.compile(r"^--> Starting (?:[a-z ,]+ )?operation: (.*?)(?: \(.*\))?\s*$")
RUN_TIMEOUT_S = 3600
#: The deploy's long steps run as transient units on the hosts (sparkfleet/tasks.py), named
#: by task: the mirror's image copy and the pulls; downloads, the mirror's holds and builds.
#: A deploy that names its tasks otherwise gives its own (--image-tasks, --weights-tasks).
TASK_PREFIX = "sparkfleet-task-"
IMAGE_TASKS = r"^image-"
WEIGHTS_TASKS = r"^(fetch-|mirror-holds-|hybrid)"
#: Each task unit's journal entries (systemd's and its own output): first and last time.
TASK_TIMES = (
    "journalctl --no-pager -o json --output-fields=UNIT,_SYSTEMD_UNIT,__REALTIME_TIMESTAMP 2>/dev/null | "
    "python3 -c 'import json,sys\n"
    "t={}\n"
    "for l in sys.stdin:\n"
    "    e=json.loads(l); u=e.get(\"UNIT\") or e.get(\"_SYSTEMD_UNIT\") or \"\"\n"
    "    if u.startswith(\"" + TASK_PREFIX + "\"):\n"
    "        s=int(e[\"__REALTIME_TIMESTAMP\"])/1e6; a,b=t.get(u,(s,s)); t[u]=(min(a,s),max(b,s))\n"
    "print(json.dumps(t))'"
)


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


SAMPLE_S = 5.0


class Sampler(threading.Thread):
    """Every SAMPLE_S while the deploy runs: the WAN's bytes on the wire so far, how busy the
    machine was and each host's CPU seconds, so that a slow phase shows whether the WAN
    idled or the cores were full (and whose)."""

    def __init__(self, tb) -> None:
        super().__init__(daemon=True)
        self.tb, self.samples, self.done = tb, [], threading.Event()

    def run(self) -> None:
        from sparkfleet.testbed import shaping

        started, last = time.monotonic(), cpu_times()
        while not self.done.wait(SAMPLE_S):
            now = cpu_times()
            busy = (now[0] - last[0]) / max(1, now[1] - last[1])
            last = now
            self.samples.append({"t": round(time.monotonic() - started, 1), "wan_wire": shaping.wan_wire_bytes(),
                                 "busy": round(busy, 3),
                                 "hosts_cpu_s": {k: round(v, 2) for k, v in host_cpu_s(self.tb.names).items()}})



def first_deploy(tb, logs: Path, label: str, extra: list[str]) -> dict[str, Any]:
    """Run pyinfra, timestamping each line of its output; wall time, rc and op timeline."""
    log_path = logs / f"{label}.log"
    cmd = [sys.executable, "-m", "pyinfra", "-y", INVENTORY, "deploy.py", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ops: list[tuple[float, str]] = []
    sampler = Sampler(tb)
    sampler.start()
    started = time.monotonic()
    with open(log_path, "w", buffering=1) as log:  # line by line: the log can be watched
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            at = time.monotonic() - started
            log.write(f"[{at:7.1f}] {line}")
            found = OP_START.match(ANSI.sub("", line).strip())
            if found:
                ops.append((at, found.group(1)))
            if at > RUN_TIMEOUT_S:
                proc.kill()
        rc = proc.wait()
    wall = time.monotonic() - started
    sampler.done.set()
    sampler.join()
    timeline = [{"op": name, "start_s": round(t, 1), "seconds": round((ops[i + 1][0] if i + 1 < len(ops) else wall) - t, 1)}
                for i, (t, name) in enumerate(ops)]
    if rc != 0:
        tail = log_path.read_text(errors="replace").rstrip().splitlines()[-15:]
        print("      " + "\n      ".join(tail), file=sys.stderr, flush=True)
    return {"rc": rc, "wall_s": round(wall, 1), "log": str(log_path), "ops": timeline, "samples": sampler.samples}


def task_windows(tb) -> dict[str, dict[str, list[float]]]:
    """Per host, each task unit's [first, last] journal time (unix seconds)."""
    out = {}
    for name in tb.names:
        done = tb.exec(name, TASK_TIMES, via="nsenter", timeout=60)
        try:
            out[name] = json.loads(done.stdout or "{}")
        except ValueError:
            out[name] = {}
    return out


def phase(windows: dict[str, dict[str, list[float]]], pattern: str, started: float) -> dict[str, float] | None:
    """From the first start to the last end of the matching tasks on any host, seconds
    after the deploy started; None when no task matched."""
    spans = [w for tasks in windows.values() for unit, w in tasks.items()
             if re.search(pattern, unit[len(TASK_PREFIX):])]
    if not spans:
        return None
    start, end = min(w[0] for w in spans) - started, max(w[1] for w in spans) - started
    return {"start_s": round(start, 1), "end_s": round(end, 1), "seconds": round(end - start, 1)}


def one_size(n: int, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from sparkfleet.testbed import fleet

    started = time.monotonic()
    tb = fleet.up(n, n_pairs=n // 2 if args.pairs else 0, bandwidth_scale=args.bandwidth_scale,
                  artifact_scale=args.artifact_scale)
    try:
        up_s = time.monotonic() - started
        copy = tb.one_copy_bytes(build_hybrid="build_hybrid=True" in args.data)
        one = sum(copy.values())
        print(f"... {n} host(s) up in {up_s:.0f} s, one copy {one / 1e6:.0f} MB; first deploy", file=sys.stderr,
              flush=True)
        before = tb.traffic()
        started_at = time.time()
        cpu_before = cpu_times()
        run = first_deploy(tb, logs, f"{n}-first", args.data)
        cpu_after = cpu_times()
        moved = tb.traffic() - before
        windows = task_windows(tb)
    finally:
        fleet.down()
    egress = {name: moved.egress(name) for name in moved.hosts}
    top = max(egress, key=egress.get)
    size = {
        "hosts": n, "up_s": round(up_s, 1), "shaping": tb.shaping, "one_copy": copy, "one_copy_bytes": one,
        **run,
        # How busy the machine was: near 1.0, the hosts wait on CPU, not on their links.
        "cpu_busy": round((cpu_after[0] - cpu_before[0]) / max(1, cpu_after[1] - cpu_before[1]), 3),
        "tasks": windows,
        "image_phase": phase(windows, args.image_tasks, started_at),
        "weights_phase": phase(windows, args.weights_tasks, started_at),
        "image_s": (phase(windows, args.image_tasks, started_at) or {}).get("seconds", float("nan")),
        "weights_s": (phase(windows, args.weights_tasks, started_at) or {}).get("seconds", float("nan")),
        "traffic": moved.record(),
        "wan_bytes": moved.wan, "wan_copies": moved.wan / one,
        "max_egress_host": top, "max_egress_bytes": egress[top], "max_egress_copies": egress[top] / one,
    }
    derive(size)
    print(f"    {n} host(s): rc {size['rc']}, {size['wall_s']:.0f} s (image {size['image_s']:.0f} s, weights "
          f"{size['weights_s']:.0f} s), WAN {size['wan_copies']:.2f}x, max egress {size['max_egress_copies']:.2f}x "
          f"({top})", file=sys.stderr, flush=True)
    return size


def derive(size: dict[str, Any]) -> None:
    """The egress as copies on the wire: interface counters count headers (TCP, IP, HTTP)
    that one copy's payload does not, so they are set against one copy's bytes on the
    wire, by the WAN's wire-to-payload ratio of the same run (the same kind of transfer)."""
    traffic = size["traffic"]
    size["wire_per_payload"] = traffic["wan_wire"] / traffic["wan"] if traffic.get("wan") else 1.0
    size["max_egress_wire_copies"] = size["max_egress_copies"] / size["wire_per_payload"]


def table(sizes: list[dict[str, Any]]) -> str:
    base = sizes[0]
    s = base["shaping"]
    rates = s.get("rates") or {}
    lines = [f"first deploy on a shaped simulated fleet ({os.cpu_count()} CPU cores): rates / {s.get('bandwidth_scale')} "
             f"(WAN {rates.get('wan_kbit', 0) / 1000:g}, LAN {rates.get('lan_kbit', 0) / 1000:g}, ConnectX-7 "
             f"{rates.get('cx7_kbit', 0) / 1000:g} Mbit/s), sizes / {s.get('artifact_scale')}: one copy "
             f"{base['one_copy_bytes'] / 1e6:.1f} MB (image {base['one_copy']['image'] / 1e6:.1f} MB)", "",
             f"{'hosts':>5} {'rc':>3} {'wall s':>13} {'image s':>8} {'weights s':>9} {'WAN MB':>8} {'WAN x':>6} "
             f"{'max egress MB':>13} {'x':>6} {'x wire':>6} {'CPU':>4}  host"]
    for r in sizes:
        ratio = f"{r['wall_s']:.0f} ({r['wall_s'] / base['wall_s']:.2f}x)"
        lines.append(f"{r['hosts']:>5} {r['rc']:>3} {ratio:>13} {r['image_s']:>8.0f} {r['weights_s']:>9.0f} "
                     f"{r['wan_bytes'] / 1e6:>8.1f} {r['wan_copies']:>6.2f} {r['max_egress_bytes'] / 1e6:>13.1f} "
                     f"{r['max_egress_copies']:>6.2f} {r['max_egress_wire_copies']:>6.2f} "
                     f"{r.get('cpu_busy', float('nan')):>4.0%}  {r['max_egress_host']}")
    return "\n".join(lines)


def summary_line(sizes: list[dict[str, Any]]) -> str:
    by_n = {r["hosts"]: r for r in sizes}

    def ratio(n: int) -> str:
        if n not in by_n or 1 not in by_n:
            return "-"
        failed = [f"rc {by_n[k]['rc']} at {k}" for k in (1, n) if by_n[k]["rc"]]  # a failed deploy is no result
        return f"{by_n[n]['wall_s'] / by_n[1]['wall_s']:.2f}×" + (f" ({', '.join(failed)})" if failed else "")

    wan = max(r["wan_copies"] for r in sizes)
    egress = max(r["max_egress_wire_copies"] for r in sizes)  # copies on the wire, as derive() says
    return (f"distribution: first deploy 8/1 = {ratio(8)}, 16/1 = {ratio(16)}, WAN = {wan:.2f}× one copy, "
            f"max host egress = {egress:.2f}× one copy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,4,8,16", help="fleet sizes, comma-separated (default 1,2,4,8,16)")
    ap.add_argument("--bandwidth-scale", type=float, default=100.0,
                    help="real rates divided by this (default 100: WAN 10, LAN 100, ConnectX-7 2000 Mbit/s)")
    ap.add_argument("--artifact-scale", type=float, default=300.0,
                    help="real artifact sizes divided by this (default 300: one dense copy ~316 MB)")
    ap.add_argument("--pairs", action="store_true", help="cable spark-1 + spark-2, ... as pairs (the pair profile)")
    ap.add_argument("--image-tasks", default=IMAGE_TASKS,
                    help=f"regex of the image phase's host tasks, after {TASK_PREFIX} ({IMAGE_TASKS!r})")
    ap.add_argument("--weights-tasks", default=WEIGHTS_TASKS,
                    help=f"regex of the weights phase's host tasks ({WEIGHTS_TASKS!r})")
    ap.add_argument("--data", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to pyinfra as --data KEY=VALUE (repeatable)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                    f"distribution-{datetime.date.today().isoformat()}.json",
                    help="the JSON of every number; the table goes beside it as .txt")
    ap.add_argument("--replace", action="store_true", help="replace this instance's fleet if one is up")
    ap.add_argument("--from-json", type=Path, metavar="JSON",
                    help="run nothing: write the table and the last line again from a run's JSON (into it, and beside it)")
    args = ap.parse_args()
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        for size in doc["sizes"]:
            derive(size)
        return report(doc, args.from_json)
    args.data = [a for kv in args.data for a in ("--data", kv)]
    if os.geteuid() != 0:
        raise SystemExit("run as root: the simulated fleet needs network namespaces and systemd-nspawn")
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"--sizes {args.sizes!r}: give numbers, e.g. 1,2,4,8,16") from None
    if not sizes or not all(1 <= s <= 50 for s in sizes):
        raise SystemExit("--sizes must be 1..50 each")

    from sparkfleet.testbed import paths
    from sparkfleet.testbed.state import State

    existing = State.load()
    if existing is not None and existing.hosts and not args.replace:
        raise SystemExit(f"instance {paths.INSTANCE} has a fleet up ({len(existing.hosts)} hosts): --replace to "
                         "replace it, or SPARKFLEET_TESTBED_INSTANCE=N for another instance")
    logs = Path(tempfile.mkdtemp(prefix="bench-distribution-"))
    print(f"... instance {paths.INSTANCE}, sizes {sizes}; logs in {logs}", file=sys.stderr, flush=True)
    doc: dict[str, Any] = {
        "issue": 25, "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
        "instance": paths.INSTANCE, "bandwidth_scale": args.bandwidth_scale, "artifact_scale": args.artifact_scale,
        "image_tasks": args.image_tasks, "weights_tasks": args.weights_tasks, "logs": str(logs), "sizes": [],
    }
    done: list[dict[str, Any]] = []
    for n in sizes:
        done.append(one_size(n, args, logs))
        doc["sizes"] = done
        write_json(args.out, doc)
    return report(doc, args.out)


def report(doc: dict[str, Any], out: Path) -> int:
    """The table and the last line: into the JSON, beside it as .txt, and printed."""
    text, line = table(doc["sizes"]), summary_line(doc["sizes"])
    doc["table"], doc["summary_line"] = text, line
    write_json(out, doc)
    out.with_suffix(".txt").write_text(f"{text}\n\n{line}\n")
    print(text)
    print(f"\nJSON: {out}; logs: {doc['logs']}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
