"""Cached weights: the profile's checkpoint and, only when used, the drafter.

Downloads run inside the serving image with its huggingface_hub (the host needs only
docker), into the host's HF cache, resumably; with a mirror (fleet_mirror) through the
mirror's HF endpoint, every host at once. A repository counts as cached when
``runtime/fetch_weights.py`` wrote its completion marker and the snapshot it names exists.
"""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FactBase, operation

from sparkfleet import mirror, remote
from sparkfleet.config import Settings, host_mirror
from sparkfleet.hostpaths import repo_cache_dir, snapshot_marker
from sparkfleet.image import one_shot
from sparkfleet.tasks import detached

GIB = 1024**3


class CachedSnapshot(FactBase["str | None"]):
    """The commit of a complete cached snapshot of ``repo_id@revision`` whose every blob
    was verified at its present size, or None."""

    def command(self, hf_home: str, repo_id: str, revision: str) -> str:
        marker = shlex.quote(snapshot_marker(hf_home, repo_id, revision))
        snapshot = shlex.quote(repo_cache_dir(hf_home, repo_id) + "/snapshots") + '/"$c"'
        records = shlex.quote(f"{hf_home}/sparkfleet/verified")
        # fetch_weights.py records each blob's size once it matched its hash: a blob
        # missing, truncated or grown since shows here without reading it.
        return (
            f'c=$(cat {marker} 2>/dev/null) && [ -n "$c" ] && [ -d {snapshot} ] || exit 0; '
            f'find {snapshot}/ ! -type d | while read -r f; do b=$(readlink -f "$f"); '
            f's=$(stat -c %s "$b" 2>/dev/null) && [ "$(cat {records}/"${{b##*/}}" 2>/dev/null)" = "$s" ] '
            '|| { echo unverified; break; }; done; echo "commit=$c"'
        )

    def process(self, output):
        if "unverified" in output:
            return None
        commits = [line[len("commit="):] for line in output if line.startswith("commit=")]
        return commits[0] if commits else None


def _progress(repo_id: str, settings: Settings):
    expected = settings.artifact_size_gib(repo_id)

    def describe(target_host) -> str:
        done = remote.run(target_host, f"du -sb {shlex.quote(repo_cache_dir(settings.hf_home, repo_id))} 2>/dev/null | cut -f1")
        got = int(done.stdout[0]) / GIB if done.ok and done.stdout and done.stdout[0].isdigit() else 0.0
        share = f" of ~{expected:.2f} GiB ({100 * got / expected:.0f}%)" if expected else ""
        return f"{repo_id}: {got:.2f} GiB{share}"

    return describe


def missing_repos(settings: Settings) -> list[str]:
    """The repositories the profile needs that this host has no complete snapshot of."""
    if settings.verify_weights:
        return list(settings.repos_to_fetch)
    return [
        repo for repo in settings.repos_to_fetch
        if host.get_fact(CachedSnapshot, hf_home=settings.hf_home, repo_id=repo, revision=settings.revision(repo)) is None
    ]


def repo_dirs(settings: Settings) -> list[str]:
    """The cache directories of the repositories this host still has to fetch."""
    return [repo_cache_dir(settings.hf_home, repo) for repo in missing_repos(settings)]


def disk_needs(settings: Settings) -> dict[str, float]:
    """What the downloads still need on this host: {hf_home: GiB}."""
    return {settings.hf_home: sum(settings.artifact_size_gib(repo) for repo in missing_repos(settings))}


@operation()
def cached(settings: Settings):
    """
    Download what the profile serves into the host's HF cache, unless complete.

    + settings: validated settings (profile, ``model_revisions``, ``hf_home``, ``hf_endpoint``)
    """
    missing = missing_repos(settings)
    if not missing:
        host.noop(f"cached: {', '.join(settings.repos_to_fetch) or 'nothing to fetch'}")
        return
    yield f"mkdir -p {shlex.quote(settings.hf_home)}"
    used = host_mirror()
    if used:
        yield mirror.answers(used, "hf")
    for repo in missing:
        task = "fetch-" + repo.replace("/", "--")
        args = f"/host/fetch_weights.py {shlex.quote(repo)} --revision {shlex.quote(settings.revision(repo))}"
        if settings.verify_weights:
            args += " --verify"
        yield detached(task, one_shot(settings, "sparkfleet-" + task.lower(), args), _progress(repo, settings))
