"""The failure summary CI keeps: a failed operation comes with what its host printed; a run
that should have changed nothing names each operation that did."""

from __future__ import annotations

from _pytest._code import ExceptionInfo
from support.failures import changed_hosts, changes, explain, telling_lines

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


def test_each_change_is_named_by_its_host_and_operation():
    converged = """--> Starting operation: Mirror | the HF mirror holds every file of the locked commits
    [spark-1.local] mirror-holds-z-lab--DFlash: done in 0 s
    [spark-1.local] Success
    [spark-2.local] No changes
--> Starting operation: Serving | READY: the served model answers
    [spark-2] noop: READY
    [spark-2] No changes
"""
    assert changes(converged + RUN) == ["spark-1: Mirror | the HF mirror holds every file of the locked commits",
                                        "spark-3: preflight: GB10, aarch64, driver, docker, disk, memory (failed)"]
    assert changed_hosts(converged + RUN) == {"spark-1", "spark-3"}
    assert changes(RUN.replace("Error: executed 0 commands", "No changes")) == []
    # Names padded to the inventory's longest, and an operation nested in another.
    padded = "--> Starting operation: Serving | unit \n    [spark-9]  Success\n    [spark-10] nested Success\n"
    assert changes(padded) == ["spark-9: Serving | unit", "spark-10: Serving | unit"]


def _failed_report(message: str):
    try:
        raise AssertionError(message)
    except AssertionError:
        return ExceptionInfo.from_current().getrepr()


def test_a_failure_carries_its_telling_lines_where_a_rerun_shows_them():
    # The assertion shows only the tail of the run; its telling lines were captured.
    longrepr = _failed_report("Grand total 102 4 1 97")
    explain(longrepr, "pyinfra deploy.py: exit 1\n" + RUN)
    assert longrepr.reprcrash.message.startswith("[spark-3.local] preflight failed")
    shown = str(longrepr)  # what a report prints, a rerun's first attempt included
    assert "why the run failed" in shown and "held by python3 (pid 3065)" in shown


def test_a_failure_without_telling_lines_is_left_as_it_is():
    longrepr = _failed_report("assert 1 == 2")
    explain(longrepr, "")
    assert longrepr.reprcrash.message == "assert 1 == 2"
    assert "why the run failed" not in str(longrepr)
