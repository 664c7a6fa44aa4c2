"""sparkfleet.remote: callbacks act on a host with the host's connector arguments."""

from __future__ import annotations

import io

import pytest
from pyinfra.api import Config, Inventory, State, StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.connectors.util import CommandOutput

from sparkfleet import remote


@pytest.fixture
def sudo_host():
    """A @fake host whose data asks for sudo as another user, with a password."""
    data = {"_sudo": True, "_sudo_user": "svc", "_sudo_password": "pw", "_use_sudo_login": True}
    inventory = Inventory((["@fake/spark-1"], data))
    state = State(inventory, Config())
    host = inventory.get_host("@fake/spark-1")
    calls: list[tuple[str, dict]] = []

    def run_shell_command(command, print_output=False, **arguments):
        calls.append((str(command), arguments))
        return True, CommandOutput([])

    def put_file(source, dest, print_output=False, **arguments):
        calls.append((f"put {dest}", arguments))
        return True

    def get_file(remote_path, dest, print_output=False, **arguments):
        calls.append((f"get {remote_path}", arguments))
        return False

    host.state = state
    host.run_shell_command = run_shell_command
    host.put_file = put_file
    host.get_file = get_file
    return host, calls


def test_run_put_and_get_carry_the_hosts_sudo_settings(sudo_host):
    host, calls = sudo_host
    assert remote.run(host, "true").ok
    remote.put(host, b"x", "/etc/sparkfleet/x", mode="0600")
    with pytest.raises(OperationError, match="could not download /etc/y"):
        remote.get(host, "/etc/y", io.BytesIO())
    assert [c for c, _ in calls] == ["true", "put /etc/sparkfleet/x", "chmod 0600 /etc/sparkfleet/x", "get /etc/y"]
    for _, arguments in calls:
        assert arguments["_sudo"] is True and arguments["_sudo_user"] == "svc"
        assert arguments["_sudo_password"] == "pw" and arguments["_use_sudo_login"] is True


def test_fail_names_the_problem_and_exits_non_zero():
    command = remote.fail("model_dir /x holds no checkpoint")
    assert isinstance(command, StringCommand)
    text = str(command)
    assert "model_dir /x holds no checkpoint" in text and text.endswith("exit 1")
    probe = str(remote.fail_unless("curl -sf http://m/", "the mirror does not answer"))
    assert probe.startswith("curl -sf http://m/ ||") and "exit 1" in probe
