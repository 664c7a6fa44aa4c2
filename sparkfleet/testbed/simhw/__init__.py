"""Simulated hardware of a DGX Spark: only what a CPU machine cannot have.

* `/usr/bin/nvidia-smi` answering like a GB10 (nvidia_smi.py),
* the processor reported as aarch64 by `uname`/`arch` (wrappers in /usr/local/bin, which
  is ahead of /usr/bin in every PATH a deploy uses: sshd's default PATH and sudo's
  secure_path. `dpkg --print-architecture` and Python's platform.machine() still say
  amd64/x86_64 - only the commands are wrapped),
* the NVIDIA container toolkit pieces `docker run --gpus all` needs
  (nvidia-container-runtime-hook, nvidia-container-runtime, nvidia-ctk), shipped as the
  simulated `nvidia-container-toolkit` .deb (see aptrepo.py),
* a boot unit applying the `disk_full` and `desktop` switches (apply_switches.py),
* a GB10's memory in /proc/meminfo, with what the simulated engine holds (meminfo.py),
* the kernel GRUB boots (kernel.py: `update-grub`, the boot's release in `uname -r`, and
  whether the NVIDIA module loads with it).

Switches live in /etc/sparkfleet-sim/switches.json on each host; the tools read them
at run time, so flipping a switch needs no reboot.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

TOOLKIT_PACKAGE = "nvidia-container-toolkit"
TOOLKIT_VERSION = "1.17.8-1"

#: The driver as a package (DGX OS 7: NVIDIA's 580 branch). It carries the userspace's
#: version; the kernel module loaded at boot is the one installed then (apply_switches.py
#: notes it in /run), so an install without a reboot leaves NVML's version mismatch, which
#: nvidia-smi and the toolkit's hook answer until the host reboots.
DRIVER_PACKAGE = "nvidia-driver-580-open"
DRIVER_VERSION = "580.95.05-1"
DRIVER_LIBRARY = "usr/lib/sparkfleet-sim/nvidia-driver.version"
DRIVER_MODULE = "/run/sparkfleet-sim/nvidia-module.version"

#: The kernel as DGX OS 7 has it: an image package per release and the meta-package that
#: pulls the newest in (kernel.py boots what GRUB chooses among the installed images).
KERNEL_META = "linux-image-nvidia-hwe-24.04"
KERNEL_RELEASE = "6.11.0-1016-nvidia"
KERNEL_VERSION = "6.11.0-1016.16"
#: Where a kernel's image package puts the driver's DKMS module (apply_switches.py: a boot
#: without it loads no driver).
NVIDIA_MODULE = "lib/modules/{release}/updates/dkms/nvidia.ko"

#: dockerd registers its `--gpus` device driver only if it finds this in PATH at start;
#: runc then runs it as an OCI prestart hook with the container state on stdin.
HOOK_SH = """#!/bin/sh
# Simulated nvidia-container-runtime-hook (sparkfleet testbed): a real one would mount
# the GPU devices and driver libraries into the container. There is no GPU here, so it
# only records the call (for tests), copies nvidia-smi into the container as the real
# hook mounts it, and succeeds; after a driver update without a reboot (or with the
# `driver_mismatch` switch) it fails as the real one does.
state=$(cat 2>/dev/null)
mkdir -p /run/sparkfleet-sim 2>/dev/null
echo "$(date +%s) $*" >> /run/sparkfleet-sim/hook.log 2>/dev/null
lib=$(cat /usr/lib/sparkfleet-sim/nvidia-driver.version 2>/dev/null)
mod=$(cat /run/sparkfleet-sim/nvidia-module.version 2>/dev/null)
if [ "$mod" = none ]; then
    echo "nvidia-container-cli: initialization error: nvml error: driver not loaded" >&2
    exit 1
fi
if grep -q '"driver_mismatch": *true' /etc/sparkfleet-sim/switches.json 2>/dev/null \
        || { [ -n "$lib" ] && [ -n "$mod" ] && [ "$lib" != "$mod" ]; }; then
    echo "nvidia-container-cli: initialization error: nvml error: driver/library version mismatch" >&2
    exit 1
fi
printf '%s' "$state" | python3 -c 'import json, os, shutil, sys
b = json.load(sys.stdin)["bundle"]; r = os.path.join(b, json.load(open(os.path.join(b, "config.json")))["root"]["path"])
os.makedirs(os.path.join(r, "usr/bin"), exist_ok=True); shutil.copy2("/usr/bin/nvidia-smi", os.path.join(r, "usr/bin/nvidia-smi"))' 2>/dev/null
exit 0
"""

#: The stack updates repository's bad toolkit (aptrepo.py): its hook fails every GPU container, as a
#: toolkit that cannot load the driver's NVML does.
BROKEN_HOOK_SH = """#!/bin/sh
# Simulated nvidia-container-runtime-hook of a bad toolkit release (sparkfleet testbed).
echo "nvidia-container-cli: initialization error: load library failed: libnvidia-ml.so.1: cannot open shared object file" >&2
exit 1
"""

RUNTIME_SH = """#!/bin/sh
# Simulated nvidia-container-runtime (sparkfleet testbed): the real one is a runc shim
# that injects the hook; docker's --gpus already adds the hook, so plain runc suffices.
if [ "$1" = "--version" ]; then
    echo "NVIDIA Container Runtime version 1.17.8 (simulated)"
fi
exec runc "$@"
"""

UNAME_SH = """#!/bin/sh
# Simulated processor and kernel (sparkfleet testbed): report aarch64 like a DGX Spark, or
# the `arch` switch of /etc/sparkfleet-sim/switches.json, and the release GRUB booted
# (kernel.py notes it at boot). The real uname is /usr/bin/uname. Shell builtins only for
# the machine and the release (what facts ask): a real uname costs a host ~1 ms, and this
# one runs in every read of a host.
arch= release=
if [ -r /etc/sparkfleet-sim/switches.json ]; then
    while IFS= read -r line || [ -n "$line" ]; do
        case $line in
            *'"arch"'*) v=${line#*'"arch"'}; v=${v#*'"'}; arch=${v%%'"'*}; break ;;
        esac
        line=
    done < /etc/sparkfleet-sim/switches.json
fi
[ -n "$arch" ] || arch=aarch64
[ -r /run/sparkfleet-sim/kernel.release ] && read -r release < /run/sparkfleet-sim/kernel.release
[ -n "$release" ] || release=$(/usr/bin/uname -r)
case "$*" in
    -m) printf '%s\\n' "$arch"; exit 0 ;;
    -r) printf '%s\\n' "$release"; exit 0 ;;
esac
out=$(/usr/bin/uname "$@") || exit $?
printf '%s\\n' "$out" | sed "s/x86_64/$arch/g; s/$(/usr/bin/uname -r)/$release/g"
"""

UPDATE_GRUB_SH = """#!/bin/sh
# Simulated GRUB (sparkfleet testbed): writes /boot/grub/grub.cfg as Ubuntu's update-grub
# does; the host's next boot runs the kernel it chooses (kernel.py).
exec python3 /usr/lib/sparkfleet-sim/kernel.py update-grub "$@"
"""

ARCH_SH = """#!/bin/sh
# Simulated processor (sparkfleet testbed): see /usr/local/bin/uname.
exec /usr/local/bin/uname -m
"""

SWITCH_UNIT = """[Unit]
Description=sparkfleet testbed: apply simulated hardware switches
DefaultDependencies=no
After=local-fs.target
Before=docker.service ssh.service multi-user.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/lib/sparkfleet-sim/apply-switches

[Install]
WantedBy=multi-user.target
"""


MEMINFO_UNIT = """[Unit]
Description=sparkfleet testbed: a GB10's memory in /proc/meminfo
DefaultDependencies=no
After=local-fs.target sparkfleet-sim-switches.service
Before=docker.service earlyoom.service ssh.service multi-user.target

[Service]
Type=simple
ExecStart=/usr/lib/sparkfleet-sim/meminfo
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
"""

BOOT_UNITS = ("sparkfleet-sim-switches.service", "sparkfleet-sim-meminfo.service")


def toolkit_files(hook: str = HOOK_SH) -> dict[str, tuple[str, int]]:
    """Files of the simulated `nvidia-container-toolkit` package: path -> (text, mode)."""
    return {
        "usr/bin/nvidia-container-runtime-hook": (hook, 0o755),
        "usr/bin/nvidia-container-runtime": (RUNTIME_SH, 0o755),
        "usr/bin/nvidia-ctk": ((HERE / "nvidia_ctk.py").read_text(), 0o755),
    }


def hardware_files() -> dict[str, tuple[str, int]]:
    """Files installed in every host root: path -> (text, mode)."""
    return {
        "usr/bin/nvidia-smi": ((HERE / "nvidia_smi.py").read_text(), 0o755),
        "usr/local/bin/uname": (UNAME_SH, 0o755),
        "usr/local/bin/arch": (ARCH_SH, 0o755),
        "usr/lib/sparkfleet-sim/apply-switches": ((HERE / "apply_switches.py").read_text(), 0o755),
        "usr/lib/sparkfleet-sim/kernel.py": ((HERE / "kernel.py").read_text(), 0o755),
        "usr/sbin/update-grub": (UPDATE_GRUB_SH, 0o755),
        "etc/systemd/system/sparkfleet-sim-switches.service": (SWITCH_UNIT, 0o644),
        "usr/lib/sparkfleet-sim/meminfo": ((HERE / "meminfo.py").read_text(), 0o755),
        "etc/systemd/system/sparkfleet-sim-meminfo.service": (MEMINFO_UNIT, 0o644),
    }


def write_files(root: Path, files: dict[str, tuple[str, int]]) -> None:
    for rel, (text, mode) in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        p.chmod(mode)


def install_hardware(root: Path) -> None:
    """Install the simulated hardware into a host root and enable the switch unit."""
    write_files(root, hardware_files())
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for unit in BOOT_UNITS:
        link = wants / unit
        if not link.is_symlink():
            link.symlink_to(f"/etc/systemd/system/{unit}")
