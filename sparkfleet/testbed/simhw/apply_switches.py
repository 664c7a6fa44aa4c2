#!/usr/bin/python3
"""Apply the boot-time simulated-hardware switches of a testbed host (stdlib only).

Installed as /usr/lib/sparkfleet-sim/apply-switches and run by the
`sparkfleet-sim-switches.service` unit before docker at every boot, and by the
controller after it flips a switch. At boot it boots the kernel GRUB's configuration
chooses (kernel.py) and notes the driver's version as the loaded kernel module's (a later
install leaves NVML's mismatch until a reboot; a kernel the module was not built for
loads none: "none"). Of the
switches only `disk_full` needs action here: it mounts a tiny
tmpfs at /var/lib/sparkfleet and fills it to ~95%, so a deploy sees a nearly full disk.
`desktop` makes graphical.target the default once (DGX OS boots to the desktop; the
fix, `systemctl set-default multi-user.target` and a reboot, then sticks), for the next
boot: meminfo.py reads it at boot.
(`gpu` and `arch` are read live by nvidia-smi and uname; `no_nvidia_runtime` is the
absence of the toolkit package, handled by the controller.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SIM_DIR = os.environ.get("SPARKFLEET_SIM_DIR", "/etc/sparkfleet-sim")
MOUNTPOINT = "/var/lib/sparkfleet"
SOURCE = "sparkfleet-sim-disk"  # the tmpfs "device" name: how we recognise our mount
SIZE_MIB = 16
FILL_FRACTION = 0.95
FILL_FILE = ".sparkfleet-sim-fill"
DRIVER_LIBRARY = "/usr/lib/sparkfleet-sim/nvidia-driver.version"  # simhw/__init__.py
DRIVER_MODULE = "/run/sparkfleet-sim/nvidia-module.version"
KERNEL = "/usr/lib/sparkfleet-sim/kernel.py"  # kernel.py: the boot's release, in /run
BOOTED = "/run/sparkfleet-sim/kernel.release"
NVIDIA_MODULE = "/lib/modules/{release}/updates/dkms/nvidia.ko"  # simhw/__init__.py


def switches() -> dict:
    try:
        with open(os.path.join(SIM_DIR, "switches.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def our_mount() -> bool:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            if parts[4] == MOUNTPOINT and parts[sep + 2] == SOURCE:
                return True
    return False


DESKTOP_MARK = "/var/lib/sparkfleet-sim/desktop-set"


def set_desktop() -> None:
    if os.path.exists(DESKTOP_MARK):
        return
    subprocess.run(["systemctl", "set-default", "graphical.target"], check=True, timeout=30)
    os.makedirs(os.path.dirname(DESKTOP_MARK), exist_ok=True)
    open(DESKTOP_MARK, "w").close()
    print("desktop: graphical.target is the default (from the next boot)")


def load_driver() -> None:
    """The driver's kernel module of this boot: the one installed now (kept in /run, so
    only a reboot loads another; a later run of this program leaves it)."""
    if os.path.exists(DRIVER_MODULE):
        return
    try:
        with open(DRIVER_LIBRARY) as f:
            version = f.read().strip()
    except OSError:
        return  # no driver package: nvidia-smi answers its built-in version
    try:
        with open(BOOTED) as f:
            release = f.read().strip()
    except OSError:
        release = ""  # no simulated kernel: the module loads
    if release and not os.path.exists(NVIDIA_MODULE.format(release=release)):
        version = "none"  # DKMS built no module for this kernel: the driver is not loaded
    os.makedirs(os.path.dirname(DRIVER_MODULE), exist_ok=True)
    with open(DRIVER_MODULE, "w") as f:
        f.write(version + "\n")


def main() -> int:
    if os.path.exists(KERNEL):
        subprocess.run([sys.executable, KERNEL, "boot"], check=False, timeout=30)
    load_driver()
    sw = switches()
    if sw.get("desktop"):
        set_desktop()
    if sw.get("disk_full"):
        if not our_mount():
            os.makedirs(MOUNTPOINT, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE_MIB}m,mode=0755", SOURCE, MOUNTPOINT],
                           check=True, timeout=30)
        st = os.statvfs(MOUNTPOINT)
        total = st.f_blocks * st.f_frsize
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        want = int(total * FILL_FRACTION) - used
        if want > 0:
            fill = os.path.join(MOUNTPOINT, FILL_FILE)
            with open(fill, "ab") as f:
                f.write(b"\0" * want)  # real bytes: tmpfs does not allocate holes
        print(f"disk_full: {MOUNTPOINT} is {SIZE_MIB} MiB, ~{int(FILL_FRACTION * 100)}% used")
    elif our_mount():
        subprocess.run(["umount", MOUNTPOINT], check=True, timeout=30)
        print(f"disk_full off: unmounted {MOUNTPOINT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
