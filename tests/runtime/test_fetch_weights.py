"""runtime/fetch_weights.py's repair of a corrupt blob, and its verdict after the new
download: only the files downloaded again are judged again, and the source is blamed
only for bytes it really served again."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import fetch_weights
from sparkfleet.testbed.hub import HubServer

FETCH = Path(__file__).resolve().parents[2] / "runtime" / "fetch_weights.py"
REPO, REV = "acme/two-shards", "2" * 40


def fetch(endpoint: str, hf_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "3", "HF_HUB_DOWNLOAD_TIMEOUT": "3"}
    env.pop("HF_TOKEN", None)
    return subprocess.run([sys.executable, str(FETCH), REPO, "--revision", "main"], env=env,
                          capture_output=True, text=True, timeout=120)


def blob_of(hf_home: Path, name: str) -> Path:
    return (hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REV / name).resolve()


def test_a_repair_is_not_blamed_on_a_blob_that_went_bad_on_disk(tmp_path):
    """One shard truncated (seen by its size), another bit-flipped at its recorded size
    (trusted until verify_weights): the truncated one comes back from a source that
    serves good bytes, and the run says repaired, not that the source serves bad ones."""
    root = tmp_path / "repos"
    (root / REPO / REV).mkdir(parents=True)
    for name in ("a.safetensors", "b.safetensors"):  # LFS files: blobs named by their sha256
        (root / REPO / REV / name).write_bytes(os.urandom(256 * 1024))
    (root / REPO / "refs.json").write_text(json.dumps({"main": REV}))
    hf_home = tmp_path / "hf"
    with HubServer(root, "127.0.0.1", 0) as hub:
        first = fetch(hub.url, hf_home)
        assert first.returncode == 0, first.stdout + first.stderr
        truncated, flipped = blob_of(hf_home, "a.safetensors"), blob_of(hf_home, "b.safetensors")
        os.truncate(truncated, 4096)
        with open(flipped, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 1]))
        done = fetch(hub.url, hf_home)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "report: corrupt: a.safetensors" in out and "report: repaired: a.safetensors" in out, out
    assert "source serves" not in out and "b.safetensors" not in out, out
    assert hashlib.sha256(truncated.read_bytes()).hexdigest() == truncated.name


class FakeHub:
    """snapshot_download over a cache laid out as huggingface_hub's: it (re)creates a
    file whose snapshot link is missing, with the bytes it is told to serve."""

    def __init__(self, hf_home: Path, files: dict[str, bytes]):
        self.repo = hf_home / "hub" / f"models--{REPO.replace('/', '--')}"
        self.files = files  # what the repo holds: each blob is named by its sha256
        self.serve: dict[str, bytes] = dict(files)  # what the source sends
        self.calls = 0

    def __call__(self, repo_id, revision, allow_patterns, max_workers):
        self.calls += 1
        snapshot = self.repo / "snapshots" / REV
        snapshot.mkdir(parents=True, exist_ok=True)
        (self.repo / "blobs").mkdir(exist_ok=True)
        for name, content in self.files.items():
            link = snapshot / name
            if link.exists() or name not in self.serve:
                continue
            blob = self.repo / "blobs" / hashlib.sha256(content).hexdigest()
            blob.write_bytes(self.serve[name])
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(blob, snapshot))
        return str(snapshot)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    import huggingface_hub

    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    hub = FakeHub(hf_home, {"a.safetensors": b"a" * 4096, "b.safetensors": b"b" * 4096})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    assert fetch_weights.main([REPO, "--revision", REV]) == 0  # cached and recorded
    return hub


def corrupt(hub: FakeHub, name: str) -> None:
    os.truncate((hub.repo / "snapshots" / REV / name).resolve(), 100)


def test_bytes_the_source_serves_again_wrong_are_its_own(fake_hub, capsys):
    corrupt(fake_hub, "a.safetensors")
    fake_hub.serve["a.safetensors"] = b"x" * 4096  # the mirror's cache holds other bytes
    assert fetch_weights.main([REPO, "--revision", REV]) == 1
    out = capsys.readouterr().out
    assert "still corrupt after a new download: a.safetensors — the source serves these bytes" in out


def test_a_file_not_downloaded_again_is_not_blamed_on_the_source(fake_hub, capsys):
    corrupt(fake_hub, "a.safetensors")
    del fake_hub.serve["a.safetensors"]  # the new download does not bring it back
    assert fetch_weights.main([REPO, "--revision", REV]) == 1
    out = capsys.readouterr().out
    assert "not downloaded again: a.safetensors" in out and "source serves" not in out

