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
from pyinfra.api import FactBase, FileUploadCommand, StringCommand, operation
from pyinfra.operations import systemd

from sparkfleet.config import Settings
from sparkfleet.hostpaths import DOCKER_DAEMON_JSON, NVIDIA_APT_KEYRING, NVIDIA_APT_SOURCES
NVIDIA_RUNTIME = {"path": "nvidia-container-runtime", "runtimeArgs": []}


class ToolkitInstalled(FactBase[bool]):
    """Whether the pieces ``docker run --gpus`` uses are on the host."""

    @staticmethod
    def default():
        return False

    def command(self) -> str:
        return (
            "command -v nvidia-container-runtime-hook >/dev/null && "
            "command -v nvidia-container-runtime >/dev/null && echo yes || echo no"
        )

    def process(self, output):
        return bool(output) and output[0].strip() == "yes"


class DockerRuntimes(FactBase["list[str]"]):
    """The runtimes the running docker daemon lists."""

    @staticmethod
    def default():
        return []

    def command(self) -> str:
        return "docker info --format '{{json .Runtimes}}' 2>/dev/null || echo '{}'"

    def process(self, output):
        try:
            return sorted(json.loads(output[0]))
        except (ValueError, IndexError):
            return []


class DaemonConfig(FactBase["dict | None"]):
    """docker's daemon.json as data ({} when absent, None when it is not valid JSON)."""

    @staticmethod
    def default():
        return {}

    def command(self) -> str:
        return f"cat {DOCKER_DAEMON_JSON} 2>/dev/null || echo '{{}}'"

    def process(self, output):
        try:
            value = json.loads("\n".join(output) or "{}")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


@operation()
def toolkit_installed(settings: Settings):
    """
    Install nvidia-container-toolkit from NVIDIA's signed apt repository when missing.

    + settings: validated settings (``nvidia_apt_repo``, ``nvidia_apt_key_url``)
    """
    if host.get_fact(ToolkitInstalled):
        host.noop("nvidia-container-toolkit is installed")
        return
    q = shlex.quote
    yield f"curl -fsSL --retry 3 {q(settings.nvidia_apt_key_url)} -o {NVIDIA_APT_KEYRING}"
    yield (
        f"echo {q(f'deb [signed-by={NVIDIA_APT_KEYRING}] {settings.nvidia_apt_repo} /')} > {NVIDIA_APT_SOURCES}"
    )
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
    if "nvidia" in host.get_fact(DockerRuntimes):
        host.noop("docker lists the nvidia runtime")
        return
    current = host.get_fact(DaemonConfig)
    if current is None:
        yield StringCommand(
            "echo", shlex.quote(f"{DOCKER_DAEMON_JSON} is not valid JSON: fix or remove it, then re-run"),
            ">&2; exit 1",
        )
        return
    desired = {**current, "runtimes": {**current.get("runtimes", {}), "nvidia": NVIDIA_RUNTIME}}
    yield "mkdir -p /etc/docker"
    yield FileUploadCommand(io.BytesIO((json.dumps(desired, indent=2) + "\n").encode()), DOCKER_DAEMON_JSON)


def configured(settings: Settings) -> None:
    """The toolkit installed, docker configured for it, docker restarted only if changed."""
    toolkit = toolkit_installed(name="NVIDIA container toolkit installed", settings=settings)
    daemon = docker_knows_nvidia(name="docker knows the nvidia runtime")
    # dockerd looks for the GPU hook only when it starts: a new toolkit needs a restart too.
    systemd.service(
        name="restart docker for its new runtime",
        service="docker.service",
        restarted=True,
        _if=lambda: toolkit.did_change() or daemon.did_change(),
    )
