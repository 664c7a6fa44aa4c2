"""Per-host cgroups, so that each host's systemd and dockerd manage their own subtree.

Why: systemd-nspawn (in its default cgroup-namespace mode) makes a container's cgroup
root the cgroup its payload starts in. Left in the controller's cgroup, every host's
systemd would create `system.slice/...` in the same place and they would kill and wait
for each other's units, and every host's dockerd would share `/docker`. So each nspawn
process is moved, before exec, into `<current>/sparkfleet-testbed/spark-i` of every
mounted hierarchy (v1 controllers, name=systemd, and the v2 unified tree). `down`
removes those directories once the processes are gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import paths


@dataclass(frozen=True)
class Hierarchy:
    mountpoint: str
    #: v1 controller names (["cpu", "cpuacct"], ["name=systemd"]) or [] for cgroup2.
    controllers: tuple[str, ...]


def hierarchies() -> list[Hierarchy]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            fstype, opts = parts[sep + 1], parts[sep + 3].split(",")
            if fstype == "cgroup2":
                out.append(Hierarchy(parts[4], ()))
            elif fstype == "cgroup":
                ctl = tuple(o for o in opts if o not in ("rw", "ro", "nosuid", "nodev", "noexec", "relatime"))
                out.append(Hierarchy(parts[4], ctl))
    # One entry per hierarchy (a hierarchy may be mounted twice).
    seen, uniq = set(), []
    for h in out:
        if h.controllers not in seen:
            seen.add(h.controllers)
            uniq.append(h)
    return uniq


def _own_paths(pid: int | str = "self") -> dict[tuple[str, ...], str]:
    res = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctl, path = line.rstrip("\n").split(":", 2)
            res[tuple(sorted(ctl.split(","))) if ctl else ()] = path
    return res


def host_cgroup_dirs(name: str) -> list[str]:
    """The per-host cgroup directory in each hierarchy (not created)."""
    own = _own_paths()
    dirs = []
    for h in hierarchies():
        rel = own.get(tuple(sorted(h.controllers)), "/")
        dirs.append(os.path.join(h.mountpoint, rel.lstrip("/"), paths.CGROUP_PARENT, name))
    return dirs


def create(name: str) -> list[str]:
    """Create the host's cgroups (cpuset ones seeded from their parent, as cgroup v1
    cpuset starts empty and would refuse tasks); return their paths."""
    dirs = host_cgroup_dirs(name)
    for d in dirs:
        parent = Path(d).parent
        for p in (parent, Path(d)):
            p.mkdir(exist_ok=True)
            for knob in ("cpuset.cpus", "cpuset.mems"):
                f = p / knob
                if f.exists() and not f.read_text().strip():
                    f.write_text((p.parent / knob).read_text())
    return dirs


def join(dirs: list[str]) -> None:
    """Move the calling process into *dirs* (used as a preexec_fn: runs in the child)."""
    pid = str(os.getpid())
    for d in dirs:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(pid)


def remove(dirs: list[str]) -> list[str]:
    """rmdir each directory tree bottom-up (cgroup files vanish with their dir);
    return the directories that could not be removed (still had processes)."""
    failed = []
    for d in dirs:
        if not os.path.isdir(d):
            continue
        for root, subdirs, _files in os.walk(d, topdown=False):  # noqa: B007
            try:
                os.rmdir(root)
            except OSError:
                failed.append(root)
    return failed


def pids_in(dirs: list[str]) -> list[int]:
    """Every process in the cgroup trees *dirs* (as seen from our PID namespace)."""
    pids: set[int] = set()
    for d in dirs:
        for root, _subdirs, files in os.walk(d):
            if "cgroup.procs" in files:
                try:
                    with open(os.path.join(root, "cgroup.procs")) as f:
                        pids.update(int(p) for p in f.read().split() if p.strip() not in ("", "0"))
                except OSError:
                    pass
    return sorted(pids)


def leftovers() -> list[str]:
    """Our parent directories anywhere near the top of each hierarchy."""
    found = []
    for h in hierarchies():
        base = Path(h.mountpoint)
        for depth in range(0, 4):
            pattern = "/".join(["*"] * depth + [paths.CGROUP_PARENT])
            found += [str(p) for p in base.glob(pattern) if p.is_dir()]
    return sorted(set(found))
