"""The serving image: pulled when absent, pinnable by digest, nothing done when present."""

from __future__ import annotations

import json
import shlex

from pyinfra import host
from pyinfra.api import FactBase, operation

from sparkfleet.config import Settings
from sparkfleet.tasks import detached


class Image(FactBase["dict | None"]):
    """The local image ``reference`` resolves to: id and repo digests, or None."""

    def command(self, reference: str) -> str:
        return (
            f"docker image inspect --format '{{{{json .Id}}}} {{{{json .RepoDigests}}}}' "
            f"{shlex.quote(reference)} 2>/dev/null || true"
        )

    def process(self, output):
        if not output or not output[0].startswith('"'):
            return None
        image_id, digests = output[0].split(" ", 1)
        return {"id": json.loads(image_id), "repo_digests": json.loads(digests) or []}


def pinned_digest(reference: str) -> str | None:
    return reference.split("@", 1)[1] if "@" in reference else None


def is_present(reference: str) -> bool:
    image = host.get_fact(Image, reference=reference)
    if image is None:
        return False
    digest = pinned_digest(reference)
    return digest is None or any(d.endswith("@" + digest) for d in image["repo_digests"])


@operation()
def pulled(settings: Settings):
    """
    Pull the serving image unless this exact reference is already on the host.

    + settings: validated settings (``image``; pin it as ``name@sha256:...`` for a fleet)

    A tag that moved upstream is not re-pulled: pin a digest to change what runs.
    """
    if is_present(settings.image):
        host.noop(f"image {settings.image} is present")
        return
    yield detached("image-pull", f"docker pull {shlex.quote(settings.image)}")
