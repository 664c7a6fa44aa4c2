"""One way to act on a host from inside a callback, and one way to fail a host.

pyinfra hands a ``python.call`` / ``FunctionCommand`` callback the host but none of the
connector arguments (``_sudo``, ``_sudo_user``, ``_sudo_password``, ``_use_sudo_login``,
``_su_user``...) that operations and facts run with. Every raw command, upload and
download in sparkfleet goes through :func:`run`, :func:`put` and :func:`get`, which
apply the host's own, so a host reached as an unprivileged SSH user with sudo behaves
the same in a callback as in an operation.
"""

from __future__ import annotations

import io
import shlex
from dataclasses import dataclass

from pyinfra.api import StringCommand
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS, pop_global_arguments
from pyinfra.api.exceptions import OperationError


def connector_arguments(host) -> dict:
    """The host's ``_sudo``/``_su_user``/... settings, as operations and facts get them."""
    arguments, _ = pop_global_arguments(host.state, host, {})
    return {key: value for key, value in arguments.items() if key in CONNECTOR_ARGUMENT_KEYS}


@dataclass(frozen=True)
class Result:
    ok: bool
    stdout: list[str]
    stderr: list[str]


def run(host, command: str | StringCommand, timeout: int = 60) -> Result:
    """Run a shell ``command`` on ``host`` as the deploy does (sudo included).

    ``command`` is a shell command whose every variable part the caller has quoted;
    nothing is printed (a secret on stdout stays off the controller's output).
    """
    command = command if isinstance(command, StringCommand) else StringCommand(command)
    arguments = {**connector_arguments(host), "_timeout": timeout}
    ok, output = host.run_shell_command(command, print_output=False, **arguments)
    return Result(ok, output.stdout_lines, output.stderr_lines)


def put(host, source: str | bytes | io.IOBase, dest: str, mode: str | None = None) -> None:
    """Upload a local file (path), bytes or a file object to ``dest`` on ``host``."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    if not host.put_file(source, dest, print_output=False, **connector_arguments(host)):
        raise OperationError(f"could not upload {dest}")
    if mode is not None:
        chmod = run(host, f"chmod {shlex.quote(mode)} {shlex.quote(dest)}")
        if not chmod.ok:
            raise OperationError(f"could not set the mode of {dest}: {' '.join(chmod.stderr)}")


def get(host, remote: str, dest: str | io.IOBase) -> None:
    """Download ``remote`` from ``host`` to a local path or file object."""
    if not host.get_file(remote, dest, print_output=False, **connector_arguments(host)):
        raise OperationError(f"could not download {remote}")


def fail(message: str) -> StringCommand:
    """A command that fails the host it runs on with ``message`` (yield it from an
    operation): a failing command, not an exception, so the other hosts go on."""
    return StringCommand("echo", shlex.quote(message), ">&2;", "exit", "1")


def fail_unless(probe: str, message: str) -> StringCommand:
    """A command that runs ``probe`` and fails the host with ``message`` if it fails."""
    return StringCommand(probe, "||", "{", "echo", shlex.quote(message), ">&2;", "exit", "1;", "}")
