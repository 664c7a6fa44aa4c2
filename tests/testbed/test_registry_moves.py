"""The testbed registry moves under the fleet as registries do: a tag re-pointed to a new
image, a manifest deleted; and the fleet lock's controller reads a tag's digest and size
from it (a real Debian docker-registry on localhost, no fleet)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest
from support.fleetdata import free_port
from support.listening import wait_for_port

from sparkfleet.testbed.registry import GENERATION_LABEL, RegistryClient, manifest_bytes, move_tag
from sparkfleet.upstream import Unresolved, Upstream


@pytest.fixture
def registry(tmp_path):
    """An empty docker-registry that allows deletes, as the testbed's: its URL."""
    if not shutil.which("docker-registry"):
        pytest.fail("docker-registry missing: apt-get install docker-registry", pytrace=False)
    port = free_port()
    config = tmp_path / "registry.json"
    config.write_text(json.dumps({
        "version": 0.1, "log": {"level": "error"}, "http": {"addr": f"127.0.0.1:{port}"},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "data")}, "delete": {"enabled": True}},
    }))
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_port(port)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


def push(url: str, repo: str, tag: str, layer: bytes) -> str:
    client = RegistryClient(url)
    config = json.dumps({"architecture": "arm64", "os": "linux", "config": {"Labels": None},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    client.push_blob(repo, layer, digest)
    client.push_blob(repo, config, "sha256:" + hashlib.sha256(config).hexdigest())
    return client.put_manifest(repo, tag, manifest_bytes(config, [(None, digest, len(layer))]))


def test_a_tag_moves_to_a_new_image_and_a_deleted_manifest_is_gone(registry):
    repo, reference = "acme/serve", registry.removeprefix("http://") + "/acme/serve:1.0"
    first = push(registry, repo, "1.0", b"layer" * 1000)
    upstream = Upstream(timeout=10)
    digest, size = upstream.image(registry, reference)
    assert digest == first and size > 5000

    moved = move_tag(RegistryClient(registry), repo, "1.0")
    assert moved != first
    assert upstream.image(registry, reference)[0] == moved
    manifest, _ = RegistryClient(registry).get_manifest(repo, moved)
    config = json.loads(RegistryClient(registry).get_blob(repo, manifest["config"]["digest"]))
    assert config["config"]["Labels"] == {GENERATION_LABEL: "2"}
    assert manifest["layers"] == RegistryClient(registry).get_manifest(repo, first)[0]["layers"]  # same layers
    assert move_tag(RegistryClient(registry), repo, "1.0") not in (first, moved)

    # The old image stays readable by its digest until its owner deletes it.
    assert upstream.image(registry, f"{reference}@{first}")[0] == first
    RegistryClient(registry).delete_manifest(repo, first)
    with pytest.raises(Unresolved, match="has no image acme/serve") as err:
        upstream.image(registry, f"{reference}@{first}")
    assert "image" in err.value.fix
