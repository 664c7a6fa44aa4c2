"""Cached weights: the profile's checkpoint and, only when used, the drafter.

Downloads run inside the serving image with its huggingface_hub (the host needs only
docker), into the host's HF cache, resumably; with a mirror (fleet_mirror) through the
mirror's HF endpoint, every host at once, and a revision upstream no longer has from the
mirror's cache (its offline HF endpoint). A repository counts as cached when
``runtime/fetch_weights.py`` wrote its completion marker, the snapshot it names exists and
every blob of it was verified against its hash at its present size. The revisions are
the commits sparkfleet.lock names: a host holding another commit of a repository (cached
before the lock, or before the lock moved) says so and fetches the locked one.
"""

from __future__ import annotations

import shlex

from pyinfra import host, logger
from pyinfra.api import deploy, operation

from sparkfleet import mirror, remote, snapshot
from sparkfleet.config import Settings
from sparkfleet.facts import CachedSnapshot, HeldArtifacts
from sparkfleet.fleet import host_mirror
from sparkfleet.hostpaths import repo_cache_dir
from sparkfleet.image import one_shot
from sparkfleet.lockfile import size_text
from sparkfleet.tasks import detached

GIB = 1024**3


def _progress(repo_id: str, hf_home: str, expected_gib: float):
    def describe(target_host) -> str:
        done = remote.run(target_host, f"du -sb {shlex.quote(repo_cache_dir(hf_home, repo_id))} 2>/dev/null | cut -f1")
        got = int(done.stdout[0]) if done.ok and done.stdout and done.stdout[0].isdigit() else 0
        expected = int(expected_gib * GIB)
        share = f" of ~{size_text(expected)} ({100 * got / expected:.0f}%)" if expected else ""
        return f"{repo_id}: {size_text(got)}{share}"

    return describe


def _missing(repos: dict[str, str], hf_home: str, verify: bool = False) -> list[str]:
    if verify:  # verify_weights: every blob hashed again, so every repository visited
        return list(repos)
    return [repo for repo, revision in repos.items()
            if snapshot.fact(CachedSnapshot, hf_home=hf_home, repo_id=repo, revision=revision) is None]


def reads(settings: Settings) -> list[tuple]:
    """The facts this step reads while the deploy plans (read in the preflight's batch)."""
    return [*((CachedSnapshot, {"hf_home": settings.hf_home, "repo_id": repo, "revision": revision})
              for repo, revision in wanted(settings).items()),
            (HeldArtifacts, {"hf_home": settings.hf_home, "images": []})]


def other_commits(repos: dict[str, str], missing: list[str], hf_home: str) -> dict[str, list[str]]:
    """For each missing repository, the other commits of it this host holds complete
    (cached before sparkfleet.lock, or before the lock moved)."""
    markers = snapshot.fact(HeldArtifacts, hf_home=hf_home, images=[])["markers"]
    found: dict[str, list[str]] = {}
    for repo in missing:
        prefix = repo.replace("/", "--") + "@"
        held = {commit for name, commit in markers.items() if name.startswith(prefix) and commit != repos[repo]}
        if held:
            found[repo] = sorted(held)
    return found


def wanted(settings: Settings) -> dict[str, str]:
    """The repositories this host's profile needs in its HF cache, with their revisions."""
    return {repo: settings.revision(repo) for repo in settings.repos_to_fetch}


def repo_dirs(settings: Settings) -> list[str]:
    """The cache directories of the repositories this host still has to fetch."""
    missing = _missing(wanted(settings), settings.hf_home, settings.verify_weights)
    return [repo_cache_dir(settings.hf_home, repo) for repo in missing]


def disk_needs(settings: Settings) -> dict[str, float]:
    """What the downloads still need on this host: {hf_home: GiB}."""
    missing = _missing(wanted(settings), settings.hf_home)
    return {settings.hf_home: sum(settings.artifact_size_gib(repo) for repo in missing)}


@operation()
def cached(repos: dict[str, str], hf_home: str, image: str, hf_endpoint: str | None, sizes_gib: dict[str, float],
           verify: bool = False, fallback_endpoint: str | None = None, also_endpoints: list[str] | None = None):
    """
    Download each repository into the host's HF cache, unless its snapshot is complete.

    + repos: repo id -> revision (the commit sparkfleet.lock names)
    + hf_home: the host's HF cache
    + image: the serving image's reference on the host (downloads run inside it)
    + hf_endpoint: where to download from (the mirror's HF endpoint; None: the hub)
    + sizes_gib: expected sizes, for the progress lines
    + verify: hash every cached blob again (``verify_weights``), not only new ones
    + fallback_endpoint: where a revision upstream refuses comes from (the mirror's offline
      HF endpoint, its cache only; None: nowhere)
    + also_endpoints: where the same files are when ``hf_endpoint`` fails mid-way (a relay
      that died: the mirrors above it), tried in turn
    """
    missing = _missing(repos, hf_home, verify)
    if not missing:
        host.noop(f"cached: {', '.join(repos) or 'nothing to fetch'}")
        return
    for repo, held in other_commits(repos, missing, hf_home).items():
        logger.warning(f"    [{host.name}] holds {repo} at {', '.join(c[:12] for c in held)}, not the "
                       f"{repos[repo][:12]} sparkfleet.lock names: fetching that")
    yield f"mkdir -p {shlex.quote(hf_home)}"
    used = host_mirror()
    if used:
        yield mirror.answers(used, "hf")
    for repo in missing:
        task = "fetch-" + repo.replace("/", "--")
        args = f"/host/fetch_weights.py {shlex.quote(repo)} --revision {shlex.quote(repos[repo])}"
        if verify:
            args += " --verify"
        if fallback_endpoint:
            args += f" --fallback-endpoint {shlex.quote(fallback_endpoint)}"
        for also in also_endpoints or []:
            args += f" --also-endpoint {shlex.quote(also)}"
        command = one_shot(image, hf_home, hf_endpoint, "sparkfleet-" + task.lower(), args)
        yield detached(task, command,
                       _progress(repo, hf_home, sizes_gib.get(repo, 0.0)))


@deploy("Weights")
def fetched(settings: Settings):
    """The profile's weights in the HF cache. Returns the download operation (for the report)."""
    used = host_mirror()
    return cached(name="weights in the HF cache", repos=wanted(settings), hf_home=settings.hf_home,
                  image=mirror.local_image(settings), hf_endpoint=mirror.hf_endpoint(settings),
                  sizes_gib=settings.artifact_sizes_gib, verify=settings.verify_weights,
                  fallback_endpoint=mirror.hf_offline_endpoint(settings),
                  also_endpoints=[above.hf_endpoint for above in used.fallbacks] if used else [])
