"""Where sparkfleet keeps things on a host, and what it names them.

Every step reads its host paths, unit names and container names from here, so no step
takes them from another. docs/architecture.md ("On a host") lists the same files.
"""

from __future__ import annotations

import hashlib

# --- serving (every host) --------------------------------------------------------------
ETC_DIR = "/etc/sparkfleet"
SERVE_ENV = f"{ETC_DIR}/serve.env"  # non-secret serving settings, 0644
SECRETS_ENV = f"{ETC_DIR}/secrets.env"  # VLLM_API_KEY, for serving and checks, 0600
HF_ENV = f"{ETC_DIR}/hf.env"  # HF_TOKEN, for downloads and builds only, 0600
AUTH_HEADER = f"{ETC_DIR}/api-auth.header"  # Authorization header for on-host curl, 0600
RUNTIME_DIR = "/opt/sparkfleet/runtime"  # copy of the repo's runtime/, mounted at /host:ro
TASK_UNIT_PREFIX = "sparkfleet-task-"  # transient units of long steps (sparkfleet/tasks.py)
UNIT = "sparkfleet-serve.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
CONTAINER = "sparkfleet-serve"
REVISION_FILE = f"{ETC_DIR}/serving.rev"  # hash of everything the service runs, as deployed
STARTED_FILE = "/run/sparkfleet-serve/started.rev"  # the revision the running service started with
LAST_GOOD_DIR = "/var/lib/sparkfleet/last-good"  # the last settings that got READY, for rollback
COMPILE_SIGNATURE = "sparkfleet-compile-signature"  # in hf_home/.vllm_cache
LOCAL_IMAGE_REPOSITORY = "localhost/sparkfleet/serve"  # the name hosts run the serving image by


def local_image(image: str) -> str:
    """The name a host runs the serving image ``image`` by, whichever registry it came
    from: its digest for a pinned image (sparkfleet.lock pins every image), else a hash of
    ``image``. The unit and every one-shot run use it, so a mirror that moves (a new
    address in the pull reference) changes nothing that runs, and restarts nothing."""
    digest = image.partition("@")[2]
    tag = digest.replace(":", "-") if digest else "ref-" + hashlib.sha256(image.encode()).hexdigest()[:20]
    return f"{LOCAL_IMAGE_REPOSITORY}:{tag}"


def digest_of(reference: str) -> str | None:
    """The image digest a reference names: ``name@sha256:...``, or a :func:`local_image` name
    made from one; None for any other (a tag, a hashed reference)."""
    if "@" in reference:
        return reference.partition("@")[2] or None
    repository, _, tag = reference.rpartition(":")
    if repository == LOCAL_IMAGE_REPOSITORY and tag.startswith("sha256-"):
        return tag.replace("-", ":", 1)
    return None

# --- one operator at a time (every host of a deploy) ----------------------------------
OPERATOR_LOCK = "/run/sparkfleet-operator.lock"  # which deploy changes the fleet now; /run: a reboot frees it

# --- the NVIDIA container runtime (every host) -----------------------------------------
DOCKER_DAEMON_JSON = "/etc/docker/daemon.json"
NVIDIA_APT_KEYRING = "/usr/share/keyrings/nvidia-container-toolkit.asc"
NVIDIA_APT_SOURCES = "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
NVIDIA_DEV_CHAR_RULE = "/etc/udev/rules.d/71-nvidia-dev-char.rules"  # NVIDIA's daemon-reload workaround
# apt_repo's list and key (docker-registry, skopeo, haproxy, earlyoom), one for every step.
ARCHIVE_APT_KEYRING = "/usr/share/keyrings/sparkfleet-archive.asc"
ARCHIVE_APT_SOURCES = "/etc/apt/sources.list.d/sparkfleet-archive.list"

# --- the ConnectX-7 link (pair members) ------------------------------------------------
NETPLAN_CX7 = "/etc/netplan/40-cx7.yaml"  # the name NVIDIA's two-Spark playbook uses
RDMA_DEVICES = "/dev/infiniband"  # the RoCE devices NCCL opens (and the container gets)
LINK_CHECK = "/var/lib/sparkfleet/link-check.json"  # the link check's last NCCL measurement (status reads it)

# --- the OOM guard (every serving host) ------------------------------------------------
EARLYOOM_DEFAULTS = "/etc/default/earlyoom"
EARLYOOM_DROPIN = "/etc/systemd/system/earlyoom.service.d/sparkfleet.conf"
OOM_HOOK = "/usr/local/lib/sparkfleet/oom-killed"  # run by earlyoom after a kill
OOM_LOG = "/var/lib/sparkfleet/oom-guard.log"  # one line per kill
OOM_REPORTED = "/var/lib/sparkfleet/oom-guard.reported"  # lines of OOM_LOG the deploy has shown

# --- the watchdog (every serving host): progress and memory, drained through HAProxy's agent --
WATCHDOG_PROGRAM = "/usr/local/lib/sparkfleet/watchdog"  # templates/sparkfleet-watchdog.py
WATCHDOG_UNIT = "sparkfleet-watchdog.service"  # a look every watchdog_interval_s
WATCHDOG_TIMER = "sparkfleet-watchdog.timer"  # what started each look before: removed where found
AGENT_SOCKET = "sparkfleet-agent.socket"  # HAProxy's agent-check: one line per connection
AGENT_SERVICE = "sparkfleet-agent@.service"
WATCHDOG_STATE = "/run/sparkfleet/watchdog.json"  # the last figures; tmpfs
AGENT_ANSWER = "/run/sparkfleet/agent"  # "up" or "down#<why>", what the agent answers
WATCHDOG_LOG = "/var/lib/sparkfleet/watchdog.log"  # one line per event (wedge, memory, up, gave-up)
WATCHDOG_REPORTED = "/var/lib/sparkfleet/watchdog.reported"  # lines of WATCHDOG_LOG the deploy has shown
BOOT_SEEN = "/var/lib/sparkfleet/boot-id"  # the boot the last deploy saw: a new one is a reboot or a reset


# --- the fleet monitor (fleet_monitor): Prometheus there, a node exporter on every host -----
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"  # Debian/Ubuntu's package
NODE_EXPORTER_DEFAULTS = "/etc/default/prometheus-node-exporter"  # its ARGS: where it listens
PROMETHEUS_UNIT = "prometheus.service"
PROMETHEUS_DEFAULTS = "/etc/default/prometheus"  # its ARGS: where its web and API listen
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"  # the scrape targets (no secret)
PROMETHEUS_RULES = "/etc/prometheus/sparkfleet-alerts.yml"  # the alert rules
PROMETHEUS_KEY = "/etc/prometheus/sparkfleet-api-key"  # the fleet key, 0600 prometheus: its bearer token


def systemd_path(unit: str) -> str:
    return f"/etc/systemd/system/{unit}"


# --- the HF cache layout (hf_home), shared with runtime/fetch_weights.py ---------------


def repo_cache_dir(hf_home: str, repo_id: str) -> str:
    """huggingface_hub's cache directory of ``repo_id`` under ``hf_home``."""
    return f"{hf_home}/hub/models--{repo_id.replace('/', '--')}"


def snapshot_marker(hf_home: str, repo_id: str, revision: str) -> str:
    """Where runtime/fetch_weights.py marks a complete snapshot (kept in step with it)."""
    return f"{snapshot_markers_dir(hf_home)}/{repo_id.replace('/', '--')}@{revision.replace('/', '%2F')}"


def snapshot_markers_dir(hf_home: str) -> str:
    return f"{hf_home}/sparkfleet/complete"


# --- the mirror host (fleet_mirror) ----------------------------------------------------
MIRROR_OPT = "/opt/sparkfleet/mirror"
OLAH_DIR = f"{MIRROR_OPT}/olah"
OLAH_LIB = f"{OLAH_DIR}/lib"
OLAH_MARKER = f"{OLAH_DIR}/installed"
DOCKER_AUTH = "/root/.docker/config.json"  # docker login's credentials, also read by the image copy
HF_MIRROR_UNIT = "sparkfleet-hf-mirror.service"
HF_MIRROR_UNIT_PATH = f"/etc/systemd/system/{HF_MIRROR_UNIT}"
HF_MIRROR_CONFIG = f"{ETC_DIR}/hf-mirror.toml"
# The same cache served offline (mirror_hf_offline_port): locked revisions upstream deleted.
HF_MIRROR_OFFLINE_UNIT = "sparkfleet-hf-mirror-offline.service"
HF_MIRROR_OFFLINE_UNIT_PATH = f"/etc/systemd/system/{HF_MIRROR_OFFLINE_UNIT}"
HF_MIRROR_OFFLINE_CONFIG = f"{ETC_DIR}/hf-mirror-offline.toml"
REGISTRY_UNIT = "docker-registry.service"
REGISTRY_CONFIG = "/etc/docker/registry/config.yml"
REGISTRY_CERT = "/etc/docker/registry/sparkfleet-mirror.crt"
REGISTRY_KEY = "/etc/docker/registry/sparkfleet-mirror.key"
REGISTRY_USER = "docker-registry"
FIREWALL_UNIT = "sparkfleet-mirror-firewall.service"  # nftables: the mirror answers the fleet only
FIREWALL_UNIT_PATH = f"/etc/systemd/system/{FIREWALL_UNIT}"
FIREWALL_RULES = f"{ETC_DIR}/mirror-firewall.nft"


def mirror_hf_cache(mirror_dir: str) -> str:
    """olah's cache on the mirror host."""
    return f"{mirror_dir}/hf/repos"


def mirror_registry_storage(mirror_dir: str) -> str:
    return f"{mirror_dir}/registry"


def mirror_kept_record(mirror_dir: str) -> str:
    """What the mirror keeps for the fleet lock, per repository, most recent first (mirror.keep)."""
    return f"{mirror_dir}/kept.json"


def mirror_held_marker(mirror_dir: str, repo_id: str, commit: str) -> str:
    """Says the HF mirror's cache holds every file of ``repo_id@commit`` (mirror.keep)."""
    return f"{mirror_dir}/held/{repo_id.replace('/', '--')}@{commit}"


def mirror_commit_dir(mirror_dir: str, repo_id: str, commit: str) -> str:
    """Where olah keeps the files of ``repo_id@commit`` it served (each commit's apart)."""
    return f"{mirror_hf_cache(mirror_dir)}/files/models/{repo_id}/resolve/{commit}"


DOCKER_CERTS_DIR = "/etc/docker/certs.d"
#: Beside a mirror registry's ca.crt: says the directory is sparkfleet's, to remove when
#: the mirror moves (docker reads only *.crt, *.cert and *.key there).
MIRROR_TRUST_MARKER = "sparkfleet-mirror.txt"


def registry_ca_path(registry: str) -> str:
    """Where docker looks for a registry's certificate (read per pull: no restart)."""
    return f"{DOCKER_CERTS_DIR}/{registry}/ca.crt"
