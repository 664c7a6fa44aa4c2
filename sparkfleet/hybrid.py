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
from pyinfra.api import FactBase, operation

from sparkfleet.config import Settings
from sparkfleet.hostpaths import repo_cache_dir, snapshot_marker
from sparkfleet.image import one_shot
from sparkfleet.profiles import FP8_DONOR, INTEL_INT4
from sparkfleet.tasks import detached


class HybridBuilt(FactBase[bool]):
    """Whether ``path`` holds a finished hybrid build (its config carries the build info)."""

    @staticmethod
    def default():
        return False

    def command(self, path: str) -> str:
        return f"grep -q sparkfleet_hybrid {shlex.quote(path + '/config.json')} 2>/dev/null && echo yes || echo no"

    def process(self, output):
        return bool(output) and output[0].strip() == "yes"


def disk_needs(settings: Settings) -> dict[str, float]:
    """What a build still needs on this host (host path -> GiB): the FP8 donor's shards
    in the HF cache and the output in ``hybrid_dir``; nothing without ``build_hybrid``."""
    if not settings.build_hybrid or host.get_fact(HybridBuilt, path=settings.hybrid_dir):
        return {}
    return {settings.hf_home: settings.artifact_size_gib(FP8_DONOR),
            settings.hybrid_dir: settings.artifact_size_gib("hybrid-build")}


@operation()
def built(settings: Settings):
    """
    Build the hybrid checkpoint into ``hybrid_dir`` when ``build_hybrid`` is set and it is absent.

    + settings: validated settings (``build_hybrid``, ``hybrid_dir``, ``model_revisions``)
    """
    if not settings.build_hybrid:
        host.noop("hybrid build not requested")
        return
    if host.get_fact(HybridBuilt, path=settings.hybrid_dir):
        host.noop(f"hybrid checkpoint present in {settings.hybrid_dir}")
        return
    q = shlex.quote
    parent, name = posixpath.split(settings.hybrid_dir.rstrip("/"))
    # The snapshot's commit is read on the host when the build starts (the fetch step
    # has just written it); the path is the same snapshot seen from inside the container.
    marker = snapshot_marker(settings.hf_home, INTEL_INT4, settings.revision(INTEL_INT4))
    int4_dir = repo_cache_dir("/hf", INTEL_INT4) + "/snapshots/$(cat " + q(marker) + ")"
    args = (
        f"/host/build_hybrid.py --int4 \"{int4_dir}\" --donor {q(FP8_DONOR)} "
        f"--donor-revision {q(settings.revision(FP8_DONOR))} --out /out/{q(name)}"
    )
    yield f"mkdir -p {q(parent)}"
    yield detached(
        "hybrid-build",
        one_shot(settings, "sparkfleet-hybrid-build", args, extra_mounts=f"-v {q(parent)}:/out "),
    )
