"""Optional hybrid INT4+FP8 build: the dense profile's checkpoint made on the host.

Runs ``runtime/build_hybrid.py`` once inside the serving image: the Intel INT4
checkpoint from the HF cache plus the FP8 donor's non-expert shards give a checkpoint
in ``hybrid_dir`` that the service then serves as ``/model``. The builder writes to a
temporary name and renames at the end, so a complete-looking output is a complete one.
"""

from __future__ import annotations

import posixpath
import shlex

from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.facts.files import FileContents

from sparkfleet import mirror
from sparkfleet.config import Settings
from sparkfleet.hostpaths import repo_cache_dir, snapshot_marker
from sparkfleet.image import one_shot
from sparkfleet.profiles import FP8_DONOR, INTEL_INT4
from sparkfleet.tasks import detached

#: The key the builder writes into the output's config.json (runtime/build_hybrid.py).
BUILD_MARK = "sparkfleet_hybrid"


def is_built(hybrid_dir: str) -> bool:
    """Whether ``hybrid_dir`` holds a finished build (its config carries the build info)."""
    config = host.get_fact(FileContents, path=f"{hybrid_dir}/config.json")
    return bool(config) and any(BUILD_MARK in line for line in config)


def disk_needs(settings: Settings) -> dict[str, float]:
    """What a build still needs on this host (host path -> GiB): the FP8 donor's shards
    in the HF cache and the output in ``hybrid_dir``; nothing without ``build_hybrid``."""
    if not settings.build_hybrid or is_built(settings.hybrid_dir):
        return {}
    return {settings.hf_home: settings.artifact_size_gib(FP8_DONOR),
            settings.hybrid_dir: settings.artifact_size_gib("hybrid-build")}


@operation()
def built(hybrid_dir: str, hf_home: str, int4_revision: str, donor_revision: str, image: str,
          hf_endpoint: str | None):
    """
    Build the hybrid checkpoint into ``hybrid_dir`` unless it is there.

    + hybrid_dir: where the build goes (served as /model)
    + hf_home: the HF cache holding the Intel INT4 snapshot (fetched by the weights step)
    + int4_revision / donor_revision: revisions of the INT4 checkpoint and of the FP8 donor
    + image / hf_endpoint: the serving image the build runs in, and where it fetches the donor
    """
    if is_built(hybrid_dir):
        host.noop(f"hybrid checkpoint present in {hybrid_dir}")
        return
    q = shlex.quote
    parent, name = posixpath.split(hybrid_dir.rstrip("/"))
    # The snapshot's commit is read on the host when the build starts (the fetch step
    # has just written it); the path is the same snapshot seen from inside the container.
    marker = snapshot_marker(hf_home, INTEL_INT4, int4_revision)
    int4_dir = repo_cache_dir("/hf", INTEL_INT4) + "/snapshots/$(cat " + q(marker) + ")"
    args = (
        f"/host/build_hybrid.py --int4 \"{int4_dir}\" --donor {q(FP8_DONOR)} "
        f"--donor-revision {q(donor_revision)} --out /out/{q(name)}"
    )
    yield f"mkdir -p {q(parent)}"
    yield detached(
        "hybrid-build",
        one_shot(image, hf_home, hf_endpoint, "sparkfleet-hybrid-build", args, extra_mounts=f"-v {q(parent)}:/out "),
    )


@deploy("Hybrid build")
def checkpoint(settings: Settings):
    """With ``build_hybrid``: the hybrid checkpoint in ``hybrid_dir``. Returns the build
    operation (a restart input of the service), or None."""
    if not settings.build_hybrid:
        return None
    return built(
        name="hybrid INT4+FP8 checkpoint", hybrid_dir=settings.hybrid_dir, hf_home=settings.hf_home,
        int4_revision=settings.revision(INTEL_INT4), donor_revision=settings.revision(FP8_DONOR),
        image=mirror.image_reference(settings), hf_endpoint=mirror.hf_endpoint(settings),
    )
