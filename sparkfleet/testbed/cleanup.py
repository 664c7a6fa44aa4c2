"""Remove everything a testbed run made: by the PIDs and names recorded in the state
file, and by a scan for our names (for leftovers of a run whose state was lost).

Order matters: processes first (they hold mounts, netns and cgroups), then mounts,
cgroups, network objects, and only then the state directory, whose deletion is refused
while anything is still mounted below it.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from . import cgroups, network, pairs, paths, rootfs, services
from .hosts import kill_netns_processes
from .proc import TestbedError, all_pids, cmdline, kill_wait, log, pid_alive, pid_matches, run, wait_until
from .state import State


def _stray_nspawn_pids() -> list[int]:
    marker = str(paths.HOSTS_DIR) + "/"
    out = []
    for pid in all_pids():
        argv = cmdline(pid)
        if argv and argv[0].endswith("systemd-nspawn") and any(marker in a for a in argv):
            out.append(pid)
    return out


def stop_hosts(state: State | None, grace: float = 3) -> None:
    """Stop every host container: SIGTERM to all at once (nspawn starts an orderly
    poweroff), a short *grace*, then SIGKILL: the hosts are being discarded, and an
    orderly stop waits up to `docker stop -t 30` for a serving container."""
    pids = set(_stray_nspawn_pids())
    if state:
        pids |= {h.pid for h in state.hosts.values() if h.pid and pid_matches(h.pid, "systemd-nspawn")}
    for pid in pids:
        try:
            __import__("os").kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if pids:
        log(f"stopping {len(pids)} host container(s)")
        try:
            wait_until(lambda: not any(pid_alive(p) for p in pids), grace, interval=0.2,
                       what="host containers to power off")
        except TestbedError:
            pass
    for pid in pids:
        if pid_alive(pid):
            kill_wait(pid, sig=signal.SIGKILL, grace=10)
    for ns in network.our_netns():
        kill_netns_processes(ns)
    if state:
        for h in state.hosts.values():
            h.pid = None


def stop_services(state: State | None) -> None:
    if state:
        for svc in state.services.values():
            services.stop(svc)
    for pid in services.stray_pids():
        log(f"stopping stray testbed process {pid}: {' '.join(cmdline(pid))[:120]}")
        kill_wait(pid, sig=signal.SIGTERM, grace=10)


def unmount_all() -> None:
    for root in (paths.STATE_DIR, paths.CACHE_DIR):
        for mp in rootfs.mounts_below(root):
            cp = run(["umount", mp], timeout=60, check=False)
            if cp.returncode != 0:
                run(["umount", "-l", mp], timeout=60, check=False)
    left = rootfs.mounts_below(paths.STATE_DIR)
    if left:
        raise TestbedError(f"still mounted: {', '.join(left)}")


def remove_cgroups() -> None:
    """Kill whatever still runs in our cgroups (a process that left the host's netns,
    e.g. in a container of its own), then remove the cgroup directories."""
    dirs = cgroups.leftovers()
    for pid in cgroups.pids_in(dirs):
        if pid != os.getpid():
            log(f"killing leftover process {pid} in a testbed cgroup: {' '.join(cmdline(pid))[:120]}")
            kill_wait(pid, sig=signal.SIGKILL, grace=5)
    failed = cgroups.remove(dirs)
    if failed:
        log(f"warning: cgroups still in use, left: {', '.join(failed[:5])}")


def teardown(state: State | None = None, *, remove_hosts_json: bool = True) -> None:
    """Remove every container, process, mount, cgroup, netns and link of the testbed,
    and the state directory. The cache (rootfs, image layers, wheels, key) is kept."""
    if state is None:
        state = State.load()
    t0 = time.monotonic()
    stop_hosts(state)
    stop_services(state)
    # gpg may have left an agent for the signing key.
    run(["gpgconf", "--homedir", str(paths.CACHE_DIR / "gnupg"), "--kill", "all"], timeout=30, check=False)
    unmount_all()
    remove_cgroups()
    pairs.remove_all()
    network.remove_all()
    rootfs.remove_stale_builds()
    if paths.STATE_DIR.exists():
        if rootfs.mounts_below(paths.STATE_DIR):
            raise TestbedError(f"refusing to delete {paths.STATE_DIR}: mounts remain below it")
        shutil.rmtree(paths.STATE_DIR)
    if remove_hosts_json:
        paths.HOSTS_JSON.unlink(missing_ok=True)
        paths.SUDO_PASSWORD_FILE.unlink(missing_ok=True)
        paths.SSH_CONFIG.unlink(missing_ok=True)
        for known in paths.KNOWN_HOSTS.parent.glob(f"{paths.KNOWN_HOSTS.name}.*"):
            known.unlink(missing_ok=True)
        if paths.INSTANCE:
            paths.INVENTORY.unlink(missing_ok=True)
    dt = time.monotonic() - t0
    if dt > 5:
        log(f"teardown took {dt:.1f}s")


def leftovers() -> dict[str, list[str]]:
    """What of ours exists right now (empty lists after a clean `down`)."""
    return {
        "nspawn": [str(p) for p in _stray_nspawn_pids()],
        "processes": [str(p) for p in services.stray_pids()],
        "netns": network.our_netns(),
        "links": network.our_links(),
        "mounts": rootfs.mounts_below(paths.STATE_DIR),
        "cgroups": cgroups.leftovers(),
        "state_dir": [str(paths.STATE_DIR)] if paths.STATE_DIR.exists() else [],
    }
