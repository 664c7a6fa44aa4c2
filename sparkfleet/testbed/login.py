"""How the controller logs in to the simulated hosts, and what it calls them.

Logins (``sparkfleet testbed up --login``):

* ``root``: root with the controller's key (the testbed's first form).
* ``dgx``: as DGX OS sets a Spark up at first boot: an ordinary user (``LOGIN_USER``) in
  group ``sudo`` whose sudo asks for a password, not in group ``docker``; root has no
  authorized_keys and sshd says ``PermitRootLogin no``. The password is random per
  fleet, kept in a 0600 file under ``.testbed/`` and given to pyinfra as
  ``_sudo_password`` host data by the generated inventory (never on a command line).

Names (``--names``):

* ``plain``: the inventory names are the hosts' own names, with their address as
  ``ssh_hostname``.
* ``alias``: the inventory names are ``<name>.local`` names that only the controller
  resolves, through a generated ssh_config (``Host <alias>`` / ``HostName <ip>``) given
  as ``ssh_config_file`` host data; like mDNS names and NVIDIA Sync's SSH aliases, the
  hosts and their containers cannot resolve them.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from . import paths
from .proc import TestbedError, run

LOGINS = ("root", "dgx")
NAMES = ("plain", "alias")
#: The defaults of `up` (one line each to change).
DEFAULT_LOGIN = "dgx"
DEFAULT_NAMES = "alias"

#: The first-boot user of a dgx login (DGX OS asks for a name; any plain one will do).
LOGIN_USER = "ops"

SSHD_DROP_IN = "etc/ssh/sshd_config.d/10-sparkfleet-sim-dgx-os.conf"


def check(login: str, names: str) -> None:
    if login not in LOGINS:
        raise TestbedError(f"--login must be one of {', '.join(LOGINS)}, not {login!r}")
    if names not in NAMES:
        raise TestbedError(f"--names must be one of {', '.join(NAMES)}, not {names!r}")


def user(login: str) -> str:
    return LOGIN_USER if login == "dgx" else "root"


def inventory_name(host_name: str, names: str) -> str:
    return f"{host_name}.local" if names == "alias" else host_name


# --- the sudo password -----------------------------------------------------------------


def new_password(path: Path = paths.SUDO_PASSWORD_FILE) -> str:
    """A fresh random password in *path* (0600 from the start, replaced atomically)."""
    password = secrets.token_urlsafe(18)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    os.replace(tmp, path)
    return password


def password(path: Path = paths.SUDO_PASSWORD_FILE) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise TestbedError(f"{path} is missing: the fleet's sudo password is gone; `sparkfleet testbed up` again") \
            from None


def remove_password(path: Path = paths.SUDO_PASSWORD_FILE) -> None:
    path.unlink(missing_ok=True)


# --- provisioning (a host's root before its first boot) -------------------------------


def provision(root: Path, login: str, pubkey: str, sudo_password: str | None) -> None:
    """Who may log in to the host in *root*, and how."""
    key_line = pubkey.strip() + "\n"
    if login == "root":
        _authorized_keys(root, root / "root", key_line, 0, 0)
        return
    if not sudo_password:
        raise TestbedError("a dgx login needs a sudo password")
    name = LOGIN_USER
    home = root / "home" / name
    if not home.is_dir():
        # Like DGX OS's first boot: a user of its own group, in sudo (adm for the logs).
        run(["chroot", root, "useradd", "--create-home", "--shell", "/bin/bash", "--groups", "sudo,adm",
             "--comment", "Spark owner", name], timeout=60)
    # chpasswd reads "user:password" on stdin: the password is in no argv.
    run(["chroot", root, "chpasswd"], input=f"{name}:{sudo_password}\n", timeout=60)
    uid, gid = _ids(root, name)
    _authorized_keys(root, home, key_line, uid, gid)
    (root / "root/.ssh/authorized_keys").unlink(missing_ok=True)
    drop_in = root / SSHD_DROP_IN
    drop_in.parent.mkdir(parents=True, exist_ok=True)
    drop_in.write_text("# As on DGX OS: no SSH login for root.\nPermitRootLogin no\n")


def _ids(root: Path, name: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2]), int(fields[3])
    raise TestbedError(f"user {name} was not created in {root}")


def _authorized_keys(root: Path, home: Path, key_line: str, uid: int, gid: int) -> None:
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    ak = ssh_dir / "authorized_keys"
    ak.write_text(key_line)
    ak.chmod(0o600)
    for p in (ssh_dir, ak):
        os.chown(p, uid, gid)


# --- the controller's side -------------------------------------------------------------


def write_ssh_config(entries: list[tuple[str, str, str]], key: Path, known_hosts: str | None = None,
                     path: Path = paths.SSH_CONFIG) -> None:
    """ssh_config for (alias, address, user) entries: how the controller alone resolves them,
    checking each host's key against ``known_hosts`` (None: any key is taken)."""
    check = (f"    StrictHostKeyChecking yes\n    UserKnownHostsFile {known_hosts}\n" if known_hosts else
             "    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n")
    blocks = [
        f"Host {alias}\n    HostName {address}\n    User {login_user}\n    IdentityFile {key}\n"
        f"    IdentitiesOnly yes\n{check}    LogLevel ERROR\n"
        for alias, address, login_user in entries
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("# Written by `sparkfleet testbed up --names alias`: these names resolve nowhere else.\n\n"
                   + "\n".join(blocks))
    os.replace(tmp, path)


def as_root(command: str, login_user: str) -> tuple[str, str | None]:
    """(command, stdin) that runs *command* as root over a login as *login_user*: through
    sudo with the password on stdin (``-k``: asked every time, so the password line is
    always consumed and never reaches the command)."""
    if login_user == "root":
        return command, None
    import shlex

    return f"sudo -k -S -p '' -- sh -c {shlex.quote(command)}", password() + "\n"
