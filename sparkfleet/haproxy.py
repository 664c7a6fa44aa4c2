"""The HAProxy runtime API, from the controller: one command at a time over the endpoint
host's admin socket (a small python3 client there), and what it says of the members.

Apart from the endpoint's deploy (sparkfleet/endpoint.py): the rollout drains and readies
members through it, and ``sparkfleet status`` reads them.
"""

from __future__ import annotations

import csv
import io
import re
import shlex
import time
from dataclasses import dataclass

import gevent
import gevent.lock
from pyinfra.api.exceptions import OperationError

from sparkfleet import remote
from sparkfleet.perrun import once

UNIT = "haproxy.service"
#: Runtime-API commands at once on the endpoint host's one SSH connection: a batch of hosts
#: draining and polling together must stay under sshd's MaxSessions 10 (DGX OS's default)
#: beside the endpoint host's own commands.
AT_ONCE = 4
ADMIN_SOCKET = "/run/haproxy/admin.sock"
STATE_FILE = "/var/lib/haproxy/server-state"
#: The members' backends: ``members``, or with an API key ``members_<key id>``, one per key
#: the members run (more than one only while a key change rolls through the fleet).
BACKEND = "members"

# One runtime-API command on the endpoint host: HAProxy answers and closes the socket.
_SOCKET_CLIENT = (
    "import socket,sys\n"
    "s=socket.socket(socket.AF_UNIX);s.settimeout(10);s.connect(sys.argv[1]);s.sendall(sys.argv[2].encode()+b'\\n')\n"
    "b=b''\n"
    "while True:\n"
    " d=s.recv(65536)\n"
    " if not d: break\n"
    " b+=d\n"
    "sys.stdout.write(b.decode())\n"
)



def server_name(inventory_name: str) -> str:
    """The member's name in HAProxy (its inventory name, in HAProxy's alphabet)."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", inventory_name)


@dataclass(frozen=True)
class Member:
    """A member as HAProxy sees it now."""

    name: str  # inventory name (the HAProxy server name)
    backend: str  # the backend of the key it runs
    address: str
    state: str  # UP, DOWN, DRAIN, MAINT, NOLB, "UP 1/2" (going down), "DOWN 1/2" (coming up)...
    sessions: int  # requests in flight through the endpoint
    requests: int  # requests sent to it since HAProxy started
    errors: int  # connection and response errors
    check: str  # last check's result (e.g. L7OK, L4CON, L7STS)

    @property
    def in_rotation(self) -> bool:
        return self.state == "UP" or self.state.startswith("UP ")

    @property
    def checked(self) -> bool:
        return bool(self.check) and not self.check.startswith("INI")


def save_state_command(forget: tuple[str, ...] = ()) -> str:
    """Save the members' states where the next worker reads them (nothing when HAProxy
    does not answer, e.g. before its first start). The states of the servers named in
    ``forget`` are left out: HAProxy would restore their old address and port over the
    new configuration's (a member that moved starts afresh from its checks)."""
    # The file's first lines (its version, the column names) have fewer than 4 fields.
    drop = " && ".join(f'$4 != "{server_name(name)}"' for name in forget)
    keep = f" | awk {shlex.quote(f'NF < 4 || ({drop})')}"
    return (runtime_shell("show servers state") + (keep if forget else "")
            + f" > {STATE_FILE}.new && mv -f {STATE_FILE}.new {STATE_FILE} || rm -f {STATE_FILE}.new")


def runtime_shell(command: str) -> str:
    return f"python3 -c {shlex.quote(_SOCKET_CLIENT)} {ADMIN_SOCKET} {shlex.quote(command)}"


def runtime(endpoint, command: str) -> list[str]:
    """One HAProxy runtime-API command on the endpoint host; its answer's lines."""
    if not endpoint.connected:  # a host this run could not reach has no connection to run on
        raise OperationError(f"{endpoint.name}: the fleet endpoint's host is not reachable from the controller")
    with once(("haproxy runtime", endpoint.name), lambda: gevent.lock.BoundedSemaphore(AT_ONCE), endpoint.state):
        done = remote.run(endpoint, runtime_shell(command), timeout=30)
    ok, lines = done.ok, done.stdout
    if not ok:
        raise OperationError(f"{endpoint.name}: the HAProxy runtime API did not answer `{command}` "
                             f"(is {UNIT} running? systemctl status haproxy)")
    return lines


def show_stat(endpoint) -> list[dict[str, str]]:
    """HAProxy's `show stat`: one row per frontend, backend and member."""
    return list(csv.DictReader(io.StringIO("\n".join(runtime(endpoint, "show stat")).lstrip("# "))))


def members_of(endpoint, stat: list[dict[str, str]] | None = None) -> dict[str, Member]:
    """Every member of the endpoint and its state, by HAProxy server name (the inventory
    name; see server_name)."""
    found = {}
    for row in stat if stat is not None else show_stat(endpoint):
        backend = row.get("pxname", "")
        if not is_members(backend) or row.get("svname") in ("BACKEND", "FRONTEND"):
            continue
        found[row["svname"]] = Member(
            # With an agent-check (the watchdog's) HAProxy says "DRAIN (agent)", "DOWN (agent)"
            # for any drain or down: the state is the same; why is in the check and the watchdog.
            name=row["svname"], backend=backend, address=row.get("addr", ""),
            state=row.get("status", "").removesuffix(" (agent)"),
            sessions=int(row.get("scur") or 0), requests=int(row.get("stot") or 0),
            errors=int(row.get("econ") or 0) + int(row.get("eresp") or 0),
            check=row.get("check_status", "").lstrip("* "),  # "* " marks a check in progress
        )
    return found


def is_members(backend: str) -> bool:
    return backend == BACKEND or backend.startswith(BACKEND + "_")


def set_state(endpoint, name: str, state: str) -> None:
    """``set server <its backend>/<name> state <state>`` (ready, drain, maint)."""
    member = members_of(endpoint).get(server_name(name))
    if member is None:
        raise OperationError(f"{endpoint.name}: {name} is not a member of the fleet endpoint")
    runtime(endpoint, f"set server {member.backend}/{member.name} state {state}")


def drain(endpoint, name: str, timeout_s: float = 600, poll_s: float = 1.0) -> int:
    """Take member ``name`` out of rotation: no new requests; wait (up to ``timeout_s``)
    for its in-flight ones to finish. Returns how many are still in flight (0: drained)."""
    set_state(endpoint, name, "drain")
    return _member_until(endpoint, name, lambda m: m.sessions == 0, timeout_s, poll_s).sessions


def ready(endpoint, name: str, timeout_s: float = 0, poll_s: float = 1.0) -> bool:
    """Put member ``name`` back in rotation: it serves again once its checks pass. Waits
    up to ``timeout_s`` for that; returns whether it is in rotation."""
    set_state(endpoint, name, "ready")
    return _member_until(endpoint, name, lambda m: m.in_rotation, timeout_s, poll_s).in_rotation


def _member_until(endpoint, name: str, done, timeout_s: float, poll_s: float) -> Member:
    """Member ``name`` once ``done(member)``, or as it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        member = members_of(endpoint).get(server_name(name))
        if member is None:
            raise OperationError(f"{endpoint.name}: {name} is not a member of the fleet endpoint")
        if done(member) or time.monotonic() >= deadline:
            return member
        gevent.sleep(poll_s)
