"""Packages from apt, and the signed source they come from: one operation for every step
that installs a package (the container toolkit, earlyoom, haproxy, docker-registry and skopeo).

pyinfra's ``apt.key``, ``apt.repo`` and ``apt.packages`` in one step, with sparkfleet's
rules: the source is a flat repository (``deb [signed-by=KEYRING] URL /``) whose key is
fetched as it is served (an armored key: apt reads it, no gpg on the host); only that
source's list is refreshed (the rest of the host's apt state is not ours); without one,
the host's own archives, refreshed whole. Nothing runs when the programs the packages
bring are there already, asked when the operation runs (:func:`sparkfleet.snapshot.program`
unless the step asks its own way).

apt takes one Signed-By per URL (two lists naming one URL with different keyrings break
all of apt), so a step whose repository may be ``apt_repo`` names the keyring of
``apt_repo``'s list: see :func:`sparkfleet.container_runtime.apt_keyring`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence

from pyinfra import host
from pyinfra.api import operation
from pyinfra.api.exceptions import OperationError

from sparkfleet import snapshot
from sparkfleet.hostpaths import ARCHIVE_APT_KEYRING, ARCHIVE_APT_SOURCES


def commands(
    packages: Sequence[str],
    apt_repo: str | None = None,
    apt_key_url: str | None = None,
    keyring: str = ARCHIVE_APT_KEYRING,
    sources: str = ARCHIVE_APT_SOURCES,
    keep_config: bool = False,
    no_recommends: bool = False,
) -> list[str]:
    """The shell commands that install ``packages`` (see :func:`installed`)."""
    if not packages:
        raise OperationError("apt.installed: no packages to install")
    q = shlex.quote
    steps = []
    if apt_repo:
        if not apt_key_url:
            raise OperationError(f"apt.installed: {apt_repo} needs its signing key (apt_key_url)")
        steps += [
            f"curl -fsSL --retry 3 {q(apt_key_url)} -o {q(keyring)}",
            f"echo {q(f'deb [signed-by={keyring}] {apt_repo} /')} > {q(sources)}",
            # Only that list is refreshed: the rest of the host's apt state is not ours.
            f"apt-get update -o Dir::Etc::sourcelist={q(sources)} -o Dir::Etc::sourceparts=- "
            "-o APT::Get::List-Cleanup=0",
        ]
    else:
        steps.append("apt-get update")
    options = (["-o Dpkg::Options::=--force-confold"] if keep_config else []) + (
        ["--no-install-recommends"] if no_recommends else [])
    steps.append(" ".join(["DEBIAN_FRONTEND=noninteractive apt-get install -y", *options,
                           *(q(package) for package in packages)]))
    return steps


def installed_message(packages: Sequence[str]) -> str:
    """What the noop says: ``earlyoom is installed``, ``docker-registry and skopeo are installed``."""
    names = list(packages)
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{listed} {'is' if len(names) == 1 else 'are'} installed"


@operation()
def installed(
    packages: Sequence[str],
    programs: Sequence[str] | None = None,
    apt_repo: str | None = None,
    apt_key_url: str | None = None,
    keyring: str = ARCHIVE_APT_KEYRING,
    sources: str = ARCHIVE_APT_SOURCES,
    keep_config: bool = False,
    no_recommends: bool = False,
    which: Callable[[str], object] | None = None,
):
    """
    Install ``packages`` with apt when one of ``programs`` is missing: from ``apt_repo``
    (its key fetched into ``keyring``, its list written to ``sources``, only that list
    refreshed) when given, else from the host's own archives.

    + packages: the apt packages
    + programs: what they bring, looked for on the host (default: the packages' names)
    + apt_repo: a flat repository to take them from (``$(ARCH)`` is apt's own); None: the
      host's own archives
    + apt_key_url: its signing key (needed with ``apt_repo``)
    + keyring: where the key goes (default: ``apt_repo``'s, one for every step)
    + sources: the list naming the repository (default: ``apt_repo``'s)
    + keep_config: keep the configuration files a step wrote over the package's on upgrades
      (``--force-confold``)
    + no_recommends: ``--no-install-recommends``
    + which: how a program is looked for (a true answer: it is there); default
      :func:`sparkfleet.snapshot.program`
    """
    look = which or snapshot.program
    if all(look(program) for program in (programs if programs is not None else packages)):
        host.noop(installed_message(packages))
        return
    yield from commands(packages, apt_repo, apt_key_url, keyring, sources, keep_config, no_recommends)
