"""The testbed's record of what it made: hosts, PIDs, services, image digest.

Saved (atomically) to /var/lib/sparkfleet-testbed/state.json after every step of `up`,
so that `down`, `status` and a later `up` can find and remove everything by the PIDs
and names recorded here, even after a crash half-way through `up`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import paths

STATE_VERSION = 1


@dataclass
class HostState:
    """One simulated Spark."""

    name: str
    index: int
    address: str
    netns: str
    veth: str
    pid: int | None = None
    switches: dict[str, Any] = field(default_factory=dict)
    #: Who the controller logs in as (login.py): root, or a dgx login's user.
    user: str = "root"
    #: Its sshd's public keys ("TYPE BASE64"), made at provisioning: the controller checks them.
    host_keys: list[str] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return paths.host_dir(self.name)

    @property
    def mnt(self) -> Path:
        """The host's root: an overlay of the cached rootfs."""
        return self.dir / "root"


@dataclass
class ServiceState:
    """A detached controller-side server (registry, hub, apt repo)."""

    name: str
    pid: int | None
    url: str
    #: A string unique to our command line, checked before signalling a recorded PID.
    marker: str
    log: str = ""


@dataclass
class State:
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    created: float = field(default_factory=time.time)
    version: int = STATE_VERSION
    rootfs: str = ""
    hosts: dict[str, HostState] = field(default_factory=dict)
    services: dict[str, ServiceState] = field(default_factory=dict)
    image: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    login: str = "root"  # login.LOGINS
    names: str = "plain"  # login.NAMES
    #: Hosts joined by a simulated ConnectX-7 link (pairs.Pair.record), in hosts.json too.
    pairs: list[dict[str, Any]] = field(default_factory=list)
    #: Bandwidth and artifact scales (shaping.py), or {}; never in hosts.json: the deploy
    #: must not know it is shaped.
    shaping: dict[str, Any] = field(default_factory=dict)

    # --- (de)serialisation ---------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "State":
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported state version {d.get('version')!r}")
        return cls(
            run_id=d["run_id"],
            created=d["created"],
            version=d["version"],
            rootfs=d.get("rootfs", ""),
            hosts={k: HostState(**v) for k, v in d.get("hosts", {}).items()},
            services={k: ServiceState(**v) for k, v in d.get("services", {}).items()},
            image=dict(d.get("image", {})),
            data=dict(d.get("data", {})),
            login=d.get("login", "root"),
            names=d.get("names", "plain"),
            pairs=list(d.get("pairs", [])),
            shaping=dict(d.get("shaping", {})),
        )

    def save(self, path: Path = paths.STATE_FILE) -> None:
        """Write atomically: a crash never leaves a half-written state file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path = paths.STATE_FILE) -> "State | None":
        """The saved state, or None if there is none (or it is unreadable: then the
        leftover scan in cleanup is what finds the remains)."""
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            return None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_hosts_json(state: State, ssh_key: Path = paths.SSH_KEY, path: Path = paths.HOSTS_JSON) -> None:
    """`.testbed/hosts.json`, the contract with inventory/testbed.py (and, for alias
    names, the ssh_config beside it)."""
    from . import login

    hosts = sorted(state.hosts.values(), key=lambda h: h.index)
    doc: dict[str, Any] = {
        "hosts": [
            {
                "name": h.name,
                "inventory_name": login.inventory_name(h.name, state.names),
                "address": h.address,
                "user": h.user,
                "ssh_key": str(ssh_key),
                "switches": h.switches,
            }
            for h in hosts
        ],
        "login": state.login,
        "names": state.names,
        "data": state.data,
        "pairs": state.pairs,
    }
    if state.login != "root":
        doc["sudo_password_file"] = str(path.with_name(paths.SUDO_PASSWORD_FILE.name))
    if all(h.host_keys for h in hosts):
        known = path.with_name(f"{paths.KNOWN_HOSTS.name}.{state.run_id}")
        _write(known, "".join(f"{login.inventory_name(h.name, state.names)},{h.address} {key}\n"
                              for h in hosts for key in h.host_keys))
        doc["known_hosts"] = str(known)  # an earlier fleet's went with it (cleanup.teardown)
    if state.names == "alias":
        doc["ssh_config"] = str(path.with_name(paths.SSH_CONFIG.name))
        login.write_ssh_config([(e["inventory_name"], e["address"], e["user"]) for e in doc["hosts"]], ssh_key,
                               doc.get("known_hosts"), Path(doc["ssh_config"]))
    _write(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if paths.INSTANCE and path == paths.HOSTS_JSON:
        paths.INVENTORY.write_text(_INSTANCE_INVENTORY.format(instance=paths.INSTANCE))


def inventory_hosts(hosts_json: Path) -> list[tuple[str, dict]]:
    """pyinfra host entries for a testbed's hosts.json, its group-data overrides as host
    data (so ``--data`` still wins). Used by inventory/testbed.py and instance inventories.

    A dgx login adds ``_sudo`` and the fleet's ``_sudo_password`` (read from its 0600
    file here, so it is on no command line), and names that file as ``_sudo_password_file``
    (what a refused password names: sparkfleet/remote.py); alias names connect through the
    ssh_config (no ``ssh_hostname``: only that file knows the address)."""
    doc = json.loads(hosts_json.read_text())
    sudo: dict[str, Any] = {}
    if doc.get("sudo_password_file"):
        sudo = {"_sudo": True, "_sudo_password": Path(doc["sudo_password_file"]).read_text().strip(),
                "_sudo_password_file": doc["sudo_password_file"]}
    entries = []
    for h in doc["hosts"]:
        reach = ({"ssh_config_file": doc["ssh_config"]} if doc.get("ssh_config")
                 else {"ssh_hostname": h["address"]})
        entries.append((
            h.get("inventory_name", h["name"]),
            {
                **reach,
                "ssh_user": h.get("user", "root"),
                "ssh_key": h["ssh_key"],
                # As a real fleet's: a host whose key is not the one it had is refused.
                **({"ssh_strict_host_key_checking": "yes", "ssh_known_hosts_file": doc["known_hosts"]}
                   if doc.get("known_hosts") else
                   {"ssh_strict_host_key_checking": "no", "ssh_known_hosts_file": "/dev/null"}),
                **sudo,
                **doc.get("data", {}),
            },
        ))
    return entries


def inventory_pairs(hosts_json: Path) -> dict[str, list[str]]:
    """The testbed's cabled pairs as the inventory groups a deploy reads (fleet.Pair):
    ``pair_1`` = the first pair's hosts by inventory name, in rank order."""
    doc = json.loads(hosts_json.read_text())
    names = {h["name"]: h.get("inventory_name", h["name"]) for h in doc["hosts"]}
    return {f"pair_{i}": [names[m] for m in pair["members"]] for i, pair in enumerate(doc.get("pairs", []), 1)}


#: The inventory of a second fleet (SPARKFLEET_TESTBED_INSTANCE=N), read from the
#: hosts.json beside it. Run pyinfra from the repository root so group_data/ is found.
_INSTANCE_INVENTORY = '''"""pyinfra inventory of testbed instance {instance} (written by `sparkfleet testbed up`)."""

from pathlib import Path

from sparkfleet.testbed.state import inventory_hosts, inventory_pairs

sparks = (inventory_hosts(Path(__file__).resolve().parent / "hosts.json"), {{}})
globals().update(inventory_pairs(Path(__file__).resolve().parent / "hosts.json"))  # pair_1, pair_2, ...
'''
