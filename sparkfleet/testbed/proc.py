"""Subprocess and process helpers: every external command runs with a timeout.

The testbed drives many system tools (ip, mount, debootstrap, systemd-nspawn...). They
all go through :func:`run` so that a hung tool turns into a clear :class:`TestbedError`
naming the command, instead of a hung `sparkfleet testbed up`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Debian package that provides each system tool the testbed needs (for error messages
#: and for the CI's apt-get line).
REQUIRED_TOOLS: dict[str, str] = {
    "ip": "iproute2",
    "mount": "mount",
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "docker-registry": "docker-registry",
    "apt-ftparchive": "apt-utils",
    "dpkg-deb": "dpkg",
    "gpg": "gnupg",
    "gpgconf": "gnupg",
    "nsenter": "util-linux",
    "setsid": "util-linux",
    "ssh": "openssh-client",
}


class TestbedError(RuntimeError):
    """A testbed operation failed; the message says what and, where known, why."""

    __test__ = False  # not a pytest test class despite the name


def log(msg: str) -> None:
    """Progress line on stderr (stdout is kept for `status` output)."""
    print(f"[testbed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    timeout: float = 60,
    check: bool = True,
    input: str | bytes | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    capture: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run *cmd* (argv, never a shell string) with a timeout; text output.

    Raises TestbedError on timeout, on a missing executable, and (with check) on a
    non-zero exit, quoting the tail of stderr so the cause is visible.
    """
    argv = [str(c) for c in cmd]
    text_input = input.decode() if isinstance(input, bytes) else input
    full_env = None if env is None else {**os.environ, **env}
    try:
        cp = subprocess.run(
            argv,
            input=text_input,
            capture_output=capture,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=cwd,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"timed out after {timeout:.0f}s: {shlex.join(argv)}") from exc
    except FileNotFoundError as exc:
        raise TestbedError(f"command not found: {argv[0]} (needed for: {shlex.join(argv)})") from exc
    if check and cp.returncode != 0:
        tail = ((cp.stderr or "") + (cp.stdout or "")).strip()[-2000:]
        raise TestbedError(f"exit {cp.returncode}: {shlex.join(argv)}\n{tail}")
    return cp


def require_root() -> None:
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces, mounts, systemd-nspawn)")


def missing_tools() -> dict[str, str]:
    """Tools from REQUIRED_TOOLS that are not on PATH, mapped to their Debian package."""
    extra = "/usr/sbin:/sbin:/usr/local/sbin"
    path = os.environ.get("PATH", "") + ":" + extra
    return {t: pkg for t, pkg in REQUIRED_TOOLS.items() if shutil.which(t, path=path) is None}


def require_tools() -> None:
    missing = missing_tools()
    if missing:
        pkgs = " ".join(sorted(set(missing.values())))
        raise TestbedError(
            f"missing tools: {', '.join(sorted(missing))}; install with: apt-get install -y {pkgs}"
        )


# --- detached processes ---------------------------------------------------------------


def start_detached(
    argv: Sequence[str | os.PathLike[str]],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    preexec_fn=None,
) -> int:
    """Start *argv* in its own session (survives the CLI), output to *log_path*; PID.

    `start_new_session` is `setsid`: the child is not killed with our terminal and is not
    in our process group, so `down` from another shell can find it by PID.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=None if env is None else {**os.environ, **env},
            cwd=cwd,
            preexec_fn=preexec_fn,
            close_fds=True,
        )
    # The Popen object is dropped on purpose: the process outlives this one. Reap it if
    # it dies while we are still running, so it does not linger as a zombie and so
    # pid_alive() sees it gone.
    _CHILDREN[proc.pid] = proc
    return proc.pid


_CHILDREN: dict[int, subprocess.Popen] = {}


def _reap(pid: int) -> None:
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        _CHILDREN.pop(pid, None)


def pid_alive(pid: int | None) -> bool:
    """True if *pid* exists and is not a zombie."""
    if not pid:
        return False
    _reap(pid)
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def cmdline(pid: int) -> list[str]:
    """argv of *pid* ([] if gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def pid_matches(pid: int | None, marker: str) -> bool:
    """True if *pid* is alive and its command line contains *marker*.

    Guards against PID reuse: a PID recorded by an earlier run is only signalled if it is
    still the process we started.
    """
    if not pid or not pid_alive(pid):
        return False
    return any(marker in a for a in cmdline(pid))


def kill_wait(pid: int, *, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Send *sig*, wait up to *grace* seconds, then SIGKILL and wait again."""
    for s, wait in ((sig, grace), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, s)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.1)
    if pid_alive(pid):
        raise TestbedError(f"process {pid} ({' '.join(cmdline(pid))[:200]}) did not exit after SIGKILL")


def wait_until(pred, timeout: float, interval: float = 0.5, what: str = "condition"):
    """Poll *pred* until it returns a truthy value or *timeout* passes; return the value."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            val = pred()
            if val:
                return val
        except Exception as exc:  # noqa: BLE001 - re-raised with context below
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc})" if last_exc else ""
            raise TestbedError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]
