"""Controller-side servers on the bridge address: registry, hub, apt repo.

Each runs detached (own session), logs to STATE_DIR/logs/<name>.log, and is recorded in
the state with its PID and a *marker*: a string unique to its command line (a path under
STATE_DIR), checked before signalling so a recycled PID is never killed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import paths
from .proc import TestbedError, all_pids, cmdline, kill_wait, log, pid_alive, pid_matches, start_detached, wait_until
from .state import ServiceState


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def start(
    name: str,
    argv: Sequence[str | Path],
    *,
    url: str,
    marker: str,
    port: int,
    ready: Callable[[], bool] | None = None,
    timeout: float = 30,
    env: dict[str, str] | None = None,
) -> ServiceState:
    """Start a server and wait until it accepts connections on CONTROLLER_IP:port (and
    *ready* holds, if given)."""
    if port_open(paths.CONTROLLER_IP, port, timeout=0.3):
        raise TestbedError(f"{name}: something already listens on {paths.CONTROLLER_IP}:{port}")
    logf = paths.LOG_DIR / f"{name}.log"
    pid = start_detached(argv, logf, env=env, cwd=Path("/"))
    svc = ServiceState(name=name, pid=pid, url=url, marker=marker, log=str(logf))

    def up() -> bool:
        if not pid_alive(pid):
            tail = logf.read_text(errors="replace")[-1500:] if logf.exists() else ""
            raise TestbedError(f"{name} exited at start; log {logf}:\n{tail}")
        return port_open(paths.CONTROLLER_IP, port) and (ready is None or ready())

    try:
        wait_until(up, timeout, interval=0.2, what=f"{name} on port {port}")
    except TestbedError:
        stop(svc)
        raise
    log(f"{name} up at {url} (pid {pid})")
    return svc


def stop(svc: ServiceState) -> None:
    if svc.pid and pid_matches(svc.pid, svc.marker):
        kill_wait(svc.pid, sig=signal.SIGTERM, grace=10)
    svc.pid = None


#: Exact arguments our servers are started with (config file / served directory);
#: a process is only taken for a stray of ours if one of its arguments equals one.
MARKERS = (
    str(paths.STATE_DIR / "registry" / "config.yml"),
    str(paths.STATE_DIR / "apt"),
    str(paths.STATE_DIR / "hub" / "repos"),
)


def stray_pids() -> list[int]:
    """Servers of an earlier run that were not recorded (e.g. the state file was lost)."""
    me = os.getpid()
    return [pid for pid in all_pids()
            if pid != me and any(a in MARKERS for a in cmdline(pid)[1:])]


def python() -> str:
    return sys.executable
