"""The mirror: the serving image and the weights cross the WAN once per fleet.

One host of the inventory (``fleet_mirror``, resolved in :func:`sparkfleet.fleet.host_mirror`)
is the mirror, and every host (the mirror too) downloads from it over the LAN, in parallel:

* model files through an HF mirror, olah (:mod:`sparkfleet.mirror.hf`);
* the image through a registry holding a byte-exact copy of it
  (:mod:`sparkfleet.mirror.registry`); hosts pull it by digest.

Both start crossing the WAN in :func:`configured`; :func:`copied` waits for the image
(the hosts' own setup runs between them).

The mirror host runs both (:mod:`sparkfleet.mirror.server`); every host trusts the
registry's certificate (:mod:`sparkfleet.mirror.tls`) and checks the mirror answers
before it fetches (:mod:`sparkfleet.mirror.clients`); the deploy prints what came from
where (:mod:`sparkfleet.mirror.report`). With ``fleet_mirror=none`` nothing here runs and
every host downloads from upstream.
"""

from __future__ import annotations

from pyinfra.api import deploy

from sparkfleet.config import Settings
from sparkfleet.fleet import host_mirror
from sparkfleet.mirror import clients, keep, server, tls
from sparkfleet.mirror.clients import answers
from sparkfleet.mirror.names import hf_endpoint, hf_offline_endpoint, image_reference, local_image
from sparkfleet.mirror.report import track

__all__ = ["answers", "configured", "copied", "disk_needs", "hf_endpoint", "hf_offline_endpoint", "holds",
           "image_reference", "local_image", "track"]


@deploy("Mirror")
def configured(settings: Settings) -> list:
    """The mirror for this host: served here (the mirror host), trusted (every host using
    it), or stopped (a host that served it before). Returns the operations it declared."""
    mirror = host_mirror()
    ops: list = []
    if mirror:
        ops.append(tls.made(name="registry certificate made on the controller",
                            tls_dir=settings.mirror_tls_dir, mirror=mirror))
        # Trusted first: the mirror host's own image copy into its registry checks it too.
        # And its fallbacks': a relay copies from the one above it, and a host whose relay
        # fails pulls from the fleet's mirror.
        for each in (mirror, *mirror.fallbacks):
            ops.append(tls.trusted(settings.mirror_tls_dir, each))
    tls.former_trust_removed(mirror)
    if mirror and mirror.is_self:
        ops += server.served(settings, mirror)
    else:
        ops.append(clients.former_mirror_stopped(name="former mirror: its services stopped", mirror=mirror))
    return ops


@deploy("Mirror")
def copied(settings: Settings) -> list:
    """On the mirror host and the relays: the serving image in the registry, from upstream
    (the copy :func:`configured` started) and down the relays. Returns the operations it
    declared."""
    mirror = host_mirror()
    return server.copied(settings, mirror) if mirror and mirror.is_self else []


@deploy("Mirror")
def holds(settings: Settings) -> None:
    """On the mirror host, once the hosts fetched: every file of each commit sparkfleet.lock
    names in its HF cache, so a host added after upstream deleted them still deploys."""
    mirror = host_mirror()
    if not mirror or not mirror.is_self or mirror.upstream:  # the fleet's mirror, not a relay
        return
    keep.complete(name="the HF mirror holds every file of the locked commits", commits=server.locked_commits(settings.mirror_dir),
                  mirror_dir=settings.mirror_dir, hf_port=mirror.hf_port)


def disk_needs(settings: Settings, image_gib: float, hf_gib: float) -> dict[str, float]:
    """Disk the mirror's caches still need on the mirror host (host path -> GiB): the image
    copy and olah's copy of every file this host, the mirror, still has to fetch."""
    mirror = host_mirror()
    if not mirror or not mirror.is_self:
        return {}
    return {settings.mirror_dir: image_gib + hf_gib}
