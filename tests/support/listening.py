"""Wait for a local server a test started to accept connections."""

from __future__ import annotations

import socket
import time


def wait_for_port(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> None:
    """Return once ``host:port`` accepts a connection, or after ``timeout_s`` (the test's
    own request then says what is wrong)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
