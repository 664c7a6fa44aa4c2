"""An image reference as registries see it: its registry, path, tag and digest, and the
registry it comes from upstream."""

from __future__ import annotations

from dataclasses import dataclass


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
    """The registry ``image`` comes from: where the mirror copies it from, and where the
    fleet lock resolves its tag."""
    if image_registry_url:
        return image_registry_url.rstrip("/")
    registry = ImageName.parse(image).registry
    return "https://registry-1.docker.io" if registry == "docker.io" else f"https://{registry}"
