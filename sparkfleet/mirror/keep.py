"""What the mirror keeps for the fleet lock, and what it deletes.

It holds every artifact sparkfleet.lock names (the image's manifest by digest in its
registry, each model commit's files in olah's cache) and, per repository, the last
``mirror_keep_previous`` that a lock named before them, most recent first: so a
redeploy, a rollback (an older lock from version control) and a new host work after
upstream moved or deleted them (a locked revision upstream refuses is served by the
offline HF mirror; the registry holds manifests by digest). Older ones are deleted: the
model commit's directories in olah's cache (olah keeps each commit's files apart, so a
commit costs its whole size), the image's manifest through the registry's API, then the
registry's garbage collection (layers another kept manifest uses stay).

The mirror host remembers what it keeps in ``mirror_dir/kept.json``; it changes only
when the lock does, so a converged run changes nothing here.

olah caches what it served, under the commit it was asked for: a host that already held a
file of a new commit (unchanged since the last) never asks for it, so after a move the
mirror may hold only the files that changed. So the mirror asks its own HF mirror for
every file of each locked commit it does not hold whole yet: what is cached comes from
disk, the rest from upstream, once. It starts as soon as its HF mirror answers
(:func:`prefetched`), so the weights cross the WAN while the image does and while the
hosts pull it, instead of after every host's pull; the deploy reads the result once the
hosts fetched (:func:`complete`).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from pyinfra import host, logger
from pyinfra.api import StringCommand, operation

from sparkfleet import snapshot
from sparkfleet.hostpaths import (
    HF_ENV,
    REGISTRY_CERT,
    REGISTRY_CONFIG,
    mirror_commit_dir,
    mirror_held_marker,
    mirror_hf_cache,
)
from sparkfleet.lockfile import size_text
from sparkfleet.perrun import once
from sparkfleet.tasks import detached, started


def next_record(record: dict[str, list[dict]], locked: list[dict[str, Any]],
                keep_previous: int) -> tuple[dict[str, list[dict]], list[dict[str, Any]]]:
    """(what the mirror keeps now, what it deletes): ``record`` (``"<kind> <name>"`` ->
    [{pin, size}], most recent first) with ``locked`` (fleetlock.artifacts) in front of
    each repository's list, and its ``keep_previous`` most recent others after them."""
    current: dict[str, list[dict]] = {}
    for artifact in locked:
        current.setdefault(f"{artifact['kind']} {artifact['name']}", []).append(
            {"pin": artifact["pin"], "size": artifact["size"]})
    kept: dict[str, list[dict]] = {}
    deleted: list[dict[str, Any]] = []
    for key in sorted(set(record) | set(current)):
        now = current.get(key, [])
        pins = {a["pin"] for a in now}
        listed = now + [a for a in record.get(key, []) if a["pin"] not in pins]
        cut = len(now) + keep_previous
        if listed[:cut]:
            kept[key] = listed[:cut]
        kind, _, name = key.partition(" ")
        deleted += [{"kind": kind, "name": name, **a} for a in listed[cut:]]
    return kept, deleted


def parse_record(text: str | None) -> dict[str, list[dict]]:
    try:
        record = json.loads(text or "{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def disk(record: dict[str, list[dict]], locked: list[dict[str, Any]]) -> str:
    """What the kept artifacts take, locked and previous apart (sizes the lock recorded)."""
    pins = {a["pin"] for a in locked}
    sizes = [(a["pin"] in pins, a.get("size")) for entries in record.values() for a in entries]

    def total(current: bool) -> str:
        known = [size for now, size in sizes if now == current]
        unknown = sum(1 for size in known if size is None)
        taken = size_text(sum(size for size in known if size is not None))
        return f"{len(known)} {'locked' if current else 'previous'} ({taken}" + (
            f", {unknown} of unknown size)" if unknown else ")")

    return f"{total(True)}, {total(False)}"


def deletion(artifact: dict[str, Any], mirror_dir: str, registry: str) -> str:
    """The command that deletes one artifact from the mirror."""
    q = shlex.quote
    if artifact["kind"] == "model":
        repo, commit = artifact["name"], artifact["pin"]
        hf_cache = mirror_hf_cache(mirror_dir)
        dirs = [mirror_commit_dir(mirror_dir, repo, commit), mirror_held_marker(mirror_dir, repo, commit),
                f"{hf_cache}/heads/models/{repo}/resolve_head/{commit}",
                *(f"{hf_cache}/api/models/{repo}/{kind}/{commit}" for kind in ("revision", "tree", "paths-info"))]
        return "rm -rf " + " ".join(q(d) for d in dirs)
    url = f"https://{registry}/v2/{artifact['name']}/manifests/{artifact['pin']}"
    # 202: deleted; 404: not there (never copied, or deleted before).
    return (f"code=$(curl -s -o /dev/null -w '%{{http_code}}' -m 30 -X DELETE --cacert {REGISTRY_CERT} {q(url)}); "
            f'[ "$code" = 202 ] || [ "$code" = 404 ] || {{ echo "the mirror registry answered $code to deleting '
            f'{artifact["name"]}@{artifact["pin"]}" >&2; exit 1; }}')


@operation()
def kept(record_path: str, locked: list[dict[str, Any]], keep_previous: int, mirror_dir: str, registry: str):
    """
    Keep what the fleet lock names and the last ``keep_previous`` per repository before it;
    delete the rest from the mirror.

    + record_path: the mirror's record of what it keeps (``mirror_dir/kept.json``)
    + locked: what sparkfleet.lock names (fleetlock.artifacts)
    + keep_previous: ``mirror_keep_previous``
    + mirror_dir / registry: the mirror's state (olah's cache in it) and its registry (host:port)
    """
    record = parse_record(snapshot.text(record_path))
    new, deleted = next_record(record, locked, keep_previous)
    if new == record:
        host.noop(f"the mirror keeps {disk(new, locked)}")
        return
    logger.info(f"    [{host.name}] the mirror keeps {disk(new, locked)}"
                + (f"; deletes {', '.join(a['name'] + '@' + a['pin'][:19] for a in deleted)}" if deleted else ""))
    for artifact in deleted:
        yield deletion(artifact, mirror_dir, registry)
    if any(a["kind"] == "image" for a in deleted):
        # Blobs no kept manifest references; the registry takes no upload meanwhile (the
        # image copy ran before this, the hosts pull after).
        yield f"docker-registry garbage-collect {REGISTRY_CONFIG} >/dev/null"
    text = json.dumps(new, indent=1, sort_keys=True) + "\n"
    yield StringCommand("printf", "%s", shlex.quote(text), ">", shlex.quote(record_path))


#: Runs on the mirror host (its python3, stdlib only): asks its own HF mirror for the
#: revision's metadata, its tree and every file of it (the bodies are dropped: olah keeps
#: them), with the fleet's HF token from its 0600 file; marks the commit held when all came.
#: A body shorter than its Content-Length is a failure (urllib's read(n) ends quietly at a
#: cut connection: the commit was marked held without the rest of a file). A request cut
#: or answered 5xx/429 (upstream or the mirror under load) is asked again, twice (huggingface_hub
#: retries such answers too): one dropped connection among a 95 GB commit's files does not
#: leave the commit unheld until the next deploy.
_HOLD_PY = r"""
import http.client, json, os, sys, time, urllib.error, urllib.parse, urllib.request
base, repo, commit, marker, env_file = sys.argv[1:6]
token = None
try:
    for line in open(env_file):
        if line.startswith("HF_TOKEN="):
            token = line.split("=", 1)[1].strip() or None
except OSError:
    pass
headers = {"Authorization": "Bearer " + token} if token else {}
def get(path, read):
    for attempt in range(3):
        try:
            with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=900) as answer:
                return read(answer)
        except (OSError, http.client.HTTPException) as exc:
            code = exc.code if isinstance(exc, urllib.error.HTTPError) else None
            if attempt == 2 or (code is not None and code < 500 and code != 429):
                raise
            print(f"asking again in {3 ** (attempt + 1)} s for {path} ({type(exc).__name__}: {exc})", flush=True)
            time.sleep(3 ** (attempt + 1))
def drained(answer):
    # read(n) takes a connection cut short for the end of the body: count it against the length.
    got, size = 0, answer.headers.get("Content-Length")
    while chunk := answer.read(1 << 20):
        got += len(chunk)
    if size and size.isdigit() and got != int(size):
        raise http.client.IncompleteRead(b"", int(size) - got)
try:
    get(f"/api/models/{repo}/revision/{commit}", drained)
    tree = get(f"/api/models/{repo}/tree/{commit}?recursive=true", json.load)
    files = [entry["path"] for entry in tree if entry.get("type") == "file"]
    for path in files:
        get(f"/{repo}/resolve/{commit}/{urllib.parse.quote(path)}", drained)
except Exception as exc:
    print(f"report: the mirror does not hold every file of {repo}@{commit} ({type(exc).__name__}: {exc}): "
          "a host added after upstream deletes it cannot fetch it; the next deploy tries again", flush=True)
    sys.exit(0)
os.makedirs(os.path.dirname(marker), exist_ok=True)
with open(marker, "w") as out:
    out.write(f"{len(files)} files\n")
print(f"the mirror holds {repo}@{commit}: {len(files)} files", flush=True)
"""


def held(mirror_dir: str, repo: str, commit: str) -> bool:
    """Whether the HF mirror's cache holds every file of ``repo@commit`` (as far as the host
    said when the deploy planned)."""
    return bool(snapshot.text(mirror_held_marker(mirror_dir, repo, commit))) and \
        (snapshot.file_state(mirror_commit_dir(mirror_dir, repo, commit)) or (0, "", ""))[2] == "directory"


def _filled(commits: list[tuple[str, str]], mirror_dir: str, hf_port: int, run):
    """The commands that ``run`` (tasks.started or tasks.detached) the task filling the HF
    mirror's cache with each commit it does not hold whole; a noop when it holds them all."""
    q = shlex.quote
    # What the mirror lacked when the prefetch looked, for both: a task that ended before
    # the wait wrote its marker, and its result is still to be read and its unit cleared
    # (a unit left loaded would pass for the fetch of a commit deleted and locked again).
    missing = once(("the mirror lacks", host.name, tuple(commits)),
                   lambda: [(repo, commit) for repo, commit in commits if not held(mirror_dir, repo, commit)])
    if not missing:
        host.noop(f"the HF mirror holds every file of {len(commits)} locked commit(s)")
    for repo, commit in missing:
        args = " ".join(q(a) for a in (f"http://127.0.0.1:{hf_port}", repo, commit,
                                        mirror_held_marker(mirror_dir, repo, commit), HF_ENV))
        yield run(f"mirror-holds-{repo.replace('/', '--')}", f"python3 -c {q(_HOLD_PY)} {args}")


@operation(is_idempotent=False)
def prefetched(commits: list[tuple[str, str]], mirror_dir: str, hf_port: int):
    """
    Start filling the HF mirror's cache with every file of each locked commit, and go on.

    + commits / mirror_dir / hf_port: as :func:`complete`, which reads the result

    The weights need not wait for the image: on a real fleet they are ~3.5x its bytes on
    the same WAN, and without this the mirror fetched them only when the hosts asked, after
    every host's pull (an operation barrier).
    """
    yield from _filled(commits, mirror_dir, hf_port, started)


@operation()
def complete(commits: list[tuple[str, str]], mirror_dir: str, hf_port: int):
    """
    Every file of each locked commit the hosts fetch, in the HF mirror's cache.

    + commits: (repo id, commit) the fleet fetches, as sparkfleet.lock names them
    + mirror_dir: the mirror's state (olah's cache, the markers of what it holds whole)
    + hf_port: the (online) HF mirror on this host

    Waits for what :func:`prefetched` started, once the hosts fetched: a file no host
    asked for (unchanged from a commit it held) comes from upstream once. A commit
    upstream no longer serves whole is reported, never fails the mirror host.
    """
    yield from _filled(commits, mirror_dir, hf_port, detached)


def expected(mirror_dir: str, commits: list[tuple[str, str]]) -> None:
    """Declare what :func:`complete` reads to the host's one read (sparkfleet.snapshot)."""
    snapshot.expect(texts=[mirror_held_marker(mirror_dir, r, c) for r, c in commits],
                    files=[mirror_commit_dir(mirror_dir, r, c) for r, c in commits])
