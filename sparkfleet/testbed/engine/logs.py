"""vLLM's log line format, and the startup failure that ends the process as vLLM's does."""
from __future__ import annotations

import os
import sys
import threading
import time

LOG_LOCK = threading.Lock()


class StartupError(Exception):
    """Startup failed the way vLLM fails (message printed, exit 1)."""


def log(level: str, where: str, msg: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    with LOG_LOCK:
        print(f"(APIServer pid={os.getpid()}) {level} {stamp} [{where}] {msg}", file=sys.stderr, flush=True)
