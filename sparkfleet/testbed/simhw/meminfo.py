#!/usr/bin/python3
"""A GB10's memory on a simulated Spark (stdlib only): /proc/meminfo as a Spark's says it.

Installed as /usr/lib/sparkfleet-sim/meminfo and run by `sparkfleet-sim-meminfo.service`
from boot. It binds a file over /proc/meminfo (as lxcfs does), so everything on the host
that reads it (the deploy's preflight, earlyoom, free) reads a GB10's: MemTotal 121.69 GiB,
MemAvailable at rest 102.2 GiB headless or 98.7 GiB when the host boots to the desktop
(graphical.target, DGX OS's default; runtime/startup.py says where the figures come from).
From that, each second, it takes away

* what the simulated engines hold (their files in STATE_DIR/reserve, in /dev/shm, which
  the serving container shares through --ipc host; a file no live process locks is freed),
* what the host's own processes grew by since boot (the sum of their resident memory), so
  a process that really allocates (a memory hog) moves MemAvailable as on a Spark.

A large process's exit is seen at once (a pidfd wakes the loop), as the kernel's figure
moves when it frees the memory: earlyoom kills, waits for the process to go, then reads
again, and a figure a second old would make it kill the next process too.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys

GIB_KIB = 1024 * 1024
TOTAL_KIB = int(121.69 * GIB_KIB)  # runtime/startup.py GB10_MEM_TOTAL_GIB
HEADLESS_KIB = int(102.2 * GIB_KIB)  # HEADLESS_AVAILABLE_GIB
DESKTOP_KIB = int((102.2 - 3.5) * GIB_KIB)  # DESKTOP_AVAILABLE_GIB
STATE_DIR = os.environ.get("SIM_MEMORY_DIR", "/dev/shm/sparkfleet-sim-memory")
FILE = os.environ.get("SIM_MEMINFO_FILE", "/run/sparkfleet-sim/meminfo")
PROC = "/proc/meminfo"
DEFAULT_TARGET = "/etc/systemd/system/default.target"
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def desktop() -> bool:
    """Whether this boot is a desktop's: the default target is graphical.target."""
    try:
        return os.path.basename(os.readlink(DEFAULT_TARGET)) == "graphical.target"
    except OSError:
        return False


#: A process holding this much is watched for its exit (a pidfd), not only counted each second.
WATCH_KIB = 128 * 1024


def resident_kib(large: list[int] | None = None) -> int:
    """The host's processes' resident memory; ``large`` gets the pids of those above WATCH_KIB."""
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    kib = int(f.read().split()[1]) * PAGE_KIB
            except (OSError, ValueError, IndexError):
                continue
            total += kib
            if large is not None and kib >= WATCH_KIB:
                large.append(int(pid))
    return total


def wait_for_exit(pids: list[int], seconds: float) -> None:
    """Sleep ``seconds``, or less: until one of ``pids`` exits."""
    poller, fds = select.poll(), []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except OSError:
            return  # gone already: count again now
        poller.register(fds[-1], select.POLLIN)
    try:
        poller.poll(seconds * 1000)
    finally:
        for fd in fds:
            os.close(fd)


def reserved_kib() -> int:
    total = 0
    directory = os.path.join(STATE_DIR, "reserve")
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)  # nobody holds it: its engine is gone, and its memory with it
        except OSError:
            try:
                total += int(os.pread(fd, 64, 0).split()[0])
            except (ValueError, IndexError):
                pass
        finally:
            os.close(fd)
    return total


def render(total: int, available: int) -> bytes:
    """A /proc/meminfo of constant length (rewritten in place, never truncated)."""
    available = max(0, min(total, available))
    free = max(0, available - 2 * GIB_KIB // 4)
    rows = [("MemTotal", total), ("MemFree", free), ("MemAvailable", available), ("Buffers", 0),
            ("Cached", available - free), ("SwapCached", 0), ("Active", total - available), ("Inactive", 0),
            ("SwapTotal", 0), ("SwapFree", 0), ("Shmem", 0)]
    return "".join(f"{key + ':':<16}{value:>12} kB\n" for key, value in rows).encode()


def bound() -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == PROC for line in f)


def main() -> int:
    available = DESKTOP_KIB if desktop() else HEADLESS_KIB
    os.makedirs(os.path.join(STATE_DIR, "reserve"), exist_ok=True)
    os.chmod(os.path.join(STATE_DIR, "reserve"), 0o1777)
    with open(os.path.join(STATE_DIR, "base"), "w") as f:
        f.write(f"{TOTAL_KIB} {available}\n")
    os.makedirs(os.path.dirname(FILE), exist_ok=True)
    with open(FILE, "wb") as f:
        f.write(render(TOTAL_KIB, available))
    if not bound():
        subprocess.run(["mount", "--bind", FILE, PROC], check=True, timeout=30)
    start = resident_kib()
    fd = os.open(FILE, os.O_WRONLY)
    used_path = os.path.join(STATE_DIR, "host_used_kib")
    while True:
        large: list[int] = []
        growth = max(0, resident_kib(large) - start)
        with open(used_path + ".tmp", "w") as f:
            f.write(f"{growth}\n")
        os.replace(used_path + ".tmp", used_path)
        os.pwrite(fd, render(TOTAL_KIB, available - growth - reserved_kib()), 0)
        wait_for_exit(large, 1.0)


if __name__ == "__main__":
    sys.exit(main())
