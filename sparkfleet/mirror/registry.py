"""The mirror registry: Debian/Ubuntu ``docker-registry`` over TLS, holding a byte-exact
copy of the serving image made by ``skopeo copy`` (Debian/Ubuntu ``skopeo``).

Why a copy and not a pull-through cache: measured on the testbed, docker-registry 2.8's
proxy reads every cold blob from upstream twice (once to store it, once to serve it) and
once more per concurrent client (2.0x and 3.9x the image). A ``docker save``/``load``
fan-out sends the uncompressed layers (3.2x the bytes here) and loses the digest.

Why skopeo: measured on the testbed (benchmarks/bench_image_copy.py), ``skopeo copy --all
--preserve-digests`` keeps the manifest's digest (an index too, children included), reads
each blob from upstream once, skips the blobs the mirror already holds (a cut-off copy
goes on with the blobs it did not finish) and re-reads only the image's config (under a
kilobyte) when run again.
"""

from __future__ import annotations

import posixpath
import shlex
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.api import operation

from sparkfleet import apt, remote, snapshot
from sparkfleet.hostpaths import (
    DOCKER_AUTH,
    REGISTRY_CERT,
    mirror_registry_storage,
    registry_ca_path,
)
from sparkfleet.imagename import ImageName
from sparkfleet.mirror.facts import RegistryManifest
from sparkfleet.mirror.report import report_of
from sparkfleet.mirrors import Mirror
from sparkfleet.perrun import once
from sparkfleet.tasks import detached, started


def installed(apt_repo: str | None, apt_key_url: str | None, **op_args):
    """
    An operation: ``docker-registry`` (the CNCF registry, "distribution") and ``skopeo``
    (the image copy) installed when one is missing.

    + apt_repo, apt_key_url: a repository to take it from and its signing key
      (``apt_repo``/``apt_key_url``); None: the host's own archives,
      Ubuntu universe / Debian main
    """
    # Our config.yml replaces the package's; keep it on upgrades.
    return apt.installed(packages=["docker-registry", "skopeo"], apt_repo=apt_repo, apt_key_url=apt_key_url,
                         keep_config=True, no_recommends=True, **op_args)


def copy_failure(tail: list[str], image: str, upstream: str) -> str | None:
    """What a failed copy into the mirror means and what to do, from skopeo's output."""
    text = "\n".join(tail).lower()
    if "manifest unknown" in text or "not found" in text:
        return f"{upstream} has no image {image} — fix `image` (its tag or digest)"
    if "no space left on device" in text:
        return "the disk of mirror_dir is full — free space there, or set mirror_dir to a larger disk"
    if "unauthorized" in text or "denied" in text:
        return f"{upstream} refused the copy of {image} — fix `image`, or set image_registry_url"
    if any(word in text for word in ("timeout", "connection refused", "no such host", "network is unreachable")):
        return f"the mirror cannot reach {upstream} — check its network and proxy"
    return None


def held(image: str, mirror: Mirror) -> dict:
    """The :class:`RegistryManifest` question whether ``mirror``'s registry holds ``image``."""
    name = ImageName.parse(image)
    return {"url": f"https://{mirror.registry}", "path": name.path, "reference": name.digest or name.tag,
            "cacert": REGISTRY_CERT}


@operation()
def copy_started(image: str, sources: list[str], result_dir: str, mirror: Mirror):
    """
    Start the fleet mirror's copy of the serving image from upstream, and go on.

    + image / sources / result_dir / mirror: as :func:`image_copied`, turn 0, which waits
      for it and reads its result

    The copy is bound by the WAN (~21 GB on a real fleet's 1 Gb/s, minutes); the hosts'
    steps that move no bytes run while it goes instead of after it.
    """
    if _held(image, mirror):
        return
    _started_this_run().add(host.name)
    yield started("image-copy", _copy_task(image, sources, result_dir, mirror))


@operation()
def image_copied(image: str, sources: list[str], result_dir: str, mirror: Mirror, turn: int = 0):
    """
    Copy the serving image, byte for byte, into the mirror registry unless it holds it.

    + image: the serving image's reference (``image``)
    + sources: the URLs of the registries to copy it from, each tried in turn (upstream;
      a relay: the mirrors above it, the nearest first)
    + result_dir: where the copy tool leaves its count of bytes (``mirror_dir``)
    + mirror: this host, the mirror or a relay
    + turn: the relays' turn this operation is: a mirror copies in the turn of its depth,
      once the ones above it hold the image, and waits in the others
    """
    if turn != mirror.depth:
        host.noop(f"copies in turn {mirror.depth}, not {turn}")
        return
    # A copy :func:`copy_started` began is waited on (the same task), also when it ended
    # before this operation asks: its result is read and its unit cleared here.
    if host.name not in _started_this_run() and _held(image, mirror):
        return
    yield detached("image-copy", _copy_task(image, sources, result_dir, mirror),
                   diagnose=lambda tail: copy_failure(tail, image, sources[-1]))
    if not mirror.upstream:  # what crossed the WAN: the fleet's mirror's copy
        yield remote.callback(_record_copy, f"{result_dir}/image-copy-bytes")


def _started_this_run() -> set[str]:
    """The hosts whose copy :func:`copy_started` started in this run."""
    return once("image copies started", set)


def _held(image: str, mirror: Mirror) -> bool:
    name = ImageName.parse(image)
    if snapshot.fact(RegistryManifest, **held(image, mirror)):  # read with the rest, unless this run changed the host
        host.noop(f"the mirror registry holds {name.path}@{name.digest or name.tag}")
        return True
    return False


def _copy_task(image: str, sources: list[str], result_dir: str, mirror: Mirror) -> str:
    """The copy's shell command: from each source in turn, and the bytes it stored."""
    name = ImageName.parse(image)
    q = shlex.quote
    storage = q(mirror_registry_storage(result_dir))
    result = q(f"{result_dir}/image-copy-bytes")
    # A mirror above this one is trusted where docker trusts it, /etc/docker/certs.d, which
    # skopeo reads for a source too.
    copy = " || ".join(f"{{ {copy_command(source, name, mirror.registry, _cert_dir(mirror.registry))}; }}"
                       for source in sources)
    # What came from upstream, measured: the registry stores blobs (and manifests) as fetched,
    # each in a file named data.
    stored = f"find {storage} -type f -name data -printf '%s\\n' | awk '{{s += $1}} END {{print s + 0}}'"
    return f"rm -f {result}; before=$({stored}) && ( {copy} ) && echo $(( $({stored}) - before )) > {result}"


def _cert_dir(registry: str) -> str:
    """Where docker (and skopeo) find the certificate of the fleet's ``registry``."""
    return posixpath.dirname(registry_ca_path(registry))


def copy_command(upstream_url: str, name: ImageName, registry: str, cert_dir: str) -> str:
    """The ``skopeo copy`` of image ``name`` from the registry at ``upstream_url`` into
    ``registry`` (TLS, its certificate in ``cert_dir``: where docker trusts it), byte for byte.

    ``--all``: an index is copied whole, children included (the registry accepts an index
    only with every child, and only the whole index keeps its digest). Credentials for a
    private upstream are docker's (``docker login`` on the mirror host), never argv.
    """
    url = urlsplit(upstream_url)
    # skopeo names Docker Hub docker.io (also where docker login keeps its credentials).
    upstream = "docker.io" if url.netloc == "registry-1.docker.io" else url.netloc
    # skopeo takes a tag or a digest, not both: read by digest, keep the tag in the copy.
    source = f"{upstream}/{name.path}" + (f"@{name.digest}" if name.digest else f":{name.tag}")
    dest = f"{registry}/{name.path}" + (f":{name.tag}" if name.tag else f"@{name.digest}")
    q = shlex.quote
    return (
        f"skopeo copy --all --preserve-digests --retry-times 3 --src-authfile {DOCKER_AUTH} "
        + ("--src-tls-verify=false " if url.scheme == "http" else "")
        + f"--dest-cert-dir {q(cert_dir)} "
        f"{q('docker://' + source)} {q('docker://' + dest)}"
    )


def _record_copy(state, host, result_path: str) -> bool:  # pyinfra passes state, host
    done = remote.run(host, f"cat {shlex.quote(result_path)}")
    if done.ok and done.stdout and done.stdout[0].strip().isdigit():
        report_of(state).copy = {"upstream_bytes": int(done.stdout[0])}
    return True
