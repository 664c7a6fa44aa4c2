"""Kinds of serving host, chosen per host when the fleet is made (`up --switch`).

DGX OS units differ in how docker gives a container the GPU and where it keeps images;
these switches make a simulated host one kind or the other. They are applied to the
host's root before its first boot (docker reads them when it starts), so flipping them
on a running fleet changes nothing: make a new fleet.

| switch | the host |
|---|---|
| `nvidia_runtime` | lists the `nvidia` runtime in /etc/docker/daemon.json, as some vendors ship it |
| `cdi` | gives GPUs through CDI only: `nvidia-cdi-hook` and a CDI spec for `nvidia.com/gpu` in /etc/cdi, no legacy `nvidia-container-runtime-hook` (Docker >= 28 maps `--gpus` to CDI) |
| `containerd_store` | runs Docker's containerd image store (Docker 29's default on a fresh install): images, compressed and unpacked, under /var/lib/containerd |

`cdi` and `containerd_store` need a Docker 28 host root (`rootfs.HOST_DOCKER_FROM`).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import simhw

SWITCHES = {"nvidia_runtime", "cdi", "containerd_store"}

#: Stand-in for the toolkit's CDI hook: a real one updates the container's ld cache and
#: makes symlinks; this one records the call (for tests) and succeeds.
CDI_HOOK_SH = """#!/bin/sh
# Simulated nvidia-cdi-hook (sparkfleet testbed): records its calls.
cat >/dev/null 2>&1
mkdir -p /run/sparkfleet-sim 2>/dev/null
echo "$(date +%s) $*" >> /run/sparkfleet-sim/cdi-hook.log 2>/dev/null
exit 0
"""

#: What `nvidia-ctk cdi generate` writes on a GB10, less the device nodes and driver
#: libraries a CPU machine does not have: nvidia-smi is mounted in, as the real spec does.
CDI_SPEC = {
    "cdiVersion": "0.5.0",
    "kind": "nvidia.com/gpu",
    "devices": [
        {"name": name, "containerEdits": {"env": [f"SPARKFLEET_SIM_CDI_DEVICE={name}"]}}
        for name in ("0", "all")
    ],
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "mounts": [
            {"hostPath": "/usr/bin/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi",
             "options": ["ro", "nosuid", "nodev", "bind"]},
            {"hostPath": "/etc/sparkfleet-sim", "containerPath": "/etc/sparkfleet-sim",
             "options": ["ro", "nosuid", "nodev", "bind"]},
        ],
        "hooks": [
            {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
             "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/aarch64-linux-gnu"]},
        ],
    },
}
CDI_SPEC_PATH = "etc/cdi/nvidia.yaml"  # JSON is YAML; the real tool writes this path too


def provision(root: Path, switches: dict) -> None:
    """Make the host root (toolkit installed, daemon.json written) the kind its switches say."""
    daemon_json = root / "etc/docker/daemon.json"
    daemon = json.loads(daemon_json.read_text())
    if switches.get("nvidia_runtime"):
        daemon.setdefault("runtimes", {})["nvidia"] = {"args": [], "path": "nvidia-container-runtime"}
    if switches.get("containerd_store"):
        daemon.setdefault("features", {})["containerd-snapshotter"] = True
    daemon_json.write_text(json.dumps(daemon, indent=2) + "\n")
    if switches.get("cdi"):
        # Without the legacy hook in PATH, dockerd can only honour --gpus through CDI.
        for legacy in ("usr/bin/nvidia-container-runtime-hook", "usr/bin/nvidia-container-runtime"):
            (root / legacy).unlink(missing_ok=True)
        simhw.write_files(root, {
            "usr/bin/nvidia-cdi-hook": (CDI_HOOK_SH, 0o755),
            CDI_SPEC_PATH: (json.dumps(CDI_SPEC, indent=2) + "\n", 0o644),
        })
