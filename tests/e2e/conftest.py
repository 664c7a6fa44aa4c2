"""End-to-end fixtures: a simulated fleet of 3 Sparks, and pyinfra run against it.

The session fixture `testbed` boots `sparkfleet testbed up --hosts 3` once (all hosts
unswitched; a test that needs a wrong GPU, an x86 host, a full disk or no NVIDIA runtime
flips it with ``testbed.switched("spark-2", gpu="NVIDIA H100 80GB HBM3")``, reverted on
exit) and removes the fleet at the end of the session.

Needs root and the testbed's system tools: without them the tests FAIL, with the reason
(they are part of `make test`; a skip would hide that nothing end-to-end ran).

Environment knobs for development:
  SPARKFLEET_TESTBED_REUSE=1  reuse a fleet that is already up (>= 3 healthy hosts)
  SPARKFLEET_KEEP_TESTBED=1   leave the fleet up after the session
  SPARKFLEET_TESTBED_INSTANCE=N  use a second, independent fleet (sparkfleet/testbed/paths.py)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest
from support.failures import telling_lines

from sparkfleet.testbed import paths as _paths

REPO_ROOT = Path(__file__).resolve().parents[2]
# inventory/testbed.py, or the generated one of SPARKFLEET_TESTBED_INSTANCE=N.
INVENTORY = str(_paths.INVENTORY.relative_to(REPO_ROOT))
N_HOSTS = 3


def pytest_collection_modifyitems(config, items):
    """Every test under tests/e2e is an e2e test (`-m "not e2e"` deselects them), run once
    more where it fails: three fleets share CI's two cores, and a step that times out
    there once is not the regression a second failure is. pytest lists each rerun (RERUN),
    and make test's last lines repeat them."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.flaky(reruns=1))


_RERUN: list = []


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":
        _RERUN.append(report)


def pytest_terminal_summary(terminalreporter):
    """The failure that made a test run again: pytest-rerunfailures prints only the last
    attempt's, so a rerun that fails for another reason would hide the first cause."""
    for report in _RERUN:
        terminalreporter.write_sep("_", f"first attempt of {report.nodeid} (rerun)")
        terminalreporter.write_line(report.longreprtext[-6000:])


def _environment_problem() -> str | None:
    if os.geteuid() != 0:
        return "the e2e tests need root (network namespaces, overlay mounts, systemd-nspawn)"
    from sparkfleet.testbed.proc import missing_tools

    missing = missing_tools()
    if missing:
        return (f"the e2e tests need {', '.join(sorted(missing))}: "
                f"apt-get install -y {' '.join(sorted(set(missing.values())))}")
    return None


def _reusable():
    from sparkfleet.testbed import fleet, login

    st = fleet.status()
    if not st or len(st["hosts"]) < N_HOSTS:
        return None
    tb = fleet.load()
    if (tb.state.login, tb.state.names) != (login.DEFAULT_LOGIN, login.DEFAULT_NAMES):
        return None  # the session's fleet is as DGX OS sets a Spark up
    if all(h["pid"] and h["ssh"] for h in st["hosts"]) and all(s["pid"] for s in st["services"]):
        return tb
    return None


@pytest.fixture(scope="session")
def testbed():
    """A running simulated fleet (sparkfleet.testbed.fleet.Testbed) of spark-1..3."""
    problem = _environment_problem()
    if problem:
        pytest.fail(problem, pytrace=False)
    from sparkfleet.testbed import fleet

    tb = _reusable() if os.environ.get("SPARKFLEET_TESTBED_REUSE") == "1" else None
    owned = tb is None
    if owned:
        # As DGX OS sets a Spark up: a password-sudo user, names only the controller resolves.
        tb = fleet.up(N_HOSTS)
    try:
        yield tb
    finally:
        if owned and os.environ.get("SPARKFLEET_KEEP_TESTBED") != "1":
            fleet.down()


def run_pyinfra(*args: str, timeout: float = 1200, env: dict[str, str] | None = None,
                inventory: str = INVENTORY) -> subprocess.CompletedProcess:
    """`pyinfra -y inventory/testbed.py ARGS...` from the repo root; output captured
    (text), never raises on a non-zero exit: tests assert on returncode/stdout."""
    cmd = ["pyinfra", "-y", inventory, *args]
    with subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
            result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # config.py: every greenlet's stack, what each host waits on
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            out, err = proc.communicate()
            result = subprocess.CompletedProcess(cmd, 124, out, err + f"\n[timed out after {timeout}s]")
    if result.returncode:
        # Shown (captured) only if the test fails: the lines that say which host failed and why.
        lines = (result.stdout + result.stderr).splitlines()
        print(f"pyinfra {' '.join(args)}: exit {result.returncode}")
        print("\n".join(telling_lines("\n".join(lines))))
        if result.returncode == 124:  # where each host's greenlet waited (the stacks config.py printed)
            print("\n".join(block for block in result.stderr.split("\n--- ") if "Host(" in block.split("\n")[0]))
    return result


@pytest.fixture(name="run_pyinfra")
def run_pyinfra_fixture(testbed):
    """The run_pyinfra helper, with the fleet guaranteed up."""
    return run_pyinfra


@contextlib.contextmanager
def module_fleet(n_hosts: int, *args, **kwargs):
    """A fresh fleet for one module (nothing cached anywhere), ``fleet.up``'s arguments: it
    replaces the session's fleet, which the session's teardown then removes. So a module
    that uses one sorts after every module on the session's fleet. Removed at the module's
    end unless SPARKFLEET_KEEP_TESTBED=1."""
    problem = _environment_problem()
    if problem:
        pytest.fail(problem, pytrace=False)
    from sparkfleet.testbed import fleet

    tb = fleet.up(n_hosts, *args, **kwargs)
    try:
        yield tb
    finally:
        if os.environ.get("SPARKFLEET_KEEP_TESTBED") != "1":
            fleet.down()


@pytest.fixture(scope="module")
def fleet4():
    """A fresh fleet of 4 hosts (test_mirror_fleet.py)."""
    with module_fleet(4) as tb:
        yield tb


@pytest.fixture(name="deploy_run")
def deploy_run_fixture():
    """run_pyinfra, for tests that bring their own fleet (fleet4)."""
    return run_pyinfra
