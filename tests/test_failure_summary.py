"""The failure summary CI keeps: a failed operation comes with what its host printed."""

from __future__ import annotations

from support.failures import telling_lines

RUN = """--> Starting operation: preflight: GB10, aarch64, driver, docker, disk, memory
    [spark-1.local] No changes
    [spark-3.local] preflight failed, nothing was changed on this host:
    [spark-3.local]   - port 8000, the engine's API, is held by python3 (pid 3065): stop that process
    [spark-2.local] No changes
    [spark-3.local] Error: executed 0 commands

--> Disconnecting from hosts...
"""


def test_a_failed_operation_brings_its_hosts_lines_before_it():
    assert telling_lines(RUN) == [
        "[spark-3.local] preflight failed, nothing was changed on this host:",
        "[spark-3.local]   - port 8000, the engine's API, is held by python3 (pid 3065): stop that process",
        "[spark-3.local] Error: executed 0 commands",
    ]


def test_a_line_said_twice_is_told_once():
    # pytest's assertion message repeats the run's output in the result's repr.
    assert telling_lines(RUN + RUN) == telling_lines(RUN)


def test_a_run_that_says_nothing_telling_gives_nothing():
    assert telling_lines("--> Loading config...\n    [spark-1.local] Success\n") == []
