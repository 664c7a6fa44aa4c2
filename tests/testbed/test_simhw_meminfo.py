"""The simulated /proc/meminfo follows a large process's exit at once, as the kernel's does."""

from __future__ import annotations

import subprocess
import threading
import time

from sparkfleet.testbed.simhw import meminfo


def test_the_loop_wakes_when_a_watched_process_exits():
    child = subprocess.Popen(["sleep", "30"])
    try:
        threading.Timer(0.3, child.kill).start()
        started = time.monotonic()
        meminfo.wait_for_exit([child.pid], 10.0)
        assert time.monotonic() - started < 3.0
    finally:
        child.kill()
        child.wait()


def test_without_an_exit_the_loop_sleeps_its_second():
    child = subprocess.Popen(["sleep", "30"])
    try:
        started = time.monotonic()
        meminfo.wait_for_exit([child.pid], 0.5)
        assert time.monotonic() - started >= 0.45
    finally:
        child.kill()
        child.wait()


def test_large_processes_are_listed_for_watching():
    hog = subprocess.Popen(["python3", "-c", "import time; b = bytearray(b'x') * (200 << 20); time.sleep(30)"])
    try:
        large: list[int] = []
        deadline = time.monotonic() + 10
        while hog.pid not in large and time.monotonic() < deadline:
            large.clear()
            meminfo.resident_kib(large)
            time.sleep(0.1)
        assert hog.pid in large
    finally:
        hog.kill()
        hog.wait()
