"""The restart decision of the serving step, without a fleet: ``service.serving`` restarts
only when the unit is not active, or started another revision than the one wanted, or an
input the revision does not cover changed; a serving host's restart takes its turn of the
rollout. And ``revision()``, the hash of what the service runs.

The operation's generator runs on an @fake host of a real pyinfra State, with the two
reads it makes (the unit's state, the revision it started with) patched."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand, StringCommand
from pyinfra.context import ctx_host
from support.fleetdata import defaults, fake_state

from sparkfleet import rollout, service, snapshot
from sparkfleet.config import validate_host_data
from sparkfleet.fleet import validate_fleet
from sparkfleet.hostpaths import REVISION_FILE, STARTED_FILE, UNIT
from sparkfleet.pairs import PairMember, fleet_pairs

ROOT = Path(__file__).resolve().parents[1]
REV = "0123456789abcdef0123456789abcdef"
ACTIVE = {"ActiveState": "active", "SubState": "running", "NRestarts": "0"}
RESTART = [f"echo {REV} > {REVISION_FILE}", f"systemctl reset-failed {UNIT} 2>/dev/null; systemctl restart {UNIT}"]


@pytest.fixture()
def spark(monkeypatch):
    """The current host, its noops and the rollout turns it planned."""
    with fake_state(["@fake/spark-1", "@fake/spark-2"], pair_a=["@fake/spark-1", "@fake/spark-2"]) as state:
        current = state.inventory.get_host("@fake/spark-1")
        current.noops, current.planned = [], []
        monkeypatch.setattr(current, "noop", current.noops.append)
        monkeypatch.setattr(rollout, "planned", lambda settings, member=None: current.planned.append((settings, member)))
        with ctx_host.use(current):
            yield current


def serving(monkeypatch, unit: dict, started: str | None, **arguments) -> list:
    """What ``serving`` yields on a host whose unit is ``unit`` and started ``started``."""
    monkeypatch.setattr(snapshot, "unit", lambda name: unit if name == UNIT else pytest.fail(name))
    monkeypatch.setattr(snapshot, "first_line", lambda path: started if path == STARTED_FILE else pytest.fail(path))
    return list(service.serving._inner(**{"revision": REV, "restart": False, **arguments}))


def shell(commands: list) -> list[str]:
    return [c.get_raw_value() if isinstance(c, StringCommand) else c for c in commands]


def test_a_service_that_runs_the_wanted_revision_is_left_alone(spark, monkeypatch):
    assert serving(monkeypatch, ACTIVE, REV) == []
    assert spark.noops == [f"{UNIT} runs these settings"] and spark.planned == []


@pytest.mark.parametrize("unit,started,why", [
    (ACTIVE, "fedcba9876543210fedcba9876543210", "started another revision"),
    (ACTIVE, None, "no record of what it started with (started by hand, or before sparkfleet)"),
    ({"ActiveState": "failed", "SubState": "failed"}, REV, "failed"),
    ({"ActiveState": "activating", "SubState": "auto-restart"}, REV, "crash loop"),
    ({"ActiveState": "inactive", "SubState": "dead"}, REV, "stopped"),
    ({}, None, "a fresh host: no unit yet"),
], ids=["another-revision", "no-record", "failed", "crash-loop", "stopped", "fresh-host"])
def test_a_service_not_running_the_wanted_revision_restarts_on_it(spark, monkeypatch, unit, started, why):
    assert shell(serving(monkeypatch, unit, started)) == RESTART, why
    assert spark.noops == []


def test_an_input_the_revision_does_not_cover_restarts_a_service_that_runs_it(spark, monkeypatch):
    assert shell(serving(monkeypatch, ACTIVE, REV, restart=True)) == RESTART  # e.g. a rebuilt checkpoint


def test_a_serving_host_restarts_in_its_turn_of_the_rollout(spark, monkeypatch):
    s = validate_host_data("spark-1", defaults())
    pair = fleet_pairs(spark.state.inventory, validate_fleet(spark.state.inventory))[0]["@fake/spark-1"]
    member = PairMember(pair, "enp1s0f1np1", "rocep1s0f1")
    commands = serving(monkeypatch, ACTIVE, "an-older-revision", rolling=s, member=member)
    assert spark.planned == [(s, pair)]  # it takes a turn, planned with the others
    [command] = commands  # no restart of its own: the turn restarts it
    assert isinstance(command, FunctionCommand)
    assert inspect.getclosurevars(command.function).nonlocals["function"] is rollout.rolled
    assert command.args == (s, REV, pair) and command.kwargs == {}


def test_a_serving_host_that_runs_the_wanted_revision_takes_no_turn(spark, monkeypatch):
    s = validate_host_data("spark-1", defaults())
    assert serving(monkeypatch, ACTIVE, REV, rolling=s) == []
    assert spark.planned == [] and spark.noops == [f"{UNIT} runs these settings"]


# --- revision() ---------------------------------------------------------------------------------


def test_the_revision_is_one_short_hash_of_everything_the_service_runs():
    wanted = service.revision("SF_PROFILE=base\n", "[Unit]\n", "sig-1")
    assert len(wanted) == 32 and int(wanted, 16) >= 0
    assert service.revision("SF_PROFILE=base\n", "[Unit]\n", "sig-1") == wanted  # the same inputs, the same hash
    changed = {service.revision("SF_PROFILE=dflash\n", "[Unit]\n", "sig-1"),  # serve.env
               service.revision("SF_PROFILE=base\n", "[Unit]\nX=1\n", "sig-1"),  # the unit
               service.revision("SF_PROFILE=base\n", "[Unit]\n", "sig-2"),  # the compile signature
               service.revision("SF_PROFILE=base\n[Unit]\n", "", "sig-1")}  # a line moved between files
    assert wanted not in changed and len(changed) == 4


def test_the_revision_covers_the_runtime_copy_but_not_pythons_caches(tmp_path, monkeypatch):
    project = service.revision("A=1\n", "[Unit]\n", "sig")
    shutil.copytree(ROOT / "runtime", tmp_path / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(service, "PROJECT", tmp_path)
    wanted = service.revision("A=1\n", "[Unit]\n", "sig")
    assert wanted == project  # a copy of the project's runtime/ is the same runtime
    (tmp_path / "runtime" / "__pycache__").mkdir()
    (tmp_path / "runtime" / "__pycache__" / "serve.cpython-312.pyc").write_bytes(b"\0")
    (tmp_path / "runtime" / "stray.pyc").write_bytes(b"\0")
    assert service.revision("A=1\n", "[Unit]\n", "sig") == wanted
    serve = tmp_path / "runtime" / "serve.py"
    serve.write_text(serve.read_text() + "\n# edited\n")
    edited = service.revision("A=1\n", "[Unit]\n", "sig")
    assert edited != wanted
    (tmp_path / "runtime" / "serve_extra.py").write_text("")  # a new, empty file counts too
    assert service.revision("A=1\n", "[Unit]\n", "sig") not in (wanted, edited)
