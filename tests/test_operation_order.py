"""config.py's two replacements of pyinfra internals give pyinfra's own answers: the
operation order read from the frames, and the global arguments' type hints read once."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyinfra
import pytest
from pyinfra.api import arguments
from pyinfra.api.util import get_operation_order_from_stack

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def project_config():
    """config.py loaded as pyinfra loads it, pyinfra's functions and signals put back after."""
    saved = (arguments.all_global_arguments, importlib.import_module("pyinfra.api.facts").all_global_arguments,
             importlib.import_module("pyinfra.api.operation").get_operation_order_from_stack,
             signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1))
    spec = importlib.util.spec_from_file_location("sparkfleet_pyinfra_config", ROOT / "config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    arguments.all_global_arguments = saved[0]
    importlib.import_module("pyinfra.api.facts").all_global_arguments = saved[1]
    importlib.import_module("pyinfra.api.operation").get_operation_order_from_stack = saved[2]
    signal.signal(signal.SIGINT, saved[3])
    signal.signal(signal.SIGUSR1, saved[4])


def _nested(depth: int, ask):
    if depth:
        return _nested(depth - 1, ask)
    return ask()


@pytest.mark.parametrize("is_cli", [True, False])
@pytest.mark.parametrize("deploy_file", [__file__, "/no/such/deploy.py", None])
def test_the_order_is_pyinfras(project_config, monkeypatch, is_cli, deploy_file):
    monkeypatch.setattr(pyinfra, "is_cli", is_cli)
    state = SimpleNamespace(current_deploy_filename=deploy_file, current_op_file_number=7)
    # Both asked from the same line of the same frame, as pyinfra's operation wrapper asks.
    ours, theirs = _nested(3, lambda: (project_config._operation_order(state), get_operation_order_from_stack(state)))
    assert ours == theirs
    if deploy_file != "/no/such/deploy.py":  # a deploy file on no frame: pyinfra's order is empty too
        assert len(ours) > 3  # the call chain's lines, not an empty order that would also compare equal


def test_the_global_arguments_are_pyinfras(project_config):
    assert arguments.all_global_arguments() == list(arguments.get_type_hints(arguments.AllArguments).items())
    arguments.all_global_arguments().clear()  # a caller's copy: the next caller still gets them all
    assert arguments.all_global_arguments()


def test_operations_called_from_functions_run_in_call_order(tmp_path):
    """A real run from the project directory (config.py loaded): operations run in the
    order the deploy file calls them, not the order of their lines."""
    deploy = tmp_path / "order.py"
    deploy.write_text(
        "from pyinfra.operations import server\n\n\n"
        "def later():\n"
        "    server.shell(name='op second', commands=['true'])\n\n\n"
        "def sooner():\n"
        "    server.shell(name='op first', commands=['true'])\n\n\n"
        "sooner()\n"
        "later()\n"
        "server.shell(name='op third', commands=['true'])\n"
    )
    run = subprocess.run([sys.executable, "-m", "pyinfra", "-y", "@local", str(deploy)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    started = [line for line in out.splitlines() if "Starting operation: op " in line]
    assert [line.rsplit("op ", 1)[1].strip() for line in started] == ["first", "second", "third"], out
