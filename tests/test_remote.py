"""remote.put/get: files pass only through a private directory and land with their mode."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
from types import SimpleNamespace

import pytest
from pyinfra.api import Config, Inventory, State, StringCommand
from pyinfra.connectors.util import CommandOutput

from sparkfleet import remote

REAL_CONNECTOR_ARGUMENTS = remote.connector_arguments


class LocalHost:
    """A pyinfra host on this machine, recording what each upload went through."""

    name = "local"

    def __init__(self):
        self.uploads: list[tuple[str, int, int]] = []  # (path, file mode, parent directory mode)

    def run_shell_command(self, command, print_output=False, **_):
        proc = subprocess.run(["sh", "-c", command.get_raw_value()], capture_output=True, text=True, timeout=60)
        return proc.returncode == 0, SimpleNamespace(stdout_lines=proc.stdout.splitlines(),
                                                     stderr_lines=proc.stderr.splitlines())

    def put_file(self, source, dest, print_output=False, **arguments):
        assert "_sudo" not in arguments  # the SSH user writes into its own directory
        with open(dest, "wb") as out:  # as sftp does: the server's default mode
            shutil.copyfileobj(source if hasattr(source, "read") else open(source, "rb"), out)
        self.uploads.append((dest, stat.S_IMODE(os.stat(dest).st_mode),
                             stat.S_IMODE(os.stat(os.path.dirname(dest)).st_mode)))
        return True

    def get_file(self, remote_path, dest, print_output=False, **arguments):
        assert "_sudo" not in arguments
        with open(remote_path, "rb") as f:
            dest.write(f.read())
        return True


@pytest.fixture(autouse=True)
def as_sudo(monkeypatch):
    monkeypatch.setattr(remote, "connector_arguments", lambda host: {"_sudo": True, "_sudo_password": "x"})
    monkeypatch.setattr(remote, "_unprivileged", lambda a: {k: v for k, v in a.items() if "sudo" not in k})


def test_a_secret_is_private_on_the_way_and_in_place(tmp_path):
    host = LocalHost()
    dest = tmp_path / "hf.env"
    remote.put(host, io.BytesIO(b"HF_TOKEN=hf_secret\n"), str(dest), "0600")
    assert dest.read_bytes() == b"HF_TOKEN=hf_secret\n"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    [(through, _, directory_mode)] = host.uploads
    assert directory_mode == 0o700 and not os.path.exists(through)  # only a 0700 directory, then gone
    assert not list(tmp_path.glob("*.sparkfleet-new"))


def test_an_existing_file_is_replaced_with_the_new_mode(tmp_path):
    dest = tmp_path / "key"
    dest.write_text("old")
    os.chmod(dest, 0o644)
    remote.put(LocalHost(), b"new", str(dest), "0640")
    assert dest.read_text() == "new" and stat.S_IMODE(dest.stat().st_mode) == 0o640


def test_get_reads_through_a_private_directory(tmp_path):
    src = tmp_path / "result.json"
    src.write_text('{"ok": true}')
    out = io.BytesIO()
    remote.get(LocalHost(), str(src), out)
    assert out.getvalue() == b'{"ok": true}'


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


def test_run_carries_the_hosts_sudo_settings(sudo_host, monkeypatch):
    monkeypatch.setattr(remote, "connector_arguments", REAL_CONNECTOR_ARGUMENTS)  # not as_sudo's stand-in
    host, calls = sudo_host
    assert remote.run(host, "true").ok
    [(command, arguments)] = calls
    assert command == "true"
    assert arguments["_sudo"] is True and arguments["_sudo_user"] == "svc"
    assert arguments["_sudo_password"] == "pw" and arguments["_use_sudo_login"] is True


def test_fail_names_the_problem_and_exits_non_zero():
    command = remote.fail("model_dir /x holds no checkpoint")
    assert isinstance(command, StringCommand)
    text = str(command)
    assert "model_dir /x holds no checkpoint" in text and text.endswith("exit 1")
    probe = str(remote.fail_unless("curl -sf http://m/", "the mirror does not answer"))
    assert probe.startswith("curl -sf http://m/ ||") and "exit 1" in probe
