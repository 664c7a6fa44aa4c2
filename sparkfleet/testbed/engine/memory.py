"""The GB10's unified memory as the simulated engine takes it (vLLM 0.23's check).

The host's memory is simulated (sparkfleet/testbed/simhw/meminfo.py): its /proc/meminfo
says what a GB10 says, and it keeps its figures in ``STATE_DIR``, in the host's /dev/shm,
which the serving container shares (``--ipc host``). The engine reserves what vLLM holds
there, in a file it keeps locked while it lives: a killed engine frees its memory as a
dead process does. Without that directory (the engine run on its own, in unit tests) the
memory is not simulated.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .logs import StartupError, log

try:  # in the image, runtime/startup.py ships beside the engine (testbed/image.py)
    from . import startup  # type: ignore[attr-defined]
except ImportError:  # the source tree
    from runtime import startup

STATE_DIR = "/dev/shm/sparkfleet-sim-memory"
KIB = 1024


def state_dir(env: dict[str, str]) -> Path:
    return Path(env.get("SIM_MEMORY_DIR", STATE_DIR))


def _kib(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def others_reserved_kib(reserve_dir: Path, mine: Path | None = None) -> int:
    """What the live reservations other than ``mine`` hold (a file no process locks is a
    dead engine's: nothing)."""
    total = 0
    for path in reserve_dir.glob("*"):
        if mine is not None and path == mine:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: a dead engine's
        except OSError:
            total += _kib(path)
        finally:
            os.close(fd)
    return total


class Memory:
    """This engine's share of the host's simulated memory."""

    def __init__(self, env: dict[str, str]) -> None:
        root = state_dir(env)
        base = root / "base"
        self.simulated = base.is_file()
        self.total_kib = self.available_kib = 0
        self.path: Path | None = None
        self._fd: int | None = None
        if not self.simulated:
            return
        total, available = (int(x) for x in base.read_text().split()[:2])
        self.total_kib, self.base_available_kib = total, available
        self.root = root
        (root / "reserve").mkdir(exist_ok=True)
        self.path = root / "reserve" / f"engine-{socket.gethostname()}-{os.getpid()}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # held until this process ends, however it ends
        self.held_kib = 0

    def available_kib_now(self) -> int:
        """MemAvailable as the host's /proc/meminfo says it, this engine's share included."""
        growth = _kib(self.root / "host_used_kib")
        others = others_reserved_kib(self.root / "reserve", self.path)
        return self.base_available_kib - growth - others - self.held_kib

    def hold(self, gib: float) -> None:
        if self._fd is None:
            return
        self.held_kib = int(gib * startup.GIB / KIB)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{self.held_kib}\n".encode(), 0)

    def check(self, utilization: float) -> float:
        """Take the engine's pre-check share, then check as vLLM 0.23 does (its message on a
        refusal); returns the GiB this engine will hold once loaded (0 when not simulated)."""
        if not self.simulated:
            log("INFO", "sim", "memory not simulated (no simulated host memory): no check")
            return 0.0
        before = self.available_kib_now() * KIB / startup.GIB
        self.hold(startup.ENGINE_PRECHECK_GIB)
        free = self.available_kib_now() * KIB / startup.GIB
        total = self.total_kib * KIB / startup.GIB
        refused = startup.refusal(utilization, free, total)
        if refused:
            raise StartupError(refused)
        # vLLM sizes its KV cache so the device's use reaches utilization x total: what
        # others held at its start counts against it (0.82 leaves ~22 GiB to the OS).
        final = max(startup.ENGINE_PRECHECK_GIB, startup.requested_gib(utilization, total) - (total - before))
        log("INFO", "worker_utils.py:88", f"Free memory on device cuda:0 ({free:.2f}/{total:.2f} GiB) on startup; "
            f"requested {startup.requested_gib(utilization, total):.2f} GiB (gpu_memory_utilization={utilization})")
        return final
