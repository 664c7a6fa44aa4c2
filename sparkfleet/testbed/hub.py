"""A small Hugging Face Hub endpoint that serves local repositories (testbed).

``huggingface_hub`` on the simulated hosts points ``HF_ENDPOINT`` here and runs its
real download path (``snapshot_download`` / ``hf_hub_download``): repo info, the tree
listing, ``HEAD``/``GET`` on ``/resolve`` with HTTP Range resume. Only what the client
needs is implemented.

Xet, like the Hub: LFS files carry a ``xetHash`` in tree and paths-info entries and
``X-Xet-Hash`` + ``Link: <.../xet-read-token/<sha>>; rel="xet-auth"`` on ``/resolve``;
``GET /api/models/{repo}/xet-read-token/{rev}`` gives a token and a CAS URL on this
server (``/_testbed/cas``). The CAS holds nothing: it counts every request
(``cas_requests`` in the stats) and answers 403, so a client that takes the Xet path
(huggingface_hub with hf_xet, unless ``HF_HUB_DISABLE_XET=1``) fails loudly and the
counter shows that a download bypassed ``HF_ENDPOINT`` and any mirror in front of it.

Layout on disk::

    ROOT/<org>/<name>/<revision>/<files...>    one directory per revision
    ROOT/<org>/<name>/refs.json                optional: {"main": "<40-hex sha>", ...}
    ROOT/<org>/<name>/.gated                   optional marker: files need a token

A revision directory named by a 40-hex sha is that commit. Any other name (``main``, a
tag) is a ref: a symlink to a sha directory aliases it, a real directory is a commit whose
sha is derived from its content. ``main`` falls back to ``refs.json`` and then to the
newest sha directory, so a root with one revision per repo needs no ref at all.

Auth, like the Hub: repo info and tree listings are public; file downloads of a gated
repo need ``Authorization: Bearer <token>`` (the ``--token`` value; any token when none is
configured), else 401 ``X-Error-Code: GatedRepo``. A bearer token that is not the
configured one is refused on every endpoint (401 "Invalid credentials").

``POST /api/models/{repo}/paths-info/{revision}`` answers like the Hub (mirrors such as
olah ask it for a file's size and LFS oid before serving it).

Upstream moves, as the Hub's do (``POST``, JSON body): ``/_testbed/move`` (``{"repo",
"ref"}``): a new commit on ``ref`` (default ``main``), its tree with
``sparkfleet-generation.txt`` counting the moves, so every byte before stays as it was;
answers ``{"sha"}``. ``/_testbed/delete`` (``{"repo", "revision"}``): that commit is gone
(a force-push); refused (409) while a ref points at it.

Testbed endpoints: ``GET /_testbed/stats`` (body bytes served, per repo and client IP;
``cas_requests`` and ``xet_token_requests``),
``POST /_testbed/reset``, ``GET /_testbed/requests`` (recent request log) and
``POST /_testbed/fault`` (``{"repo", "path", "abort_after", "times"}``: the next GETs of
that file send their headers, then only ``abort_after`` body bytes, then drop the
connection, to exercise resume; ``{"repo", "path", "delay_s", "times"}``: their body
trickles over ``delay_s``, a piece a second, so a slow upstream is not cut by a proxy's
read timeout; ``{"repo", "path", "release": true}``: that file's trickles, in flight or
to come, end at once, so a test holds a transfer exactly as long as it needs;
``"times": 0`` withdraws a fault).

Stdlib only: it runs on the controller next to the registry.
"""
from __future__ import annotations

import argparse
import collections
import datetime as _dt
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# The Hub's default .gitattributes: these go to LFS, whose ETag is the content sha256.
_LFS_SUFFIXES = (
    ".7z", ".arrow", ".bin", ".bz2", ".ckpt", ".ftz", ".gz", ".h5", ".joblib", ".mlmodel",
    ".model", ".msgpack", ".npy", ".npz", ".onnx", ".ot", ".parquet", ".pb", ".pickle",
    ".pkl", ".pt", ".pth", ".rar", ".safetensors", ".tar", ".tflite", ".tgz", ".wasm",
    ".xz", ".zip", ".zst", ".gguf",
)
_LFS_MIN_SIZE = 10 * 1024 * 1024
#: The file a moved ref's new commit adds (its count of moves): the only byte that differs.
GENERATION_FILE = "sparkfleet-generation.txt"
_LFS_POINTER_SIZE = 134
_CHUNK = 1 << 20
_REQUEST_LOG_LEN = 2000
#: What the CAS answers: a client error, which hf_xet does not retry (a 503 it retries for minutes).
_CAS_STATUS = 403


class HubError(Exception):
    """An HTTP error answered the way the Hub does (status, X-Error-Code, message)."""

    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.commit = commit


@dataclass(frozen=True)
class FileInfo:
    path: str  # repo-relative, "/"-separated
    abspath: Path
    size: int
    blob_id: str  # git blob sha1, the Hub's "oid"
    sha256: str | None  # set for LFS-like files

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id

    @property
    def xet_hash(self) -> str | None:
        """The file's Xet content hash (64 hex) where the Hub would keep it in Xet: LFS files.
        Made from the content sha256 (a real one hashes Xet chunks; no client checks it)."""
        return hashlib.sha256(b"sparkfleet-xet\0" + bytes.fromhex(self.sha256)).hexdigest() if self.sha256 else None


@dataclass(frozen=True)
class Revision:
    repo_id: str
    sha: str
    directory: Path
    mtime: float


def _is_lfs(path: str, size: int) -> bool:
    return path.lower().endswith(_LFS_SUFFIXES) or size >= _LFS_MIN_SIZE


class RepoStore:
    """Reads repositories from ``root``; hashes are cached by (size, mtime)."""

    def __init__(self, root: str | os.PathLike[str], gated: Iterable[str] = ()) -> None:
        self.root = Path(root)
        self.gated = set(gated)
        self._hash_cache: dict[Path, tuple[int, int, str, str | None]] = {}
        self._lock = threading.Lock()
        self._moves = threading.Lock()  # one upstream move at a time (the hash cache has its own)

    # -- repositories and revisions ---------------------------------------------------
    def repo_dir(self, repo_id: str) -> Path:
        parts = repo_id.split("/")
        if len(parts) != 2 or not all(_NAME_RE.match(p) for p in parts):
            raise HubError(404, "RepoNotFound", f"Repository not found: {repo_id}")
        d = self.root / parts[0] / parts[1]
        if not d.is_dir():
            raise HubError(404, "RepoNotFound", f"Repository not found: {repo_id}")
        return d

    def is_gated(self, repo_id: str) -> bool:
        return repo_id in self.gated or (self.repo_dir(repo_id) / ".gated").exists()

    def _revision_dirs(self, repo_dir: Path) -> list[Path]:
        return sorted(p for p in repo_dir.iterdir() if p.is_dir() and not p.name.startswith("."))

    def resolve(self, repo_id: str, rev: str | None) -> Revision:
        repo_dir = self.repo_dir(repo_id)
        rev = rev or "main"
        not_found = HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if "/" in rev or rev in (".", "..") or rev.startswith("."):
            raise not_found
        entry = repo_dir / rev
        if entry.is_dir():
            if entry.is_symlink():
                target = entry.resolve()
                if SHA_RE.match(target.name) and target.parent == repo_dir.resolve():
                    return self._revision(repo_id, target.name, target)
            if SHA_RE.match(rev):
                return self._revision(repo_id, rev, entry)
            return self._revision(repo_id, self._content_sha(repo_id, entry), entry)
        if SHA_RE.match(rev):
            # A sha may also name a ref directory whose sha is derived from its content.
            for d in self._revision_dirs(repo_dir):
                if not SHA_RE.match(d.name) and not d.is_symlink() and self._content_sha(repo_id, d) == rev:
                    return self._revision(repo_id, rev, d)
            raise not_found
        refs_file = repo_dir / "refs.json"
        if refs_file.is_file():
            refs = json.loads(refs_file.read_text())
            if rev in refs:
                return self.resolve(repo_id, refs[rev])
        if rev == "main":
            shas = [d for d in self._revision_dirs(repo_dir) if SHA_RE.match(d.name)]
            if shas:
                newest = max(shas, key=lambda d: (d.stat().st_mtime_ns, d.name))
                return self._revision(repo_id, newest.name, newest)
        raise not_found

    # -- upstream moves ------------------------------------------------------------------
    def _refs(self, repo_dir: Path) -> dict[str, str]:
        refs_file = repo_dir / "refs.json"
        return json.loads(refs_file.read_text()) if refs_file.is_file() else {}

    def move_ref(self, repo_id: str, ref: str = "main") -> str:
        """A new commit on ``ref``: the tree it names now with ``sparkfleet-generation.txt``
        counting the moves; ``ref`` points at it (refs.json). Returns its sha."""
        with self._moves:
            repo_dir = self.repo_dir(repo_id)
            current = self.resolve(repo_id, ref)
            marker = current.directory / GENERATION_FILE
            generation = int(marker.read_text().strip() or "1") + 1 if marker.is_file() else 2
            work = repo_dir / f".move-{os.getpid()}-{threading.get_ident()}"
            # Hard links: the files that stay are the same bytes, and cost no space.
            shutil.copytree(current.directory, work, copy_function=os.link)
            (work / GENERATION_FILE).unlink(missing_ok=True)
            (work / GENERATION_FILE).write_text(f"{generation}\n")
            sha = self._content_sha(repo_id, work)
            os.rename(work, repo_dir / sha)
            refs = {**self._refs(repo_dir), ref: sha}
            (repo_dir / "refs.json.tmp").write_text(json.dumps(refs, indent=1, sort_keys=True) + "\n")
            os.replace(repo_dir / "refs.json.tmp", repo_dir / "refs.json")
            return sha

    def delete_revision(self, repo_id: str, revision: str) -> None:
        """The commit ``revision`` is gone (a force-push upstream). A commit a ref names is kept."""
        with self._moves:
            repo_dir = self.repo_dir(repo_id)
            rev = self.resolve(repo_id, revision)
            named = {name for name, sha in self._refs(repo_dir).items() if sha == rev.sha}
            if self.resolve(repo_id, "main").sha == rev.sha:
                named.add("main")
            if named:
                raise HubError(409, None, f"{rev.sha} is what {', '.join(sorted(named))} names: move it first")
            if rev.directory.parent.resolve() != repo_dir.resolve():
                raise HubError(400, None, f"{revision} is not a commit of {repo_id}")
            shutil.rmtree(rev.directory)

    def _revision(self, repo_id: str, sha: str, directory: Path) -> Revision:
        return Revision(repo_id=repo_id, sha=sha, directory=directory, mtime=directory.stat().st_mtime)

    def _content_sha(self, repo_id: str, directory: Path) -> str:
        h = hashlib.sha1(repo_id.encode())
        for f in sorted(self.files(directory).values(), key=lambda f: f.path):
            h.update(f"\0{f.path}\0{f.blob_id}".encode())
        return h.hexdigest()

    # -- files ---------------------------------------------------------------------------
    def files(self, directory: Path) -> dict[str, FileInfo]:
        out: dict[str, FileInfo] = {}
        for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            for name in sorted(filenames):
                abspath = Path(dirpath) / name
                if not abspath.is_file():
                    continue
                rel = abspath.relative_to(directory).as_posix()
                out[rel] = self._file_info(rel, abspath)
        return out

    def file(self, rev: Revision, path: str) -> FileInfo:
        parts = path.split("/")
        missing = HubError(404, "EntryNotFound", f"Entry not found: {path}", commit=rev.sha)
        if not path or any(p in ("", ".", "..") for p in parts) or ".git" in parts:
            raise missing
        abspath = rev.directory.joinpath(*parts)
        if not abspath.is_file():
            raise missing
        return self._file_info(path, abspath)

    def _file_info(self, rel: str, abspath: Path) -> FileInfo:
        st = abspath.stat()
        with self._lock:
            cached = self._hash_cache.get(abspath)
        if cached and cached[0] == st.st_size and cached[1] == st.st_mtime_ns:
            blob_id, sha256 = cached[2], cached[3]
        else:
            blob = hashlib.sha1(f"blob {st.st_size}\0".encode())
            content = hashlib.sha256()
            with abspath.open("rb") as fh:
                for chunk in iter(lambda: fh.read(_CHUNK), b""):
                    blob.update(chunk)
                    content.update(chunk)
            blob_id = blob.hexdigest()
            sha256 = content.hexdigest() if _is_lfs(rel, st.st_size) else None
            with self._lock:
                self._hash_cache[abspath] = (st.st_size, st.st_mtime_ns, blob_id, sha256)
        return FileInfo(path=rel, abspath=abspath, size=st.st_size, blob_id=blob_id, sha256=sha256)


class ByteCounter:
    """Body bytes served, per repo, per client IP and per (repo, client)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.total = 0
            self.cas_requests = 0
            self.xet_token_requests = 0
            self.by_repo: dict[str, int] = collections.defaultdict(int)
            self.by_client: dict[str, int] = collections.defaultdict(int)
            self.by_repo_client: dict[str, dict[str, int]] = collections.defaultdict(
                lambda: collections.defaultdict(int)
            )
            self.requests: collections.deque[dict[str, Any]] = collections.deque(maxlen=_REQUEST_LOG_LEN)

    def add(self, repo_id: str, client: str, n: int) -> None:
        with self._lock:
            self.total += n
            self.by_repo[repo_id] += n
            self.by_client[client] += n
            self.by_repo_client[repo_id][client] += n

    def log(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(entry)

    def count(self, what: str) -> None:
        """One more request of *what* (``cas_requests``, ``xet_token_requests``)."""
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "total": self.total,
                "cas_requests": self.cas_requests,
                "xet_token_requests": self.xet_token_requests,
                "by_repo": dict(self.by_repo),
                "by_client": dict(self.by_client),
                "by_repo_client": {r: dict(c) for r, c in self.by_repo_client.items()},
            }

    def request_log(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.requests)


class _Faults:
    """One-shot transfer faults, keyed by (repo_id, path)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aborts: dict[tuple[str, str], list[int]] = {}
        self._delays: dict[tuple[str, str], list[float]] = {}
        self._released: dict[tuple[str, str], threading.Event] = {}

    def add_abort(self, repo_id: str, path: str, after_bytes: int, times: int = 1) -> None:
        with self._lock:
            if int(times) <= 0:  # times=0 withdraws the fault
                self._aborts.pop((repo_id, path), None)
            else:
                self._aborts[(repo_id, path)] = [int(after_bytes), int(times)]

    def add_delay(self, repo_id: str, path: str, seconds: float, times: int = 1) -> None:
        with self._lock:
            if int(times) <= 0:
                self._delays.pop((repo_id, path), None)
            else:
                self._delays[(repo_id, path)] = [float(seconds), int(times)]
                self._released[(repo_id, path)] = threading.Event()

    def release(self, repo_id: str, path: str) -> None:
        with self._lock:
            self._delays.pop((repo_id, path), None)
            self._released.pop((repo_id, path), threading.Event()).set()

    def take_delay(self, repo_id: str, path: str) -> tuple[float, threading.Event]:
        """The delay of this GET, and the event that ends it early."""
        with self._lock:
            fault = self._delays.get((repo_id, path))
            if not fault:
                return 0.0, threading.Event()
            fault[1] -= 1
            if fault[1] <= 0:
                del self._delays[(repo_id, path)]
            return fault[0], self._released[(repo_id, path)]

    def take_abort(self, repo_id: str, path: str) -> int | None:
        with self._lock:
            fault = self._aborts.get((repo_id, path))
            if not fault:
                return None
            fault[1] -= 1
            if fault[1] <= 0:
                del self._aborts[(repo_id, path)]
            return fault[0]

    def clear(self) -> None:
        with self._lock:
            self._aborts.clear()
            self._delays.clear()
            for released in self._released.values():
                released.set()
            self._released.clear()


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single ``bytes=`` range; None = whole file.

    Raises HubError(416) when the range cannot be satisfied. Multi-range requests are
    answered with the whole file, which RFC 9110 allows."""
    if not header:
        return None
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if not m or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.groups()
    if not first:
        length = int(last)
        if length == 0:
            raise HubError(416, None, "Range Not Satisfiable")
        return max(0, size - length), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        raise HubError(416, None, "Range Not Satisfiable")
    return start, end


def _file_entry(f: FileInfo) -> dict[str, Any]:
    """A file's entry in tree and paths-info answers."""
    entry: dict[str, Any] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
    if f.is_lfs:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": _LFS_POINTER_SIZE}
        entry["xetHash"] = f.xet_hash
    return entry


class _HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Many hosts pull at once; the default backlog of 5 drops connections under load.
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], store: RepoStore, token: str | None, log_requests: bool) -> None:
        super().__init__(addr, _HubHandler)
        self.store = store
        self.token = token
        self.log_requests = log_requests
        self.counter = ByteCounter()
        self.faults = _Faults()


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HubHTTPServer
    server_version = "sparkfleet-hub/1"

    def setup(self) -> None:
        super().setup()
        # Small JSON answers and HEADs should not wait on Nagle + delayed ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.log_requests:
            super().log_message(format, *args)

    # -- plumbing --------------------------------------------------------------------------
    def _segments(self) -> tuple[list[str], dict[str, list[str]]]:
        split = urlsplit(self.path)
        # Split before unquoting: a revision such as refs%2Fpr%2F1 is one segment.
        segs = [unquote(s) for s in split.path.split("/")[1:]]
        return segs, parse_qs(split.query)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
              content_type: str = "application/json", head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self._send(status, json.dumps(obj).encode(), headers, head=head)

    def _send_error(self, err: HubError, head: bool = False) -> None:
        headers = {"X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        if err.commit:
            headers["X-Repo-Commit"] = err.commit
        self._send_json(err.status, {"error": err.message}, headers, head=head)

    def _bearer(self) -> str | None:
        value = self.headers.get("Authorization") or ""
        scheme, _, token = value.partition(" ")
        return (token.strip() or None) if scheme.lower() == "bearer" else None

    def _check_auth(self, repo_id: str, files: bool) -> None:
        """Like the Hub: a wrong token is refused everywhere; gated files need a good one."""
        token, expected = self._bearer(), self.server.token
        if token and expected and token != expected:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        if files and self.server.store.is_gated(repo_id) and not token:
            raise HubError(
                401, "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in.",
            )

    # -- verbs -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_PUT(self) -> None:
        self._read_body()
        segs, _ = self._segments()
        if segs[:2] == ["_testbed", "cas"]:
            return self._cas(head=False)
        self._send_error(HubError(405, None, "Method Not Allowed"))

    def _cas(self, head: bool) -> None:
        """The Xet CAS (reconstructions, chunks, xorbs): counted, then refused."""
        self.server.counter.count("cas_requests")
        self.server.counter.log({"time": time.time(), "method": self.command, "cas": self.path,
                                 "client": self.client_address[0], "status": _CAS_STATUS, "bytes": 0})
        self._send_json(_CAS_STATUS, {"error": "the testbed has no Xet CAS: download over HTTP (HF_HUB_DISABLE_XET=1)"},
                        head=head)

    def _base_url(self) -> str:
        """This server as the client named it (the Hub names itself; clients map that to their endpoint)."""
        return f"http://{self.headers.get('Host') or self._own_address()}"

    def _own_address(self) -> str:
        host, port = self.server.server_address[:2]
        if host in ("0.0.0.0", "::"):
            return self.headers.get("Host") or f"127.0.0.1:{port}"
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def do_POST(self) -> None:
        segs, _ = self._segments()
        body = self._read_body()
        if segs[:2] == ["_testbed", "cas"]:
            return self._cas(head=False)
        try:
            if segs == ["_testbed", "reset"]:
                self.server.counter.reset()
                self.server.faults.clear()
                return self._send_json(200, {"ok": True})
            if segs == ["_testbed", "move"]:
                spec = json.loads(body or b"{}")
                return self._send_json(200, {"sha": self.server.store.move_ref(spec["repo"], spec.get("ref", "main"))})
            if segs == ["_testbed", "delete"]:
                spec = json.loads(body or b"{}")
                self.server.store.delete_revision(spec["repo"], spec["revision"])
                return self._send_json(200, {"ok": True})
            if segs == ["_testbed", "fault"]:
                spec = json.loads(body or b"{}")
                if spec.get("release"):
                    self.server.faults.release(spec["repo"], spec["path"])
                elif "delay_s" in spec:
                    self.server.faults.add_delay(spec["repo"], spec["path"], spec["delay_s"], spec.get("times", 1))
                else:
                    self.server.faults.add_abort(spec["repo"], spec["path"], spec["abort_after"], spec.get("times", 1))
                return self._send_json(200, {"ok": True})
            if segs[:2] == ["api", "models"] and len(segs) == 6 and segs[4] == "paths-info":
                form = parse_qs(body.decode("utf-8", "replace"))
                return self._paths_info(f"{segs[2]}/{segs[3]}", segs[5], form.get("paths", []))
            raise HubError(404, None, "Not Found")
        except (KeyError, ValueError) as exc:
            self._send_error(HubError(400, None, f"bad request: {exc}"))
        except HubError as err:
            self._send_error(err)

    def _dispatch(self, head: bool) -> None:
        segs, query = self._segments()
        try:
            if segs[:1] == ["_testbed"]:
                if segs == ["_testbed", "stats"]:
                    return self._send_json(200, self.server.counter.snapshot(), head=head)
                if segs == ["_testbed", "requests"]:
                    return self._send_json(200, self.server.counter.request_log(), head=head)
                if segs[:2] == ["_testbed", "cas"]:
                    return self._cas(head)
                raise HubError(404, None, "Not Found")
            if segs[:2] == ["api", "models"] and len(segs) >= 4:
                repo_id = f"{segs[2]}/{segs[3]}"
                rest = segs[4:]
                if not rest:
                    return self._model_info(repo_id, None, head)
                if rest[0] == "revision" and len(rest) == 2:
                    return self._model_info(repo_id, rest[1], head)
                if rest[0] == "tree" and len(rest) >= 2:
                    return self._tree(repo_id, rest[1], "/".join(rest[2:]), query, head)
                if rest[0] == "xet-read-token" and len(rest) == 2:
                    return self._xet_read_token(repo_id, rest[1], head)
                raise HubError(404, None, "Not Found")
            if len(segs) >= 5 and segs[2] == "resolve":
                return self._resolve(f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:]), head)
            raise HubError(404, None, "Not Found")
        except HubError as err:
            self._send_error(err, head=head)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # -- API ---------------------------------------------------------------------------------
    def _model_info(self, repo_id: str, rev_name: str | None, head: bool) -> None:
        store = self.server.store
        self._check_auth(repo_id, files=False)
        rev = store.resolve(repo_id, rev_name)
        files = store.files(rev.directory)
        siblings = []
        for f in files.values():
            sib: dict[str, Any] = {"rfilename": f.path, "size": f.size, "blobId": f.blob_id}
            if f.is_lfs:
                sib["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": _LFS_POINTER_SIZE}
            siblings.append(sib)
        org, name = repo_id.split("/")
        gated = store.is_gated(repo_id)
        info = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": org,
            "sha": rev.sha,
            "lastModified": _iso(rev.mtime),
            "createdAt": _iso(rev.mtime),
            "private": False,
            "gated": "manual" if gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["safetensors"],
            "library_name": "transformers",
            "siblings": siblings,
            "spaces": [],
            "usedStorage": sum(f.size for f in files.values()),
        }
        self._send_json(200, info, head=head)

    def _tree(self, repo_id: str, rev_name: str, path: str, query: dict[str, list[str]], head: bool) -> None:
        store = self.server.store
        self._check_auth(repo_id, files=False)
        rev = store.resolve(repo_id, rev_name)
        recursive = (query.get("recursive") or ["false"])[0].lower() in ("1", "true")
        files = store.files(rev.directory)
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        if prefix and not any(p.startswith(prefix) for p in files):
            raise HubError(404, "EntryNotFound", f"Entry not found: {path}", commit=rev.sha)
        entries: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for f in files.values():
            if not f.path.startswith(prefix):
                continue
            rel = f.path[len(prefix):]
            parents = rel.split("/")[:-1]
            for i in range(1, len(parents) + 1):
                if recursive or i == 1:
                    dirs.add(prefix + "/".join(parents[:i]))
            if "/" in rel and not recursive:
                continue
            entries.append(_file_entry(f))
        for d in dirs:
            oid = hashlib.sha1(f"tree {rev.sha} {d}".encode()).hexdigest()
            entries.append({"type": "directory", "oid": oid, "size": 0, "path": d})
        entries.sort(key=lambda e: (e["path"].count("/"), e["type"] != "directory", e["path"]))
        self._send_json(200, entries, head=head)

    def _xet_read_token(self, repo_id: str, rev_name: str, head: bool) -> None:
        """A Xet read token and the CAS to use it with, in headers and body like the Hub."""
        self._check_auth(repo_id, files=True)
        rev = self.server.store.resolve(repo_id, rev_name)
        self.server.counter.count("xet_token_requests")
        token = "xet_testbed_" + hashlib.sha1(f"{repo_id}@{rev.sha}".encode()).hexdigest()[:16]
        expires = int(time.time()) + 3600
        cas = f"http://{self._own_address()}/_testbed/cas"  # like the Hub's: a host of its own, not the endpoint
        headers = {"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": token, "X-Xet-Token-Expiration": str(expires)}
        self._send_json(200, {"casUrl": cas, "accessToken": token, "exp": expires}, headers, head=head)

    def _paths_info(self, repo_id: str, rev_name: str, paths: list[str]) -> None:
        """``POST /api/models/{repo}/paths-info/{rev}`` (form ``paths=...``, repeatable): the
        tree entries of those paths; missing paths are left out, like the Hub does."""
        store = self.server.store
        self._check_auth(repo_id, files=False)
        rev = store.resolve(repo_id, rev_name)
        files = store.files(rev.directory)
        entries: list[dict[str, Any]] = []
        for path in paths:
            path = path.strip("/")
            f = files.get(path)
            if f is not None:
                entries.append(_file_entry(f))
            elif path and any(p.startswith(path + "/") for p in files):
                oid = hashlib.sha1(f"tree {rev.sha} {path}".encode()).hexdigest()
                entries.append({"type": "directory", "oid": oid, "size": 0, "path": path})
        self._send_json(200, entries)

    def _resolve(self, repo_id: str, rev_name: str, path: str, head: bool) -> None:
        store = self.server.store
        client = self.client_address[0]
        self._check_auth(repo_id, files=True)
        rev = store.resolve(repo_id, rev_name)
        f = store.file(rev, path)
        headers = {
            "X-Repo-Commit": rev.sha,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
            "Last-Modified": self.date_time_string(rev.mtime),
        }
        if f.is_lfs:
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
            headers["X-Linked-Size"] = str(f.size)
            headers["X-Xet-Hash"] = f.xet_hash
            headers["Link"] = f'<{self._base_url()}/api/models/{repo_id}/xet-read-token/{rev.sha}>; rel="xet-auth"'
        rng = None if head else _parse_range(self.headers.get("Range"), f.size)
        start, end = rng if rng else (0, f.size - 1)
        length = end - start + 1 if f.size else 0
        self.send_response(206 if rng else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length if not head else f.size))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        entry = {
            "time": time.time(), "method": self.command, "repo": repo_id, "path": path,
            "revision": rev.sha, "range": self.headers.get("Range"), "client": client,
            "status": 206 if rng else 200, "bytes": 0,
        }
        if head:
            self.server.counter.log(entry)
            return
        abort_after = self.server.faults.take_abort(repo_id, path)
        budget = length if abort_after is None else min(length, abort_after)
        # A slow upstream: the body comes a piece a second over `delay` seconds, never silent
        # long enough for a proxy's read timeout (olah's is 15 s) to give up on it.
        delay, released = self.server.faults.take_delay(repo_id, path)
        pieces = math.ceil(delay)
        pause = delay / pieces if pieces else 0.0
        step = -(-budget // pieces) if pieces else _CHUNK
        sent = 0
        try:
            with f.abspath.open("rb") as fh:
                fh.seek(start)
                while sent < budget:
                    if pieces and not released.is_set():
                        released.wait(pause)
                        pieces -= 1
                    chunk = fh.read(min(step, budget - sent))
                    if not chunk:
                        break
                    # Counted before it is written: a client that has every byte finds them counted.
                    self.server.counter.add(repo_id, client, len(chunk))
                    self.wfile.write(chunk)
                    sent += len(chunk)
        finally:
            entry["bytes"] = sent
            entry["aborted"] = sent < length
            self.server.counter.log(entry)
        if sent < length:
            # Simulated network failure: drop the connection mid-body.
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class HubServer:
    """The hub in a background thread (tests) or the foreground (``serve``)."""

    def __init__(self, root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, gated: Iterable[str] = (), log_requests: bool = False) -> None:
        self.store = RepoStore(root, gated=gated)
        self.httpd = _HubHTTPServer((host, port), self.store, token, log_requests)
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return str(self.httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread:
            self._thread.join(timeout=5)

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        return self.httpd.counter.snapshot()

    def requests(self) -> list[dict[str, Any]]:
        return self.httpd.counter.request_log()

    def reset(self) -> None:
        self.httpd.counter.reset()
        self.httpd.faults.clear()

    def inject_abort(self, repo_id: str, path: str, after_bytes: int, times: int = 1) -> None:
        """Make the next ``times`` GETs of ``path`` stop after ``after_bytes`` body bytes."""
        self.httpd.faults.add_abort(repo_id, path, after_bytes, times)

    def move_ref(self, repo_id: str, ref: str = "main") -> str:
        """Upstream moves ``ref`` to a new commit; its sha."""
        return self.store.move_ref(repo_id, ref)

    def delete_revision(self, repo_id: str, revision: str) -> None:
        """Upstream deletes the commit ``revision``."""
        self.store.delete_revision(repo_id, revision)

    def inject_delay(self, repo_id: str, path: str, seconds: float, times: int = 1) -> None:
        """Make the next ``times`` GETs of ``path`` start their body ``seconds`` late."""
        self.httpd.faults.add_delay(repo_id, path, seconds, times)


def serve(root: str | os.PathLike[str], host: str, port: int, token: str | None = None,
          gated: Iterable[str] = (), log_requests: bool = False) -> None:
    """Serve ``root`` until SIGTERM/SIGINT."""
    server = HubServer(root, host, port, token=token, gated=gated, log_requests=log_requests)
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    print(f"sparkfleet hub serving {Path(root).resolve()} on {server.url}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparkfleet.testbed.hub", description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="directory holding <org>/<name>/<revision>/ trees")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--token", default=None, help="the one valid bearer token (gated repos need it)")
    parser.add_argument("--gated", action="append", default=[], metavar="ORG/NAME",
                        help="mark a repo gated (also: a .gated file in its directory)")
    parser.add_argument("--log-requests", action="store_true", help="log every request to stderr")
    args = parser.parse_args(argv)
    if not Path(args.root).is_dir():
        parser.error(f"--root {args.root} is not a directory")
    serve(args.root, args.host, args.port, token=args.token, gated=args.gated, log_requests=args.log_requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
