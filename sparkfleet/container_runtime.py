"""GPU access for the serving container: whatever the host already gives, configured only
when nothing does.

DGX OS units differ: some list the ``nvidia`` runtime in /etc/docker/daemon.json, some
only have the toolkit's legacy hook, some only a CDI spec. None of them needs the runtime
in daemon.json: dockerd honours ``--gpus all`` through the legacy hook when it found
``nvidia-container-runtime-hook`` in PATH at its start, and Docker 29 also through CDI
when ``nvidia-cdi-hook`` is there; ``--device nvidia.com/gpu=all`` uses a CDI spec in
/etc/cdi or /var/run/cdi on any Docker with CDI on (measured: Docker 28.5.2 with a spec and
``nvidia-cdi-hook`` but no legacy hook refuses ``--gpus all`` and runs ``--device``).

So the host is asked what works (:class:`GpuAccess`), and the unit uses that
(:func:`gpu_flag`); only when nothing does is the toolkit installed and docker restarted
— which stops every container, so never while our server runs (it already has a GPU).
The ``/dev/char`` symlinks NVIDIA documents keep ``systemctl daemon-reload`` from
detaching a running container from its GPU under the systemd cgroup driver.
"""

from __future__ import annotations

import hashlib
import io
import shlex

from pyinfra import host
from pyinfra.api import FactBase, FileUploadCommand, operation
from pyinfra.facts.files import Sha256File
from pyinfra.operations import systemd

from sparkfleet.config import Settings
from sparkfleet.facts import CommandAvailable
from sparkfleet.mirror import image_reference
from sparkfleet.hostpaths import (
    DOCKER_DAEMON_JSON,
    NVIDIA_APT_KEYRING,
    NVIDIA_APT_SOURCES,
    NVIDIA_DEV_CHAR_RULE,
    UNIT,
    UNIT_PATH,
)

GPUS_ALL = "--gpus all"
CDI_ALL = "--device nvidia.com/gpu=all"
GPU_FLAGS = (GPUS_ALL, CDI_ALL)  # the first that works is used

#: NVIDIA's udev rule: the /dev/char links again whenever the driver loads (at boot).
DEV_CHAR_RULE = (
    "# sparkfleet: NVIDIA's workaround for containers losing their GPU on systemctl daemon-reload\n"
    'ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
    'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"\n'
)


class GpuAccess(FactBase["dict[str, object]"]):
    """How docker gives this host's containers the GPU.

    With ``image`` on the host, a GPU container of it runs ``nvidia-smi -L`` with each of
    :data:`GPU_FLAGS` (the truth). Without, the evidence: the legacy hook and whether
    dockerd started after it appeared, ``nvidia-cdi-hook``, a CDI spec for
    ``nvidia.com/gpu``, docker's version and CDI spec dirs. Returns ``{"works": [flags],
    "probed": bool, "evidence": {...}}``.
    """

    @staticmethod
    def default():
        return {"works": [], "probed": False, "evidence": {}}

    def command(self, image: str) -> str:
        q = shlex.quote
        probes = "".join(
            f"docker run --rm --pull never {flag} --entrypoint nvidia-smi {q(image)} -L 2>/dev/null "
            f"| grep -q '^GPU ' && echo {q('works=' + flag)}; "
            for flag in GPU_FLAGS
        )
        return (
            "echo docker=$(docker version --format '{{.Server.Version}}' 2>/dev/null); "
            "echo cdi_dirs=$(docker info --format '{{json .CDISpecDirs}}' 2>/dev/null); "
            "echo cdi_spec=$(grep -ls 'nvidia.com/gpu' /etc/cdi/* /var/run/cdi/* 2>/dev/null | head -n 1); "
            "echo cdi_hook=$(command -v nvidia-cdi-hook); "
            "h=$(command -v nvidia-container-runtime-hook); echo hook=$h; "
            # dockerd registers the hook's --gpus driver only if the hook was there at its start.
            "s=$(systemctl show docker.service -p ExecMainStartTimestamp --value 2>/dev/null); "
            'if [ -n "$h" ] && [ -n "$s" ] && [ "$(stat -c %Z "$h")" -lt "$(date -d "$s" +%s)" ]; '
            "then echo hook_registered=yes; fi; "
            f"if docker image inspect --format . {q(image)} >/dev/null 2>&1; then echo probed=yes; {probes}fi; true"
        )

    def process(self, output):
        evidence: dict[str, str] = {}
        works: list[str] = []
        for line in output:
            key, _, value = line.strip().partition("=")
            if key == "works":
                works.append(value)
            elif key:
                evidence[key] = value
        probed = evidence.pop("probed", "") == "yes"
        if not probed:
            works = [flag for flag in GPU_FLAGS if _evidently_works(flag, evidence)]
        return {"works": works, "probed": probed, "evidence": evidence}


def _evidently_works(flag: str, ev: dict[str, str]) -> bool:
    cdi = bool(ev.get("cdi_spec")) and ev.get("cdi_dirs", "") not in ("", "null", "[]")
    if flag == GPUS_ALL:
        major = ev.get("docker", "").split(".")[0]
        docker_maps_gpus_to_cdi = major.isdigit() and int(major) >= 29 and bool(ev.get("cdi_hook"))
        return ev.get("hook_registered") == "yes" or (docker_maps_gpus_to_cdi and cdi)
    return cdi


class UnitGpuFlag(FactBase["str | None"]):
    """The GPU flag the installed serving unit runs with (None without the unit)."""

    def command(self) -> str:
        return f"grep -o -e '{GPUS_ALL}' -e '{CDI_ALL}' {UNIT_PATH} 2>/dev/null | head -n 1 || true"

    def process(self, output):
        return output[0].strip() if output and output[0].strip() else None


class ServingActive(FactBase[bool]):
    @staticmethod
    def default():
        return False

    def command(self) -> str:
        return f"systemctl is-active -q {UNIT} && echo yes || echo no"

    def process(self, output):
        return bool(output) and output[-1].strip() == "yes"


def gpu_flag(settings: Settings) -> str | None:
    """The docker flag that gives the serving container the GPU here, or None when nothing
    does yet. A running server keeps the flag it runs with: it has the GPU already."""
    running_with = host.get_fact(UnitGpuFlag) if host.get_fact(ServingActive) else None
    if running_with:
        return running_with
    works = host.get_fact(GpuAccess, image=image_reference(settings))["works"]
    return works[0] if works else None


def unit_gpu_flag(settings: Settings) -> str:
    """What the unit is rendered with: the working flag, else ``--gpus all``, which the
    toolkit this deploy then installs provides."""
    return gpu_flag(settings) or GPUS_ALL


@operation()
def toolkit_installed(settings: Settings, gpu_works: bool):
    """
    Install nvidia-container-toolkit from NVIDIA's signed apt repository when GPU
    containers do not work and it is missing.

    + settings: validated settings (``nvidia_apt_repo``, ``nvidia_apt_key_url``)
    + gpu_works: whether a GPU container already works here (then nothing is installed)
    """
    if gpu_works:
        host.noop("GPU containers work: nothing to install")
        return
    if host.get_fact(CommandAvailable, program="nvidia-container-runtime-hook") and host.get_fact(
        CommandAvailable, program="nvidia-ctk"
    ):
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
    yield f"nvidia-ctk runtime configure --runtime=docker --config={DOCKER_DAEMON_JSON}"


@operation()
def dev_char_symlinks():
    """
    NVIDIA's udev rule for the ``/dev/char`` symlinks, and the links made now when the
    rule is new: without them ``systemctl daemon-reload`` (a package install, a unit
    change) can cut a running container off its GPU under the systemd cgroup driver.
    """
    if host.get_fact(Sha256File, path=NVIDIA_DEV_CHAR_RULE) == hashlib.sha256(DEV_CHAR_RULE.encode()).hexdigest():
        host.noop("the /dev/char symlinks rule is in place")
        return
    yield f"mkdir -p {NVIDIA_DEV_CHAR_RULE.rsplit('/', 1)[0]}"
    yield FileUploadCommand(io.BytesIO(DEV_CHAR_RULE.encode()), NVIDIA_DEV_CHAR_RULE)
    yield "nvidia-ctk system create-dev-char-symlinks --create-all"


def configured(settings: Settings) -> None:
    """GPU access as the host gives it; toolkit, docker configuration and a docker restart
    only where no GPU container works; the /dev/char links everywhere."""
    works = gpu_flag(settings) is not None
    toolkit = toolkit_installed(name="NVIDIA container toolkit installed", settings=settings, gpu_works=works)
    daemon = docker_configured(name="docker configured for the NVIDIA runtime", gpu_works=works)
    # dockerd looks for the GPU hook only when it starts: a new toolkit needs a restart too.
    systemd.service(
        name="restart docker for its new runtime",
        service="docker.service",
        restarted=True,
        _if=lambda: toolkit.did_change() or daemon.did_change(),
    )
    dev_char_symlinks(name="/dev/char symlinks for the GPU (daemon-reload safe)")
