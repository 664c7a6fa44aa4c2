"""The serving image: pulled by the digest sparkfleet.lock names when absent, nothing done when present.

With a mirror (``fleet_mirror``) every host pulls the mirror registry's byte-exact copy
of ``image`` (same digest); without, ``image`` itself. A pull is checked: the host must
end with the fleet's digest, or it fails saying which. The host then names the image
locally (:func:`sparkfleet.mirror.names.local_image`) and runs it only by that name, so
where it was pulled from is not part of what runs. A host whose image by that name, or by
the tag, is other bytes (pulled by hand) says so and pulls the locked ones. One-shot runs
of the image (downloads, builds) are made by :func:`one_shot`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.docker import DockerImage, DockerSystemInfo

from sparkfleet import mirror, remote, snapshot
from sparkfleet.config import Settings
from sparkfleet.facts import MANIFEST_ACCEPT, ContainerdRoot, DockerAnswers, ManifestSize
from sparkfleet.fleet import host_mirror
from sparkfleet.hostpaths import HF_ENV, RUNTIME_DIR, registry_ca_path
from sparkfleet.imagename import ImageName, upstream_registry_url
from sparkfleet.mirror import image_reference, local_image
from sparkfleet.tasks import detached


def pinned_digest(reference: str) -> str | None:
    return reference.split("@", 1)[1] if "@" in reference else None


def reads(settings: Settings) -> list[tuple]:
    """The facts this step reads while the deploy plans (read in the preflight's batch): a
    host that holds the image asks nothing else (each is a docker command on the host)."""
    return [(DockerImage, {"object_id": local_image(settings)}), (DockerAnswers, {})]


def _digests(ref: str) -> list[str] | None:
    """The digests of the image ``ref`` names here (None: no such image)."""
    images = snapshot.fact(DockerImage, object_id=ref) or []
    return [d.split("@", 1)[1] for d in images[0].get("RepoDigests") or [] if "@" in d] if images else None


def _holds(ref: str, digest: str | None) -> bool:
    """Whether ``ref`` names an image here, and one of ``digest`` (when given)."""
    digests = _digests(ref)
    return digests is not None and (digest is None or digest in digests)


def _present(ref: str) -> bool:
    return _holds(ref, pinned_digest(ref))


def other_bytes(reference: str, local: str) -> dict[str, list[str]]:
    """The names of the image here (the local one, the tag) that are not the digest
    ``reference`` pins: {name: its digests}."""
    digest = pinned_digest(reference)
    if digest is None:
        return {}
    found = {}
    for name in (local, reference.partition("@")[0]):
        digests = _digests(name)
        if digests is not None and digest not in digests:
            found[name] = digests
    return found


def is_present(reference: str) -> bool:
    """Whether ``reference`` (or, with a mirror, its copy in the mirror registry) is here."""
    if _present(reference):
        return True
    used = host_mirror()
    return bool(used) and _present(ImageName.parse(reference).at(used.registry))


def image_store() -> dict | None:
    """Where docker keeps images here (:func:`store_of` this host's ``docker info``)."""
    return store_of(snapshot.fact(DockerSystemInfo, _ignore_errors=True) or {}, lambda: host.get_fact(ContainerdRoot))


def store_of(info: dict, containerd_root) -> dict | None:
    """Where docker keeps images: ``{"containerd": bool, "path": dir}``, or None when docker
    does not answer. Docker's containerd image store (``driver-type
    io.containerd.snapshotter.v1``, Docker 29's default) keeps the compressed blobs and
    the unpacked snapshots under containerd's root (``containerd_root()``), not
    ``DockerRootDir``."""
    root = info.get("DockerRootDir")
    if not root:
        return None
    status = info.get("DriverStatus") or []
    if any("io.containerd.snapshotter" in str(value) for pair in status for value in pair):
        return {"containerd": True, "path": containerd_root()}
    return {"containerd": False, "path": root}


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
    if _holds(local_image(settings), pinned_digest(settings.image)) or is_present(settings.image):
        return {}
    store = image_store()  # docker info: only for an image still to come
    if store is None:
        return {}
    size = sizes(settings)
    return {store["path"]: size.unpacked_gib + (size.compressed_gib if store["containerd"] else 0.0)}


#: huggingface_hub's read timeout (HF_HUB_DOWNLOAD_TIMEOUT, 10 s by default) for downloads
#: through an HF endpoint. A pull-through mirror answers a cold file's first clients late:
#: olah 0.5.4 holds the headers up to 5 s, and a client that joins a block another one is
#: fetching gets no byte until that whole 64 MiB block is in (olah waits up to 120 s for
#: it). 10 s cuts that wait short: the client asks for the file again (a second GET from
#: the mirror), and after 5 retries without a byte its download fails.
MIRROR_READ_TIMEOUT_S = 120


def one_shot(image: str, hf_home: str, hf_endpoint: str | None, name: str, args: str, extra_mounts: str = "") -> str:
    """A one-shot run of the serving image's Python (container ``name``) with the HF cache
    at /hf and the runtime at /host, for downloads and builds.

    + image: the reference the host pulled (never a new pull)
    + hf_endpoint: the mirror's HF endpoint, ``hf_endpoint``, or None for the hub (which
      keeps huggingface_hub's own read timeout; an endpoint gets MIRROR_READ_TIMEOUT_S)
    """
    q = shlex.quote
    endpoint = (f"-e HF_ENDPOINT={q(hf_endpoint)} -e HF_HUB_DOWNLOAD_TIMEOUT={MIRROR_READ_TIMEOUT_S} "
                if hf_endpoint else "")
    return (
        f"docker rm -f {name} >/dev/null 2>&1; "
        f"docker run --rm --pull never --name {name} --network host --env-file {HF_ENV} "
        f"-e HF_HOME=/hf -e HF_HUB_DISABLE_TELEMETRY=1 {endpoint}"
        "-e HF_HUB_DISABLE_XET=1 "  # else hf_xet fetches from the Xet CAS, past HF_ENDPOINT and the mirror
        f"-v {q(hf_home)}:/hf -v {RUNTIME_DIR}:/host:ro {extra_mounts}"
        f"--entrypoint python3 {q(image)} {args}"
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


def pull_failure(tail: list[str], reference: str, used, target_host) -> str | None:
    """What a failed ``docker pull`` means and what to do ("what — fix"), from its output."""
    text = "\n".join(tail).lower()
    if used and not used.is_self and any(h.name == used.host for h in target_host.state.failed_hosts):
        return (f"the mirror {used.host} failed before it held the image (its error is above) — fix that "
                "host, or deploy with --data fleet_mirror=none")
    if "no space left on device" in text:
        return "the disk of docker's data root is full — free space there (the preflight lists the need)"
    if "manifest unknown" in text or "not found" in text:
        where = f"the mirror registry {used.registry}" if used else "its registry"
        return f"{where} has no image {reference} — fix `image` (its tag or digest)"
    if "unauthorized" in text or "denied" in text:
        return f"the registry refused the pull of {reference} — log docker in on the host, or fix `image`"
    if any(word in text for word in ("timeout", "connection refused", "no such host", "network is unreachable",
                                     "i/o timeout", "tls handshake")):
        return "the host cannot reach the registry — check its network and proxy (with the mirror: that it runs)"
    return None


@operation()
def pulled(reference: str, local: str, fallbacks: list[str] | None = None):
    """
    Pull the serving image unless the host has it, and name it ``local``.

    + reference: what to pull (the mirror registry's copy of ``image``, or ``image``;
      pin it as ``name@sha256:...`` for a fleet)
    + local: the name the host runs it by (``local_image``)
    + fallbacks: where else the same bytes are, tried in turn when ``reference`` fails (a
      relay that died mid-pull: the mirrors above it)

    A tag that moved upstream is not re-pulled: sparkfleet.lock pins its digest, and
    moving it (``--data fleet_lock_update=image``) changes what runs. With a mirror the pull
    comes from its registry, and a host left with another digest than the fleet's fails
    with both digests named.
    """
    used = host_mirror()
    digest = pinned_digest(reference)
    if _holds(local, digest):
        host.noop(f"image {local} is present")
        return
    for name, digests in other_bytes(reference, local).items():
        logger.warning(f"    [{host.name}] holds {name} as {', '.join(d[:19] for d in digests) or 'no digest'}, "
                       f"not the {digest[:19]} sparkfleet.lock names: pulling that")
    q = shlex.quote
    if _present(reference):
        yield f"docker tag {q(reference)} {q(local)}"
        return
    if used:
        yield mirror.answers(used, "registry")
    sources = [reference, *(fallbacks or [])]
    pull = " || ".join(f"{{ {'' if i == 0 else f'echo report: pulling from {q(ref)} instead && '}"
                       f"docker pull {q(ref)}; }}" for i, ref in enumerate(sources))
    yield detached("image-pull", pull, diagnose=lambda tail: pull_failure(tail, reference, used, host))
    # Named from whichever source the bytes came, then checked under that name.
    yield StringCommand("sh", "-c", q(" ".join(
        f"docker image inspect {q(ref)} >/dev/null 2>&1 && exec docker tag {q(ref)} {q(local)};" for ref in sources)
        + " exit 1"))
    check_tag = reference if used and not pinned_digest(reference) else None
    yield remote.callback(_verify, local, pinned_digest(reference), check_tag)


@deploy("Serving image")
def present(settings: Settings):
    """The serving image on this host. Returns the pull operation (for the download report)."""
    used = host_mirror()
    fallbacks = [image_reference(settings, above) for above in used.fallbacks] if used else []
    return pulled(name="serving image present", reference=image_reference(settings), local=local_image(settings),
                  fallbacks=fallbacks)
