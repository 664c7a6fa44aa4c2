"""What the mirror keeps for the fleet lock, and what it deletes.

It keeps every artifact sparkfleet.lock names (the image's manifest by digest in its
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
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from pyinfra import host, logger
from pyinfra.api import StringCommand, operation

from sparkfleet import snapshot
from sparkfleet.hostpaths import REGISTRY_CERT, REGISTRY_CONFIG

GIB = 1024**3


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
        gib = sum(size for size in known if size is not None) / GIB
        return f"{len(known)} {'locked' if current else 'previous'} ({gib:.2f} GiB" + (
            f", {unknown} of unknown size)" if unknown else ")")

    return f"{total(True)}, {total(False)}"


def deletion(artifact: dict[str, Any], hf_cache: str, registry: str) -> str:
    """The command that deletes one artifact from the mirror."""
    q = shlex.quote
    if artifact["kind"] == "model":
        org, _, name = artifact["name"].partition("/")
        commit = artifact["pin"]
        dirs = [f"{hf_cache}/files/models/{org}/{name}/resolve/{commit}",
                f"{hf_cache}/heads/models/{org}/{name}/resolve_head/{commit}",
                *(f"{hf_cache}/api/models/{org}/{name}/{kind}/{commit}" for kind in ("revision", "tree", "paths-info"))]
        return "rm -rf " + " ".join(q(d) for d in dirs)
    url = f"https://{registry}/v2/{artifact['name']}/manifests/{artifact['pin']}"
    # 202: deleted; 404: not there (never copied, or deleted before).
    return (f"code=$(curl -s -o /dev/null -w '%{{http_code}}' -m 30 -X DELETE --cacert {REGISTRY_CERT} {q(url)}); "
            f'[ "$code" = 202 ] || [ "$code" = 404 ] || {{ echo "the mirror registry answered $code to deleting '
            f'{artifact["name"]}@{artifact["pin"]}" >&2; exit 1; }}')


@operation()
def kept(record_path: str, locked: list[dict[str, Any]], keep_previous: int, hf_cache: str, registry: str):
    """
    Keep what the fleet lock names and the last ``keep_previous`` per repository before it;
    delete the rest from the mirror.

    + record_path: the mirror's record of what it keeps (``mirror_dir/kept.json``)
    + locked: what sparkfleet.lock names (fleetlock.artifacts)
    + keep_previous: ``mirror_keep_previous``
    + hf_cache / registry: olah's cache and the mirror registry (host:port)
    """
    record = parse_record(snapshot.text(record_path))
    new, deleted = next_record(record, locked, keep_previous)
    if new == record:
        host.noop(f"the mirror keeps {disk(new, locked)}")
        return
    logger.info(f"    [{host.name}] the mirror keeps {disk(new, locked)}"
                + (f"; deletes {', '.join(a['name'] + '@' + a['pin'][:19] for a in deleted)}" if deleted else ""))
    for artifact in deleted:
        yield deletion(artifact, hf_cache, registry)
    if any(a["kind"] == "image" for a in deleted):
        # Blobs no kept manifest references; the registry takes no upload meanwhile (the
        # image copy ran before this, the hosts pull after).
        yield f"docker-registry garbage-collect {REGISTRY_CONFIG} >/dev/null"
    text = json.dumps(new, indent=1, sort_keys=True) + "\n"
    yield StringCommand("printf", "%s", shlex.quote(text), ">", shlex.quote(record_path))
