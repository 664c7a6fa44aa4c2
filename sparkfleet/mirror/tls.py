"""The mirror registry's TLS certificate: made once on the controller (like the API key,
in ``mirror_tls_dir``), when a deploy executes; docker on every host using the mirror
trusts it in ``/etc/docker/certs.d``, so docker needs neither insecure-registries nor a
restart."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from pyinfra import host
from pyinfra.api import operation
from pyinfra.operations import files

from sparkfleet import credentials, remote, snapshot
from sparkfleet.hostpaths import (
    DOCKER_CERTS_DIR,
    MIRROR_TRUST_MARKER,
    REGISTRY_CERT,
    REGISTRY_KEY,
    REGISTRY_USER,
    registry_ca_path,
)
from sparkfleet.mirror.facts import MirrorTrust
from sparkfleet.mirrors import Mirror

# Every host is asked which former mirrors it still trusts: with its first read.
snapshot.expect_first(facts=[(MirrorTrust, {})])


def _make(state, host, tls_dir: str, mirror: Mirror) -> bool:  # pyinfra passes state, host
    credentials.mirror_tls(tls_dir, mirror)
    return True


def _adopt(state, host, tls_dir: str, mirror: Mirror) -> bool:  # pyinfra passes state, host
    cert, key = io.BytesIO(), io.BytesIO()
    remote.get(host, REGISTRY_CERT, cert)
    remote.get(host, REGISTRY_KEY, key)
    credentials.keep_mirror_tls(tls_dir, mirror, cert.getvalue(), key.getvalue())
    return True


@operation()
def made(tls_dir: str, mirror: Mirror):
    """
    The mirror registry's certificate and key on the controller: the ones the mirror host
    already serves with when they name its address (another checkout made them), else
    new ones. The mirror host's run makes them, before any host trusts them.

    + tls_dir: the controller's directory for them (``mirror_tls_dir``)
    + mirror: the mirror (its address is the certificate's name)
    """
    cert, key = credentials.mirror_tls_paths(tls_dir, mirror)
    if cert.exists() and key.exists():
        host.noop(f"the mirror registry's certificate is in {cert.parent}")
        return
    if not mirror.is_self:
        if mirror.host not in {h.name for h in host.state.active_hosts}:
            yield remote.fail(
                f"the mirror registry's certificate for {mirror.registry} is not in {cert.parent}, and the "
                f"mirror {mirror.host} is not in this run. Fix: deploy with {mirror.host} in the run (its "
                "certificate is adopted), or copy the mirror_tls_dir of the checkout that made it")
            return
        host.noop(f"the mirror {mirror.host} provides the registry certificate")
        return
    # Runs on the controller when the deploy executes; planning writes nothing.
    serving = (snapshot.text(REGISTRY_CERT) or "").rstrip("\n").encode()
    if serving and credentials.names_mirror(serving + b"\n", mirror):
        yield remote.callback(_adopt, tls_dir, mirror)
    else:
        yield remote.callback(_make, tls_dir, mirror)


def on_registry(tls_dir: str, mirror: Mirror) -> list:
    """The certificate and its key where the registry on the mirror host reads them."""
    cert, key = credentials.mirror_tls_paths(tls_dir, mirror)
    # src: `made` creates them when the deploy executes, before these run.
    return [
        snapshot.file(REGISTRY_CERT, src=str(cert), name="registry certificate"),
        key_installed(name="registry key", key_path=str(key)),
    ]


def _install_key(state, host, key_path: str) -> bool:  # pyinfra passes state, host
    return remote.uploaded(state, host, Path(key_path).read_bytes(), REGISTRY_KEY, "0640", f"root:{REGISTRY_USER}")


@operation()
def key_installed(key_path: str):
    """
    The registry's TLS key on the mirror host, 0640 root:docker-registry from its first byte.

    + key_path: the key on the controller (made when the deploy executes, so read then)

    Not ``files.put``: with sudo it passes through a world-readable file in /tmp.
    """
    path = Path(key_path)
    if path.exists() and (snapshot.file_state(REGISTRY_KEY) or (0, "", ""))[2] == hashlib.sha256(path.read_bytes()).hexdigest():
        host.noop("the registry key is in place")
        return
    yield remote.callback(_install_key, key_path)


def trusted(tls_dir: str, mirror: Mirror):
    """Docker on this host trusts the mirror registry's certificate (read per pull: no restart)."""
    cert, _ = credentials.mirror_tls_paths(tls_dir, mirror)
    # src: `made` creates it when the deploy executes, before this runs.
    trust = snapshot.file(registry_ca_path(mirror.registry), src=str(cert), name="its registry certificate trusted by docker")
    snapshot.file(f"{DOCKER_CERTS_DIR}/{mirror.registry}/{MIRROR_TRUST_MARKER}",
                  f"sparkfleet placed ca.crt here for the mirror registry {mirror.registry}; "
                  "the deploy removes this directory when the mirror moves\n",
                  name="its trust marked as sparkfleet's")
    return trust


def former_trust_removed(mirror: Mirror | None) -> None:
    """The certificates of registries this host trusted for a former mirror (another
    address, another relay, or fleet_mirror=none) removed: a mirror address that moves on
    leaves nothing behind."""
    keep = {each.registry for each in (mirror, *mirror.fallbacks)} if mirror else set()
    for registry in snapshot.fact(MirrorTrust):
        if registry not in keep:
            files.directory(name=f"trust of the former mirror registry {registry} removed",
                            path=f"{DOCKER_CERTS_DIR}/{registry}", present=False)
