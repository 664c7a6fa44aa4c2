"""Every host that uses the mirror: it trusts the registry's certificate and checks that
the mirror answers before it pulls or downloads; a host that was the mirror before
stops its services."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import StringCommand
from pyinfra.operations import files, systemd

from sparkfleet import remote, secrets
from sparkfleet.config import Mirror, Settings
from sparkfleet.facts import MirrorUnits
from sparkfleet.hostpaths import registry_ca_path


def answers(mirror: Mirror, service: str) -> StringCommand:
    """A command that fails this host, saying so, when the mirror's ``service``
    ("registry" or "hf") does not answer it."""
    if service == "registry":
        probe = (f"curl -sf -m 10 --cacert {shlex.quote(registry_ca_path(mirror.registry))} "
                 f"https://{mirror.registry}/v2/ >/dev/null")
        what = f"registry {mirror.registry}"
    else:
        probe = f"curl -s -m 10 -o /dev/null {mirror.hf_endpoint}/"
        what = f"HF mirror {mirror.hf_endpoint}"
    return remote.fail_unless(
        probe,
        f"the mirror {mirror.host} does not answer ({what}): see its errors above, set mirror_address "
        "to an address of it this host reaches, or deploy with --data fleet_mirror=none to download from upstream",
    )


def trusted(settings: Settings, mirror: Mirror):
    """Docker on this host trusts the mirror registry's certificate (no restart needed)."""
    cert, _ = secrets.mirror_tls(settings.mirror_tls_dir, mirror)
    return files.put(name="mirror: its registry certificate trusted by docker",
                     src=str(cert), dest=registry_ca_path(mirror.registry), mode="644")


def former_mirror_stopped() -> list:
    """A host that was the mirror before (fleet_mirror moved or off): its services stopped."""
    return [systemd.service(name=f"former mirror: {unit} stopped", service=unit, running=False, enabled=False)
            for unit in host.get_fact(MirrorUnits)]
