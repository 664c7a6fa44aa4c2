#!/usr/bin/python3
"""The simulated kernel of a DGX Spark: installed kernels, GRUB's choice, the boot's release.

Standalone, stdlib only: copied into each host as /usr/lib/sparkfleet-sim/kernel.py. A
container runs the machine's kernel, so what a Spark's bootloader decides is simulated here,
with Ubuntu's files and commands:

* a kernel is a package (aptrepo.py) that installs ``/boot/vmlinuz-<release>`` and, where
  the NVIDIA driver's DKMS module builds for it, ``/lib/modules/<release>/updates/dkms/
  nvidia.ko``; its maintainer scripts run ``update-grub``;
* ``update-grub`` (``kernel.py update-grub``) writes ``/boot/grub/grub.cfg`` as Ubuntu's
  does: the newest kernel first, every kernel in the "Advanced options" submenu, and
  ``set default`` from ``GRUB_DEFAULT`` (``/etc/default/grub``, then ``/etc/default/grub.d/
  *.cfg`` in order, the last one setting it wins);
* at boot (``kernel.py boot``, from apply-switches) the entry ``set default`` names boots
  (``0``: the first, the newest), and its release is noted in /run (a new boot forgets it):
  ``uname -r`` answers it (simhw's uname wrapper), and a release without the NVIDIA module
  leaves the driver unloaded: nvidia-smi and every GPU container fail, as on the DGX OS 7.4.0
  OTA kernel 6.17.0-1008-nvidia ("Failed to query NVIDIA devices" on every boot).
"""

from __future__ import annotations

import glob
import os
import re
import sys

ROOT = os.environ.get("SPARKFLEET_SIM_ROOT", "/")
#: The release this boot runs (absent: the host has no simulated kernel, uname says the real one).
BOOTED = "run/sparkfleet-sim/kernel.release"
GRUB_CFG = "boot/grub/grub.cfg"
#: The root filesystem's id in GRUB's entry ids (Ubuntu's is the filesystem UUID).
FS_ID = "5f0b3c2e-7a51-4c8e-9d2b-1e6f0a4c7d93"


def _path(rel: str) -> str:
    return os.path.join(ROOT, rel)


def _version_key(release: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"[.-]", release)]


def installed() -> list[str]:
    """Kernel releases with an image in /boot, newest first."""
    found = [os.path.basename(p)[len("vmlinuz-"):] for p in glob.glob(_path("boot/vmlinuz-*"))]
    return sorted(found, key=_version_key, reverse=True)


def grub_default() -> str:
    """GRUB_DEFAULT as update-grub reads it: /etc/default/grub, then grub.d/*.cfg in order."""
    value = "0"
    for path in [_path("etc/default/grub"), *sorted(glob.glob(_path("etc/default/grub.d/*.cfg")))]:
        try:
            with open(path) as f:
                for line in f:
                    found = re.match(r"""\s*GRUB_DEFAULT=(["']?)(.*?)\1\s*$""", line)
                    if found:
                        value = found.group(2)
        except OSError:
            continue
    return value


def grub_cfg(kernels: list[str], default: str) -> str:
    """grub.cfg's kernel entries as Ubuntu's update-grub writes them."""
    if not kernels:
        return f'set default="{default}"\n'
    entry = "\tmenuentry 'Ubuntu, with Linux {r}{mode}' --class ubuntu $menuentry_id_option 'gnulinux-{r}-{kind}-{fs}' {{\n" \
            "\t\tlinux /boot/vmlinuz-{r} root=UUID={fs} ro{args}\n\t}}\n"
    lines = [f'set default="{default}"\n',
             f"menuentry 'Ubuntu' --class ubuntu $menuentry_id_option 'gnulinux-simple-{FS_ID}' {{\n"
             f"\tlinux /boot/vmlinuz-{kernels[0]} root=UUID={FS_ID} ro quiet splash\n}}\n",
             f"submenu 'Advanced options for Ubuntu' $menuentry_id_option 'gnulinux-advanced-{FS_ID}' {{\n"]
    for release in kernels:
        lines.append(entry.format(r=release, mode="", kind="advanced", fs=FS_ID, args=" quiet splash"))
        lines.append(entry.format(r=release, mode=" (recovery mode)", kind="recovery", fs=FS_ID, args=" single"))
    lines.append("}\n")
    return "".join(lines)


def update_grub() -> int:
    kernels = installed()
    os.makedirs(os.path.dirname(_path(GRUB_CFG)), exist_ok=True)
    with open(_path(GRUB_CFG) + ".new", "w") as f:
        f.write(grub_cfg(kernels, grub_default()))
    os.replace(_path(GRUB_CFG) + ".new", _path(GRUB_CFG))
    print("Generating grub configuration file ...", file=sys.stderr)
    for release in kernels:
        print(f"Found linux image: /boot/vmlinuz-{release}", file=sys.stderr)
    print("done", file=sys.stderr)
    return 0


def chosen(cfg: str) -> str | None:
    """The release GRUB boots by ``cfg``: the entry ``set default`` names (by index, by id,
    or ``submenu>entry``), the first entry when it names none that exists."""
    default = re.search(r'^set default="([^"]*)"', cfg, re.M)
    entries = re.findall(r"menuentry .*?\$menuentry_id_option '([^']+)' \{\n\s*linux /boot/vmlinuz-(\S+)", cfg)
    if not entries:
        return None
    wanted = default.group(1).rsplit(">", 1)[-1] if default else "0"
    for entry_id, release in entries:
        if entry_id == wanted:
            return release
    return entries[int(wanted)][1] if wanted.isdigit() and int(wanted) < len(entries) else entries[0][1]


def boot() -> int:
    """This boot's kernel, as GRUB chooses it, noted in /run (once per boot)."""
    if os.path.exists(_path(BOOTED)):
        return 0
    try:
        with open(_path(GRUB_CFG)) as f:
            release = chosen(f.read())
    except OSError:
        return 0  # no simulated kernel: the machine's
    if release:
        os.makedirs(os.path.dirname(_path(BOOTED)), exist_ok=True)
        with open(_path(BOOTED), "w") as f:
            f.write(release + "\n")
    return 0


def booted() -> str | None:
    try:
        with open(_path(BOOTED)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["update-grub"]:
        return update_grub()
    if argv[:1] == ["boot"]:
        return boot()
    if argv[:1] == ["release"]:
        release = booted()
        if release:
            print(release)
        return 0 if release else 1
    print("usage: kernel.py update-grub | boot | release", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
