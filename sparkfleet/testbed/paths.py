"""Names, addresses and paths of the simulated fleet.

Everything here follows docs/architecture.md ("The simulated fleet"): change it only
together with the contract. Every object the testbed creates on the controller is named
from these constants, which is also how cleanup finds leftovers of an earlier run.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Repository root (sparkfleet/testbed/paths.py -> two levels up).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: A second, independent fleet on the same machine (e.g. two people developing at once):
#: SPARKFLEET_TESTBED_INSTANCE=N (1..9) gives it its own bridge sfbrN, subnet 10.(213+N).0.0/24,
#: state directory, lock, cgroups, netns/veth names and `.testbed/instance-N/` files, so
#: neither `up` nor `down` touches the other. 0 (the default) is the fleet described above.
INSTANCE = int(os.environ.get("SPARKFLEET_TESTBED_INSTANCE", "0") or 0)
if not 0 <= INSTANCE <= 9:
    raise ValueError(f"SPARKFLEET_TESTBED_INSTANCE must be 0..9, not {INSTANCE}")
_SUFFIX = f"-{INSTANCE}" if INSTANCE else ""

#: Git-ignored per-checkout output: controller SSH key and hosts.json.
DOT_TESTBED = REPO_ROOT / ".testbed"
SSH_KEY = DOT_TESTBED / "id_ed25519"
if INSTANCE:
    #: Its own hosts.json and a generated inventory reading it (inventory/testbed.py
    #: reads the default fleet's).
    HOSTS_JSON = DOT_TESTBED / f"instance-{INSTANCE}" / "hosts.json"
    INVENTORY = HOSTS_JSON.with_name("inventory.py")
else:
    HOSTS_JSON = DOT_TESTBED / "hosts.json"
    INVENTORY = REPO_ROOT / "inventory" / "testbed.py"
#: The fleet's API key and mirror TLS files on the controller (the fleet's api_key_file and
#: mirror_tls_dir, relative to the checkout): a second instance's own, so two fleets of one
#: checkout never share, replace or remove each other's.
_CONTROLLER_FILES = ".sparkfleet" + (f"/instance-{INSTANCE}" if INSTANCE else "")
API_KEY_FILE = f"{_CONTROLLER_FILES}/api-key"
MIRROR_TLS_DIR = f"{_CONTROLLER_FILES}/mirror-tls"
#: A dgx login's sudo password (0600) and the ssh_config of alias names (login.py).
SUDO_PASSWORD_FILE = HOSTS_JSON.with_name("sudo-password")
SSH_CONFIG = HOSTS_JSON.with_name("ssh_config")
#: The hosts' sshd keys, as a real fleet's known_hosts holds them (one file per `up`:
#: pyinfra keeps a known_hosts file it read for the life of its process).
KNOWN_HOSTS = HOSTS_JSON.with_name("known_hosts")

#: Built once, kept by `down` (rootfs, image base layer, wheels, signing key); shared.
CACHE_DIR = Path("/var/cache/sparkfleet-testbed")
#: Runtime state of one fleet; wiped by `up` and `down`.
STATE_DIR = Path("/var/lib/sparkfleet-testbed" + _SUFFIX)
STATE_FILE = STATE_DIR / "state.json"
#: The fleet's sparkfleet.lock (its fleet_lock_file): removed with the fleet, so a fresh fleet
#: resolves its references again and no test leaves a lock in the checkout.
SPARKFLEET_LOCK = STATE_DIR / "sparkfleet.lock"
HOSTS_DIR = STATE_DIR / "hosts"
LOG_DIR = STATE_DIR / "logs"
#: Outside STATE_DIR on purpose: it must survive the wipe of STATE_DIR it guards.
LOCK_FILE = Path(f"/run/sparkfleet-testbed{_SUFFIX}.lock")
#: One for every instance: `up` builds into and `down` unmounts below the shared CACHE_DIR.
CACHE_LOCK_FILE = Path("/run/sparkfleet-testbed-cache.lock")

# --- network ------------------------------------------------------------------------
BRIDGE = f"sfbr{INSTANCE}"
SUBNET_PREFIX = f"10.{213 + INSTANCE}.0."
CONTROLLER_IP = f"{SUBNET_PREFIX}1"
NETMASK_BITS = 24
NETNS_PREFIX = f"sf{INSTANCE or ''}-spark-"
#: Host-side veth names: "sfv-spark-<i>" (IFNAMSIZ is 16, so at most 15 characters).
VETH_PREFIX = f"sfv{INSTANCE or ''}-spark-"
HOST_PREFIX = "spark-"

# --- services on the bridge address --------------------------------------------------
REGISTRY_PORT = 5000
HUB_PORT = 8090
APT_PORT = 8091
REGISTRY = f"{CONTROLLER_IP}:{REGISTRY_PORT}"
IMAGE_REPO = "sparkfleet/vllm-sim"
IMAGE_TAG = "0.23.0"
IMAGE_REF = f"{REGISTRY}/{IMAGE_REPO}:{IMAGE_TAG}"
HUB_URL = f"http://{CONTROLLER_IP}:{HUB_PORT}"
APT_URL = f"http://{CONTROLLER_IP}:{APT_PORT}/"
APT_KEY_URL = f"http://{CONTROLLER_IP}:{APT_PORT}/gpgkey"

#: cgroup directory (in the name=systemd and unified hierarchies) holding one
#: sub-cgroup per host, so that the systemd of each host manages its own subtree.
CGROUP_PARENT = "sparkfleet-testbed" + _SUFFIX

#: Where the simulated hardware reads its switches inside a host.
SIM_DIR_IN_HOST = "/etc/sparkfleet-sim"


def host_name(index: int) -> str:
    """`spark-<index>` (1-based)."""
    return f"{HOST_PREFIX}{index}"


def host_index(name: str) -> int:
    """Inverse of :func:`host_name`; raises ValueError for foreign names."""
    if not name.startswith(HOST_PREFIX) or not name[len(HOST_PREFIX):].isdigit():
        raise ValueError(f"not a testbed host name: {name!r}")
    return int(name[len(HOST_PREFIX):])


def host_address(index: int) -> str:
    """10.213.0.(10+i)."""
    if not 1 <= index <= 200:
        raise ValueError(f"host index out of range 1..200: {index}")
    return f"{SUBNET_PREFIX}{10 + index}"


def netns_name(name: str) -> str:
    return f"{NETNS_PREFIX}{host_index(name)}"


def veth_name(name: str) -> str:
    return f"{VETH_PREFIX}{host_index(name)}"


def host_dir(name: str) -> Path:
    return HOSTS_DIR / name
