"""One way to act on a host from inside a callback, one way to run a callback, and one
way to fail a host.

pyinfra hands a ``python.call`` / ``FunctionCommand`` callback the host but none of the
connector arguments (``_sudo``, ``_sudo_user``, ``_sudo_password``, ``_use_sudo_login``,
``_su_user``...) that operations and facts run with. Every raw command, upload and
download in sparkfleet goes through :func:`run`, :func:`put` and :func:`get`, which
apply the host's own, so a host reached as an unprivileged SSH user with sudo behaves
the same in a callback as in an operation.

Uploads never pass through a file another user could read: pyinfra's own sudo upload
(``files.put``) lands as ``/tmp/pyinfra-<sha1>`` with the SFTP server's default mode
(0644 under sshd's umask 022) before it is copied; :func:`put` uploads into a 0700
directory of the SSH user and copies into place under umask 077.

The sudo password goes to sudo on its standard input (``sudo -S``), never in a command
line: pyinfra's own way (``env SUDO_ASKPASS=... PYINFRA_SUDO_PASSWORD=<password> sudo
-A``) puts it in the argv of ``env`` and of the login shell on the host, which any user
there reads in ``ps`` for as long as the command runs. It also spares every host the
two commands that make and remove pyinfra's askpass script. :func:`_sudo_reads_stdin`
installs this for every SSH command of the process, facts and uploads included.

A callback that fails as expected raises :class:`OperationError`; :func:`callback` shows
that as one message, ``[host] step: what went wrong — what to do`` with any log tail
below it, and no traceback (``-v`` shows it). Anything else is a bug and keeps
pyinfra's traceback.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shlex
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from paramiko import SSHException
from pyinfra.api import FunctionCommand, QuoteString, StringCommand
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS, pop_global_arguments
from pyinfra.api.exceptions import OperationError
from pyinfra.connectors import ssh as ssh_connector

logger = logging.getLogger("pyinfra")


# --- the sudo password on stdin ----------------------------------------------------------


#: Stands for the sudo password in a command's arguments once it is on stdin.
ON_STDIN = object()
#: Set in a host's connector data by :func:`check_sudo` (the first command of every run
#: of the deploy) when its sudo asks no password: its commands then give none.
SUDO_FREE = "sparkfleet_sudo_asks_no_password"
#: Set in a host's connector data by :func:`check_sudo`: the address its SSH connection
#: reached (``routes.SshServerAddress``), which the check's command prints along.
SSH_ADDRESS = "sparkfleet_ssh_server_address"


def _sudo_reads_stdin() -> None:
    """Route every sudo password of pyinfra's SSH connector through sudo's stdin."""
    connector = ssh_connector.SSHConnector
    if getattr(connector.run_shell_command, "sparkfleet", False):
        return
    run_shell_command = connector.run_shell_command
    make_command = ssh_connector.make_unix_command_for_host

    def run_with_password_on_stdin(self, command, print_output=False, print_input=False, **arguments):
        password = arguments.get("_sudo_password")
        if password and self.host.connector_data.get(SUDO_FREE):
            arguments = {**arguments, "_sudo_password": ""}  # pyinfra's `sudo -n`
        elif arguments.get("_sudo") and password and password is not ON_STDIN and not arguments.get("_get_pty"):
            given = arguments.get("_stdin")
            given = [] if given is None else given.readlines() if hasattr(given, "readlines") else (
                list(given) if isinstance(given, (list, tuple)) else [given])
            # sudo reads its password a byte at a time up to the newline: the rest is the command's.
            arguments = {**arguments, "_sudo_password": ON_STDIN, "_stdin": [password, *given]}
        return run_shell_command(self, command, print_output, print_input, **arguments)

    def command_for_host(state, host, command, **arguments):
        if arguments.get("_sudo_password") is not ON_STDIN:
            return make_command(state, host, command, **arguments)
        made = make_command(state, host, command, **{**arguments, "_sudo_password": ""})
        bits = list(made.bits)
        # pyinfra's `sudo -H -n` (no password to give) becomes `sudo -H -S -p '' -k`: the
        # password from stdin, no prompt on stderr, no cached credential.
        at = next(i for i in range(len(bits) - 2) if bits[i:i + 3] == ["sudo", "-H", "-n"])
        bits[at + 2:at + 3] = ["-S", "-p", QuoteString(""), "-k"]
        return StringCommand(*bits, _separator=made.separator)

    run_with_password_on_stdin.sparkfleet = True
    connector.run_shell_command = run_with_password_on_stdin
    ssh_connector.make_unix_command_for_host = command_for_host


_sudo_reads_stdin()


class _PasswordsMasked(logging.Filter):
    """pyinfra's ``--debug`` prints each deploy's global arguments (its ``Starting deploy
    ... (args=...)`` line), the sudo password among them: masked there, as pyinfra masks
    it in the commands it prints."""

    SECRETS = ("_sudo_password", "_su_password")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if any(isinstance(arg, dict) and any(arg.get(k) for k in self.SECRETS) for arg in args):
            record.args = tuple({**arg, **{k: "***" for k in self.SECRETS if arg.get(k)}} if isinstance(arg, dict)
                                else arg for arg in args)
        return True


logger.addFilter(_PasswordsMasked())  # pyinfra's own logger, which pyinfra.api.host logs to


#: What a step says of a host that went away under it.
LOST = ("the host stopped answering over SSH (powered off, rebooted or cut off from the controller): "
        "bring it back and deploy again")


def answers(host) -> bool:
    """Whether ``host`` still runs a command: asked when a step failed in a way that may
    mean the host went away (power, link) rather than a fault of the step."""
    try:
        return run(host, "true", timeout=15, as_login=True).ok
    except Exception:  # noqa: BLE001 - whatever the connection raises, the host does not answer
        return False


def callback(function, *args, **kwargs) -> FunctionCommand:
    """``function(state, host, *args, **kwargs)`` as an operation's command, its expected
    failures (OperationError) reported as one message naming the step; a host lost in
    the middle of it (whatever the broken connection raised) in one line too."""

    def run_step(state, host, *args, **kwargs) -> bool:
        try:
            return function(state, host, *args, **kwargs)
        except Exception as exc:
            if not isinstance(exc, OperationError):
                if answers(host):
                    raise  # a fault of ours: its traceback says where
                exc = OperationError(LOST)
            meta = state.get_op_meta(host.current_op_hash) if host.current_op_hash else None
            # The operation's own name, without the deploy group's "Group | " prefix.
            step = ", ".join(sorted({n.rsplit(" | ", 1)[-1] for n in meta.names})) if meta and meta.names else "step"
            headline, _, detail = str(exc).partition("\n")
            host.log_styled(f"{step}: {headline}", fg="red", log_func=logger.error)
            for line in detail.splitlines():
                logger.error(line)
            if state.print_fact_info:  # -v
                logger.warning(traceback.format_exc())
            return False

    return FunctionCommand(run_step, args, kwargs)


def connector_arguments(host) -> dict:
    """The host's ``_sudo``/``_su_user``/... settings, as operations and facts get them."""
    arguments, _ = pop_global_arguments(host.state, host, {})
    return {key: value for key, value in arguments.items() if key in CONNECTOR_ARGUMENT_KEYS}


@dataclass(frozen=True)
class Result:
    ok: bool
    stdout: list[str]
    stderr: list[str]


def _unprivileged(arguments: dict) -> dict:
    """The arguments for a command as the SSH user itself (its own temp directory)."""
    return {k: v for k, v in arguments.items()
            if k not in ("_sudo", "_sudo_user", "_use_sudo_login", "_sudo_password", "_preserve_sudo_env",
                         "_su_user", "_use_su_login", "_preserve_su_env", "_su_password", "_doas", "_doas_user",
                         "_dzdo", "_dzdo_user")}


def run(host, command: str | StringCommand, timeout: int | None = 60, success_exit_codes: list[int] | None = None,
        print_output: bool = False, as_login: bool = False, stdin: str | None = None) -> Result:
    """Run a shell ``command`` on ``host`` as the deploy does (sudo included).

    ``command`` is a shell command whose every variable part the caller has quoted;
    nothing is printed unless asked (a secret on stdout stays off the controller's
    output). ``as_login``: as the SSH user, without sudo (its environment, its files).
    ``stdin``: written to the command's standard input (a secret goes there, never in argv).
    """
    command = command if isinstance(command, StringCommand) else StringCommand(command)
    arguments = connector_arguments(host)
    if as_login:
        arguments = _unprivileged(arguments)
    arguments["_timeout"] = timeout
    if stdin is not None:
        arguments["_stdin"] = stdin
    if success_exit_codes is not None:
        arguments["_success_exit_codes"] = success_exit_codes
    try:
        ok, output = host.run_shell_command(command, print_output=print_output, **arguments)
    except (OSError, EOFError, SSHException) as exc:  # the connection broke: the host is down or cut off
        raise OperationError(f"{host.name}: lost the SSH connection ({type(exc).__name__}: {exc}) — "
                             "is the host up and reachable?") from None
    return Result(ok, output.stdout_lines, output.stderr_lines)


@contextmanager
def _private_directory(host) -> Iterator[str]:
    """A 0700 directory of the SSH user on ``host`` (mktemp's), removed afterwards."""
    made = run(host, "mktemp -d", as_login=True)
    if not made.ok or not made.stdout:
        raise OperationError(f"could not make a private directory: {' '.join(made.stderr)}")
    private = made.stdout[0].strip()
    try:
        yield private
    finally:
        run(host, f"rm -rf {shlex.quote(private)}", as_login=True)


def put(host, source: str | bytes | io.IOBase, dest: str, mode: str = "0644", owner: str | None = None,
        parent: bool = False) -> None:
    """Upload a local file (path), bytes or a file object to ``dest`` on ``host``, with
    ``mode`` (and ``owner``, user[:group]) from the first byte on: through a 0700 directory
    of the SSH user, copied into place under umask 077, then renamed over ``dest``.
    ``parent``: ``dest``'s directory is made too (0755), in the same command."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    q = shlex.quote
    with _private_directory(host) as private:
        if not host.put_file(source, f"{private}/upload", print_output=False,
                             **_unprivileged(connector_arguments(host))):
            raise OperationError(f"could not upload {dest}")
        new = f"{dest}.sparkfleet-new"
        chown = f" && chown {q(owner)} {q(new)}" if owner else ""
        made = f"install -d -m 0755 {q(dest.rsplit('/', 1)[0] or '/')} && " if parent else ""
        placed = run(host, f"{made}umask 077 && cp {q(private + '/upload')} {q(new)} && chmod {q(mode)} {q(new)}"
                           f"{chown} && mv -f {q(new)} {q(dest)}")
        if not placed.ok:
            raise OperationError(f"could not put {dest} in place: {' '.join(placed.stderr)}")


def uploaded(state, host, source: str | bytes, dest: str, mode: str = "0644", owner: str | None = None,
             parent: bool = False) -> bool:
    """:func:`put` as an operation's command: ``yield remote.callback(remote.uploaded, ...)``."""
    put(host, source, dest, mode, owner, parent)
    return True


def get(host, remote: str, dest: str | io.IOBase) -> None:
    """Download ``remote`` from ``host`` to a local path or file object, through a 0700
    directory of the SSH user (pyinfra's sudo download leaves a world-readable copy in /tmp)."""
    q = shlex.quote
    with _private_directory(host) as private:
        copied = run(host, f"cp {q(remote)} {q(private + '/download')} && chmod 0644 {q(private + '/download')}")
        if not copied.ok or not host.get_file(f"{private}/download", dest, print_output=False,
                                              **_unprivileged(connector_arguments(host))):
            raise OperationError(f"could not download {remote}: {' '.join(copied.stderr)}")


#: Where inventory/sparks.py reads the sudo password from: this variable names the file, else
#: the default path. An inventory that reads another file names it as ``_sudo_password_file``
#: host data (a private key: pyinfra and the validation ignore it), as the testbed's does.
SUDO_PASSWORD_FILE_ENV = "SPARKFLEET_SUDO_PASSWORD_FILE"
SUDO_PASSWORD_FILE = "~/.config/sparkfleet/sudo-password"
_WRONG_PASSWORD = re.compile(r"incorrect password|Sorry, try again|[Aa]uthentication fail|incorrect authentication")


def sudo_password_file(host, password: str) -> str | None:
    """The file on the controller the sudo password given for ``host`` was read from, if
    known: ``_sudo_password_file``, else inventory/sparks.py's file when it holds that password."""
    named = host.data.get("_sudo_password_file")
    if named:
        return str(named)
    path = Path(os.environ.get(SUDO_PASSWORD_FILE_ENV) or SUDO_PASSWORD_FILE).expanduser()
    try:
        return str(path) if path.read_text().strip() == password else None
    except OSError:
        return None


#: The sudo check's first line: where the host's SSH connection arrived (the controller
#: asks nothing else for it).
_SAY_ADDRESS = 'echo "ssh ${SSH_CONNECTION:-}"'


def _told_address(host, done: Result) -> Result:
    """``done`` without the line of :data:`_SAY_ADDRESS`, which goes to the host's
    connector data (:data:`SSH_ADDRESS`)."""
    from sparkfleet.routes import SshServerAddress

    said = [line for line in done.stdout if line.startswith("ssh ")]
    if said:
        host.connector_data[SSH_ADDRESS] = SshServerAddress().process([said[0][4:]])
    return Result(done.ok, [line for line in done.stdout if not line.startswith("ssh ")], done.stderr)


def check_sudo(host, then: list[str] | None = None) -> list[str] | None:
    """Raise :class:`~sparkfleet.config.ConfigError` when ``host`` is reached with sudo
    that will not work: it asks for a password nobody gave (pyinfra would prompt for it in
    the middle of the run, once per host, with the other hosts' output scrolling past), or
    it refuses the one given (every command of the run would fail after sudo's three tries,
    "Sorry, try again." each). The password is tried once, on sudo's stdin.

    ``then``: a command (argv) to run in the same sudo once the password passed, so that
    the host hashes the password once for both; returns the lines it printed (its stderr
    and exit status are its own to tell: they do not fail the check). None when it did
    not run: no ``then``, or sudo was not checked with a password."""
    from sparkfleet.config import ConfigError

    arguments = connector_arguments(host)
    if not arguments.get("_sudo"):
        return None
    password = arguments.get("_sudo_password")
    # Exit 0 and sudo's words prefixed: pyinfra answers a failed command that printed
    # "a password is required" with a prompt of its own.
    if not password:
        done = _told_address(host, run(host, f'{_SAY_ADDRESS}; said=$(sudo -n true 2>&1) && echo ok '
                                             '|| echo "sudo said: $said"', as_login=True))
        if done.ok and done.stdout == ["ok"]:
            return None
        said = " ".join(done.stdout + done.stderr).strip() or "no answer"
        raise ConfigError(
            f"{host.name}: sudo needs a password and none was given ({said}); nothing was changed on any host. "
            "Fix: give `_sudo_password` in its host data (read from a 0600 file or the environment, as "
            "inventory/sparks.py does), or run pyinfra with --same-sudo-password to type it once"
        )
    as_user = f" -u {shlex.quote(arguments['_sudo_user'])}" if arguments.get("_sudo_user") else ""
    # -k: ask even with a cached credential; one line on stdin, then EOF: one try. A login
    # whose sudo asks no password (NOPASSWD) leaves that line unread, for the command to
    # read (:data:`SUDO_FREE`): the command tells which, in the same sudo (each costs the
    # host a password hash), then runs ``then`` (its arguments after sh -c's own).
    told = shlex.quote('if read -r _; then echo free; else echo ok; fi; [ "$#" -eq 0 ] || "$@" 2>/dev/null; exit 0')
    argv = "".join(f" {shlex.quote(arg)}" for arg in then or ())
    done = _told_address(host, run(
        host, f"{_SAY_ADDRESS}; login=$(id -un); said=$(sudo -k -S -p ''{as_user} sh -c {told} sh{argv} 2>&1) "
              '&& printf "%s\\n" "$said" || printf "login %s\\nsudo said: %s\\n" "$login" "$said"',
        as_login=True, stdin=password))
    # sudo's own words (a first use's lecture) may come before the answer; ``then``'s after.
    told_at = next((i for i, line in enumerate(done.stdout) if line in ("free", "ok")), None) if done.ok else None
    if told_at is not None:
        if done.stdout[told_at] == "free":
            host.connector_data[SUDO_FREE] = True
        return done.stdout[told_at + 1:] if then else None
    login = next((line[6:] for line in done.stdout if line.startswith("login ")), "the login")
    said = " ".join(line for line in done.stdout + done.stderr if not line.startswith("login ")).strip()
    if not _WRONG_PASSWORD.search(said):
        raise ConfigError(f"{host.name}: sudo as {login} failed with the given password ({said or 'no answer'}); "
                          f"nothing was changed on any host. Fix: make `sudo -v` work for {login} on {host.name}")
    path = sudo_password_file(host, password)
    instead = ", or leave it out of the inventory and run pyinfra with --same-sudo-password to type it"
    if path:
        source, fix = f"`_sudo_password`, read from {path}", f"put {login}'s sudo password in {path} (chmod 600)"
    elif host.data.get("_sudo_password"):
        source, fix = "`_sudo_password` in its host data", "correct `_sudo_password` in its host data (the inventory)"
    else:  # pyinfra's --same-sudo-password: typed at the start of the run
        source, fix, instead = "the password typed for --same-sudo-password", f"type {login}'s sudo password", ""
    raise ConfigError(f"{host.name}: sudo refused the password for {login} ({source}); nothing was changed on any "
                      f"host. Fix: {fix}{instead}")


def fail(message: str) -> StringCommand:
    """A command that fails the host it runs on with ``message`` (yield it from an
    operation): a failing command, not an exception, so the other hosts go on."""
    return StringCommand("echo", shlex.quote(message), ">&2;", "exit", "1")


def fail_unless(probe: str, message: str) -> StringCommand:
    """A command that runs ``probe`` and fails the host with ``message`` if it fails."""
    return StringCommand(probe, "||", "{", "echo", shlex.quote(message), ">&2;", "exit", "1;", "}")
