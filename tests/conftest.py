"""Make ``tests/`` importable so tests can ``from support.vllm_source import ...``, and
mark the tests that download as ``network`` (``make test-unit`` leaves them out)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from support.failures import explain  # noqa: E402  (tests/ on the path first)

#: Fixtures that fetch from the internet on a cold cache (tests/runtime/conftest.py).
_DOWNLOADING_FIXTURES = {"vllm_tree"}


def _downloads(item) -> bool:
    """A test downloads when it uses real vLLM sources (PyPI sdists, tests/support/vllm_source.py)
    directly or through a fixture; tests that download otherwise carry the marker themselves."""
    if _DOWNLOADING_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return module is not None and any(
        getattr(value, "__name__", None) == "support.vllm_source" or getattr(value, "__module__", None) == "support.vllm_source"
        for value in vars(module).values()
    )


@pytest.fixture(autouse=True)
def _snapshot_hints_of_the_test(tmp_path_factory, monkeypatch):
    """Hosts of a test keep their snapshot hints in a directory of the test's own, not the
    checkout's state directory (where the deploys a test runs in a subprocess keep theirs)."""
    from sparkfleet import snapshot

    monkeypatch.setattr(snapshot, "HINTS", tmp_path_factory.mktemp("snapshot-hints"))
    # Facts' commands are built once per process; a test may patch the paths they are built from.
    monkeypatch.setattr(snapshot, "_COMMANDS", {})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _downloads(item):
            item.add_marker(pytest.mark.network)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        explain(report.longrepr, report.capstdout)
