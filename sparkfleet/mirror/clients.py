"""Every host of a fleet with a mirror checks that the mirror answers before it pulls
or downloads; a host that was the mirror before stops its services."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import StringCommand, operation

from sparkfleet import remote, snapshot
from sparkfleet.hostpaths import (
    FIREWALL_UNIT,
    HF_MIRROR_OFFLINE_UNIT,
    HF_MIRROR_UNIT,
    REGISTRY_CONFIG,
    REGISTRY_UNIT,
    registry_ca_path,
)
from sparkfleet.mirrors import Mirror


def _probe(mirror: Mirror, service: str) -> tuple[str, str]:
    """(a command that succeeds when the mirror's ``service`` answers this host, what it is)."""
    if service == "registry":
        return (f"curl -sf -m 10 --cacert {shlex.quote(registry_ca_path(mirror.registry))} "
                f"https://{mirror.registry}/v2/ >/dev/null"), f"registry {mirror.registry}"
    return f"curl -s -m 10 -o /dev/null {mirror.hf_endpoint}/", f"HF mirror {mirror.hf_endpoint}"


def answers(mirror: Mirror, service: str) -> StringCommand:
    """A command that fails this host, saying so, when neither the mirror's ``service``
    ("registry" or "hf") nor its fallbacks' answer it."""
    probe, what = _probe(mirror, service)
    others = [_probe(m, service)[0] for m in mirror.fallbacks]
    return remote.fail_unless(
        " || ".join([probe, *others]),
        f"the mirror {mirror.host} does not answer ({what}"
        + (f", nor {', '.join(m.host for m in mirror.fallbacks)} above it" if others else "")
        + "): see its errors above, set mirror_address to an address of it this host reaches, or deploy with "
        "--data fleet_mirror=none to download from upstream",
    )


def _former_units() -> list[str]:
    """The mirror's services that run or are enabled here; docker-registry only when its
    configuration is ours (a registry the host runs for itself is not ours to stop)."""
    units = [HF_MIRROR_UNIT, HF_MIRROR_OFFLINE_UNIT, FIREWALL_UNIT]
    if "sparkfleet" in (snapshot.text(REGISTRY_CONFIG) or ""):
        units.append(REGISTRY_UNIT)
    return [unit for unit in units if snapshot.unit(unit).get("ActiveState") == "active"
            or snapshot.unit(unit).get("UnitFileState") in ("enabled", "enabled-runtime")]


def former_mirror_stopped(mirror: Mirror | None, **op_args):
    """An operation: :func:`_former_mirror_stopped` (what it reads declared to the snapshot)."""
    snapshot.expect(texts=[REGISTRY_CONFIG], units=[HF_MIRROR_UNIT, HF_MIRROR_OFFLINE_UNIT, FIREWALL_UNIT,
                                                    REGISTRY_UNIT])
    return _former_mirror_stopped(mirror=mirror, **op_args)


@operation()
def _former_mirror_stopped(mirror: Mirror | None):
    """
    A host that was the mirror before (fleet_mirror moved or off): its services stopped,
    once the new mirror answers this host. Until then they keep serving whoever still
    pulls from them, and the next run tries again.

    + mirror: the mirror this host uses now (None: fleet_mirror=none)
    """
    units = _former_units()
    if not units:
        host.noop("this host serves no mirror")
        return
    stop = f"systemctl disable --now {' '.join(units)}"
    if mirror is None:
        yield stop
        return
    probes = " && ".join(_probe(mirror, service)[0] for service in ("registry", "hf"))
    kept = f"the new mirror {mirror.host} does not answer yet: {', '.join(units)} kept running here"
    yield StringCommand("if", probes + ";", "then", stop + ";", "else", "echo", shlex.quote(kept), ">&2;", "fi")
