"""The stack under the engine: the NVIDIA driver, the container toolkit, Docker and the kernel.

Their packages are data (``stack_versions``: component -> {apt package: version}) and are
held with apt's own means (``apt-mark hold``): unattended-upgrades and ``apt-get upgrade``
skip a held package, so nothing moves the stack behind the fleet's back (a DGX OS kernel
update broke NCCL between two Sparks; a driver userspace update without a reboot fails
every new GPU container). A package the host does not have is not ours to install; a
declared version the host does not run is drift, which ``sparkfleet status`` shows.

One read per host (:class:`StackPackages`: ``dpkg-query``, whose status says hold) serves
the deploy and the status alike; no other step reads it, so it is asked directly.
"""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FactBase, deploy, operation

from sparkfleet.config import Settings

#: Components whose new version runs only after a reboot: a new kernel boots, and a new
#: driver's kernel module must be the one loaded (else NVML's driver/library mismatch).
REBOOT_COMPONENTS = ("driver", "kernel")


class StackPackages(FactBase["dict[str, dict[str, object]]"]):
    """The listed packages the host has installed: {package: {"version": ..., "held": bool}}.

    dpkg's own status says both: the first letter of ``db:Status-Abbrev`` is the wanted
    state (``h``: held, what ``apt-mark hold`` sets), the second ``i`` once installed.
    """

    @staticmethod
    def default():
        return {}

    def command(self, packages: list[str]) -> str:
        names = " ".join(shlex.quote(p) for p in packages)
        # Unknown names are no error here: a host has docker.io or docker-ce, not both.
        return f"dpkg-query -W -f='${{db:Status-Abbrev}}|${{Package}}|${{Version}}\\n' {names} 2>/dev/null; true"

    def process(self, output):
        return parse_packages(output)


def parse_packages(lines) -> dict[str, dict[str, object]]:
    found: dict[str, dict[str, object]] = {}
    for line in lines:
        parts = line.strip().split("|")
        if len(parts) != 3 or len(parts[0]) < 2 or parts[0][1] != "i":
            continue  # not installed (un, rc...): nothing to hold
        found[parts[1]] = {"version": parts[2], "held": parts[0][0] == "h"}
    return found


def packages(settings: Settings) -> list[str]:
    """Every package the data lists, in its order."""
    return [p for component in settings.stack_versions.values() for p in component]


def declared(settings: Settings) -> dict[str, str]:
    """The packages whose version the data declares: {package: version}."""
    return {p: v for component in settings.stack_versions.values() for p, v in component.items() if v is not None}


def drift(settings: Settings, have: dict[str, dict[str, object]]) -> list[str]:
    """How the host differs from the data: a declared version it does not run, a package not held."""
    found = []
    for package, version in declared(settings).items():
        running = (have.get(package) or {}).get("version")
        if running != version:
            found.append(f"{package} {running or 'not installed'}, declared {version}")
    found += [f"{p} {have[p]['version']} not held" for p in packages(settings) if p in have and not have[p]["held"]]
    return found


@operation()
def packages_held(names: list[str]):
    """
    Hold every one of ``names`` the host has installed (``apt-mark hold``).

    + names: the stack's apt packages
    """
    have = host.get_fact(StackPackages, packages=list(names))
    loose = [p for p in names if p in have and not have[p]["held"]]
    if not loose:
        host.noop(f"the stack's {len(have)} installed package(s) are held")
        return
    yield "apt-mark hold " + " ".join(shlex.quote(p) for p in loose)


@deploy("Stack")
def held(settings: Settings) -> None:
    """The stack's installed packages held, so no unattended upgrade moves them."""
    names = packages(settings)
    if names:
        packages_held(name="driver, toolkit, Docker, kernel held (apt-mark hold)", names=names)


# --- sparkfleet status --------------------------------------------------------------------


def status_command(settings: Settings) -> str:
    """The shell command whose output :func:`status_of` reads (a section of status' one command)."""
    names = packages(settings)
    return StackPackages().command(names) if names else "true"


def status_of(lines: list[str], settings: Settings) -> dict[str, object]:
    """The host's stack packages and its drift from the data, for status' row."""
    have = parse_packages(lines)
    return {"stack": have, "stack_drift": drift(settings, have)}
