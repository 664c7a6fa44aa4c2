"""The testbed's Hugging Face hub endpoint, driven by the real huggingface_hub client."""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from sparkfleet.testbed.hub import HubServer

REPO = "acme/tiny"
GATED = "acme/locked"
OLD = "1" * 40  # older revision
NEW = "2" * 40  # newer revision, "main" via refs.json
TOKEN = "hf_testbed_secret"
# Resume works from the client's last whole chunk: http_get writes DOWNLOAD_CHUNK_SIZE pieces.
CHUNK = getattr(constants, "DOWNLOAD_CHUNK_SIZE", 10 * 1024 * 1024)


def write_revision(root: Path, repo: str, rev: str, files: dict[str, bytes]) -> None:
    base = root / repo / rev
    for name, data in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_bytes(data)


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("repos")
    old = {"config.json": b'{"revision": "old"}', "model.safetensors": os.urandom(200_000),
           "sub/notes.txt": b"old notes\n"}
    new = {"config.json": b'{"revision": "new", "hidden_size": 8}', "model.safetensors": os.urandom(300_000),
           "big.safetensors": os.urandom(CHUNK + 1_000_123), "sub/notes.txt": b"new notes\n"}
    write_revision(root, REPO, OLD, old)
    write_revision(root, REPO, NEW, new)
    (root / REPO / "refs.json").write_text(json.dumps({"main": NEW}))
    write_revision(root, GATED, "3" * 40, {"config.json": b"{}", "model.safetensors": os.urandom(1000)})
    (root / GATED / ".gated").touch()
    return {"root": root, OLD: old, NEW: new}  # type: ignore[dict-item]


@pytest.fixture
def hub(repos: dict[str, Any]) -> Iterator[HubServer]:
    with HubServer(repos["root"], "127.0.0.1", 0, token=TOKEN) as server:
        yield server


def read_tree(path: str | Path) -> dict[str, bytes]:
    base = Path(path)
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def raw(hub: HubServer, method: str, path: str, headers: dict[str, str] | None = None,
        source: str | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(hub.host, hub.port, timeout=10,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def total_size(files: dict[str, bytes], *names: str) -> int:
    return sum(len(files[n]) for n in (names or files))


# ---------------------------------------------------------------------------------------
def test_snapshot_download_is_byte_identical(hub: HubServer, repos: dict[str, Any], tmp_path: Path) -> None:
    path = snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path / "hub")
    assert Path(path).name == NEW  # main -> the commit refs.json names
    assert read_tree(path) == repos[NEW]
    stats = hub.stats()
    assert stats["total"] == total_size(repos[NEW])  # each file exactly once
    assert stats["by_repo"] == {REPO: stats["total"]}
    assert stats["by_client"] == {"127.0.0.1": stats["total"]}
    assert stats["by_repo_client"] == {REPO: {"127.0.0.1": stats["total"]}}
    # Everything cached: a second call transfers nothing.
    snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path / "hub")
    assert hub.stats()["total"] == total_size(repos[NEW])


def test_revision_pinning_and_allow_patterns(hub: HubServer, repos: dict[str, Any], tmp_path: Path) -> None:
    old = snapshot_download(REPO, revision=OLD, endpoint=hub.url, cache_dir=tmp_path / "hub")
    assert Path(old).name == OLD and read_tree(old) == repos[OLD]
    cfg = snapshot_download(REPO, revision="main", allow_patterns=["*.json"], endpoint=hub.url,
                            cache_dir=tmp_path / "hub")
    assert Path(cfg).name == NEW
    assert read_tree(cfg) == {"config.json": repos[NEW]["config.json"]}
    assert hub.stats()["total"] == total_size(repos[OLD]) + len(repos[NEW]["config.json"])
    one = hf_hub_download(REPO, "sub/notes.txt", revision=OLD, endpoint=hub.url, cache_dir=tmp_path / "hub2")
    assert Path(one).read_bytes() == b"old notes\n"


def test_hf_endpoint_environment_variable(hub: HubServer, repos: dict[str, Any], tmp_path: Path) -> None:
    """The way hosts use it: HF_ENDPOINT set, the client reads it at import time."""
    code = ("import sys; from huggingface_hub import snapshot_download; "
            f"print(snapshot_download({REPO!r}, revision={OLD!r}))")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_XET": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    path = Path(res.stdout.strip().splitlines()[-1])
    assert path == tmp_path / "hf" / "hub" / "models--acme--tiny" / "snapshots" / OLD
    assert read_tree(path) == repos[OLD]


def test_resume_after_a_dropped_connection_fetches_only_the_rest(hub: HubServer, repos: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    size = len(repos[NEW]["big.safetensors"])
    hub.inject_abort(REPO, "big.safetensors", after_bytes=CHUNK)  # the network drops after one chunk
    try:
        path = snapshot_download(REPO, allow_patterns=["big.*"], endpoint=hub.url, cache_dir=tmp_path / "hub")
    except (OSError, HfHubHTTPError):
        # Clients that do not retry in-process resume from their .incomplete file instead.
        path = snapshot_download(REPO, allow_patterns=["big.*"], endpoint=hub.url, cache_dir=tmp_path / "hub")
    assert Path(path, "big.safetensors").read_bytes() == repos[NEW]["big.safetensors"]
    gets = [r for r in hub.requests() if r["method"] == "GET" and r["path"] == "big.safetensors"]
    assert [(g["status"], g["bytes"], g["aborted"]) for g in gets] == [(200, CHUNK, True), (206, size - CHUNK, False)]
    assert gets[1]["range"] == f"bytes={CHUNK}-"
    assert hub.stats()["total"] == size  # nothing fetched twice


def test_delay_and_withdrawn_faults(hub: HubServer, repos: dict[str, Any]) -> None:
    hub.inject_delay(REPO, "config.json", 1.0)
    started = time.monotonic()
    status, _, body = raw(hub, "GET", f"/{REPO}/resolve/{NEW}/config.json")
    assert status == 200 and body == repos[NEW]["config.json"] and time.monotonic() - started >= 1.0
    started = time.monotonic()
    raw(hub, "GET", f"/{REPO}/resolve/{NEW}/config.json")  # one time only
    assert time.monotonic() - started < 1.0  # a local GET, with room for a loaded machine
    hub.inject_abort(REPO, "config.json", after_bytes=3, times=5)
    hub.inject_abort(REPO, "config.json", after_bytes=3, times=0)  # withdrawn
    status, _, body = raw(hub, "GET", f"/{REPO}/resolve/{NEW}/config.json")
    assert body == repos[NEW]["config.json"]


def test_a_slow_file_trickles_under_a_proxy_read_timeout(hub: HubServer, repos: dict[str, Any]) -> None:
    hub.inject_delay(REPO, "big.safetensors", 4.0)
    conn = http.client.HTTPConnection(hub.host, hub.port, timeout=2)  # a read timeout under the delay
    started = time.monotonic()
    try:
        conn.request("GET", f"/{REPO}/resolve/{NEW}/big.safetensors")
        body = conn.getresponse().read()
    finally:
        conn.close()
    assert body == repos[NEW]["big.safetensors"] and time.monotonic() - started >= 4.0


def test_a_held_file_comes_at_once_when_released(hub: HubServer, repos: dict[str, Any]) -> None:
    """A trickle far longer than a test waits, ended by a release: in flight, and for the
    GETs it would still have slowed."""
    def fault(spec: dict[str, Any]) -> None:
        conn = http.client.HTTPConnection(hub.host, hub.port, timeout=10)
        try:
            conn.request("POST", "/_testbed/fault", body=json.dumps({"repo": REPO, "path": "big.safetensors", **spec}))
            assert conn.getresponse().status == 200
        finally:
            conn.close()

    fault({"delay_s": 600, "times": 2})
    got: list[bytes] = []
    started = time.monotonic()
    reader = threading.Thread(target=lambda: got.append(raw(hub, "GET", f"/{REPO}/resolve/{NEW}/big.safetensors")[2]))
    reader.start()
    time.sleep(1.5)
    assert got == []  # held
    fault({"release": True})
    reader.join(timeout=10)
    assert got == [repos[NEW]["big.safetensors"]] and time.monotonic() - started < 12
    started = time.monotonic()
    raw(hub, "GET", f"/{REPO}/resolve/{NEW}/big.safetensors")  # its second time: released too
    assert time.monotonic() - started < 5


def test_range_and_head_headers(hub: HubServer, repos: dict[str, Any]) -> None:
    data = repos[NEW]["model.safetensors"]
    url = f"/{REPO}/resolve/main/model.safetensors"
    status, headers, body = raw(hub, "HEAD", url)
    assert status == 200 and body == b""
    assert headers["x-repo-commit"] == NEW
    sha256 = hashlib.sha256(data).hexdigest()
    assert headers["x-linked-etag"] == headers["etag"] == f'"{sha256}"'  # LFS-like: content sha256
    assert headers["x-linked-size"] == headers["content-length"] == str(len(data))
    xet = headers["x-xet-hash"]  # like the Hub: a Xet file, its token route in a Link
    assert len(xet) == 64 and int(xet, 16) >= 0
    assert headers["link"] == f'<{hub.url}/api/models/{REPO}/xet-read-token/{NEW}>; rel="xet-auth"'
    cfg = repos[NEW]["config.json"]
    status, headers, _ = raw(hub, "HEAD", f"/{REPO}/resolve/{NEW}/config.json")
    git_sha1 = hashlib.sha1(b"blob %d\0" % len(cfg) + cfg).hexdigest()
    assert headers["etag"] == f'"{git_sha1}"' and "x-linked-etag" not in headers  # small file: git blob id
    assert "x-xet-hash" not in headers and "link" not in headers  # a git file is never in Xet
    assert hub.stats()["total"] == 0  # HEADs send no body

    status, headers, body = raw(hub, "GET", url, {"Range": "bytes=10-19"})
    assert (status, body) == (206, data[10:20]) and headers["content-range"] == f"bytes 10-19/{len(data)}"
    status, _, body = raw(hub, "GET", url, {"Range": "bytes=-5"})
    assert (status, body) == (206, data[-5:])
    status, _, body = raw(hub, "GET", url, {"Range": f"bytes={len(data) - 3}-"})
    assert (status, body) == (206, data[-3:])
    status, headers, _ = raw(hub, "GET", url, {"Range": f"bytes={len(data)}-"})
    assert status == 416
    assert hub.stats()["total"] == 10 + 5 + 3


def test_unknown_repo_revision_file_are_404(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("acme/nothing", endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="v9", endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="f" * 40, endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.bin", endpoint=hub.url, cache_dir=tmp_path)
    for path, code in ((f"/{REPO}/resolve/main/missing.bin", "EntryNotFound"),
                       (f"/{REPO}/resolve/v9/config.json", "RevisionNotFound"),
                       ("/acme/nothing/resolve/main/config.json", "RepoNotFound"),
                       (f"/{REPO}/resolve/main/../../../etc/passwd", "EntryNotFound"),
                       ("/api/models/acme/nothing", "RepoNotFound")):
        status, headers, _ = raw(hub, "GET", path)
        assert (status, headers.get("x-error-code")) == (404, code), path


def test_gated_repo_needs_the_token(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(GatedRepoError):
        snapshot_download(GATED, endpoint=hub.url, cache_dir=tmp_path / "a")
    status, headers, _ = raw(hub, "HEAD", f"/{GATED}/resolve/main/config.json")
    assert (status, headers["x-error-code"]) == (401, "GatedRepo")
    with pytest.raises(HfHubHTTPError) as wrong:
        snapshot_download(GATED, endpoint=hub.url, cache_dir=tmp_path / "b", token="hf_wrong")
    assert wrong.value.response.status_code == 401
    assert hub.stats()["total"] == 0
    path = snapshot_download(GATED, endpoint=hub.url, cache_dir=tmp_path / "c", token=TOKEN)
    assert sorted(read_tree(path)) == ["config.json", "model.safetensors"]


def test_byte_counters_per_client_and_reset(hub: HubServer, repos: dict[str, Any], tmp_path: Path) -> None:
    snapshot_download(REPO, revision=OLD, endpoint=hub.url, cache_dir=tmp_path / "hub")
    status, _, body = raw(hub, "GET", f"/{REPO}/resolve/{OLD}/model.safetensors", source="127.0.0.2")
    assert status == 200 and body == repos[OLD]["model.safetensors"]
    status, _, stats_body = raw(hub, "GET", "/_testbed/stats")
    stats = json.loads(stats_body)
    first, second = total_size(repos[OLD]), len(repos[OLD]["model.safetensors"])
    assert stats == {
        "total": first + second, "cas_requests": 0, "xet_token_requests": 0,
        "by_repo": {REPO: first + second},
        "by_client": {"127.0.0.1": first, "127.0.0.2": second},
        "by_repo_client": {REPO: {"127.0.0.1": first, "127.0.0.2": second}},
    }
    status, _, _ = raw(hub, "POST", "/_testbed/reset")
    assert status == 200
    assert json.loads(raw(hub, "GET", "/_testbed/stats")[2]) == {
        "total": 0, "cas_requests": 0, "xet_token_requests": 0, "by_repo": {}, "by_client": {}, "by_repo_client": {}}


def test_info_and_tree_endpoints(hub: HubServer, repos: dict[str, Any]) -> None:
    api = huggingface_hub.HfApi(endpoint=hub.url)
    info = api.model_info(REPO, revision="main")
    assert info.sha == NEW
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    assert sizes == {k: len(v) for k, v in repos[NEW].items()}
    assert api.model_info(REPO, revision=OLD).sha == OLD
    entries = list(api.list_repo_tree(REPO, revision=NEW, recursive=True))
    files = {e.path: e for e in entries if isinstance(e, huggingface_hub.hf_api.RepoFile)}
    assert set(files) == set(repos[NEW])
    assert files["model.safetensors"].lfs is not None and files["config.json"].lfs is None
    assert files["model.safetensors"].lfs.sha256 == hashlib.sha256(repos[NEW]["model.safetensors"]).hexdigest()
    assert len(files["model.safetensors"].xet_hash) == 64 and files["config.json"].xet_hash is None
    assert files["model.safetensors"].xet_hash != files["big.safetensors"].xet_hash
    top = {e.path for e in api.list_repo_tree(REPO, revision=NEW)}
    assert top == {"config.json", "model.safetensors", "big.safetensors", "sub"}
    assert {e.path for e in api.list_repo_tree(REPO, path_in_repo="sub", revision=NEW)} == {"sub/notes.txt"}


def test_paths_info_endpoint(hub: HubServer, repos: dict[str, Any]) -> None:
    """What a mirror (olah) asks before serving a file: size and LFS oid, per path."""
    api = huggingface_hub.HfApi(endpoint=hub.url)
    infos = api.get_paths_info(REPO, ["model.safetensors", "config.json", "sub", "missing.bin"], revision=NEW)
    by_path = {i.path: i for i in infos}
    assert set(by_path) == {"model.safetensors", "config.json", "sub"}
    assert by_path["model.safetensors"].size == len(repos[NEW]["model.safetensors"])
    assert by_path["model.safetensors"].lfs.sha256 == hashlib.sha256(repos[NEW]["model.safetensors"]).hexdigest()
    assert by_path["config.json"].lfs is None
    assert by_path["model.safetensors"].xet_hash == next(
        e.xet_hash for e in api.list_repo_tree(REPO, revision=NEW) if e.path == "model.safetensors")
    assert isinstance(by_path["sub"], huggingface_hub.hf_api.RepoFolder)


def test_ref_resolution_without_refs_file(tmp_path: Path) -> None:
    """main = a `main` symlink/dir if present, else the newest sha directory."""
    write_revision(tmp_path, "o/a", OLD, {"f.txt": b"old"})
    write_revision(tmp_path, "o/a", NEW, {"f.txt": b"new"})
    os.utime(tmp_path / "o/a" / OLD, (1, 1))  # OLD is the older directory whatever the names sort to
    write_revision(tmp_path, "o/b", "main", {"f.txt": b"plain dir"})
    write_revision(tmp_path, "o/c", OLD, {"f.txt": b"old"})
    write_revision(tmp_path, "o/c", NEW, {"f.txt": b"new"})
    (tmp_path / "o/c" / "main").symlink_to(OLD)
    with HubServer(tmp_path) as hub:
        assert Path(hf_hub_download("o/a", "f.txt", endpoint=hub.url, cache_dir=tmp_path / "x")).read_bytes() == b"new"
        status, headers, body = raw(hub, "GET", "/o/b/resolve/main/f.txt")
        sha = headers["x-repo-commit"]
        assert body == b"plain dir" and len(sha) == 40
        assert raw(hub, "GET", f"/o/b/resolve/{sha}/f.txt")[2] == b"plain dir"  # its derived sha works too
        status, headers, body = raw(hub, "GET", "/o/c/resolve/main/f.txt")
        assert (body, headers["x-repo-commit"]) == (b"old", OLD)


def test_upstream_moves_a_branch_and_deletes_the_commit_it_named(tmp_path: Path) -> None:
    """POST /_testbed/move: a new commit on main, every other byte as it was; POST
    /_testbed/delete: the old commit is gone (a force-push), refused while a ref names it."""
    write_revision(tmp_path, "o/d", OLD, {"model.safetensors": b"4 layers" * 1000, "config.json": b"{}"})
    with HubServer(tmp_path) as hub:
        api = huggingface_hub.HfApi(endpoint=hub.url)

        def post(what: str, spec: dict) -> tuple[int, dict]:
            conn = http.client.HTTPConnection(hub.host, hub.port, timeout=10)
            conn.request("POST", f"/_testbed/{what}", body=json.dumps(spec), headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            return answer.status, json.loads(answer.read() or b"{}")

        assert api.model_info("o/d", revision="main").sha == OLD
        status, moved = post("move", {"repo": "o/d"})
        assert status == 200 and len(moved["sha"]) == 40 and moved["sha"] != OLD
        assert api.model_info("o/d", revision="main").sha == moved["sha"]
        new = read_tree(snapshot_download("o/d", revision="main", endpoint=hub.url, cache_dir=tmp_path / "x"))
        assert new == {"model.safetensors": b"4 layers" * 1000, "config.json": b"{}",
                       "sparkfleet-generation.txt": b"2\n"}
        assert post("move", {"repo": "o/d"})[1]["sha"] not in (OLD, moved["sha"])  # generation 3
        assert post("delete", {"repo": "o/d", "revision": api.model_info("o/d").sha})[0] == 409  # main names it
        # The old commit still downloads, until it is deleted.
        assert snapshot_download("o/d", revision=OLD, endpoint=hub.url, cache_dir=tmp_path / "y")
        assert post("delete", {"repo": "o/d", "revision": OLD}) == (200, {"ok": True})
        with pytest.raises(RevisionNotFoundError):
            api.model_info("o/d", revision=OLD)
        with pytest.raises(RevisionNotFoundError):
            snapshot_download("o/d", revision=OLD, endpoint=hub.url, cache_dir=tmp_path / "z")


def test_synthetic_checkpoints_round_trip(tmp_path: Path) -> None:
    from sparkfleet.testbed import checkpoints

    revs = checkpoints.write_synthetic_repos(tmp_path / "repos")
    with HubServer(tmp_path / "repos") as hub:
        for repo, rev in revs.items():
            path = snapshot_download(repo, revision=rev, endpoint=hub.url, cache_dir=tmp_path / "hub")
            assert read_tree(path) == read_tree(tmp_path / "repos" / repo / rev)
            assert hub.stats()["by_repo"][repo] == sum(len(v) for v in read_tree(path).values())


def test_cli(repos: dict[str, Any]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sparkfleet.testbed.hub", "--root", str(repos["root"]),
                             "--host", "127.0.0.1", "--port", str(port), "--token", TOKEN],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", f"/api/models/{REPO}/revision/{OLD}")
                info = json.loads(conn.getresponse().read())
                conn.close()
                break
            except OSError:
                assert time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "timeout"
                time.sleep(0.1)
        assert info["sha"] == OLD and {s["rfilename"] for s in info["siblings"]} == set(repos[OLD])
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


# --- Xet: what a current huggingface_hub does against a Hub that has it ------------------------
def fetch(endpoint: str, home: Path, disable_xet: bool, revision: str = NEW) -> subprocess.CompletedProcess[str]:
    """snapshot_download in a fresh process (huggingface_hub reads HF_HUB_DISABLE_XET at import)."""
    code = ("from huggingface_hub import snapshot_download; "
            f"print(snapshot_download({REPO!r}, revision={revision!r}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1")
    if disable_xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_xet_read_token_names_the_testbed_cas(hub: HubServer) -> None:
    status, headers, body = raw(hub, "GET", f"/api/models/{REPO}/xet-read-token/{NEW}")
    token = json.loads(body)
    assert status == 200 and token["casUrl"] == headers["x-xet-cas-url"] == f"{hub.url}/_testbed/cas"
    assert token["accessToken"] == headers["x-xet-access-token"] and int(headers["x-xet-token-expiration"]) > time.time()
    assert raw(hub, "GET", f"/api/models/{GATED}/xet-read-token/main")[0] == 401  # gated like its files
    status, _, _ = raw(hub, "GET", "/_testbed/cas/v2/reconstructions/" + "0" * 64)
    assert status == 403
    assert raw(hub, "POST", "/_testbed/cas/v1/xorbs/default/" + "0" * 64)[0] == 403
    assert hub.stats()["cas_requests"] == 2 and hub.stats()["xet_token_requests"] == 1
    hub.reset()
    assert hub.stats()["cas_requests"] == 0


def test_current_huggingface_hub_goes_to_the_cas_unless_xet_is_disabled(hub: HubServer, repos: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    """huggingface_hub with hf_xet takes LFS files from the Xet CAS, never from HF_ENDPOINT;
    HF_HUB_DISABLE_XET=1 keeps every byte on the endpoint."""
    import hf_xet  # noqa: F401 - a hard dependency of huggingface_hub on x86_64 and aarch64

    xet = fetch(hub.url, tmp_path / "xet", disable_xet=False)
    assert xet.returncode != 0 and "_testbed/cas" in xet.stderr
    stats = hub.stats()
    assert stats["cas_requests"] > 0 and stats["xet_token_requests"] >= 1
    lfs = [n for n in repos[NEW] if n.endswith(".safetensors")]
    assert not any(r.get("path") in lfs and r["bytes"] for r in hub.requests())  # no LFS byte over HTTP
    hub.reset()
    plain = fetch(hub.url, tmp_path / "http", disable_xet=True)
    assert plain.returncode == 0, plain.stderr
    assert read_tree(plain.stdout.strip().splitlines()[-1]) == repos[NEW]
    assert hub.stats()["cas_requests"] == 0 and hub.stats()["xet_token_requests"] == 0
    assert hub.stats()["total"] == total_size(repos[NEW])


@pytest.fixture(scope="module")
def olah_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fleet mirror's olah (mirror_olah), installed from the wheel set the deploy uses."""
    import platform
    import runpy

    from sparkfleet.mirror.hf import controller_wheelhouse

    requirement = runpy.run_path(str(Path(__file__).resolve().parents[2] / "group_data" / "all.py"))["mirror_olah"]
    python = {"major": sys.version_info[0], "minor": sys.version_info[1], "machine": platform.machine(),
              "glibc": platform.libc_ver()[1] or "-"}
    wheels = controller_wheelhouse(requirement, python)
    target = tmp_path_factory.mktemp("olah")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    *[str(w) for w in wheels.glob("*.whl") if not w.name.startswith("pip-")]],
                   check=True, timeout=300, capture_output=True)
    return target


@pytest.mark.network
def test_through_olah_xet_bypasses_the_mirror_unless_disabled(hub: HubServer, repos: dict[str, Any],
                                                              olah_lib: Path, tmp_path: Path) -> None:
    """olah 0.5.4 relays the tree (xetHash included) and forwards xet-read-token upstream:
    with Xet on, the client goes past the mirror to the CAS. With HF_HUB_DISABLE_XET=1 every
    byte comes through olah, byte-identical."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "olah.toml"
    config.write_text(
        f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{tmp_path / "cache"}"\n'
        f'hf-scheme = "http"\nhf-netloc = "127.0.0.1:{hub.port}"\nhf-lfs-netloc = "127.0.0.1:{hub.port}"\n'
        f'mirror-netloc = "127.0.0.1:{port}"\nmirror-lfs-netloc = "127.0.0.1:{port}"\n'
    )
    with open(tmp_path / "olah.log", "w") as log:
        olah = subprocess.Popen(
            [sys.executable, "-m", "olah.server", "--config", str(config), "--log-path", str(tmp_path / "logs")],
            env={**os.environ, "PYTHONPATH": str(olah_lib), "GIT_PYTHON_REFRESH": "quiet"},
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert olah.poll() is None and time.monotonic() < deadline, (tmp_path / "olah.log").read_text()
                time.sleep(0.1)
        mirror = f"http://127.0.0.1:{port}"
        xet = fetch(mirror, tmp_path / "xet", disable_xet=False)
        assert xet.returncode != 0
        before = hub.stats()
        assert before["cas_requests"] > 0 and before["xet_token_requests"] >= 1
        lfs = [n for n in repos[NEW] if n.endswith(".safetensors")]
        assert before["total"] == total_size(repos[NEW]) - total_size(repos[NEW], *lfs)  # the git files only
        plain = fetch(mirror, tmp_path / "http", disable_xet=True)
        assert plain.returncode == 0, plain.stderr
        assert read_tree(plain.stdout.strip().splitlines()[-1]) == repos[NEW]
        after = hub.stats()
        assert [after[k] - before[k] for k in ("cas_requests", "xet_token_requests")] == [0, 0]
        assert after["total"] == total_size(repos[NEW])  # every byte upstream once, through olah (git files cached)
    finally:
        olah.terminate()
        olah.wait(timeout=10)
