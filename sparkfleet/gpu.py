"""The GPU as the host gives it: what nvidia-smi reports (a driver updated without a
reboot included), and how docker hands it to containers (``--gpus``, CDI).
"""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

#: What nvidia-smi says when the driver's userspace was updated and its kernel module was not
#: reloaded (a driver update without a reboot): every new GPU container fails the same way.
NVML_MISMATCH = "Driver/library version mismatch"


class Gpu(FactBase["dict[str, object] | None"]):
    """The first GPU as ``nvidia-smi`` reports it, or None without a working nvidia-smi.

    A driver updated without a reboot answers NVML's version mismatch: then the name fields
    are empty and ``mismatch`` holds the loaded kernel module's version and the library's
    ("" where unread)."""

    def requires_command(self) -> str:
        return "nvidia-smi"

    def command(self) -> str:
        # A driver that does not answer is an answer too: its message parses as no GPU,
        # and the preflight says what to do. On a mismatch, the version of the kernel module
        # still loaded (the library's is in nvidia-smi's message).
        return (
            "o=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>&1); "
            f'echo "$o"; case "$o" in *{shlex.quote(NVML_MISMATCH)}*) echo "kernel_module=$('
            "cat /sys/module/nvidia/version 2>/dev/null || grep -o '  [0-9][0-9.]*  ' /proc/driver/nvidia/version "
            "2>/dev/null | head -n 1 | tr -d ' ')\";; esac; true"
        )

    def process(self, output):
        if any(NVML_MISMATCH in line for line in output):
            found = dict(line.strip().split("=", 1) for line in output if line.startswith("kernel_module="))
            library = next((line.split(":", 1)[1].strip() for line in output
                            if line.startswith("NVML library version:")), "")
            return {"name": "", "compute_cap": "", "driver_version": "",
                    "mismatch": {"kernel_module": found.get("kernel_module", ""), "library": library}}
        for line in output:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[0]:
                return {"name": parts[0], "compute_cap": parts[1], "driver_version": parts[2]}
        return None


GPUS_ALL = "--gpus all"
CDI_ALL = "--device nvidia.com/gpu=all"
GPU_FLAGS = (GPUS_ALL, CDI_ALL)  # the first that works is used


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

    def requires_command(self, image: str) -> str:
        return "docker"

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
        # Docker 28 maps --gpus to CDI only from 29 on (moby #50228).
        major = ev.get("docker", "").split(".")[0]
        docker_maps_gpus_to_cdi = major.isdigit() and int(major) >= 29 and bool(ev.get("cdi_hook"))
        return ev.get("hook_registered") == "yes" or (docker_maps_gpus_to_cdi and cdi)
    return cdi
