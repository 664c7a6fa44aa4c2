"""The fleet monitor: Prometheus on one host watches every engine, exporter and node.

Prometheus and its node exporter come from the distribution's archives (Debian/Ubuntu
``prometheus``, ``prometheus-node-exporter``; ``apt_repo`` if set) and run as the packaged
units. On the host ``fleet_monitor`` names (fleet.chosen_monitor), Prometheus scrapes:

- every serving host's engine ``/metrics`` (a pair: its head), with the fleet key as a
  bearer token read from a 0600 file of the prometheus user at each scrape;
- the fleet endpoint's HAProxy exporter (``endpoint_metrics_port``), with the same key;
- the node exporter of every host.

Every target is reached at the address its host has on its route to the monitor host (the
endpoint finds its members the same way), and labelled with its inventory name (``host``).
Each node exporter listens on that address only; Prometheus' web and API on
``monitor_bind_address`` (loopback: an SSH tunnel reaches it). The alert rules
(templates/sparkfleet-alerts.yml.j2) and the configuration are checked with the package's
``promtool`` on the host before they replace the running ones; Prometheus then reloads
(SIGHUP), it never restarts for them. ``sparkfleet status`` shows the alerts that fire.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr
from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.api.util import get_template
from pyinfra.operations import systemd

from sparkfleet import apt, credentials, remote, snapshot
from sparkfleet.config import Settings
from sparkfleet.fleet import (
    all_pairs,
    all_settings,
    chosen_endpoint,
    chosen_monitor,
    once,
    reached_at,
    source_toward,
    ssh_address,
)
from sparkfleet.hostpaths import (
    NODE_EXPORTER_DEFAULTS,
    NODE_EXPORTER_UNIT,
    PROMETHEUS_CONFIG,
    PROMETHEUS_DEFAULTS,
    PROMETHEUS_KEY,
    PROMETHEUS_RULES,
    PROMETHEUS_UNIT,
)

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
MARKER = "# Rendered by sparkfleet (monitor.py)"
USER = "prometheus"  # the packages' own user: Prometheus reads its key file as it
#: Filesystems that are not a disk (the disk alert leaves them out).
PSEUDO_FS = "tmpfs|devtmpfs|ramfs|overlay|squashfs|nsfs|fuse.lxcfs|autofs"


@dataclass(frozen=True)
class Target:
    """One scrape target: the inventory name it is labelled with, and where it answers."""

    host: str
    address: str  # address:port as Prometheus dials it


@dataclass(frozen=True)
class Job:
    name: str
    why: str
    keyed: bool
    targets: tuple[Target, ...]


def netloc(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


# --- what lands on the hosts --------------------------------------------------------------


def render_config(settings: Settings, jobs: list[Job], key_file: str = PROMETHEUS_KEY,
                  rules_file: str = PROMETHEUS_RULES) -> str:
    """prometheus.yml (templates/prometheus.yml.j2): the jobs, their targets, the rules."""
    interval = settings.monitor_scrape_interval_s
    return get_template(str(TEMPLATES / "prometheus.yml.j2")).render(
        interval_s=interval, timeout_s=min(10, interval), rules_file=rules_file, key_file=key_file,
        jobs=[job for job in jobs if job.targets])


def render_rules(settings: Settings) -> str:
    """The alert rules (templates/sparkfleet-alerts.yml.j2), their thresholds from the settings."""
    return get_template(str(TEMPLATES / "sparkfleet-alerts.yml.j2")).render(
        for_s=settings.alert_for_s, wedge_s=settings.wedge_timeout_s,
        psi_pct=f"{settings.alert_psi_full_pct:g}", stop_psi_pct=f"{settings.memory_stop_psi_full_pct:g}",
        available_bytes=int(settings.alert_memory_available_gib * 2**30),
        available_gib=f"{settings.alert_memory_available_gib:g}",
        stop_available_gib=f"{settings.memory_stop_available_gib:g}",
        acceptance_s=settings.alert_acceptance_window_s, acceptance_floor=f"{settings.rollout_min_acceptance:g}",
        disk_free_pct=f"{settings.alert_disk_free_pct:g}", pseudo_fs=PSEUDO_FS)


def prometheus_args(settings: Settings) -> str:
    listen = netloc(settings.monitor_bind_address, settings.monitor_port)
    return f'{MARKER}: Prometheus\' web and API answer here only.\nARGS="--web.listen-address={listen}"\n'


def node_exporter_args(address: str, port: int) -> str:
    return (f"{MARKER}: the node exporter answers on this host's fleet address only.\n"
            f'ARGS="--web.listen-address={netloc(address, port)}"\n')


# --- where the hosts are, as the monitor host reaches them --------------------------------------


def monitor_name(state, settings: dict[str, Settings] | None = None) -> str | None:
    """The inventory name of the fleet monitor's host, or None (fleet_monitor=none).

    + settings: every host's settings (default: this run's, validated once)
    """
    return chosen_monitor(list(state.inventory), settings if settings is not None else all_settings())[0]


#: A target of the running prometheus.yml (templates/prometheus.yml.j2) and its host label.
TARGET = re.compile(r'- targets: \["(?P<address>[^"]+)"\]\n\s+labels: \{host: "(?P<host>[^"]+)"\}')


def current_addresses(config: str) -> dict[str, str]:
    """{inventory name: address} as the running configuration reaches each host (its node
    exporter's target)."""
    found = {}
    for job in config.split("- job_name: ")[1:]:
        if job.startswith("node\n"):
            for target in TARGET.finditer(job):
                found[target["host"]] = target["address"].rsplit(":", 1)[0].strip("[]")
    return found


def reachable(member) -> bool:
    """Whether this run reached ``member`` (a host it could not connect to is never asked)."""
    return member in host.state.activated_hosts and member not in host.state.failed_hosts


#: Where the node exporter listens, in its defaults file (node_exporter_args).
LISTENING = re.compile(r'--web\.listen-address=\[?(?P<address>[^"\]\s]+?)\]?:\d+"')


def fleet_address(member, previous: dict[str, str] | None = None) -> str:
    """The address ``member`` has on its route to the monitor host (asked once per run,
    whoever asks first): where its exporters listen and Prometheus reaches them. A host
    that cannot be asked keeps its address in ``previous`` (the running configuration's:
    an unreachable host changes nothing), else how the controller reaches it; "" when the
    monitor host cannot be asked and ``previous`` does not say."""
    state = host.state
    monitor = state.inventory.get_host(monitor_name(state))

    def ask() -> str:
        if not reachable(monitor):  # nothing to route toward: where it is now stays
            return (previous or {}).get(member.name, "")
        toward = ssh_address(monitor)
        if member is monitor:
            return toward or reached_at(member)
        if toward and reachable(member):
            try:
                found = source_toward(member, toward)
            except Exception:  # noqa: BLE001 - an unreachable host keeps how the controller names it
                found = ""
            if found:
                return found
        return (previous or {}).get(member.name) or reached_at(member)

    return once(("monitor address", member.name), ask)


def jobs(settings: Settings) -> list[Job]:
    """What Prometheus scrapes: every serving host's engine (a pair: its head), the
    endpoint's HAProxy exporter, every host's node exporter."""
    state = host.state
    every = all_settings()
    pairs = all_pairs()
    keyed = settings.api_key.get_secret_value() != "none"
    engines, nodes = [], []
    previous = current_addresses(snapshot.text(PROMETHEUS_CONFIG) or "")
    for member in state.inventory:
        ms = every[member.name]
        address = fleet_address(member, previous)
        nodes.append(Target(member.name, netloc(address, ms.node_exporter_port)))
        if not ms.serving or (member.name in pairs and not pairs[member.name].is_head):
            continue  # a headless rank serves no HTTP
        bound = ipaddress.ip_address(ms.bind_address)
        engine_at = address if bound.is_unspecified or bound.is_loopback else ms.bind_address
        engines.append(Target(member.name, netloc(engine_at, ms.port)))
    endpoint = chosen_endpoint(list(state.inventory), every)[0]
    haproxy = ([Target(endpoint, netloc(fleet_address(state.inventory.get_host(endpoint), previous),
                                        every[endpoint].endpoint_metrics_port))] if endpoint else [])
    return [
        Job("engine", "vLLM's /metrics on every serving host (a pair: its head), with the fleet key", keyed,
            tuple(engines)),
        Job("haproxy", "the fleet endpoint's HAProxy exporter, with the fleet key", keyed, tuple(haproxy)),
        Job("node", "the node exporter of every host: memory, PSI, filesystems", False, tuple(nodes)),
    ]


# --- operations -------------------------------------------------------------------------------


@operation()
def checked_file(path: str, content: str, check: str):
    """
    ``path`` holds ``content`` (0644 root), written only once ``check`` accepts it: a file
    the program would refuse never replaces the one it runs with.

    + path: the file on the host
    + content: what it must hold
    + check: a command that judges the new file, given as its last argument; it runs only
      where it is installed (its first word is looked for on the PATH)
    """
    if snapshot.file_state(path) == (0o644, "root:root", hashlib.sha256(content.encode()).hexdigest()):
        host.noop(f"{path} is up to date")
        return
    q = shlex.quote
    new = f"{path}.sparkfleet-new"
    yield f"install -d -m 0755 {q(path.rsplit('/', 1)[0])}"
    yield remote.callback(remote.uploaded, content.encode(), new, "0644", "root:root")
    program = check.split()[0]
    yield (f"if command -v {q(program)} >/dev/null 2>&1; then {check} {q(new)} || {{ rm -f {q(new)}; exit 1; }}; fi; "
           f"mv -f {q(new)} {q(path)}")


def _key_written(state, host, api_key: SecretStr, key_file: Path) -> bool:  # pyinfra passes state, host
    key = credentials.make_api_key(api_key, key_file)
    remote.put(host, f"{key or ''}\n".encode(), PROMETHEUS_KEY, mode="0600", owner=f"{USER}:{USER}")
    return True


@operation()
def key_written(api_key: SecretStr, key_file: Path):
    """
    The fleet key in Prometheus' bearer-token file: 0600, the prometheus user's, never in
    argv or the configuration.

    + api_key: ``auto`` (the project's key in ``key_file``, made by the deploy), ``none`` or the key
    + key_file: where the controller keeps the ``auto`` key
    """
    try:
        key = credentials.existing_api_key(api_key, key_file)
    except credentials.NotYetMade:  # made when the deploy executes, never while it plans
        yield remote.callback(_key_written, api_key, key_file)
        return
    content = f"{key or ''}\n".encode()
    if snapshot.file_state(PROMETHEUS_KEY) == (0o600, f"{USER}:{USER}", hashlib.sha256(content).hexdigest()):
        host.noop(f"{PROMETHEUS_KEY} holds the fleet key")
        return
    yield remote.callback(_key_written, api_key, key_file)


# --- the state --------------------------------------------------------------------------------


snapshot.expect_first(files=[NODE_EXPORTER_DEFAULTS, PROMETHEUS_DEFAULTS, PROMETHEUS_KEY, PROMETHEUS_RULES,
                             PROMETHEUS_CONFIG], texts=[NODE_EXPORTER_DEFAULTS, PROMETHEUS_DEFAULTS, PROMETHEUS_CONFIG],
                      units=[NODE_EXPORTER_UNIT, PROMETHEUS_UNIT], programs=["prometheus-node-exporter", "prometheus"])


@deploy("Fleet monitor")
def configured(settings: Settings) -> None:
    """A node exporter on this host when the fleet has a monitor, and Prometheus with the
    alert rules on the monitor host; a former monitor's Prometheus and the exporters of a
    fleet without one stopped."""
    name = monitor_name(host.state)
    if name is None:
        if MARKER in (snapshot.text(NODE_EXPORTER_DEFAULTS) or ""):
            snapshot.service(NODE_EXPORTER_UNIT, running=False, enabled=False, name="node exporter stopped (no monitor)")
    else:
        node_exporter(settings)
    if name == host.name:
        prometheus(settings)
    elif MARKER in (snapshot.text(PROMETHEUS_DEFAULTS) or ""):
        snapshot.service(PROMETHEUS_UNIT, running=False, enabled=False, name="former fleet monitor: Prometheus stopped")


def node_exporter(settings: Settings) -> None:
    # Where it listens is written before the package starts it: it never answers on every address.
    # The monitor host unreachable this run: the exporter keeps the address it listens on.
    listening = LISTENING.search(snapshot.text(NODE_EXPORTER_DEFAULTS) or "")
    address = fleet_address(host) or (listening["address"] if listening else "") or reached_at(host)
    args = snapshot.file(NODE_EXPORTER_DEFAULTS, node_exporter_args(address, settings.node_exporter_port),
                         name="node exporter on the fleet address")
    package = apt.installed(name="prometheus-node-exporter installed", packages=["prometheus-node-exporter"],
                            apt_repo=settings.apt_repo, apt_key_url=settings.apt_key_url, keep_config=True,
                            no_recommends=True)
    snapshot.service(NODE_EXPORTER_UNIT, name="node exporter running")
    systemd.service(name="node exporter restarted on its new address", service=NODE_EXPORTER_UNIT, restarted=True,
                    _if=lambda: args.did_change() and not package.did_change())


def prometheus(settings: Settings) -> None:
    args = snapshot.file(PROMETHEUS_DEFAULTS, prometheus_args(settings), name="Prometheus' web on its address")
    package = apt.installed(name="prometheus installed", packages=["prometheus"], apt_repo=settings.apt_repo,
                            apt_key_url=settings.apt_key_url, keep_config=True, no_recommends=True)
    keyed = settings.api_key.get_secret_value() != "none"
    if keyed:
        key_written(name="fleet key in Prometheus' 0600 token file", api_key=settings.api_key,
                    key_file=credentials.api_key_path(settings))
    rules = checked_file(name="alert rules (promtool check rules)", path=PROMETHEUS_RULES,
                         content=render_rules(settings), check="promtool check rules")
    config = checked_file(name="scrape targets (promtool check config)", path=PROMETHEUS_CONFIG,
                          content=render_config(settings, jobs(settings)), check="promtool check config")
    snapshot.service(PROMETHEUS_UNIT, name="Prometheus running")

    def moved() -> bool:  # a new address: a restart (the package's own start had it already)
        return args.did_change() and not package.did_change()

    systemd.service(name="Prometheus restarted on its new address", service=PROMETHEUS_UNIT, restarted=True,
                    _if=moved)
    # Rules and targets: a reload (SIGHUP), never a restart.
    systemd.service(name="Prometheus reloaded for its rules and targets", service=PROMETHEUS_UNIT, reloaded=True,
                    _if=lambda: (rules.did_change() or config.did_change()) and not moved())
