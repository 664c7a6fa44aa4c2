"""GPU access for the serving container: whatever the host already gives, configured only
when nothing does.

DGX OS units differ: some list the ``nvidia`` runtime in /etc/docker/daemon.json, some
only have the toolkit's legacy hook, some only a CDI spec. None of them needs the runtime
in daemon.json: dockerd honours ``--gpus all`` through the legacy hook when it found
``nvidia-container-runtime-hook`` in PATH at its start, and Docker 29 also through CDI
when ``nvidia-cdi-hook`` is there; ``--device nvidia.com/gpu=all`` uses a CDI spec in
/etc/cdi or /var/run/cdi on any Docker with CDI on (measured: Docker 28.5.2 with a spec and
``nvidia-cdi-hook`` but no legacy hook refuses ``--gpus all`` and runs ``--device``;
moby #50228 maps ``--gpus`` to CDI from 29 on).

So the host is asked what works (``gpu.GpuAccess``), and the unit uses that
(:func:`gpu_flag`); only when nothing does is the toolkit installed and docker restarted
— which stops every container, so never while our server runs (it already has a GPU).
The ``/dev/char`` symlinks NVIDIA documents keep ``systemctl daemon-reload`` from
detaching a running container from its GPU under the systemd cgroup driver.
"""

from __future__ import annotations

import hashlib
import io
import json
import re

from pyinfra import host
from pyinfra.api import FileUploadCommand, deploy, operation
from pyinfra.facts.files import FileContents
from pyinfra.facts.server import Which
from pyinfra.operations import systemd

from sparkfleet import apt, remote, snapshot
from sparkfleet.config import Settings
from sparkfleet.gpu import CDI_ALL, GPU_FLAGS, GPUS_ALL, GpuAccess
from sparkfleet.hostpaths import (
    ARCHIVE_APT_KEYRING,
    DOCKER_DAEMON_JSON,
    NVIDIA_APT_KEYRING,
    NVIDIA_APT_SOURCES,
    NVIDIA_DEV_CHAR_RULE,
    UNIT,
    UNIT_PATH,
)
from sparkfleet.mirror import local_image

__all__ = ["CDI_ALL", "GPUS_ALL", "configured", "gpu_flag", "unit_gpu_flag"]

#: What ``docker run --gpus`` uses of the toolkit, and its configuration tool.
TOOLKIT_PROGRAMS = ("nvidia-container-runtime-hook", "nvidia-ctk")

#: NVIDIA's udev rule: the /dev/char links again whenever the driver loads (at boot).
DEV_CHAR_RULE = (
    "# sparkfleet: NVIDIA's workaround for containers losing their GPU on systemctl daemon-reload\n"
    'ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
    'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"\n'
)


def _unit_flag() -> str | None:
    """The GPU flag the installed serving unit runs with, while it is active."""
    if snapshot.unit(UNIT).get("ActiveState") != "active":
        return None
    text = snapshot.text(UNIT_PATH) or ""
    found = re.search("|".join(re.escape(flag) for flag in GPU_FLAGS), text)
    return found.group(0) if found else None


def gpu_flag(settings: Settings) -> str | None:
    """The docker flag that gives the serving container the GPU here, or None when nothing
    does yet. A running server keeps the flag it runs with: it has the GPU already."""
    running_with = _unit_flag()
    if running_with:
        return running_with
    # The name the host runs it by: the pull's reference differs with the mirror (or relay) it came from.
    works = host.get_fact(GpuAccess, image=local_image(settings))["works"]
    return works[0] if works else None


def unit_gpu_flag(settings: Settings) -> str:
    """What the unit is rendered with: the working flag, else ``--gpus all``, which the
    toolkit this deploy then installs provides."""
    return gpu_flag(settings) or GPUS_ALL


def apt_keyring(nvidia_apt_repo: str, apt_repo: str | None) -> str:
    """The keyring NVIDIA's list names. apt refuses two lists naming one URL with different
    Signed-By files (all of apt, not only our install), so a repository that also serves
    ``apt_repo`` (validated: the same key) names the keyring of that one."""
    if apt_repo and apt_repo.rstrip("/") == nvidia_apt_repo.rstrip("/"):
        return ARCHIVE_APT_KEYRING
    return NVIDIA_APT_KEYRING


def _on_path(program: str) -> str | None:
    return host.get_fact(Which, command=program)


@operation()
def toolkit_installed(apt_repo: str, apt_key_url: str, keyring: str, gpu_works: bool):
    """
    Install nvidia-container-toolkit from NVIDIA's signed apt repository when GPU
    containers do not work and it is missing.

    + apt_repo: the repository (``nvidia_apt_repo``; ``$(ARCH)`` is apt's own)
    + apt_key_url: its signing key (``nvidia_apt_key_url``)
    + keyring: where the key goes (:func:`apt_keyring`)
    + gpu_works: whether a GPU container already works here (then nothing is installed)
    """
    if gpu_works:
        host.noop("GPU containers work: nothing to install")
        return
    yield from apt.installed._inner(["nvidia-container-toolkit"], programs=TOOLKIT_PROGRAMS, apt_repo=apt_repo,
                                    apt_key_url=apt_key_url, keyring=keyring, sources=NVIDIA_APT_SOURCES,
                                    which=_on_path)


@operation()
def docker_configured(gpu_works: bool):
    """
    NVIDIA's install step, ``nvidia-ctk runtime configure --runtime=docker`` (merges the
    ``nvidia`` runtime into daemon.json, keeping every other key), only on a host where no
    GPU container works (docker restarts there anyway).

    + gpu_works: whether a GPU container already works here (then daemon.json is left alone)
    """
    if gpu_works:
        host.noop(f"GPU containers work: {DOCKER_DAEMON_JSON} is left alone")
        return
    lines = host.get_fact(FileContents, path=DOCKER_DAEMON_JSON)
    try:
        current = json.loads("\n".join(lines or []) or "{}")
    except ValueError:
        current = None
    if not isinstance(current, dict):
        yield remote.fail(f"{DOCKER_DAEMON_JSON} is not valid JSON: fix or remove it, then re-run")
        return
    yield f"nvidia-ctk runtime configure --runtime=docker --config={DOCKER_DAEMON_JSON}"


@operation()
def dev_char_symlinks():
    """
    NVIDIA's udev rule for the ``/dev/char`` symlinks, and the links made now when the
    rule is new: without them ``systemctl daemon-reload`` (a package install, a unit
    change) can cut a running container off its GPU under the systemd cgroup driver.
    """
    if (snapshot.file_state(NVIDIA_DEV_CHAR_RULE) or (0, "", ""))[2] == hashlib.sha256(DEV_CHAR_RULE.encode()).hexdigest():
        host.noop("the /dev/char symlinks rule is in place")
        return
    yield f"mkdir -p {NVIDIA_DEV_CHAR_RULE.rsplit('/', 1)[0]}"
    yield FileUploadCommand(io.BytesIO(DEV_CHAR_RULE.encode()), NVIDIA_DEV_CHAR_RULE)
    yield "nvidia-ctk system create-dev-char-symlinks --create-all"


snapshot.expect_first(files=[NVIDIA_DEV_CHAR_RULE], texts=[UNIT_PATH], units=[UNIT])


@deploy("NVIDIA container runtime")
def configured(settings: Settings) -> None:
    """GPU access as the host gives it; toolkit, docker configuration and a docker restart
    only where no GPU container works; the /dev/char links everywhere."""
    works = gpu_flag(settings) is not None
    toolkit = toolkit_installed(name="NVIDIA container toolkit installed",
                                apt_repo=settings.nvidia_apt_repo, apt_key_url=settings.nvidia_apt_key_url,
                                keyring=apt_keyring(settings.nvidia_apt_repo, settings.apt_repo),
                                gpu_works=works)
    daemon = docker_configured(name="docker configured for the NVIDIA runtime", gpu_works=works)
    # dockerd looks for the GPU hook only when it starts: a new toolkit needs a restart too.
    systemd.service(
        name="restart docker for its new runtime",
        service="docker.service",
        restarted=True,
        _if=lambda: toolkit.did_change() or daemon.did_change(),
    )
    dev_char_symlinks(name="/dev/char symlinks for the GPU (daemon-reload safe)")
