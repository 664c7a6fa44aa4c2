"""The image registry at 10.213.0.1:5000 (Debian's `docker-registry`, distribution 2.8),
and a minimal registry-v2 client to push the simulated serving image without a docker
engine on the controller; upstream moves as registries see them: a tag re-pointed to a
new image (:func:`move_tag`), a manifest deleted (``RegistryClient.delete_manifest``).

The registry starts fresh on every `up` (storage under STATE_DIR is wiped with it); the
image's layers are cached, so the push is only a local upload.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from . import paths, services
from .proc import TestbedError, log
from .state import ServiceState

REGISTRY_DIR = paths.STATE_DIR / "registry"

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V1 = "application/vnd.docker.container.image.v1+json"
LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def write_config() -> Path:
    storage = REGISTRY_DIR / "data"
    storage.mkdir(parents=True, exist_ok=True)
    cfg = REGISTRY_DIR / "config.yml"
    # No auth: the testbed network is private to this machine. JSON is valid YAML.
    cfg.write_text(json.dumps({
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": paths.REGISTRY, "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }, indent=2) + "\n")
    return cfg


def start_server() -> ServiceState:
    if REGISTRY_DIR.exists():
        shutil.rmtree(REGISTRY_DIR)
    cfg = write_config()
    client = RegistryClient(f"http://{paths.REGISTRY}")
    return services.start(
        "registry", ["docker-registry", "serve", str(cfg)],
        url=f"http://{paths.REGISTRY}", marker=str(cfg), port=paths.REGISTRY_PORT,
        ready=client.ping,
    )


_ACCESS = re.compile(r'^(\S+) - \S+ \[[^\]]*\] "GET /v2/(\S+)/blobs/sha256:[0-9a-f]+ [^"]*" \d+ (\d+)')


def access_log_size() -> int:
    log_file = paths.LOG_DIR / "registry.log"
    return log_file.stat().st_size if log_file.exists() else 0


def blob_stats(since: int = 0) -> dict[str, Any]:
    """Blob bytes served (the access log's response sizes, cut-off transfers included as
    far as they got), from byte offset *since* of the registry's log."""
    stats: dict[str, Any] = {"total": 0, "by_repo": {}, "by_client": {}, "by_repo_client": {}}
    log_file = paths.LOG_DIR / "registry.log"
    if not log_file.exists():
        return stats
    with open(log_file, "rb") as f:
        f.seek(since)
        text = f.read().decode("utf-8", "replace")
    for line in text.splitlines():
        m = _ACCESS.match(line)
        if not m:
            continue
        client, repo, n = m.group(1), m.group(2), int(m.group(3))
        stats["total"] += n
        stats["by_repo"][repo] = stats["by_repo"].get(repo, 0) + n
        stats["by_client"][client] = stats["by_client"].get(client, 0) + n
        stats["by_repo_client"].setdefault(repo, {})
        stats["by_repo_client"][repo][client] = stats["by_repo_client"][repo].get(client, 0) + n
    return stats


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class RegistryClient:
    """Just enough of the distribution v2 API: monolithic blob upload and manifest PUT."""

    def __init__(self, base: str, timeout: float = 60):
        import requests

        self.base = base.rstrip("/")
        self.timeout = timeout
        self.http = requests.Session()
        self.http.trust_env = False  # never via a proxy: the registry is on our bridge

    def ping(self) -> bool:
        try:
            return self.http.get(f"{self.base}/v2/", timeout=2).status_code == 200
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def has_blob(self, repo: str, digest: str) -> bool:
        r = self.http.head(f"{self.base}/v2/{repo}/blobs/{digest}", timeout=self.timeout)
        return r.status_code == 200

    def push_blob(self, repo: str, data: bytes | Path, digest: str) -> None:
        if self.has_blob(repo, digest):
            return
        r = self.http.post(f"{self.base}/v2/{repo}/blobs/uploads/", timeout=self.timeout)
        if r.status_code != 202:
            raise TestbedError(f"registry: start upload for {repo}: HTTP {r.status_code} {r.text[:300]}")
        loc = r.headers["Location"]
        if loc.startswith("/"):
            loc = self.base + loc
        sep = "&" if "?" in loc else "?"
        if isinstance(data, Path):
            with open(data, "rb") as f:
                r = self.http.put(f"{loc}{sep}digest={digest}", data=f, timeout=max(self.timeout, 300),
                                  headers={"Content-Type": "application/octet-stream",
                                           "Content-Length": str(data.stat().st_size)})
        else:
            r = self.http.put(f"{loc}{sep}digest={digest}", data=data, timeout=self.timeout,
                              headers={"Content-Type": "application/octet-stream"})
        if r.status_code != 201:
            raise TestbedError(f"registry: upload {digest}: HTTP {r.status_code} {r.text[:300]}")

    def put_manifest(self, repo: str, tag: str, manifest: bytes) -> str:
        r = self.http.put(f"{self.base}/v2/{repo}/manifests/{tag}", data=manifest,
                          headers={"Content-Type": MANIFEST_V2}, timeout=self.timeout)
        if r.status_code != 201:
            raise TestbedError(f"registry: manifest {repo}:{tag}: HTTP {r.status_code} {r.text[:300]}")
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        served = r.headers.get("Docker-Content-Digest")
        if served and served != digest:
            raise TestbedError(f"registry answered digest {served}, expected {digest}")
        return digest

    def get_manifest(self, repo: str, ref: str) -> tuple[dict[str, Any], str]:
        r = self.http.get(f"{self.base}/v2/{repo}/manifests/{ref}", headers={"Accept": MANIFEST_V2},
                          timeout=self.timeout)
        r.raise_for_status()
        return r.json(), r.headers.get("Docker-Content-Digest", "")

    def get_blob(self, repo: str, digest: str) -> bytes:
        r = self.http.get(f"{self.base}/v2/{repo}/blobs/{digest}", timeout=self.timeout)
        r.raise_for_status()
        return r.content

    def delete_manifest(self, repo: str, digest: str) -> None:
        """The manifest ``digest`` is gone (and every tag that named it), as a registry's
        owner deletes one; its blobs stay until a garbage collection."""
        r = self.http.delete(f"{self.base}/v2/{repo}/manifests/{digest}", timeout=self.timeout)
        if r.status_code != 202:
            raise TestbedError(f"registry: delete {repo}@{digest}: HTTP {r.status_code} {r.text[:300]}")


#: The label a moved tag's new image carries (its count of moves): its only difference.
GENERATION_LABEL = "org.sparkfleet.testbed.generation"


def move_tag(client: RegistryClient, repo: str, tag: str) -> str:
    """Upstream re-points ``tag`` to a new image: the same layers, a config with
    :data:`GENERATION_LABEL` counting the moves (so a new manifest digest, and a pull of it
    moves only the config). Returns its digest."""
    manifest, _ = client.get_manifest(repo, tag)
    config = json.loads(client.get_blob(repo, manifest["config"]["digest"]))
    inner = config.setdefault("config", {})
    labels = inner.get("Labels") or {}
    labels[GENERATION_LABEL] = str(int(labels.get(GENERATION_LABEL, "1")) + 1)
    inner["Labels"] = labels
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    client.push_blob(repo, blob, digest)
    manifest["config"] = {**manifest["config"], "digest": digest, "size": len(blob)}
    moved = client.put_manifest(repo, tag, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    log(f"moved {repo}:{tag} to {moved}")
    return moved


def push_image(client: RegistryClient, repo: str, tag: str, config: bytes,
               layers: list[tuple[Path, str, int]]) -> str:
    """Push config + layers (path, digest, size) and the schema-2 manifest; its digest."""
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    for path, digest, _size in layers:
        client.push_blob(repo, path, digest)
    client.push_blob(repo, config, config_digest)
    manifest = manifest_bytes(config, layers)
    digest = client.put_manifest(repo, tag, manifest)
    log(f"pushed {paths.REGISTRY}/{repo}:{tag}@{digest}")
    return digest


def manifest_bytes(config: bytes, layers: list[tuple[Path, str, int]]) -> bytes:
    """The schema-2 manifest, serialised canonically (sorted keys, no spaces) so that the
    same content always has the same digest."""
    doc = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_V2,
        "config": {"mediaType": CONFIG_V1, "size": len(config),
                   "digest": "sha256:" + hashlib.sha256(config).hexdigest()},
        "layers": [{"mediaType": LAYER_GZIP, "size": size, "digest": digest}
                   for _p, digest, size in layers],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
