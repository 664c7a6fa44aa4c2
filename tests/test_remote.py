"""remote.put/get: files pass only through a private directory and land with their mode."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api import Config, Inventory, State, StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.connectors.util import CommandOutput, OutputLine

from sparkfleet import remote
from sparkfleet.config import ConfigError

REAL_CONNECTOR_ARGUMENTS = remote.connector_arguments
REAL_UNPRIVILEGED = remote._unprivileged


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


def test_a_missing_directory_is_made_0755_in_the_same_command(tmp_path):
    host = LocalHost()
    dest = tmp_path / "etc" / "sparkfleet" / "serve.env"
    remote.put(host, b"A=1\n", str(dest), "0600", parent=True)
    assert dest.read_bytes() == b"A=1\n" and stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert stat.S_IMODE(dest.parent.stat().st_mode) == 0o755  # not the copy's umask 077
    with pytest.raises(OperationError):  # without parent=True, no directory is made
        remote.put(host, b"A=1\n", str(tmp_path / "none" / "x"), "0600")


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


# What the login's sudo answers (one try, the password on stdin) when it is refused.
REFUSED = ["login ops", "sudo said: Sorry, try again.", "sudo: no password was provided",
           "sudo: 1 incorrect password attempt"]


def sudo_login(monkeypatch, data: dict, config: Config | None = None, right: str = "right-pw"):
    """A @fake host reached as login ops with password sudo whose password is ``right``:
    (host, the commands it ran with their stdin)."""
    monkeypatch.setattr(remote, "connector_arguments", REAL_CONNECTOR_ARGUMENTS)
    monkeypatch.setattr(remote, "_unprivileged", REAL_UNPRIVILEGED)
    inventory = Inventory((["@fake/spark-1"], {"_sudo": True, **data}))
    host = inventory.get_host("@fake/spark-1")
    host.state = State(inventory, config or Config())
    ran: list[tuple[str, dict]] = []

    def run_shell_command(command, print_output=False, **arguments):
        ran.append((str(command), arguments))
        answer = ["ok"] if arguments.get("_stdin") == right else REFUSED
        return True, CommandOutput([OutputLine("stdout", line) for line in answer])

    host.run_shell_command = run_shell_command
    return host, ran


def test_a_refused_sudo_password_stops_the_run_once_naming_its_file_and_the_fix(monkeypatch):
    host, ran = sudo_login(monkeypatch, {"_sudo_password": "wrong-pw", "_sudo_password_file": "/ctl/sudo-password"})
    with pytest.raises(ConfigError) as caught:
        remote.check_sudo(host)
    message = str(caught.value)
    assert message.startswith("@fake/spark-1: sudo refused the password for ops (`_sudo_password`, read from "
                              "/ctl/sudo-password); nothing was changed on any host."), message
    assert "Fix: put ops's sudo password in /ctl/sudo-password (chmod 600)" in message
    assert "--same-sudo-password" in message and "wrong-pw" not in message
    [(command, arguments)] = ran  # one try, as the login, the password on stdin only
    assert "sudo -k -S" in command and "wrong-pw" not in command
    assert arguments["_stdin"] == "wrong-pw" and not arguments.get("_sudo")


def test_the_password_file_of_the_example_inventory_is_named(monkeypatch, tmp_path):
    kept = tmp_path / "sudo-password"
    kept.write_text("wrong-pw\n")
    monkeypatch.setenv(remote.SUDO_PASSWORD_FILE_ENV, str(kept))  # inventory/sparks.py reads it there
    host, _ = sudo_login(monkeypatch, {"_sudo_password": "wrong-pw"})
    with pytest.raises(ConfigError, match=f"read from {kept}"):
        remote.check_sudo(host)
    kept.write_text("another-pw\n")  # not the file this password came from
    with pytest.raises(ConfigError, match="`_sudo_password` in its host data"):
        remote.check_sudo(host)


def test_a_password_typed_for_same_sudo_password_is_named_as_typed(monkeypatch):
    config = Config()
    config.SUDO_PASSWORD = "wrong-pw"
    host, _ = sudo_login(monkeypatch, {}, config)
    with pytest.raises(ConfigError, match="the password typed for --same-sudo-password"):
        remote.check_sudo(host)


def test_the_right_password_passes_with_one_command(monkeypatch):
    host, ran = sudo_login(monkeypatch, {"_sudo_password": "right-pw"})
    remote.check_sudo(host)
    assert len(ran) == 1


def test_the_sudo_check_tells_where_the_ssh_connection_arrived(monkeypatch):
    """The run's first command answers for $SSH_CONNECTION too: no command of its own."""
    host, ran = sudo_login(monkeypatch, {"_sudo_password": "right-pw"})

    def answer(command, print_output=False, **arguments):
        ran.append((str(command), arguments))
        return True, CommandOutput([OutputLine("stdout", "ssh 10.0.0.5 50022 10.0.0.11 22"),
                                    OutputLine("stdout", "ok")])

    host.run_shell_command = answer
    remote.check_sudo(host)  # "ok" once the address line is taken out: passes
    assert 'echo "ssh ${SSH_CONNECTION:-}"' in ran[0][0]
    assert host.connector_data[remote.SSH_ADDRESS] == "10.0.0.11"


def test_fail_names_the_problem_and_exits_non_zero():
    command = remote.fail("model_dir /x holds no checkpoint")
    assert isinstance(command, StringCommand)
    text = str(command)
    assert "model_dir /x holds no checkpoint" in text and text.endswith("exit 1")
    probe = str(remote.fail_unless("curl -sf http://m/", "the mirror does not answer"))
    assert probe.startswith("curl -sf http://m/ ||") and "exit 1" in probe


FAILING_DEPLOY = '''
from pyinfra.api import operation
from pyinfra.api.exceptions import OperationError

from sparkfleet import remote


def expected(state, host):
    raise OperationError("the thing is missing — set thing_key\\n    log line 1\\n    log line 2")


def bug(state, host):
    raise KeyError("a bug")


@operation(is_idempotent=False)
def step(kind: str):
    yield remote.callback(expected if kind == "expected" else bug)


step(name="the failing step", kind=KIND)
'''


@pytest.mark.parametrize("kind", ["expected", "bug"])
def test_a_callback_failure_is_one_message_and_a_bug_keeps_its_traceback(tmp_path, kind):
    deploy = tmp_path / "deploy.py"
    deploy.write_text(FAILING_DEPLOY.replace("KIND", repr(kind)))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    pyinfra = str(Path(sys.executable).with_name("pyinfra"))
    runs = {flag: subprocess.run([pyinfra, "-y", *flag, "@local", str(deploy)], capture_output=True, text=True,
                                 timeout=120, cwd=tmp_path, env=env) for flag in ((), ("-v",))}
    quiet, verbose = (r.stdout + r.stderr for r in runs.values())
    assert all(r.returncode != 0 for r in runs.values()), quiet
    if kind == "expected":
        assert "[@local] the failing step: the thing is missing — set thing_key" in quiet, quiet
        assert "    log line 2" in quiet
        assert "Traceback" not in quiet and "Unexpected error" not in quiet
        assert "Traceback" in verbose  # -v shows where it came from
    else:
        assert "Traceback" in quiet and "KeyError" in quiet


class GoneHost(LocalHost):
    """A host whose power went: every command after ``alive`` of them breaks the connection."""

    print_prefix = "[gone] "
    current_op_hash = None

    def __init__(self, alive: int = 0):
        super().__init__()
        self.alive = alive
        self.errors: list[str] = []

    def run_shell_command(self, command, print_output=False, **_):
        if self.alive <= 0:
            raise AttributeError("'NoneType' object has no attribute 'open_session'")  # a closed client
        self.alive -= 1
        return super().run_shell_command(command)

    def log_styled(self, message, **_):
        self.errors.append(message)


def test_a_step_whose_host_went_away_says_so_in_one_line_and_a_fault_of_ours_keeps_its_traceback():
    state = SimpleNamespace(print_fact_info=False)

    def step(state, host):
        host.run_shell_command(StringCommand("true"))
        raise KeyError("a fault of the step")

    gone = GoneHost(alive=1)  # the step's first command ran, then the host went
    assert remote.callback(step).execute(state, gone, {}) is False
    assert gone.errors == [f"step: {remote.LOST}"]
    alive = GoneHost(alive=9)  # the host answers: the step's own fault is not hidden
    with pytest.raises(KeyError, match="a fault of the step"):
        remote.callback(step).execute(state, alive, {})


class Channel:
    def recv_exit_status(self) -> int:
        return 0


class Output(list):
    channel = Channel()


class Stdin:
    def __init__(self):
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        pass


def connector_sent(connector_data: dict | None = None, **arguments) -> tuple[str, bytes]:
    """What pyinfra's SSH connector sends a host for ``cat > /etc/x``: the command line
    sshd gets, and the bytes on its stdin."""
    from pyinfra.connectors.ssh import SSHConnector

    sent: dict = {}

    def exec_command(command, get_pty=False):
        sent["command"], sent["stdin"] = command, Stdin()
        return sent["stdin"], Output(), Output()

    host = SimpleNamespace(name="spark-1", print_prefix="[spark-1] ", connector_data=connector_data or {})
    connector = SimpleNamespace(state=None, host=host, client=SimpleNamespace(exec_command=exec_command))
    ok, _ = SSHConnector.run_shell_command(connector, StringCommand("cat", ">", "/etc/x"), **arguments)
    assert ok
    return sent["command"], sent["stdin"].data


def test_the_sudo_password_goes_on_stdin_never_in_the_command():
    command, stdin = connector_sent(_sudo=True, _sudo_password="pa ss;word", _stdin="the file\n")
    assert "pa ss" not in command and "ASKPASS" not in command
    assert command == "sudo -H -S -p '' -k sh -c 'cat > /etc/x'"
    assert stdin == b"pa ss;word\nthe file\n"  # sudo reads its line; the rest is the command's
    command, stdin = connector_sent(_sudo=True, _sudo_password="pw", _sudo_user="serve", _stdin=["a", "b"])
    assert (command, stdin) == ("sudo -H -S -p '' -k -u serve sh -c 'cat > /etc/x'", b"pw\na\nb\n")


def test_without_a_password_or_sudo_the_command_is_pyinfras():
    assert connector_sent(_sudo=True) == ("sudo -H -n sh -c 'cat > /etc/x'", b"")
    assert connector_sent(_stdin="x") == ("sh -c 'cat > /etc/x'", b"x\n")


#: sudo as the check meets it: -k -S -p '' [-u user] then the command; NOPASSWD reads
#: nothing, password sudo reads one line and runs the command only for the right one.
FAKE_SUDO = """#!/bin/sh
while [ "$#" -gt 0 ]; do case "$1" in -k|-S) shift;; -p|-u) shift 2;; *) break;; esac; done
if [ "$SUDO_KIND" = password ]; then
  read -r given || given=
  [ "$given" = right-pw ] || { echo "Sorry, try again." >&2; echo "sudo: 1 incorrect password attempt" >&2; exit 1; }
fi
exec "$@"
"""


@pytest.mark.parametrize(("kind", "given", "free", "refused"), [
    ("nopasswd", "pw", True, False), ("password", "right-pw", False, False), ("password", "wrong-pw", False, True)])
def test_one_sudo_tells_nopasswd_from_password_sudo_and_a_refused_password(monkeypatch, tmp_path, kind, given,
                                                                            free, refused):
    """NOPASSWD sudo reads nothing: the password line is left for the command, which the
    deploy then never sends (it would be read by the command)."""
    (tmp_path / "sudo").write_text(FAKE_SUDO)
    (tmp_path / "sudo").chmod(0o755)
    host, ran = sudo_login(monkeypatch, {"_sudo_password": given})

    def on_this_machine(command, print_output=False, **arguments):
        ran.append((str(command), arguments))
        done = subprocess.run(["sh", "-c", str(command)], input=arguments.get("_stdin", "") + "\n", text=True,
                              capture_output=True, env={**os.environ, "SUDO_KIND": kind,
                                                        "PATH": f"{tmp_path}:{os.environ['PATH']}"})
        return done.returncode == 0, CommandOutput([OutputLine("stdout", line) for line in done.stdout.splitlines()]
                                                   + [OutputLine("stderr", line) for line in done.stderr.splitlines()])

    host.run_shell_command = on_this_machine
    then = ["sh", "-c", 'echo "read as $0"; cat; echo "to stderr" >&2; exit 3', "the first read"]
    if refused:
        with pytest.raises(ConfigError, match="sudo refused the password"):
            remote.check_sudo(host, then=then)
    else:  # what the command printed, after the check's answer; its stdin empty, its stderr and status its own
        assert remote.check_sudo(host, then=then) == ["read as the first read"]
        assert remote.check_sudo(host) is None
        ran.pop()
    assert len(ran) == 1 and ran[0][0].count("sudo -") == 1  # one sudo: one password hash on the host
    assert bool(host.connector_data.get(remote.SUDO_FREE)) is free
    if free:
        assert connector_sent(host.connector_data, _sudo=True, _sudo_password="pw", _stdin="x") == (
            "sudo -H -n sh -c 'cat > /etc/x'", b"x\n")


def test_pyinfras_debug_line_of_a_deploy_masks_the_sudo_password(caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="pyinfra")
    logging.getLogger("pyinfra").debug("Starting deploy %s (args=%r, data=%r)", "Serving",
                                                {"_sudo": True, "_sudo_password": "pa55"}, {})
    assert "pa55" not in caplog.text and "'_sudo_password': '***'" in caplog.text
