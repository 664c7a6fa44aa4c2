"""The serving image: pulled when absent, pinnable by digest, nothing done when present.

With a mirror (``fleet_mirror``) every host pulls the mirror registry's byte-exact copy
of ``image`` (same digest) and runs that reference; without, ``image`` itself. A pull is
checked: the host must end with the fleet's digest, or it fails saying which. One-shot
runs of the image (downloads, builds) are made by :func:`one_shot`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from pyinfra import host
from pyinfra.api import FactBase, FunctionCommand, operation
from pyinfra.api.exceptions import OperationError

from sparkfleet import mirror, remote
from sparkfleet.config import Settings, host_mirror
from sparkfleet.facts import MANIFEST_ACCEPT
from sparkfleet.hostpaths import HF_ENV, RUNTIME_DIR, registry_ca_path
from sparkfleet.mirror import ImageName, image_reference
from sparkfleet.mirror.names import upstream_registry_url
from sparkfleet.tasks import detached


class Image(FactBase["dict | None"]):
    """The local image ``reference`` resolves to: id and repo digests, or None."""

    def command(self, reference: str) -> str:
        return (
            f"docker image inspect --format '{{{{json .Id}}}} {{{{json .RepoDigests}}}}' "
            f"{shlex.quote(reference)} 2>/dev/null || true"
        )

    def process(self, output):
        if not output or not output[0].startswith('"'):
            return None
        image_id, digests = output[0].split(" ", 1)
        return {"id": json.loads(image_id), "repo_digests": json.loads(digests) or []}


def pinned_digest(reference: str) -> str | None:
    return reference.split("@", 1)[1] if "@" in reference else None


def _present(ref: str) -> bool:
    image = host.get_fact(Image, reference=ref)
    if image is None:
        return False
    digest = pinned_digest(ref)
    return digest is None or any(d.endswith("@" + digest) for d in image["repo_digests"])


def is_present(reference: str) -> bool:
    """Whether ``reference`` (or, with a mirror, its copy in the mirror registry) is here."""
    if _present(reference):
        return True
    used = host_mirror()
    return bool(used) and _present(ImageName.parse(reference).at(used.registry))


#: Reads the image's manifest from its registry on the host (stdlib only; anonymous or
#: bearer-token auth as registries answer): prints the compressed bytes of its layers
#: and config, for arm64 when the reference is a multi-platform index.
_MANIFEST_SIZE_PY = r"""
import json, re, sys, urllib.error, urllib.parse, urllib.request
base, repo, ref, accept = sys.argv[1:5]
token = None
def get(ref):
    global token
    while True:
        headers = {"Accept": accept, **({"Authorization": "Bearer " + token} if token else {})}
        req = urllib.request.Request(f"{base}/v2/{repo}/manifests/{ref}", headers=headers)
        try:
            return json.load(urllib.request.urlopen(req, timeout=20))
        except urllib.error.HTTPError as err:
            challenge = err.headers.get("WWW-Authenticate", "")
            if err.code != 401 or token is not None or not challenge.lower().startswith("bearer "):
                raise
            params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
            realm = params.pop("realm")
            doc = json.load(urllib.request.urlopen(realm + "?" + urllib.parse.urlencode(params), timeout=20))
            token = doc.get("token") or doc.get("access_token") or ""
doc = get(ref)
if "manifests" in doc:
    children = doc["manifests"]
    arm = [m for m in children if m.get("platform", {}).get("architecture") == "arm64"]
    doc = get((arm or children)[0]["digest"])
print("compressed", doc["config"]["size"] + sum(layer["size"] for layer in doc["layers"]))
"""


class ImageStore(FactBase["dict | None"]):
    """Where docker keeps images: ``{"containerd": bool, "path": dir}``, or None when docker
    does not answer. Docker's containerd image store (``driver-type
    io.containerd.snapshotter.v1``, Docker 29's default) keeps the compressed blobs and
    the unpacked snapshots under containerd's root, not ``DockerRootDir``."""

    def command(self) -> str:
        return (
            "docker info --format '{{.DockerRootDir}} {{json .DriverStatus}}' 2>/dev/null || true; "
            "containerd config dump 2>/dev/null | grep '^root = ' | tr -d \"'\\\"\" | sed 's/^root = /containerd_root /' || true"
        )

    def process(self, output):
        if not output or not output[0].startswith("/"):
            return None
        root, _, status = output[0].partition(" ")
        containerd_root = next((line.split(" ", 1)[1] for line in output[1:] if line.startswith("containerd_root ")),
                               "/var/lib/containerd")
        containerd = "io.containerd.snapshotter" in status
        return {"containerd": containerd, "path": containerd_root if containerd else root}


class ManifestSize(FactBase["int | None"]):
    """Compressed bytes of ``path:reference`` in the registry at ``url`` (None if unread)."""

    def command(self, url: str, path: str, reference: str) -> str:
        q = shlex.quote
        return (
            f"timeout 60 python3 -c {q(_MANIFEST_SIZE_PY)} {q(url)} {q(path)} {q(reference)} "
            f"{q(MANIFEST_ACCEPT)} 2>/dev/null || true"
        )

    def process(self, output):
        for line in output:
            key, _, value = line.partition(" ")
            if key == "compressed" and value.strip().isdigit():
                return int(value)
        return None


@dataclass(frozen=True)
class ImageSizes:
    compressed_gib: float  # what the registry sends, and a registry copy holds
    unpacked_gib: float  # the layers unpacked on disk
    source: str  # where the numbers come from


def sizes(settings: Settings) -> ImageSizes:
    """The image's sizes: from its manifest in the registry (compressed, exact; unpacked,
    ``image_unpack_ratio`` times that), else ``image_size_gib`` as the unpacked size."""
    name = ImageName.parse(settings.image)
    url = upstream_registry_url(settings.image, settings.image_registry_url)
    compressed = host.get_fact(ManifestSize, url=url, path=name.path, reference=name.digest or name.tag)
    if compressed:
        gib = compressed / 1024**3
        return ImageSizes(gib, gib * settings.image_unpack_ratio, f"its manifest in {url}")
    unpacked = settings.image_size_gib
    return ImageSizes(unpacked / settings.image_unpack_ratio, unpacked,
                      f"image_size_gib (the manifest in {url} could not be read from this host)")


def disk_needs(settings: Settings) -> dict[str, float]:
    """What the image still needs on this host: {the directory that holds docker's images:
    GiB}. The classic store keeps the unpacked layers under DockerRootDir (each compressed
    layer is deleted once unpacked); the containerd store keeps both under containerd's
    root. Nothing when the image is there or docker does not answer (the preflight says so)."""
    store = host.get_fact(ImageStore)
    if store is None or is_present(settings.image):
        return {}
    size = sizes(settings)
    return {store["path"]: size.unpacked_gib + (size.compressed_gib if store["containerd"] else 0.0)}


def one_shot(settings: Settings, name: str, args: str, extra_mounts: str = "") -> str:
    """A one-shot run of the serving image's Python with the HF cache and runtime mounted.

    Downloads go to the mirror's HF endpoint when there is a mirror (fleet_mirror), else
    to ``hf_endpoint``; the image is the reference the host pulled (never a new pull).
    """
    q = shlex.quote
    endpoint_url = mirror.hf_endpoint(settings)
    endpoint = f"-e HF_ENDPOINT={q(endpoint_url)} " if endpoint_url else ""
    return (
        f"docker rm -f {name} >/dev/null 2>&1; "
        f"docker run --rm --pull never --name {name} --network host --env-file {HF_ENV} "
        f"-e HF_HOME=/hf -e HF_HUB_DISABLE_TELEMETRY=1 {endpoint}"
        "-e HF_HUB_DISABLE_XET=1 "  # else hf_xet fetches from the Xet CAS, past HF_ENDPOINT and the mirror
        f"-v {q(settings.hf_home)}:/hf -v {RUNTIME_DIR}:/host:ro {extra_mounts}"
        f"--entrypoint python3 {q(image_reference(settings))} {args}"
    )


def _verify(state, host, ref: str, expected: str | None, mirror_ref: str | None) -> bool:  # state, host: pyinfra's
    """After a pull: the host must hold the fleet's digest (the pin, or the mirror registry's)."""
    q = shlex.quote
    inspected = remote.run(host, f"docker image inspect --format '{{{{json .RepoDigests}}}}' {q(ref)}")
    try:
        digests = json.loads("\n".join(inspected.stdout) or "[]") or []
    except ValueError:
        digests = []
    if expected is None and mirror_ref:
        name = ImageName.parse(mirror_ref)
        registry = name.registry
        manifest = remote.run(
            host,
            f"curl -sfI -m 10 --cacert {q(registry_ca_path(registry))} "
            f"-H {q('Accept: ' + MANIFEST_ACCEPT)} "
            f"{q(f'https://{registry}/v2/{name.path}/manifests/{name.tag}')} | tr -d '\\r' "
            "| sed -n 's/^[Dd]ocker-[Cc]ontent-[Dd]igest: *//p'",
        )
        expected = (manifest.stdout or [""])[0].strip() or None
    if expected and not any(d.endswith("@" + expected) for d in digests):
        raise OperationError(
            f"{ref} on this host has digest {', '.join(d.split('@')[-1] for d in digests) or 'none'}, "
            f"the fleet's image is {expected}: the tag moved while the fleet pulled it; pin "
            "`image` to name@sha256:... so that every host runs the same image"
        )
    return True


@operation()
def pulled(settings: Settings):
    """
    Pull the serving image unless this exact reference is already on the host.

    + settings: validated settings (``image``; pin it as ``name@sha256:...`` for a fleet)

    A tag that moved upstream is not re-pulled: pin a digest to change what runs. With a
    mirror the pull comes from its registry, and a host left with another digest than the
    fleet's fails with both digests named.
    """
    used = host_mirror()
    ref = image_reference(settings, used)
    if _present(ref):
        host.noop(f"image {ref} is present")
        return
    if used:
        yield mirror.answers(used, "registry")
    yield detached("image-pull", f"docker pull {shlex.quote(ref)}")
    yield FunctionCommand(_verify, (ref, pinned_digest(ref), ref if used and not pinned_digest(ref) else None), {})
