"""NVIDIA container runtime: the toolkit from NVIDIA's signed apt repository, and docker
configured to know the ``nvidia`` runtime — each only when missing.

Docker is restarted only when its configuration really changed: a restart stops every
running container, and NVIDIA documents that needless reloads can detach GPUs.
"""

from __future__ import annotations

import io
import json
import shlex

from pyinfra import host
from pyinfra.api import FileUploadCommand, deploy, operation
from pyinfra.facts.files import FileContents
from pyinfra.facts.server import Which
from pyinfra.operations import systemd

from sparkfleet import remote
from sparkfleet.config import Settings
from sparkfleet.facts import docker_info
from sparkfleet.hostpaths import DOCKER_DAEMON_JSON, NVIDIA_APT_KEYRING, NVIDIA_APT_SOURCES

NVIDIA_RUNTIME = {"path": "nvidia-container-runtime", "runtimeArgs": []}
#: What ``docker run --gpus`` uses of the toolkit.
TOOLKIT_PROGRAMS = ("nvidia-container-runtime-hook", "nvidia-container-runtime")


@operation()
def toolkit_installed(apt_repo: str, apt_key_url: str):
    """
    Install nvidia-container-toolkit from NVIDIA's signed apt repository when missing.

    + apt_repo: the repository (``nvidia_apt_repo``; ``$(ARCH)`` is apt's own)
    + apt_key_url: its signing key (``nvidia_apt_key_url``)
    """
    if all(host.get_fact(Which, command=program) for program in TOOLKIT_PROGRAMS):
        host.noop("nvidia-container-toolkit is installed")
        return
    q = shlex.quote
    yield f"curl -fsSL --retry 3 {q(apt_key_url)} -o {NVIDIA_APT_KEYRING}"
    yield f"echo {q(f'deb [signed-by={NVIDIA_APT_KEYRING}] {apt_repo} /')} > {NVIDIA_APT_SOURCES}"
    # Refresh only NVIDIA's list: the rest of the host's apt state is not ours to touch.
    yield (
        f"apt-get update -o Dir::Etc::sourcelist={NVIDIA_APT_SOURCES} -o Dir::Etc::sourceparts=- "
        "-o APT::Get::List-Cleanup=0"
    )
    yield "DEBIAN_FRONTEND=noninteractive apt-get install -y nvidia-container-toolkit"


@operation()
def docker_knows_nvidia():
    """
    Add the ``nvidia`` runtime to docker's daemon.json, keeping every other setting.

    Nothing is written when docker already lists the runtime.
    """
    if "nvidia" in (docker_info().get("Runtimes") or {}):
        host.noop("docker lists the nvidia runtime")
        return
    lines = host.get_fact(FileContents, path=DOCKER_DAEMON_JSON)
    try:
        current = json.loads("\n".join(lines or []) or "{}")
    except ValueError:
        current = None
    if not isinstance(current, dict):
        yield remote.fail(f"{DOCKER_DAEMON_JSON} is not valid JSON: fix or remove it, then re-run")
        return
    desired = {**current, "runtimes": {**current.get("runtimes", {}), "nvidia": NVIDIA_RUNTIME}}
    yield "mkdir -p /etc/docker"
    yield FileUploadCommand(io.BytesIO((json.dumps(desired, indent=2) + "\n").encode()), DOCKER_DAEMON_JSON)


@deploy("NVIDIA container runtime")
def configured(settings: Settings) -> None:
    """The toolkit installed, docker configured for it, docker restarted only if changed."""
    toolkit = toolkit_installed(name="NVIDIA container toolkit installed",
                                apt_repo=settings.nvidia_apt_repo, apt_key_url=settings.nvidia_apt_key_url)
    daemon = docker_knows_nvidia(name="docker knows the nvidia runtime")
    # dockerd looks for the GPU hook only when it starts: a new toolkit needs a restart too.
    systemd.service(
        name="restart docker for its new runtime",
        service="docker.service",
        restarted=True,
        _if=lambda: toolkit.did_change() or daemon.did_change(),
    )
