"""Progress lines for long benches.

Lines go to stderr, flushed, one per event; pyinfra streams them live, prefixed with
the host name. A request can run for minutes (2048 tokens at 28 tok/s is 73 s with no
output for a non-streaming request), so :func:`heartbeat` prints a line every
``every_s`` seconds while a step runs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO | None = None, quiet: bool = False, every_s: float = 15.0) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.every_s = every_s
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def log(self, message: str) -> None:
        if self.quiet:
            return
        elapsed = time.monotonic() - self._t0
        with self._lock:
            self.stream.write(f"[bench {elapsed:6.1f}s] {message}\n")
            self.stream.flush()

    @contextmanager
    def heartbeat(self, what: str) -> Iterator[None]:
        """Print ``what ... still running (N s)`` every ``every_s`` until the block ends."""
        done = threading.Event()
        started = time.monotonic()

        def beat() -> None:
            while not done.wait(self.every_s):
                self.log(f"{what} ... still running ({time.monotonic() - started:.0f} s)")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
