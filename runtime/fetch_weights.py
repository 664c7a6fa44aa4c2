#!/usr/bin/env python3
"""Download one Hugging Face repository into the HF cache, file by file, and mark it complete.

Runs inside the serving image (its huggingface_hub, ``HF_HOME=/hf``). The token, when
needed, arrives as ``HF_TOKEN`` in the environment, never on the command line. An
interrupted download keeps the files it finished: the next run fetches the others (a
file cut mid-way starts again: huggingface_hub >= 1.18 deletes its partial file). The
completion marker is written only after every file of the snapshot is in place, so its
presence is what "cached" means to the deploy.

A revision the endpoint refuses (upstream deleted it, or the whole repository) is
fetched from ``--fallback-endpoint`` when given: the fleet mirror's offline HF endpoint,
which serves what the mirror holds without asking upstream (sparkfleet.lock's revisions
stay deployable after upstream moved or deleted them).

Every blob is checked against its own name before the marker is written: the cache
names a blob by the Hub's ETag, the sha256 of an LFS file's content or the git blob
sha1 of a small file. A blob that does not match is deleted and downloaded again, and
only those files are judged again: one still wrong is what the source serves, one
missing was not downloaded again. A verified blob gets a record of its size under
``sparkfleet/verified/``, so a later run re-hashes only new blobs (``--verify``: all of
them) and the deploy sees a truncated one by its size alone.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import sys
import time
from pathlib import Path


def marker_path(hf_home: str, repo_id: str, revision: str) -> Path:
    name = repo_id.replace("/", "--") + "@" + revision.replace("/", "%2F")
    return Path(hf_home) / "sparkfleet" / "complete" / name


def verified_dir(hf_home: str) -> Path:
    return Path(hf_home) / "sparkfleet" / "verified"


def blob_matches(blob: Path) -> bool:
    """Whether a cached blob's content matches the ETag it is named by."""
    name = blob.name
    if len(name) == 64:
        digest = hashlib.sha256()
    elif len(name) == 40:  # a git blob id: sha1 over "blob <size>\0" + content
        digest = hashlib.sha1(f"blob {blob.stat().st_size}\0".encode())
    else:
        return True  # not content-addressed: nothing to check against
    with open(blob, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == name


def corrupt_files(snapshot: Path, hf_home: str, recheck: bool,
                  only: set[str] | None = None) -> list[tuple[str, Path]]:
    """(path in the repo, blob) of every file (of ``only``, if given) whose blob does not
    match its name; the blobs that match are recorded as verified."""
    records = verified_dir(hf_home)
    records.mkdir(parents=True, exist_ok=True)
    bad = []
    # ``only``: by name, so a file the download did not bring back is there to fail.
    links = ([snapshot / name for name in sorted(only)] if only is not None
             else [link for link in sorted(snapshot.rglob("*")) if not link.is_dir()])
    for link in links:
        blob = link.resolve()
        record = records / blob.name
        size = str(blob.stat().st_size) if blob.exists() else None
        if size is not None and not recheck and record.is_file() and record.read_text() == size:
            continue
        if size is not None and blob_matches(blob):
            record.write_text(size)
        else:
            bad.append((str(link.relative_to(snapshot)), blob))
    return bad


#: What an endpoint answers for a revision, a repository or a file that is not (or no
#: longer) there; a gated repository (a subclass of the repository's) is the token's problem.
GONE = {"RevisionNotFoundError", "RepositoryNotFoundError", "EntryNotFoundError", "RemoteEntryNotFoundError"}


def gone(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    # LocalEntryNotFoundError (an EntryNotFoundError): the endpoint did not answer at all.
    return bool(names & GONE) and not names & {"GatedRepoError", "LocalEntryNotFoundError"}


def explain(exc: BaseException, repo: str, revision: str, endpoint: str) -> str | None:
    """What went wrong and what to do, for the failures a download is expected to meet
    (by class name: huggingface_hub's errors moved between modules across versions);
    None for anything else, which is a bug and keeps its traceback."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if "RevisionNotFoundError" in names:
        return (f"{repo} has no revision {revision!r} at {endpoint} — fix model_revisions (a branch, tag or commit of "
                f"it); a commit sparkfleet.lock names that upstream deleted needs a mirror that holds it, or the "
                f"lock moved: --data fleet_lock_update={repo}")
    if "GatedRepoError" in names:
        return (f"{repo} is gated and the HF token has no access — accept its terms on the Hub with the "
                "token's account, or set hf_token")
    if "RepositoryNotFoundError" in names:
        return f"{repo} does not exist at {endpoint}, or the HF token cannot see it — check the repo id and hf_token"
    if status in (401, 403):
        return f"{endpoint} refused the HF token (HTTP {status}) — set a valid hf_token, or none for public repos"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "the disk that holds hf_home is full — free space there, or set hf_home to a larger disk"
    if unanswered(exc):
        return (f"{endpoint} did not answer ({type(exc).__name__}) — check the host's network and proxy "
                "(with the mirror: that it runs); a re-run resumes")
    return None


def refuses(endpoint: str, timeout_s: float = 5.0) -> ConnectionError | None:
    """Why ``endpoint`` takes no connection now (refused, no route, no answer within
    ``timeout_s``), or None when it takes one or a proxy stands between. huggingface_hub
    retries a refused connection with backoff for ~23 s before it gives up; a relay that
    died is told at once, so its hosts go on to the mirror above without that wait."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    if not url.hostname or urllib.request.getproxies().get(url.scheme) and not urllib.request.proxy_bypass(url.hostname):
        return None  # through a proxy: only it can say
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError as exc:  # refused, unreachable, timed out: a source that did not answer
        return ConnectionError(f"{endpoint}: {exc}")
    return None


#: What a source that did not answer raises: a connection refused or reset, a timeout.
UNANSWERED = {"LocalEntryNotFoundError", "ConnectError", "ConnectionError", "TimeoutException", "Timeout",
              "ReadTimeout", "ConnectTimeout", "RemoteProtocolError", "ReadError", "NetworkError",
              "ChunkedEncodingError"}


def unanswered(exc: BaseException) -> bool:
    """A source that did not answer, or answered 5xx: worth asking again, later."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return bool(names & UNANSWERED) or status in (500, 502, 503, 504)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo_id")
    parser.add_argument("--revision", default="main")
    parser.add_argument("--allow", action="append", default=None, help="only files matching these globs")
    parser.add_argument("--verify", action="store_true", help="re-hash every blob, not only new ones")
    parser.add_argument("--fallback-endpoint", default=None,
                        help="where a revision the endpoint refuses comes from (the mirror's cache, offline)")
    parser.add_argument("--also-endpoint", action="append", default=[],
                        help="where the same files are when the endpoint fails mid-way (a relay that died: "
                             "the mirrors above it), tried in turn")
    # A fleet's mirror that many hosts ask at once can drop a connection, and a relay can
    # restart: every source once more, after a pause, before the deploy fails the host
    # (16 hosts on one mirror lost 2 that way). The finished files stay.
    parser.add_argument("--round-waits", default="15,60",
                        help="seconds to wait before each further round of every source, comma-separated")
    args = parser.parse_args(argv)

    from huggingface_hub import snapshot_download

    hf_home = os.environ.get("HF_HOME", "/hf")
    started = time.monotonic()
    endpoint = os.environ.get("HF_ENDPOINT", "the hub")
    print(f"fetching {args.repo_id}@{args.revision} from {endpoint}", flush=True)

    def fetch(where: str | None) -> Path:
        elsewhere = {"endpoint": where} if where else {}  # None: HF_ENDPOINT, as before
        return Path(snapshot_download(
            repo_id=args.repo_id, revision=args.revision, allow_patterns=args.allow, max_workers=4, **elsewhere,
        ))

    def fetch_round() -> Path:
        """From HF_ENDPOINT, else (it fails, not refusing the revision) each --also-endpoint."""
        sources = [None, *args.also_endpoint]
        for i, where in enumerate(sources):
            try:
                # With a source to go on to, one that takes no connection is passed over at
                # once; the last one gets huggingface_hub's own retries, then a round's pause.
                refused = refuses(where or endpoint) if i + 1 < len(sources) else None
                if refused is not None:
                    raise refused
                return fetch(where)
            except Exception as exc:
                if i + 1 == len(sources) or gone(exc):
                    raise
                # "report: " lines reach the deploy's output (sparkfleet/tasks.py).
                print(f"report: {args.repo_id} from {where or endpoint} failed ({type(exc).__name__}): "
                      f"fetching from {sources[i + 1]}", flush=True)
        raise AssertionError("unreachable")

    def fetch_first() -> Path:
        """A round of the sources, again after each of --round-waits while none answered."""
        waits = [float(w) for w in args.round_waits.split(",") if w.strip()]
        for wait in [*waits, None]:
            try:
                return fetch_round()
            except Exception as exc:
                if wait is None or not unanswered(exc):
                    raise
                print(f"report: {args.repo_id}: no source answered ({type(exc).__name__}): "
                      f"every source again in {wait:g} s", flush=True)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def download() -> Path:
        try:
            return fetch_first()
        except Exception as exc:
            if args.fallback_endpoint and gone(exc):
                # "report: " lines reach the deploy's output (sparkfleet/tasks.py).
                print(f"report: {args.repo_id}@{args.revision} is gone from {endpoint} ({type(exc).__name__}): "
                      f"fetching it from the mirror's cache, {args.fallback_endpoint}", flush=True)
                try:
                    return fetch(args.fallback_endpoint)
                except Exception as again:  # noqa: BLE001 - said below, with what upstream said
                    print(f"{type(again).__name__} from {args.fallback_endpoint}: "
                          f"{str(again).splitlines()[0] if str(again) else ''}", flush=True)
                    print(f"error: {args.repo_id}@{args.revision} is gone from {endpoint}, and the mirror does not "
                          "hold it either — pin a revision that exists (model_revisions), or move the lock: "
                          f"--data fleet_lock_update={args.repo_id}", flush=True)
                    raise SystemExit(2) from None
            what = explain(exc, args.repo_id, args.revision, endpoint)
            if what is None:
                raise
            # "error: " is the step's diagnosis in the deploy's output (sparkfleet/tasks.py).
            print(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            print(f"error: {what}", flush=True)
            raise SystemExit(2) from None

    path = download()
    bad = corrupt_files(path, hf_home, recheck=args.verify)
    if bad:
        for name, blob in bad:
            # "report: " lines reach the deploy's output (sparkfleet/tasks.py).
            print(f"report: corrupt: {name} (blob {blob.name} does not match its hash): deleted, "
                  "downloading again", flush=True)
            blob.unlink(missing_ok=True)
            (path / name).unlink(missing_ok=True)
        path = download()
        # Only the files just downloaded again say anything about the source: a blob that
        # went bad on this disk since its record (same size, trusted) is not its doing.
        again = corrupt_files(path, hf_home, recheck=True, only={name for name, _ in bad})
        absent = [name for name, _ in again if not (path / name).exists()]
        served = [name for name, _ in again if name not in absent]
        if absent:
            print(f"report: not downloaded again: {', '.join(absent)} — the download did not bring these "
                  "files back; run it again", flush=True)
        if served:
            print(f"report: still corrupt after a new download: {', '.join(served)} — "
                  "the source serves these bytes; check the mirror's cache or the hub", flush=True)
        if again:
            return 1
        print(f"report: repaired: {', '.join(name for name, _ in bad)}", flush=True)
    commit = path.name
    marker = marker_path(hf_home, args.repo_id, args.revision)
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(commit + "\n")
    os.replace(tmp, marker)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    print(f"complete: {args.repo_id}@{commit} ({size / 2**30:.2f} GiB) in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
