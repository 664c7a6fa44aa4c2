"""What a deploy costs as the fleet grows: 1, 4, 8, 16 (32) simulated hosts (issue 31).

    sudo SPARKFLEET_TESTBED_INSTANCE=N .venv/bin/python benchmarks/bench_scale.py \\
        [--sizes 1,4,8,16] [--repeats 3] [--out benchmarks/results/scale-DATE.json] [--replace]

Each size's fleet runs in a testbed instance of its own (SPARKFLEET_TESTBED_INSTANCE, then
the next numbers), served by a process of its own: the fleets are booted (``fleet.up``: the
default login and names, as DGX OS: a sudo user with a password, ``spark-i.local``
aliases) and first deployed (``pyinfra -y inventory/testbed.py deploy.py``: its exit status
and wall time) one after the other, and stay up side by side. Then ``--repeats`` rounds: in
each, every size in turn runs

1. a converged re-run (the same command),
2. the same with ``--dry``,
3. ``sparkfleet status inventory/testbed.py``,

so the sizes alternate, and load or drift on the machine (its speed moved by a third
within an hour here) meets every size alike; the table shows the medians of the rounds.
The fleets go down at the end (also on an error or Ctrl-C). An idle fleet beside a run
adds its background (~0.004 cores per host) to the machine's load.

Every pyinfra run goes through ``benchmarks/pyinfra_counted.py`` (pyinfra's own command
line, unchanged), and so does ``sparkfleet status`` (its ``main()`` under the same
counting), which gives per host: SSH commands (exec channels opened), the peak of channels
open at once, channels the host refused, and the controller process's CPU seconds (self +
children; for status also ``getrusage(RUSAGE_CHILDREN)`` around it). The simulated hosts'
own CPU time over a run is the sum over hosts of their cgroups' usage (``cpuacct.usage``
on cgroup v1, ``cpu.stat`` ``usage_usec`` on v2): on this machine the hosts share the
controller's cores, which a real fleet does not. Before its rounds, each size's fleet is
watched idle for ``IDLE_S``: the hosts' background (timers, daemons), which a run's hosts'
CPU includes for its whole wall time, is shown beside it. A converged run must change nothing: the
``changed`` column is the Success column of pyinfra's ``Grand total`` row (its columns are
op-hosts / success (= changed) / error / no change); the serving unit's InvocationID is
compared before and after the rounds (``restarted``). After the runs of a size, each host's
journal is searched for sshd's "no more sessions" (a session refused beyond
``MaxSessions``).

Memory: MemAvailable (``/proc/meminfo``) before the boot, after it and after the first
deploy, per host, and the hosts' own memory cgroups after the first deploy, so that one can
tell whether 32 hosts fit.

Last line:
``scale: converged 16/1 = X.XX×, dry 16/1 = X.XX×, status 16/1 = X.XX×, commands/host = N,
controller cpu/host = X.XX s, first deploy 16 hosts rc=R`` (on one line): the largest
size over size 1 (the labels say which sizes ran), commands/host the most of any host of
the largest size (the median of its converged runs), controller cpu/host the largest
size's median converged-run controller CPU divided by its hosts. The table and every raw
number go to ``--out`` as JSON (rewritten after each size); each run's output is kept in a
log directory (its path is printed).

Run as root. It replaces this instance's fleet (``--replace`` when one is up): pick an
instance of your own with ``SPARKFLEET_TESTBED_INSTANCE=N``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

INVENTORY = "inventory/testbed.py"  # reads this instance's hosts.json
COUNTED = REPO / "benchmarks" / "pyinfra_counted.py"
SERVE_UNIT = "sparkfleet-serve.service"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
GRAND_TOTAL = re.compile(r"^\s*Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", re.M)
RUN_TIMEOUT_S = 3600

#: ``sparkfleet status`` under pyinfra_counted's counting: argv = COUNTS.json, status args.
STATUS_COUNTED = """\
import atexit, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import paramiko
import pyinfra_counted as pc
paramiko.Transport.open_session = pc._counted_open_session
atexit.register(pc._write, os.path.abspath(sys.argv[2]))
from sparkfleet.status import main
sys.exit(main(sys.argv[3:]))
"""


# --- measurements ---------------------------------------------------------------------


def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _cgroup_file(name: str, v1: str, v2: str) -> tuple[Path, str] | None:
    """The host's cgroup file for a v1 knob (preferred) or its v2 counterpart."""
    from sparkfleet.testbed.cgroups import host_cgroup_dirs

    dirs = [Path(d) for d in host_cgroup_dirs(name)]
    for d in dirs:
        if (d / v1).is_file():
            return d / v1, "v1"
    for d in dirs:
        if (d / v2).is_file():
            return d / v2, "v2"
    return None


def host_cpu_s(names: list[str]) -> dict[str, float]:
    """Each host's cgroup CPU time so far, seconds (hierarchical: docker's containers too)."""
    out = {}
    for name in names:
        found = _cgroup_file(name, "cpuacct.usage", "cpu.stat")
        if found is None:
            out[name] = math.nan
            continue
        path, kind = found
        text = path.read_text()
        if kind == "v1":
            out[name] = int(text.strip()) / 1e9
        else:
            usec = re.search(r"^usage_usec (\d+)", text, re.M)
            out[name] = int(usec.group(1)) / 1e6 if usec else math.nan
    return out


def host_mem_mib(names: list[str]) -> dict[str, float]:
    out = {}
    for name in names:
        found = _cgroup_file(name, "memory.usage_in_bytes", "memory.current")
        out[name] = int(found[0].read_text().strip()) / 2**20 if found else math.nan
    return out


def in_host(tb, name: str, command: str) -> str:
    """A command inside the host without SSH (nsenter): it opens no session to count."""
    done = tb.exec(name, command, via="nsenter", timeout=60)
    return done.stdout.strip()


def refused_sessions(tb) -> dict[str, int]:
    """sshd's "no more sessions" lines in each host's journal (the whole journal: the
    per-connection sshd logs from the user's session scope, not only from ssh.service)."""
    out = {}
    for name in tb.names:
        text = in_host(tb, name, "journalctl --no-pager -o cat 2>/dev/null | grep -c 'no more sessions' || true")
        out[name] = int(text) if text.isdigit() else -1
    return out


def serve_invocations(tb) -> dict[str, str]:
    return {name: in_host(tb, name, f"systemctl show -p InvocationID --value {SERVE_UNIT} 2>/dev/null || true")
            for name in tb.names}


def grand_total(output: str) -> dict[str, int] | None:
    """pyinfra's results table's last row: op-hosts, success (changed), error, no change."""
    found = GRAND_TOTAL.findall(ANSI.sub("", output))
    if not found:
        return None
    values = [0 if v == "-" else int(v) if v.isdigit() else -1 for v in found[-1]]
    return dict(zip(("op_hosts", "changed", "error", "no_change"), values, strict=True))


def run_counted(cmd: list[str], label: str, tb, logs: Path, counts: Path) -> dict[str, Any]:
    """Run *cmd* (which writes *counts*), timing it; return the raw numbers of the run."""
    by_address = {h.address: h.name for h in tb.hosts}
    log_path = logs / f"{label}.log"
    cpu_before = host_cpu_s(tb.names)
    ru_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=RUN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.monotonic() - started
    ru_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_after = host_cpu_s(tb.names)
    output = log_path.read_text(errors="replace")
    raw = json.loads(counts.read_text()) if counts.is_file() else {"hosts": {}, "cpu_s": math.nan}
    per_host = {by_address.get(addr, addr): v for addr, v in raw["hosts"].items()}
    for name in tb.names:
        per_host.setdefault(name, {"commands": 0, "peak_channels": 0, "refused": 0})
    run = {
        "label": label, "rc": rc, "wall_s": wall, "log": str(log_path),
        "controller_cpu_s": raw["cpu_s"],
        "controller_cpu_rusage_s": (ru_after.ru_utime + ru_after.ru_stime) - (ru_before.ru_utime + ru_before.ru_stime),
        "hosts_cpu_s": sum(cpu_after[n] - cpu_before[n] for n in tb.names),
        "per_host": per_host,
        "commands_max": max(v["commands"] for v in per_host.values()),
        "commands_median": statistics.median(v["commands"] for v in per_host.values()),
        "peak_channels": max(v["peak_channels"] for v in per_host.values()),
        "refused": sum(v["refused"] for v in per_host.values()),
        "totals": grand_total(output),
    }
    changed = f", changed {run['totals']['changed']}" if run["totals"] else ""
    print(f"    {label}: rc {rc}, {wall:.1f} s, controller cpu {run['controller_cpu_s']:.1f} s, "
          f"hosts cpu {run['hosts_cpu_s']:.1f} s, commands/host max {run['commands_max']}, "
          f"peak channels {run['peak_channels']}, refused {run['refused']}{changed}",
          file=sys.stderr, flush=True)
    if rc != 0:
        print("      " + "\n      ".join(output.rstrip().splitlines()[-15:]), file=sys.stderr, flush=True)
    return run


def pyinfra_run(tb, label: str, logs: Path, *extra: str) -> dict[str, Any]:
    counts = logs / f"{label}.counts.json"
    cmd = [sys.executable, str(COUNTED), str(counts), "-y", INVENTORY, "deploy.py", *extra]
    return run_counted(cmd, label, tb, logs, counts)


def status_run(tb, label: str, logs: Path) -> dict[str, Any]:
    counts = logs / f"{label}.counts.json"
    cmd = [sys.executable, "-c", STATUS_COUNTED, str(REPO), str(counts), INVENTORY]
    run = run_counted(cmd, label, tb, logs, counts)
    # The brief's measure for status: the child's CPU from getrusage; pyinfra_counted's agrees.
    run["controller_cpu_s"] = run["controller_cpu_rusage_s"]
    return run


# --- one size -------------------------------------------------------------------------


def median(values: list[float]) -> float:
    values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else math.nan


#: How long each size's fleet is watched idle, after its first deploy.
IDLE_S = 20.0


def idle_cores(names: list[str]) -> float:
    """The hosts' own CPU while no run asks them anything, in cores: their background
    (timers, daemons, the mirrors), which every run's "hosts' CPU" includes for its
    whole wall time and which real Sparks spend on their own cores."""
    before, started = host_cpu_s(names), time.monotonic()
    time.sleep(IDLE_S)
    after = host_cpu_s(names)
    return sum(after[n] - before[n] for n in names) / (time.monotonic() - started)


def summarize(size: dict[str, Any]) -> dict[str, Any]:
    n = size["hosts"]
    rounds = size["rounds"]
    conv = [r["converged"] for r in rounds]
    dry = [r["dry"] for r in rounds]
    stat = [r["status"] for r in rounds]
    per_host_cmds = {name: median([r["per_host"][name]["commands"] for r in conv]) for name in size["names"]}
    return {
        "hosts": n,
        "first_rc": size["first"]["rc"], "first_wall_s": size["first"]["wall_s"],
        "first_commands_max": size["first"]["commands_max"], "first_peak_channels": size["first"]["peak_channels"],
        "first_refused": size["first"]["refused"],
        "converged_wall_s": median([r["wall_s"] for r in conv]),
        "dry_wall_s": median([r["wall_s"] for r in dry]),
        "status_wall_s": median([r["wall_s"] for r in stat]),
        "converged_rcs": [r["rc"] for r in conv], "dry_rcs": [r["rc"] for r in dry],
        "status_rcs": [r["rc"] for r in stat],
        "commands_per_host_max": max(per_host_cmds.values()) if per_host_cmds else math.nan,
        "commands_per_host_median": median(list(per_host_cmds.values())),
        "dry_commands_per_host_max": median([r["commands_max"] for r in dry]),
        "status_commands_per_host_max": median([r["commands_max"] for r in stat]),
        "peak_channels": max(r["peak_channels"] for r in [size["first"], *conv, *dry, *stat]),
        "refused_channels": sum(r["refused"] for r in conv + dry + stat),
        "changed": [r["totals"]["changed"] if r["totals"] else None for r in conv],
        "converged_controller_cpu_s": median([r["controller_cpu_s"] for r in conv]),
        "converged_controller_cpu_per_host_s": median([r["controller_cpu_s"] for r in conv]) / n,
        "dry_controller_cpu_s": median([r["controller_cpu_s"] for r in dry]),
        "status_controller_cpu_s": median([r["controller_cpu_s"] for r in stat]),
        "converged_hosts_cpu_s": median([r["hosts_cpu_s"] for r in conv]),
        "idle_hosts_cores": size.get("idle_hosts_cores", math.nan),
        "converged_hosts_background_s": size.get("idle_hosts_cores", math.nan) * median([r["wall_s"] for r in conv]),
        "dry_hosts_cpu_s": median([r["hosts_cpu_s"] for r in dry]),
        "status_hosts_cpu_s": median([r["hosts_cpu_s"] for r in stat]),
        "restarted": size.get("restarted"),
        "no_more_sessions_first": sum(size["no_more_sessions_after_first"].values()),
        "no_more_sessions_total": sum(size["no_more_sessions_after_all"].values()),
        "mem_per_host_boot_mib": size["memory"]["per_host_boot_mib"],
        "mem_per_host_deployed_mib": size["memory"]["per_host_deployed_mib"],
        "mem_cgroup_per_host_mib": size["memory"]["cgroup_per_host_mib"],
    }


#: How a size's process answers its parent: one line each, the rest of its stdout is the testbed's.
ANSWER = "@@bench "


def _answer(doc: dict[str, Any]) -> None:
    print(ANSWER + json.dumps(doc, default=str), flush=True)


def serve_size(n: int, logs: Path) -> None:
    """One size's fleet, in this process's testbed instance: boot, first deploy, the idle
    watch; then the runs the parent asks for on stdin, a line each ("converged LABEL", "dry
    LABEL", "status LABEL"), each answered on stdout; at "finish" or end of input, the checks
    after the rounds, then the fleet down (also on an error or SIGTERM)."""
    from sparkfleet.testbed import fleet

    # Its parent stops it (SIGTERM: the fleet goes down in the finally below). A Ctrl-C
    # reaches the whole process group: taken here too, it would start the teardown that
    # the parent's SIGTERM then cuts short, leaving hosts up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    size: dict[str, Any] = {"hosts": n}
    mem_before = mem_available_kib()
    started = time.monotonic()
    tb = fleet.up(n)
    try:
        size["up_s"] = time.monotonic() - started
        size["names"] = tb.names
        mem_booted = mem_available_kib()
        sshd = in_host(tb, tb.names[0], "sshd -T 2>/dev/null | grep -Ei '^(maxsessions|maxstartups) '")
        size["sshd"] = ", ".join(sshd.splitlines())
        print(f"... {n} host(s) up in {size['up_s']:.0f} s; first deploy", file=sys.stderr, flush=True)
        size["first"] = pyinfra_run(tb, f"{n}-first", logs)
        mem_deployed = mem_available_kib()
        cgroup_mem = host_mem_mib(tb.names)
        size["memory"] = {
            "mem_available_kib": {"before": mem_before, "booted": mem_booted, "deployed": mem_deployed},
            "per_host_boot_mib": (mem_before - mem_booted) / n / 1024,
            "per_host_deployed_mib": (mem_before - mem_deployed) / n / 1024,
            "cgroup_mib": cgroup_mem, "cgroup_per_host_mib": median(list(cgroup_mem.values())),
        }
        size["no_more_sessions_after_first"] = refused_sessions(tb)
        size["idle_hosts_cores"] = idle_cores(tb.names)
        invocations = serve_invocations(tb)
        _answer(size)
        runs = {"converged": lambda label: pyinfra_run(tb, label, logs),
                "dry": lambda label: pyinfra_run(tb, label, logs, "--dry"),
                "status": lambda label: status_run(tb, label, logs)}
        for line in sys.stdin:
            kind, _, label = line.strip().partition(" ")
            if kind == "finish":
                break
            _answer(runs[kind](label))
        after = serve_invocations(tb)
        _answer({"serve_invocations": {"before": invocations, "after": after},
                 "restarted": sum(1 for name in tb.names if invocations[name] != after[name]),
                 "no_more_sessions_after_all": refused_sessions(tb)})
    finally:
        fleet.down()


class Size:
    """A size's fleet, served by its own process (:func:`serve_size`) in its own testbed
    instance, so that the sizes' runs alternate round by round."""

    def __init__(self, n: int, instance: int, logs: Path, replace: bool):
        self.n = n
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", str(n), "--logs", str(logs)]
        self.proc = subprocess.Popen(argv + (["--replace"] if replace else []), cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "SPARKFLEET_TESTBED_INSTANCE": str(instance)})
        self.doc: dict[str, Any] = {"hosts": n, "rounds": [], "instance": instance}

    def ready(self) -> None:
        """Wait for the fleet to be up and first deployed (its first answer)."""
        self.doc.update(self._answer())

    def _answer(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
            sys.stderr.write(line)  # the testbed's own output
        raise RuntimeError(f"the {self.n}-host fleet's process ended (exit {self.proc.wait()}); "
                           "its output is above")

    def ask(self, what: str) -> dict[str, Any]:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def finish(self) -> None:
        self.doc.update(self.ask("finish"))
        self.proc.stdin.close()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # its fleet goes down (serve_size's finally)
            self.proc.wait()


def all_sizes(sizes: list[int], repeats: int, logs: Path, replace: bool, on_size) -> list[dict[str, Any]]:
    """Every size's fleet up beside the others (booted and first deployed one after the
    other), then ``repeats`` rounds in which each size runs converged, --dry and status in
    turn: load or drift on the machine meets every size alike."""
    from sparkfleet.testbed import paths

    if paths.INSTANCE + len(sizes) - 1 > 9:
        raise SystemExit(f"{len(sizes)} sizes need testbed instances {paths.INSTANCE}..{paths.INSTANCE + len(sizes) - 1}; "
                         f"the last is 9. Fix: SPARKFLEET_TESTBED_INSTANCE={10 - len(sizes)} or fewer sizes")
    running: list[Size] = []
    try:
        for i, n in enumerate(sizes):
            running.append(Size(n, paths.INSTANCE + i, logs, replace))  # stopped below, even while booting
            running[-1].ready()
            on_size([s.doc for s in running])
        for r in range(repeats):
            for size in running:
                n = size.n
                print(f"... round {r + 1}/{repeats}, {n} host(s)", file=sys.stderr, flush=True)
                size.doc["rounds"].append({kind: size.ask(f"{kind} {n}-{kind}-{r + 1}")
                                           for kind in ("converged", "dry", "status")})
            on_size([s.doc for s in running])
        for size in running:
            size.finish()
    finally:
        for size in running:
            size.stop()
    for size in running:
        size.doc["summary"] = summarize(size.doc)
    return [s.doc for s in running]


# --- output ---------------------------------------------------------------------------


def num(value: float, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and value.is_integer() and digits == 0:
        return str(int(value))
    return f"{value:.{digits}f}"


def table(sizes: list[dict[str, Any]], repeats: int) -> str:
    rows = [s["summary"] for s in sizes]
    base = rows[0]
    lines = [f"sparkfleet at scale, simulated fleet ({os.cpu_count()} CPU cores shared by controller and hosts), "
             f"medians of {repeats} round(s) per size; wall seconds, ratio to {base['hosts']} host(s) in ()", ""]
    head = (f"{'hosts':>5} {'first rc':>8} {'first s':>8} {'converged s':>15} {'dry s':>15} {'status s':>15} "
            f"{'changed':>8} {'restarted':>9}")
    lines.append(head)
    for r in rows:
        def timed(key: str, r=r) -> str:
            return f"{num(r[key])} ({num(r[key] / base[key], 2)}x)"
        changed = ",".join("?" if c is None else str(c) for c in r["changed"]) or "-"
        lines.append(f"{r['hosts']:>5} {r['first_rc']:>8} {num(r['first_wall_s']):>8} {timed('converged_wall_s'):>15} "
                     f"{timed('dry_wall_s'):>15} {timed('status_wall_s'):>15} {changed:>8} "
                     f"{num(r['restarted'], 0) if r['restarted'] is not None else '-':>9}")
    lines += ["", "SSH commands per host (converged: median of runs, over hosts med/max; first deploy, dry, status: max), "
              "peak channels open per host (any run), channels refused, sshd 'no more sessions' (after first deploy "
              "/ all runs)"]
    lines.append(f"{'hosts':>5} {'conv med':>8} {'conv max':>8} {'first max':>9} {'dry max':>8} {'status max':>10} "
                 f"{'peak ch':>7} {'refused':>7} {'no more sessions':>16}")
    for r in rows:
        lines.append(f"{r['hosts']:>5} {num(r['commands_per_host_median'], 0):>8} {num(r['commands_per_host_max'], 0):>8} "
                     f"{r['first_commands_max']:>9} {num(r['dry_commands_per_host_max'], 0):>8} "
                     f"{num(r['status_commands_per_host_max'], 0):>10} {r['peak_channels']:>7} "
                     f"{r['refused_channels'] + r['first_refused']:>7} "
                     f"{str(r['no_more_sessions_first']) + ' / ' + str(r['no_more_sessions_total']):>16}")
    lines += ["", "CPU seconds: the controller process (self + children) and the simulated hosts' cgroups (sum), "
              "per run; memory per host (MiB): MemAvailable drop after boot / after first deploy, host cgroup"]
    lines.append(f"{'hosts':>5} {'conv ctl':>8} {'ctl/host':>8} {'conv hosts':>10} {'dry ctl':>8} {'dry hosts':>9} "
                 f"{'stat ctl':>8} {'stat hosts':>10} {'mem boot':>8} {'mem dep':>8} {'mem cg':>8}")
    for r in rows:
        lines.append(f"{r['hosts']:>5} {num(r['converged_controller_cpu_s']):>8} "
                     f"{num(r['converged_controller_cpu_per_host_s'], 2):>8} {num(r['converged_hosts_cpu_s']):>10} "
                     f"{num(r['dry_controller_cpu_s']):>8} {num(r['dry_hosts_cpu_s']):>9} "
                     f"{num(r['status_controller_cpu_s']):>8} {num(r['status_hosts_cpu_s']):>10} "
                     f"{num(r['mem_per_host_boot_mib'], 0):>8} {num(r['mem_per_host_deployed_mib'], 0):>8} "
                     f"{num(r['mem_cgroup_per_host_mib'], 0):>8}")
    return "\n".join(lines)


def summary_line(sizes: list[dict[str, Any]]) -> str:
    base, top = sizes[0]["summary"], sizes[-1]["summary"]
    label = f"{top['hosts']}/{base['hosts']}"

    def ratio(key: str) -> str:
        return num(top[key] / base[key], 2)

    return (f"scale: converged {label} = {ratio('converged_wall_s')}×, dry {label} = {ratio('dry_wall_s')}×, "
            f"status {label} = {ratio('status_wall_s')}×, commands/host = {num(top['commands_per_host_max'], 0)}, "
            f"controller cpu/host = {num(top['converged_controller_cpu_per_host_s'], 2)} s, "
            f"first deploy {top['hosts']} hosts rc={top['first_rc']}")


def memory_line(sizes: list[dict[str, Any]], total_kib: int) -> str:
    """What a deployed host takes: the MemAvailable drop per host at the largest size, and
    (with two sizes) the drop's growth per added host, which leaves out what the fleet
    shares (registry, hub, apt repo on the controller); a guess at 32 hosts from that."""
    small, big = sizes[0], sizes[-1]
    top = big["summary"]

    def drop_mib(size: dict[str, Any]) -> float:
        m = size["memory"]["mem_available_kib"]
        return (m["before"] - m["deployed"]) / 1024

    line = (f"memory per simulated host at {top['hosts']} hosts: MemAvailable drop {num(top['mem_per_host_boot_mib'], 0)} "
            f"MiB booted, {num(top['mem_per_host_deployed_mib'], 0)} MiB deployed; host cgroup (median) "
            f"{num(top['mem_cgroup_per_host_mib'], 0)} MiB")
    if big["hosts"] > small["hosts"]:
        marginal = (drop_mib(big) - drop_mib(small)) / (big["hosts"] - small["hosts"])
        at32 = drop_mib(small) + (32 - small["hosts"]) * marginal
        available = small["memory"]["mem_available_kib"]["before"] / 1024
        line += (f"; each added host {marginal:.0f} MiB ({small['hosts']} -> {big['hosts']} hosts), so 32 deployed "
                 f"hosts ~ {at32 / 1024:.1f} GiB of the {available / 1024:.1f} GiB available before the first boot")
    if not math.isnan(top["mem_cgroup_per_host_mib"]):
        line += f"; 32 x the host cgroup ~ {32 * top['mem_cgroup_per_host_mib'] / 1024:.1f} GiB"
    return line + (f" (machine: {total_kib / 2**20:.1f} GiB; MemAvailable moves with anything else running here, "
                   "the cgroup counts the host's page cache and its share of the state tmpfs)")


def background_line(sizes: list[dict[str, Any]]) -> str:
    """How much of a converged run's hosts' CPU is their background, size by size."""
    parts = []
    for size in sizes:
        s = size["summary"]
        parts.append(f"{s['hosts']} hosts {num(s.get('idle_hosts_cores', math.nan), 2)} cores idle, "
                     f"{num(s.get('converged_hosts_background_s', math.nan))} of {num(s['converged_hosts_cpu_s'])} s")
    return ("the hosts' background (their CPU while idle, times a converged run's wall), of a converged run's "
            "hosts' CPU: " + "; ".join(parts))


def floor_line(sizes: list[dict[str, Any]]) -> str:
    """The least wall time each run of the largest size could take here with the CPU it
    used: its controller's and hosts' CPU spread over this machine's cores, or the
    controller's alone (one process), whichever is longer; and that over the smallest
    size's measured time. What the shared cores allow at best, not what a real fleet
    takes: there each Spark spends its share on its own cores."""
    base, top = sizes[0]["summary"], sizes[-1]["summary"]
    cores = os.cpu_count() or 1
    parts = []
    for kind in ("converged", "dry", "status"):
        ctl, hosts = top[f"{kind}_controller_cpu_s"], top[f"{kind}_hosts_cpu_s"]
        least = max(ctl, (ctl + hosts) / cores)
        parts.append(f"{kind} {num(least, 2)} s ({num(least / base[f'{kind}_wall_s'], 2)}x)")
    return (f"the least a {top['hosts']}-host run could take on these {cores} cores with its CPU (controller + "
            f"hosts over the cores), and over {base['hosts']} host(s)' measured time: " + ", ".join(parts))


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,8,16", help="fleet sizes, comma-separated (default 1,4,8,16; "
                    "32 where the machine holds it)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of converged / dry / status per size (default 3)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                    f"scale-{datetime.date.today().isoformat()}.json", help="JSON of the table and every raw number")
    ap.add_argument("--replace", action="store_true", help="replace a fleet up in an instance the sizes use")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # one size's process (serve_size)
    ap.add_argument("--logs", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the simulated fleet needs network namespaces and systemd-nspawn")
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"--sizes {args.sizes!r}: give numbers, e.g. 1,4,8,16") from None
    if not sizes or not all(1 <= s <= 50 for s in sizes) or args.repeats < 1:
        raise SystemExit("--sizes must be 1..50 each and --repeats at least 1")
    if not COUNTED.is_file():
        raise SystemExit(f"{COUNTED} is missing")

    from sparkfleet.testbed import paths
    from sparkfleet.testbed.state import State

    existing = State.load()
    if existing is not None and existing.hosts and not args.replace:
        raise SystemExit(f"instance {paths.INSTANCE} has a fleet up ({len(existing.hosts)} hosts): --replace to "
                         "replace it, or SPARKFLEET_TESTBED_INSTANCE=N for other instances")
    # SIGTERM ends either process through its finally: the parent stops its sizes' processes,
    # each of those takes its fleet down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.serve:
        serve_size(args.serve, args.logs)
        return 0
    logs = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    print(f"... instance {paths.INSTANCE}, sizes {sizes}, {args.repeats} round(s); logs in {logs}",
          file=sys.stderr, flush=True)
    doc: dict[str, Any] = {
        "issue": 31, "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
        "mem_total_kib": next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:")),
        "instances": f"{paths.INSTANCE}..{paths.INSTANCE + len(sizes) - 1}", "repeats": args.repeats, "logs": str(logs), "sizes": [],
    }

    def keep(sizes_so_far: list[dict[str, Any]]) -> None:
        doc["sizes"] = sizes_so_far
        write_json(args.out, doc)

    done = all_sizes(sizes, args.repeats, logs, args.replace, keep)
    keep(done)
    text = table(done, args.repeats)
    line = summary_line(done)
    doc["table"], doc["summary_line"] = text, line
    write_json(args.out, doc)
    print(text)
    print("\n" + memory_line(done, doc["mem_total_kib"]))
    print(background_line(done))
    print(floor_line(done))
    print(f"sshd on the hosts: {done[0].get('sshd') or '?'}; JSON: {args.out}; logs: {logs}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
