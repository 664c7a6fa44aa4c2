"""The mirror registry's TLS certificate: made once on the controller (like the API key,
in ``mirror_tls_dir``), when a deploy executes; docker on every host using the mirror
trusts it in ``/etc/docker/certs.d``, so docker needs neither insecure-registries nor a
restart."""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import FunctionCommand, operation
from pyinfra.operations import files

from sparkfleet import secrets
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
        files.put(name="registry key", src=str(key), dest=REGISTRY_KEY, user="root", group=REGISTRY_USER,
                  mode="640", assume_exists=True),
    ]


def trusted(tls_dir: str, mirror: Mirror):
    """Docker on this host trusts the mirror registry's certificate (read per pull: no restart)."""
    cert, _ = secrets.mirror_tls_paths(tls_dir, mirror)
    return files.put(name="its registry certificate trusted by docker", src=str(cert),
                     dest=registry_ca_path(mirror.registry), mode="644", assume_exists=True)
