"""Names of the mirror's services as the fleet's hosts see them: image references in the
mirror registry, the HF endpoint, the upstream registry the copy reads from."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from sparkfleet.config import Settings
from sparkfleet.fleet import Mirror, host_mirror


@dataclass(frozen=True)
class ImageName:
    """A docker reference split the way registries see it."""

    registry: str  # host[:port]; docker.io for Docker Hub
    path: str  # repository path in that registry (library/x for official images)
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, reference: str) -> ImageName:
        name, _, digest = reference.partition("@")
        tag = None
        if ":" in name.rsplit("/", 1)[-1]:
            name, tag = name.rsplit(":", 1)
        first, _, rest = name.partition("/")
        if rest and ("." in first or ":" in first or first == "localhost"):
            registry, path = first, rest
        else:
            registry, path = "docker.io", name if "/" in name else f"library/{name}"
        if not tag and not digest:
            tag = "latest"
        return cls(registry, path, tag, digest or None)

    def at(self, registry: str) -> str:
        """This image's reference in another registry (same path, tag and digest)."""
        return f"{registry}/{self.path}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else ""
        )


def upstream_registry_url(image: str, image_registry_url: str | None) -> str:
    """The registry the mirror copies ``image`` from."""
    if image_registry_url:
        return image_registry_url.rstrip("/")
    registry = ImageName.parse(image).registry
    return "https://registry-1.docker.io" if registry == "docker.io" else f"https://{registry}"


def image_reference(settings: Settings, mirror: Mirror | None = None) -> str:
    """The reference hosts pull and run: the mirror registry's copy, or ``image`` itself."""
    mirror = mirror if mirror is not None else host_mirror()
    return ImageName.parse(settings.image).at(mirror.registry) if mirror else settings.image


#: The repository hosts run the serving image by (see :func:`local_image`).
LOCAL_REPOSITORY = "localhost/sparkfleet/serve"


def local_image(settings: Settings) -> str:
    """The name a host runs the serving image by, whichever registry it came from: its
    digest for a pinned image, else a hash of ``image``. The unit and every one-shot run
    use it, so a mirror that moves (a new address in the pull reference) changes nothing
    that runs, and restarts nothing."""
    digest = ImageName.parse(settings.image).digest
    tag = digest.replace(":", "-") if digest else "ref-" + hashlib.sha256(settings.image.encode()).hexdigest()[:20]
    return f"{LOCAL_REPOSITORY}:{tag}"


def hf_endpoint(settings: Settings, mirror: Mirror | None = None) -> str | None:
    """The HF endpoint downloads use: the mirror's HF endpoint, or ``hf_endpoint``."""
    mirror = mirror if mirror is not None else host_mirror()
    return mirror.hf_endpoint if mirror else settings.hf_endpoint
