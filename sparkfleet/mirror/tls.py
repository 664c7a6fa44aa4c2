"""The mirror registry's TLS certificate: made once on the controller (like the API key,
in ``mirror_tls_dir``), when a deploy executes; docker on every host using the mirror
trusts it in ``/etc/docker/certs.d``, so docker needs neither insecure-registries nor a
restart."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pyinfra import host
from pyinfra.api import FunctionCommand, operation
from pyinfra.facts.files import Sha256File
from pyinfra.operations import files

from sparkfleet import remote, secrets
from sparkfleet.config import Mirror
from sparkfleet.hostpaths import REGISTRY_CERT, REGISTRY_KEY, REGISTRY_USER, registry_ca_path


def _make(state, host, tls_dir: str, mirror: Mirror) -> bool:  # pyinfra passes state, host
    secrets.mirror_tls(tls_dir, mirror)
    return True


@operation()
def made(tls_dir: str, mirror: Mirror):
    """
    Make the mirror registry's certificate and key on the controller unless they exist.

    + tls_dir: the controller's directory for them (``mirror_tls_dir``)
    + mirror: the mirror (its address is the certificate's name)
    """
    cert, key = secrets.mirror_tls_paths(tls_dir, mirror)
    if cert.exists() and key.exists():
        host.noop(f"the mirror registry's certificate is in {cert.parent}")
        return
    # Runs on the controller when the deploy executes; planning writes nothing.
    yield FunctionCommand(_make, (tls_dir, mirror), {})


def on_registry(tls_dir: str, mirror: Mirror) -> list:
    """The certificate and its key where the registry on the mirror host reads them."""
    cert, key = secrets.mirror_tls_paths(tls_dir, mirror)
    # assume_exists: `made` creates them when the deploy executes, before these run.
    return [
        files.put(name="registry certificate", src=str(cert), dest=REGISTRY_CERT, mode="644", assume_exists=True),
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
    if path.exists() and host.get_fact(Sha256File, path=REGISTRY_KEY) == hashlib.sha256(path.read_bytes()).hexdigest():
        host.noop("the registry key is in place")
        return
    yield FunctionCommand(_install_key, (key_path,), {})


def trusted(tls_dir: str, mirror: Mirror):
    """Docker on this host trusts the mirror registry's certificate (read per pull: no restart)."""
    cert, _ = secrets.mirror_tls_paths(tls_dir, mirror)
    return files.put(name="its registry certificate trusted by docker", src=str(cert),
                     dest=registry_ca_path(mirror.registry), mode="644", assume_exists=True)
