"""The mirror host, or a relay: the registry with the image copy and the HF mirror, each
up and restarted only when its configuration changed, both answering before anyone
fetches. The fleet's mirror copies from upstream and also serves its cache offline; a
relay (:func:`sparkfleet.mirrors.relay_tree`) copies from the mirror above it, once that one
holds the image, and its HF mirror fetches through the one above it."""

from __future__ import annotations

import shlex
from pathlib import Path

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.operations import systemd

from sparkfleet import fleetlock, snapshot
from sparkfleet.config import Settings
from sparkfleet.fleet import all_mirrors, all_settings, fleet_lock
from sparkfleet.hostpaths import (
    HF_MIRROR_CONFIG,
    HF_MIRROR_OFFLINE_CONFIG,
    HF_MIRROR_OFFLINE_UNIT,
    HF_MIRROR_OFFLINE_UNIT_PATH,
    HF_MIRROR_UNIT,
    HF_MIRROR_UNIT_PATH,
    OLAH_LIB,
    REGISTRY_CERT,
    REGISTRY_CONFIG,
    REGISTRY_KEY,
    REGISTRY_UNIT,
    REGISTRY_USER,
    mirror_hf_cache,
    mirror_kept_record,
    mirror_registry_storage,
)
from sparkfleet.imagename import upstream_registry_url
from sparkfleet.mirror import firewall, hf, keep, registry, tls
from sparkfleet.mirror.facts import MirrorAnswers, RegistryManifest
from sparkfleet.mirrors import Mirror

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"


def served(settings: Settings, mirror: Mirror) -> list:
    """The registry and the HF mirror on this host, the mirror, both answering; the fleet's
    mirror starts fetching the weights and copying the image from upstream. Returns the
    operations it declared (for the report)."""
    snapshot.expect(programs=["docker-registry", "skopeo", "nft"])
    installed = registry.installed(name="docker-registry and skopeo installed", apt_repo=settings.apt_repo,
                                   apt_key_url=settings.apt_key_url)
    firewall.fleet_only(mirror)  # before either service first answers
    storage = snapshot.directory(mirror_registry_storage(settings.mirror_dir), mode="750",
                                 owner=f"{REGISTRY_USER}:{REGISTRY_USER}", name="registry storage")
    certificate = tls.on_registry(settings.mirror_tls_dir, mirror)
    config = snapshot.template(
        REGISTRY_CONFIG, str(TEMPLATES / "registry-mirror.yml.j2"), op_args={"name": "registry configuration"},
        storage=mirror_registry_storage(settings.mirror_dir), port=mirror.registry_port, cert=REGISTRY_CERT,
        key=REGISTRY_KEY,
    )
    registry_feeds = (installed, storage, *certificate, config)
    snapshot.service(REGISTRY_UNIT, name=f"{REGISTRY_UNIT} running")
    systemd.service(
        name=f"{REGISTRY_UNIT} restarted for its new configuration", service=REGISTRY_UNIT,
        restarted=True, _if=lambda: any(op.did_change() for op in registry_feeds),
    )

    olah = hf.installed(name=f"HF mirror ({settings.mirror_olah}) installed", requirement=settings.mirror_olah)
    hf_data = snapshot.directory(mirror_hf_cache(settings.mirror_dir), name="HF mirror cache")
    # The same cache twice: online (fetches from the hub), and offline (serves only what
    # it holds: the locked revisions upstream refuses since, sparkfleet.fleetlock). A relay
    # runs the online one only: every host's offline fallback is the fleet's mirror.
    services = [(False, mirror.hf_port, HF_MIRROR_CONFIG, HF_MIRROR_UNIT, HF_MIRROR_UNIT_PATH, "logs")]
    if mirror.hf_offline_port:
        services.append((True, mirror.hf_offline_port, HF_MIRROR_OFFLINE_CONFIG, HF_MIRROR_OFFLINE_UNIT,
                         HF_MIRROR_OFFLINE_UNIT_PATH, "logs-offline"))
    for offline, port, config_path, unit_name, unit_path, logs in services:
        _olah_served(settings, mirror, olah, hf_data, offline, port, config_path, unit_name, unit_path, logs)
    if not mirror.hf_offline_port:  # a former fleet's mirror, now a relay: its offline cache no longer served
        snapshot.service(HF_MIRROR_OFFLINE_UNIT, running=False, enabled=False,
                         name=f"{HF_MIRROR_OFFLINE_UNIT} stopped (a relay)")
    # Both answer before anything is fetched from them.
    snapshot.expect(facts=[(MirrorAnswers, _answers(mirror))])
    ready = answering(name="registry and HF mirror answer", mirror=mirror)
    if not mirror.upstream:  # the fleet's mirror: the weights cross the WAN while the image does
        keep.prefetched(name="the HF mirror fetches every file of the locked commits", commits=locked_commits(settings.mirror_dir),
                        mirror_dir=settings.mirror_dir, hf_port=mirror.hf_port)
    if not mirror.upstream:  # the fleet's mirror: the image crosses the WAN too, waited for in copied()
        registry.copy_started(name="serving image copy from upstream started", image=settings.image,
                              sources=_sources(settings, mirror), result_dir=settings.mirror_dir, mirror=mirror)
    return [installed, olah, ready]


def copied(settings: Settings, mirror: Mirror) -> list:
    """The image in this host's registry: the fleet mirror's copy from upstream (started by
    :func:`served`) waited for, then each relay's from the one above it, turn by turn; and
    what the mirror keeps. Returns the operations it declared (for the report)."""
    # A relay's copy waits for its turn: pyinfra runs each turn's operation on every host
    # before the next, so the mirror above it holds the image by then. Should that one have
    # failed, the copy comes from the fleet's mirror. Every host that serves declares every
    # turn: pyinfra orders operations by each host's own sequence, so a turn declared on
    # some hosts only could run before an earlier one (an operation of the fleet's mirror
    # alone, before its copy, did so).
    turns = max((m.depth for m in all_mirrors().values() if m and m.is_self), default=0)
    for turn in host.loop(range(turns + 1)):
        copied = registry.image_copied(
            name="serving image copied from upstream" if turn == 0 else f"serving image copied into the relays "
                                                                       f"{turn} hop{'s' if turn > 1 else ''} down",
            image=settings.image, sources=_sources(settings, mirror), result_dir=settings.mirror_dir, mirror=mirror,
            turn=turn,
        )
        if turn == mirror.depth:
            copy = copied
            snapshot.expect(facts=[(RegistryManifest, registry.held(settings.image, mirror))])
    snapshot.expect(texts=[mirror_kept_record(settings.mirror_dir)])
    keep.kept(name="the mirror keeps what sparkfleet.lock names, and the previous ones",
              record_path=mirror_kept_record(settings.mirror_dir), locked=fleetlock.artifacts(fleet_lock().lock),
              keep_previous=settings.mirror_keep_previous, mirror_dir=settings.mirror_dir, registry=mirror.registry)
    return [copy]


def _sources(settings: Settings, mirror: Mirror) -> list[str]:
    """Where this mirror copies the image from: the mirrors above it, nearest first; the
    fleet's mirror: upstream."""
    return [f"https://{m.registry}" for m in mirror.fallbacks] or [
        upstream_registry_url(settings.image, settings.image_registry_url)]


def locked_commits(mirror_dir: str) -> list[tuple[str, str]]:
    """(repo id, commit) of every repository a serving host fetches, as sparkfleet.lock pins
    them: what the fleet's mirror holds. Declared to this host's one read."""
    commits = sorted({(repo, s.revision(repo)) for s in all_settings().values() if s.serving
                      for repo in s.repos_to_fetch})
    keep.expected(mirror_dir, commits)
    return commits


def _olah_served(settings: Settings, mirror: Mirror, olah, hf_data, offline: bool, port: int, config_path: str,
                 unit_name: str, unit_path: str, logs: str) -> None:
    """One olah service over the mirror's HF cache: configured, running, restarted when
    what it runs changed."""
    scheme, netloc, lfs_netloc = hf.upstream_hub(mirror.upstream.hf_endpoint if mirror.upstream
                                                 else settings.hf_endpoint)
    what = "HF mirror" + (" (offline)" if offline else "")
    hf_config = snapshot.template(
        config_path, str(TEMPLATES / "hf-mirror.toml.j2"), op_args={"name": f"{what} configuration"},
        port=port, repos=mirror_hf_cache(settings.mirror_dir), offline=offline,
        scheme=scheme, netloc=netloc, lfs_netloc=lfs_netloc, address=mirror.netloc_host,
        listen="::" if ":" in str(mirror.address) else "0.0.0.0",
    )
    hf_unit = snapshot.template(
        unit_path, str(TEMPLATES / "sparkfleet-hf-mirror.service.j2"),
        op_args={"name": f"systemd unit {unit_name}"}, lib=OLAH_LIB, config=config_path,
        data_dir=f"{settings.mirror_dir}/hf", requirement=settings.mirror_olah, offline=offline, logs=logs,
        # olah spends ~tens of ms of CPU per request; one process per core, up to 4 (offline:
        # one, it serves only what upstream no longer has).
        workers=1 if offline else max(1, min(4, snapshot.cpus())),
    )
    systemd.daemon_reload(name=f"systemd reload for the {what} unit", _if=hf_unit.did_change)
    snapshot.service(unit_name, name=f"{unit_name} running")
    feeds = (olah, hf_config, hf_unit, hf_data)
    systemd.service(
        name=f"{unit_name} restarted for its new configuration", service=unit_name,
        restarted=True, _if=lambda: any(op.did_change() for op in feeds),
    )


def _answers(mirror: Mirror) -> dict:
    return {"registry": mirror.registry, "hf_port": mirror.hf_port, "hf_offline_port": mirror.hf_offline_port}


@operation(is_idempotent=False)
def answering(mirror: Mirror):
    """
    Wait (up to 60 s) until the mirror registry and the HF mirrors answer.

    + mirror: this host, the mirror
    """
    if snapshot.fact(MirrorAnswers, **_answers(mirror)):  # read with the rest, unless this run changed the host
        host.noop("the registry and the HF mirrors answer")
        return
    offline = f"curl -s -m 5 -o /dev/null http://127.0.0.1:{mirror.hf_offline_port}/ && " if mirror.hf_offline_port else ""
    yield StringCommand(
        "sh", "-c",
        shlex.quote(
            "for i in $(seq 60); do "
            f"curl -sf -m 5 --cacert {REGISTRY_CERT} https://{mirror.registry}/v2/ >/dev/null && "
            f"curl -s -m 5 -o /dev/null http://127.0.0.1:{mirror.hf_port}/ && {offline}exit 0; sleep 1; done; "
            f"echo 'the mirror does not answer: see journalctl -u {REGISTRY_UNIT} -u {HF_MIRROR_UNIT} "
            f"-u {HF_MIRROR_OFFLINE_UNIT}' >&2; "
            f"journalctl -u {REGISTRY_UNIT} -u {HF_MIRROR_UNIT} -u {HF_MIRROR_OFFLINE_UNIT} -n 20 --no-pager -o cat >&2; "
            "exit 1"
        ),
    )
