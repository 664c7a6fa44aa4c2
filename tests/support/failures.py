"""What a pyinfra run printed that says why it failed, for a test's failure summary, and
what it changed, for a test of a run that should change nothing."""

from __future__ import annotations

import re

# The lines of a failed run that say why: pyinfra's per-host errors, a stopped rollout, a
# traceback. CI's log keeps only the summary's first line of each failure, so they go first.
_TELLING = re.compile(r"\] Error|rollout stopped|Traceback|\berror:|Error response|timed out after")
#: pyinfra's line for a failed operation; the host's lines just before it say what failed.
_FAILED_OP = re.compile(r"^(\[[^\]]+\]) Error: executed")
#: pyinfra's header of an operation, and a host's result of it that changed or failed it
#: (``.local``: a fleet reached by alias names; pyinfra pads a name to the inventory's
#: longest, spark-9 beside spark-10; ``nested``: an operation run inside another).
_OPERATION = re.compile(r"^--> Starting operation: (.*?)\s*$")
_CHANGED = re.compile(r"^\[([^\]\s]+?)(?:\.local)?\]\s+(?:nested\s+)?(Success|Error)")


def changes(text: str) -> list[str]:
    """Each operation a run changed or failed on a host, as "host: operation", in order:
    an assertion that a run changed nothing shows which operation did, where the tail of
    the output shows only the results table."""
    found, operation = [], "?"
    for line in text.splitlines():
        line = line.strip()
        if header := _OPERATION.match(line):
            operation = header[1]
        elif result := _CHANGED.match(line):
            found.append(f"{result[1]}: {operation}" + (" (failed)" if result[2] == "Error" else ""))
    return found


def changed_hosts(text: str) -> set[str]:
    """The hosts a run changed or failed an operation on."""
    return {change.split(":", 1)[0] for change in changes(text)}


def telling_lines(text: str) -> list[str]:
    """The lines of ``text`` that say why a run failed, each once, in order; before a failed
    operation's line, that host's last lines before it (what the operation printed)."""
    lines = [line.strip() for line in text.splitlines()]
    found: list[str] = []
    for i, line in enumerate(lines):
        if not _TELLING.search(line):
            continue
        failed = _FAILED_OP.match(line)
        if failed:
            found += [before for before in lines[max(0, i - 4):i] if before.startswith(failed[1] + " ")][-3:]
        found.append(line)
    return list(dict.fromkeys(found))


def explain(longrepr, captured: str) -> None:
    """Put a failed test's telling lines where CI's log shows them: first on the summary's
    line, and as a section of the failure's report, which a rerun's "first attempt" prints
    too (it prints neither the summary line nor the captured output). An assertion that
    shows only the tail of a run's output can miss the host that failed early; run_pyinfra
    printed the telling lines, captured with the test's stdout."""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is None:
        return
    telling = telling_lines(crash.message) or telling_lines(captured)
    if not telling:
        return
    crash.message = " | ".join(telling[-4:])[:900] + "\n" + crash.message
    if hasattr(longrepr, "addsection"):
        longrepr.addsection("why the run failed", "\n".join(telling))
