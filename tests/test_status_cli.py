"""`sparkfleet status` on an inventory that cannot be read: one line naming the missing file
and the fix, a non-zero exit, no traceback (no fleet)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra.context import ctx_state

from sparkfleet import cli
from sparkfleet.testbed import state as testbed_state


@pytest.fixture(autouse=True)
def _no_state_left():
    yield
    ctx_state.reset()  # status sets pyinfra's state to read an inventory file


def test_a_torn_down_testbeds_inventory_names_the_file_and_testbed_up(tmp_path, capsys):
    # `testbed down` removes an instance's hosts.json and the inventory beside it; pyinfra
    # would take the path for a host name and fail its DNS lookup with a UnicodeError.
    inventory = tmp_path / ".testbed" / "instance-7" / "inventory.py"
    assert cli.main(["status", str(inventory)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"sparkfleet status: inventory {inventory} does not exist: boot the simulated "
                           "fleet with `SPARKFLEET_TESTBED_INSTANCE=7 sparkfleet testbed up`, which writes it")


def test_an_inventory_whose_hosts_json_is_missing_names_hosts_json(tmp_path, capsys):
    inventory = tmp_path / ".testbed" / "instance-7" / "inventory.py"
    inventory.parent.mkdir(parents=True)
    inventory.write_text(testbed_state._INSTANCE_INVENTORY.format(instance=7))
    assert cli.main(["status", str(inventory)]) == 2
    err = capsys.readouterr().err
    assert f"reads {inventory.parent / 'hosts.json'}, which does not exist" in err, err
    assert "`SPARKFLEET_TESTBED_INSTANCE=7 sparkfleet testbed up`" in err and "Traceback" not in err, err


def test_a_missing_inventory_file_elsewhere_names_an_example(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path / "sparks.py")]) == 2
    assert "does not exist: give the path of an inventory file, e.g. inventory/sparks.py" in capsys.readouterr().err


def test_a_fleet_where_no_host_answers_is_a_table_of_unreachable_hosts(tmp_path, capsys, monkeypatch):
    # pyinfra raises "No hosts remaining!" when it reaches none: the table says it instead.
    monkeypatch.chdir(Path(cli.__file__).resolve().parents[1])  # group_data/ of the checkout
    inventory = tmp_path / "sparks.py"
    inventory.write_text('sparks = ["spark-gone.invalid"]\n')
    assert cli.main(["status", str(inventory)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:2] == ["spark-gone.invalid", "unreachable"], out
