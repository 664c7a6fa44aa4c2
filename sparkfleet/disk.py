"""What the profile still has to put on disk, from what the host already holds."""

from __future__ import annotations

from pyinfra import host

from sparkfleet import image, weights
from sparkfleet.config import Settings
from sparkfleet.hybrid import HybridBuilt
from sparkfleet.profiles import FP8_DONOR


def still_needed(settings: Settings) -> tuple[float, dict[str, float]]:
    """(GiB for the image in docker's root, {host path: GiB}) for what is not there yet.

    Only what this profile uses counts: no drafter for base/mtp, no download for a
    model_dir, the donor and build output only for a hybrid build.
    """
    image_gib = 0.0 if image.is_present(settings.image) else settings.image_size_gib
    cache_gib = sum(settings.artifact_size_gib(repo) for repo in weights.missing_repos(settings))
    needs = {settings.hf_home: cache_gib}
    if settings.build_hybrid and not host.get_fact(HybridBuilt, path=settings.hybrid_dir):
        needs[settings.hf_home] += settings.artifact_size_gib(FP8_DONOR)
        needs[settings.hybrid_dir] = settings.artifact_size_gib("hybrid-build")
    return image_gib, needs
