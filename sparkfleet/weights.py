"""Cached weights: the profile's checkpoint and, only when used, the drafter.

Downloads run inside the serving image with its huggingface_hub (the host needs only
docker), into the host's HF cache, resumably; with a fleet source (fleet_mirror) through
the fleet's HF mirror, every host at once. A repository counts as cached when
``runtime/fetch_weights.py`` wrote its completion marker and the snapshot it names exists.
"""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FactBase, operation

from sparkfleet.config import Settings, fleet_source
from sparkfleet.distribution import hf_endpoint, image_reference, source_answers
from sparkfleet.tasks import detached, shell

RUNTIME_DIR = "/opt/sparkfleet/runtime"
SECRETS_ENV = "/etc/sparkfleet/secrets.env"  # VLLM_API_KEY, for serving and checks
HF_ENV = "/etc/sparkfleet/hf.env"  # HF_TOKEN, for downloads and builds only
GIB = 1024**3


def marker_path(hf_home: str, repo_id: str, revision: str) -> str:
    """Where runtime/fetch_weights.py marks a complete snapshot (kept in step with it)."""
    return f"{hf_home}/sparkfleet/complete/{repo_id.replace('/', '--')}@{revision.replace('/', '%2F')}"


def repo_cache_dir(hf_home: str, repo_id: str) -> str:
    return f"{hf_home}/hub/models--{repo_id.replace('/', '--')}"


class CachedSnapshot(FactBase["str | None"]):
    """The commit of a complete cached snapshot of ``repo_id@revision``, or None."""

    def command(self, hf_home: str, repo_id: str, revision: str) -> str:
        marker = shlex.quote(marker_path(hf_home, repo_id, revision))
        snapshots = shlex.quote(repo_cache_dir(hf_home, repo_id) + "/snapshots")
        return f'c=$(cat {marker} 2>/dev/null) && [ -n "$c" ] && [ -d {snapshots}/"$c" ] && echo "$c" || true'

    def process(self, output):
        return output[0].strip() if output and output[0].strip() else None


class CheckpointDir(FactBase[bool]):
    """Whether ``path`` holds a checkpoint (a config.json)."""

    @staticmethod
    def default():
        return False

    def command(self, path: str) -> str:
        return f"test -f {shlex.quote(path + '/config.json')} && echo yes || echo no"

    def process(self, output):
        return bool(output) and output[0].strip() == "yes"


def container_command(settings: Settings, name: str, args: str, extra_mounts: str = "") -> str:
    """A one-shot run of the serving image's Python with the cache and runtime mounted.

    Downloads go to the fleet's HF mirror when there is a fleet source (fleet_mirror),
    else to ``hf_endpoint``; the image is the reference the host pulled (never a new pull).
    """
    q = shlex.quote
    endpoint_url = hf_endpoint(settings)
    endpoint = f"-e HF_ENDPOINT={q(endpoint_url)} " if endpoint_url else ""
    return (
        f"docker rm -f {name} >/dev/null 2>&1; "
        f"docker run --rm --pull never --name {name} --network host --env-file {HF_ENV} "
        f"-e HF_HOME=/hf -e HF_HUB_DISABLE_TELEMETRY=1 {endpoint}"
        "-e HF_HUB_DISABLE_XET=1 "  # else hf_xet fetches from the Xet CAS, past HF_ENDPOINT and the fleet mirror
        f"-v {q(settings.hf_home)}:/hf -v {RUNTIME_DIR}:/host:ro {extra_mounts}"
        f"--entrypoint python3 {q(image_reference(settings))} {args}"
    )


def _progress(repo_id: str, settings: Settings):
    expected = settings.artifact_size_gib(repo_id)

    def describe(target_host) -> str:
        ok, lines = shell(target_host, f"du -sb {shlex.quote(repo_cache_dir(settings.hf_home, repo_id))} 2>/dev/null | cut -f1")
        done = int(lines[0]) / GIB if ok and lines and lines[0].isdigit() else 0.0
        share = f" of ~{expected:.2f} GiB ({100 * done / expected:.0f}%)" if expected else ""
        return f"{repo_id}: {done:.2f} GiB{share}"

    return describe


def repo_dirs(settings: Settings) -> list[str]:
    """The cache directories of the repositories this host still has to fetch."""
    return [repo_cache_dir(settings.hf_home, repo) for repo in missing_repos(settings)]


def missing_repos(settings: Settings) -> list[str]:
    return [
        repo for repo in settings.repos_to_fetch
        if host.get_fact(CachedSnapshot, hf_home=settings.hf_home, repo_id=repo, revision=settings.revision(repo)) is None
    ]


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
    source = fleet_source()
    if source:
        yield source_answers(source, "hf")
    for repo in missing:
        task = "fetch-" + repo.replace("/", "--")
        args = f"/host/fetch_weights.py {shlex.quote(repo)} --revision {shlex.quote(settings.revision(repo))}"
        yield detached(task, container_command(settings, "sparkfleet-" + task.lower(), args), _progress(repo, settings))
