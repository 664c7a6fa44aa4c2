"""Start the Hugging Face hub stand-in (sparkfleet.testbed.hub, written elsewhere) at
http://10.213.0.1:8090, serving the synthetic repositories of
sparkfleet.testbed.checkpoints written under STATE_DIR/hub/repos."""

from __future__ import annotations

import os

from . import paths, services
from .proc import log
from .state import ServiceState

REPOS_DIR = paths.STATE_DIR / "hub" / "repos"
GIB = 1024**3


def write_repos(artifact_scale: float | None = None) -> dict[str, str]:
    """Write the synthetic repos (padded to real size / *artifact_scale*, if given);
    {repo id: pinned revision} ({} if the checkpoints module is unavailable)."""
    try:
        from .checkpoints import write_synthetic_repos
    except ImportError as exc:  # pragma: no cover - only while checkpoints.py is missing
        # TODO(testbed): checkpoints.py is written by the hub/checkpoints engineer; the
        # hub then serves nothing and model_revisions stays empty.
        log(f"warning: synthetic repos unavailable ({exc}); the hub serves no repos")
        REPOS_DIR.mkdir(parents=True, exist_ok=True)
        return {}
    return write_synthetic_repos(REPOS_DIR, artifact_scale)


def repo_sizes_gib(revisions: dict[str, str]) -> dict[str, float]:
    """Real on-disk size of each pinned revision, in GiB (for the deploy's disk
    preflight); `hybrid-build` is sized like the published hybrid repo it reproduces."""
    sizes: dict[str, float] = {}
    for repo, rev in revisions.items():
        d = REPOS_DIR / repo / rev
        total = sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0
        sizes[repo] = round(total / GIB, 6)
    hybrid = next((r for r in revisions if r.startswith("bleysg/")), None)
    if hybrid:
        sizes["hybrid-build"] = sizes[hybrid]
    return sizes


def start_server() -> ServiceState:
    repo_root = str(paths.REPO_ROOT)
    env = {"PYTHONPATH": repo_root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    return services.start(
        "hub",
        [services.python(), "-m", "sparkfleet.testbed.hub", "--root", str(REPOS_DIR),
         "--host", paths.CONTROLLER_IP, "--port", str(paths.HUB_PORT)],
        url=paths.HUB_URL, marker=str(REPOS_DIR), port=paths.HUB_PORT, env=env,
    )
