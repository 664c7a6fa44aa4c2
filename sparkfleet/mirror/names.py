"""Names of the mirror's services as the fleet's hosts see them: image references in the
mirror registry, the HF endpoint."""

from __future__ import annotations

from sparkfleet import hostpaths
from sparkfleet.config import Settings
from sparkfleet.fleet import host_mirror
from sparkfleet.imagename import ImageName
from sparkfleet.mirrors import Mirror

__all__ = ["LOCAL_REPOSITORY", "hf_endpoint", "hf_offline_endpoint", "image_reference", "local_image"]


def image_reference(settings: Settings, mirror: Mirror | None = None) -> str:
    """The reference hosts pull and run: the mirror registry's copy, or ``image`` itself."""
    mirror = mirror if mirror is not None else host_mirror()
    return ImageName.parse(settings.image).at(mirror.registry) if mirror else settings.image


LOCAL_REPOSITORY = hostpaths.LOCAL_IMAGE_REPOSITORY


def local_image(settings: Settings) -> str:
    """The name a host runs the serving image by, whichever registry it came from
    (:func:`sparkfleet.hostpaths.local_image`)."""
    return hostpaths.local_image(settings.image)


def hf_endpoint(settings: Settings, mirror: Mirror | None = None) -> str | None:
    """The HF endpoint downloads use: the mirror's HF endpoint, or ``hf_endpoint``."""
    mirror = mirror if mirror is not None else host_mirror()
    return mirror.hf_endpoint if mirror else settings.hf_endpoint


def hf_offline_endpoint(settings: Settings, mirror: Mirror | None = None) -> str | None:
    """The mirror's HF endpoint that serves its cache only (None without a mirror): where a
    download goes when upstream no longer has a locked revision."""
    mirror = mirror if mirror is not None else host_mirror()
    return mirror.hf_offline_endpoint if mirror else None
