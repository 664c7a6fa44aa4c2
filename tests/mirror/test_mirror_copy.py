"""The mirror's image copy (``skopeo copy``, as sparkfleet.mirror.registry builds it)
between two real local registries (Debian's docker-registry, the mirror one over TLS):
byte-exact, each blob read from upstream once, resumable."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time

import pytest
from support.fleetdata import free_port
from support.listening import wait_for_port

from sparkfleet import credentials
from sparkfleet.imagename import ImageName
from sparkfleet.mirror.registry import copy_command, copy_failure
from sparkfleet.mirrors import Mirror

BLOB_GET = re.compile(r'"GET /v2/\S+/blobs/(sha256:[0-9a-f]+) [^"]*" 200 (\d+)')


@pytest.fixture
def registries(tmp_path):
    """Two empty docker-registry servers on localhost: upstream (HTTP) and the mirror's
    (TLS, with the certificate sparkfleet makes for a mirror): (upstream URL, mirror
    registry host:port, its CA directory, upstream log)."""
    missing = [tool for tool in ("docker-registry", "skopeo") if not shutil.which(tool)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: apt-get install {' '.join(missing)}", pytrace=False)
    procs, ports = [], []
    for name in ("upstream", "mirror"):
        port = free_port()
        http: dict = {"addr": f"127.0.0.1:{port}"}
        if name == "mirror":
            cert, key = credentials.mirror_tls(str(tmp_path / "tls"), Mirror("m", "127.0.0.1", 1, port, True))
            http["tls"] = {"certificate": str(cert), "key": str(key)}
            (tmp_path / "certs.d").mkdir()
            shutil.copy(cert, tmp_path / "certs.d" / "ca.crt")
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps({
            "version": 0.1, "log": {"level": "error", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(tmp_path / name)}}, "http": http,
        }))
        log = open(tmp_path / f"{name}.log", "w")
        procs.append(subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT))
        ports.append(port)
        wait_for_port(port)
    yield f"http://127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", str(tmp_path / "certs.d"), tmp_path / "upstream.log"
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


def _copy(upstream: str, image: str, mirror: str, cert_dir: str, log) -> dict[str, list[int]]:
    """Run the copy; the bytes of each blob GET it made upstream, by digest."""
    mark = log.stat().st_size
    command = copy_command(upstream, ImageName.parse(image), mirror, cert_dir)
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": "/nonexistent"})
    assert done.returncode == 0, done.stdout + done.stderr
    time.sleep(0.2)  # the access log's last lines
    reads: dict[str, list[int]] = {}
    with open(log, "rb") as f:
        f.seek(mark)
        for digest, size in BLOB_GET.findall(f.read().decode()):
            reads.setdefault(digest, []).append(int(size))
    return reads


def _mirror_manifest(mirror: str, cert_dir: str, ref: str) -> tuple[dict, str]:
    from sparkfleet.testbed.registry import RegistryClient

    client = RegistryClient(f"https://{mirror}")
    client.http.verify = f"{cert_dir}/ca.crt"
    return client.get_manifest("org/img", ref)


def test_the_copy_keeps_the_digest_and_reads_each_blob_once(registries):
    upstream, mirror, cert_dir, log = registries
    blobs = [os.urandom(3_000_000), os.urandom(1_000_000)]
    digest = _push(upstream, "org/img", "1.0", blobs)
    layers = ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]
    first = _copy(upstream, f"registry.example/org/img:1.0@{digest}", mirror, cert_dir, log)
    assert all(first[d] == [len(b)] for d, b in zip(layers, blobs)), first
    assert sum(len(b) for b in blobs) <= sum(map(sum, first.values())) < sum(len(b) for b in blobs) + 1000  # + config
    manifest, served = _mirror_manifest(mirror, cert_dir, "1.0")
    assert served == digest and len(manifest["layers"]) == 2
    assert _mirror_manifest(mirror, cert_dir, digest)[1] == digest
    # Run again: no layer is read; only the image's config (under a kilobyte) is.
    again = _copy(upstream, f"registry.example/org/img:1.0@{digest}", mirror, cert_dir, log)
    assert not any(d in again for d in layers) and sum(map(sum, again.values())) < 1000


def test_a_copy_interrupted_after_some_blobs_continues_with_the_rest(registries):
    upstream, mirror, cert_dir, log = registries
    blobs = [os.urandom(2_000_000), os.urandom(2_000_000)]
    digest = _push(upstream, "org/img", "2", blobs)
    # The mirror registry already holds the first layer (as after a cut-off copy).
    from sparkfleet.testbed.registry import RegistryClient

    client = RegistryClient(f"https://{mirror}")
    client.http.verify = f"{cert_dir}/ca.crt"
    first, second = ("sha256:" + hashlib.sha256(b).hexdigest() for b in blobs)
    client.push_blob("org/img", blobs[0], first)
    reads = _copy(upstream, f"registry.example/org/img@{digest}", mirror, cert_dir, log)
    assert first not in reads and reads[second] == [len(blobs[1])]
    assert _mirror_manifest(mirror, cert_dir, digest)[1] == digest


def test_a_wrong_pin_is_refused(registries):
    upstream, mirror, cert_dir, _ = registries
    _push(upstream, "org/img", "3", [os.urandom(1000)])
    command = copy_command(upstream, ImageName.parse("registry.example/org/img@sha256:" + "0" * 64), mirror, cert_dir)
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "manifest unknown" in (done.stdout + done.stderr)


def test_a_tag_missing_upstream_is_named_with_its_fix(registries):
    upstream, mirror, cert_dir, _ = registries
    image = "registry.example/org/img:missing"
    done = subprocess.run(["sh", "-c", copy_command(upstream, ImageName.parse(image), mirror, cert_dir)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    what = copy_failure((done.stdout + done.stderr).splitlines()[-20:], image, upstream)
    assert what == f"{upstream} has no image {image} — fix `image` (its tag or digest)"


def test_an_index_is_copied_whole_with_its_digest(registries):
    import requests

    upstream, mirror, cert_dir, log = registries
    blobs = [os.urandom(500_000)]
    child = _push(upstream, "org/img", "4-arm64", blobs)
    body = requests.get(f"{upstream}/v2/org/img/manifests/{child}",
                        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}).content
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.list.v2+json",
                        "manifests": [{"mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                                       "digest": child, "size": len(body),
                                       "platform": {"architecture": "arm64", "os": "linux"}}]}).encode()
    put = requests.put(f"{upstream}/v2/org/img/manifests/4", data=index,
                       headers={"Content-Type": "application/vnd.docker.distribution.manifest.list.v2+json"})
    assert put.status_code == 201, put.text
    digest = "sha256:" + hashlib.sha256(index).hexdigest()
    reads = _copy(upstream, f"registry.example/org/img:4@{digest}", mirror, cert_dir, log)
    assert reads["sha256:" + hashlib.sha256(blobs[0]).hexdigest()] == [len(blobs[0])]  # an arm64 child, on any host
    from sparkfleet.testbed.registry import RegistryClient

    client = RegistryClient(f"https://{mirror}")
    client.http.verify = f"{cert_dir}/ca.crt"
    served = client.http.head(f"https://{mirror}/v2/org/img/manifests/4", headers={
        "Accept": "application/vnd.docker.distribution.manifest.list.v2+json"}).headers["Docker-Content-Digest"]
    assert served == digest
    assert _mirror_manifest(mirror, cert_dir, child)[1] == child
