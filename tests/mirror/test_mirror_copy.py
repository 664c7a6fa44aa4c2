"""The image copy tool (templates/sparkfleet-copy-image.py) against two real local
registries (Debian's docker-registry): byte-exact, each blob read once, resumable."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.fleetdata import free_port

ROOT = Path(__file__).resolve().parents[2]
COPY_TOOL = ROOT / "templates" / "sparkfleet-copy-image.py"


@pytest.fixture
def registries(tmp_path):
    """Two empty docker-registry servers on localhost: (source URL, fleet URL)."""
    if not shutil.which("docker-registry"):
        pytest.fail("docker-registry is not installed: make deps (apt-get install docker-registry)")
    procs, urls = [], []
    for name in ("upstream", "fleet"):
        port = free_port()
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps({
            "version": 0.1, "log": {"level": "error", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(tmp_path / name)}},
            "http": {"addr": f"127.0.0.1:{port}"},
        }))
        log = open(tmp_path / f"{name}.log", "w")
        procs.append(subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
    yield urls[0], urls[1], tmp_path
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def _push(url: str, repo: str, tag: str, blobs: list[bytes]) -> str:
    from sparkfleet.testbed.registry import RegistryClient, manifest_bytes

    client = RegistryClient(url)
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    layers = []
    for blob in blobs:
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        client.push_blob(repo, blob, digest)
        layers.append((None, digest, len(blob)))
    client.push_blob(repo, config, "sha256:" + hashlib.sha256(config).hexdigest())
    return client.put_manifest(repo, tag, manifest_bytes(config, layers))


def _copy(src: str, repo: str, ref: str, dst: str, *extra: str) -> dict:
    done = subprocess.run([sys.executable, str(COPY_TOOL), src, repo, ref, dst, *extra],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/nonexistent"})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1].removeprefix("RESULT "))


def test_the_copy_keeps_the_digest_and_reads_each_blob_once(registries):
    upstream, fleet_url, _ = registries
    blobs = [os.urandom(3_000_000), os.urandom(1_000_000)]
    digest = _push(upstream, "org/img", "1.0", blobs)
    first = _copy(upstream, "org/img", digest, fleet_url, "--tag", "1.0")
    assert first["digest"] == digest
    assert sum(len(b) for b in blobs) <= first["upstream_bytes"] < sum(len(b) for b in blobs) + 1000  # + config
    from sparkfleet.testbed.registry import RegistryClient

    manifest, served = RegistryClient(fleet_url).get_manifest("org/img", "1.0")
    assert served == digest and len(manifest["layers"]) == 2
    again = _copy(upstream, "org/img", digest, fleet_url, "--tag", "1.0")
    assert again["upstream_bytes"] == 0 and again["present_bytes"] == first["upstream_bytes"]


def test_a_copy_interrupted_after_some_blobs_continues_with_the_rest(registries):
    upstream, fleet_url, _ = registries
    blobs = [os.urandom(2_000_000), os.urandom(2_000_000)]
    digest = _push(upstream, "org/img", "2", blobs)
    # The mirror registry already holds the first layer (as after a cut-off copy).
    from sparkfleet.testbed.registry import RegistryClient

    RegistryClient(fleet_url).push_blob("org/img", blobs[0], "sha256:" + hashlib.sha256(blobs[0]).hexdigest())
    result = _copy(upstream, "org/img", digest, fleet_url)
    assert result["present_bytes"] == len(blobs[0])
    assert len(blobs[1]) <= result["upstream_bytes"] < len(blobs[1]) + 1000


def test_a_wrong_pin_is_refused(registries):
    upstream, fleet_url, _ = registries
    _push(upstream, "org/img", "3", [os.urandom(1000)])
    done = subprocess.run([sys.executable, str(COPY_TOOL), upstream, "org/img", "sha256:" + "0" * 64, fleet_url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "404" in (done.stdout + done.stderr)
