"""An example fleet of DGX Sparks as DGX OS sets them up: copy it, then list yours.

    pyinfra inventory/sparks.py deploy.py

A Spark is reached as the user its first boot made: in group sudo, whose sudo asks for
its password, not in group docker; root has no SSH login. So every host gets ``_sudo``
and the password as ``_sudo_password``, read here from a 0600 file on the controller
(``SPARKFLEET_SUDO_PASSWORD_FILE``, default ``~/.config/sparkfleet/sudo-password``),
never written into this file or passed on a command line. Without that file, run
``pyinfra --same-sudo-password ...`` to type it once; with neither, the run stops before
it touches anything and says so (pyinfra would otherwise prompt per host mid-run).

Names are what the controller reaches: a ``.local`` name (mDNS) or an SSH alias from
``~/.ssh/config`` (NVIDIA Sync writes those; its HostName, User and key apply). The
other hosts need not resolve them: they reach the mirror at the address it has on its
route to them (set ``mirror_address`` to choose another).

Each entry is a host name or (host name, host data). Host data wins over
group_data/*.py and loses to --data. Keys starting with ssh_ or _ are pyinfra's
connection settings; every other key is validated against sparkfleet/config.py.
"""

import os
from pathlib import Path


def _sudo_password() -> dict:
    path = Path(os.environ.get("SPARKFLEET_SUDO_PASSWORD_FILE", "~/.config/sparkfleet/sudo-password")).expanduser()
    if not path.exists():
        return {}  # --same-sudo-password, or a password-less sudo
    if path.stat().st_mode & 0o077:
        raise SystemExit(f"{path} is readable by others: chmod 600 {path}")
    return {"_sudo_password": path.read_text().strip()}


_login = {"_sudo": True, **_sudo_password()}

sparks = [
    # A Spark by its mDNS name, as the user made at first boot, serving the default profile.
    ("spark-1a2b.local", {"ssh_user": "nvidia", **_login}),
    # A Spark by an SSH alias (User and key from ~/.ssh/config), its HF cache on a bigger
    # NVMe, serving the dflash profile.
    ("spark-lab-2", {**_login, "hf_home": "/mnt/nvme/hf", "profile": "dflash"}),
]
