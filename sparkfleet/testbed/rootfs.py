"""Debian root filesystems, built once with debootstrap and cached.

Two roots are built:

* the *host* root (systemd, sshd, dockerd, python3...) that every simulated Spark boots
  from through its own overlayfs, and
* the *image* root (minbase + python3) that becomes the base layer of the simulated
  serving image (see image.py).

Each is cached under /var/cache/sparkfleet-testbed/ in a directory named after a hash of
its build recipe, so a recipe change (package list, mirror, steps) rebuilds it. A build
goes to a `*.tmp-<pid>` directory that is renamed only once complete, so an interrupted
build is never mistaken for a cache hit (cleanup removes the temp directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from . import paths
from .proc import log, run

SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"

#: Bump when the build steps below change in a way the package lists do not show.
HOST_RECIPE_VERSION = 5
IMAGE_RECIPE_VERSION = 1

HOST_INCLUDE = [
    "systemd", "systemd-sysv", "openssh-server", "dbus", "python3", "sudo", "curl",
    "ca-certificates", "iproute2", "apt-utils", "procps", "gpg", "kmod", "less", "iputils-ping",
]
#: Installed in a second, chrooted apt step: debootstrap's resolver cannot place them.
#: netplan.io: DGX OS configures its networks with netplan (the ConnectX-7 link too); its
#: default renderer, systemd-networkd, is part of bookworm's systemd. `netplan apply` runs
#: udevadm (package udev, as on DGX OS); systemd-udevd itself does not start in the
#: container (/sys is read-only), so networkd does not wait for it either.
HOST_SECOND_STEP = ["docker.io", "netplan.io", "udev"]
#: The Debian suite the hosts' Docker comes from. bookworm's docker.io is 20.10, far older
#: than DGX OS's 28-29; "forky" (Debian testing) gives docker.io 28.5.2 with docker-cli,
#: containerd 2.1 and runc 1.3 (it brings libc6 2.43 and base-files from forky along, which
#: the rest of bookworm runs on). trixie's 26.1 does not install on bookworm.
HOST_DOCKER_FROM = "bookworm"
#: With a newer suite, these come from it (docker-cli is a package of its own from 28 on).
HOST_DOCKER_PACKAGES = ["docker.io", "docker-cli", "containerd", "runc", "tini"]
#: ca-certificates: as in the real serving image; without a CA bundle hf_xet cannot even
#: build its HTTP client, so the image would hide the Xet path (testbed README, "Xet").
IMAGE_INCLUDE = ["python3", "ca-certificates"]

#: Trimmed from the image root: nothing at run time reads them.
IMAGE_TRIM = [
    "usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
    "usr/share/lintian", "usr/share/bash-completion", "var/cache/apt", "var/lib/apt/lists",
    "var/cache/debconf/templates.dat-old", "var/cache/debconf/config.dat-old", "var/log",
]

DEB_CACHE = paths.CACHE_DIR / "debs"

UDEVADM_SHIM = """#!/bin/sh
# sparkfleet testbed: no udevd in this container and /sys is read-only, so there is
# nothing to trigger (see sparkfleet/testbed/rootfs.py); the rest is the real udevadm.
if [ "$1" = trigger ] && ! [ -w /sys ]; then
    exit 0
fi
exec /usr/bin/udevadm "$@"
"""


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's apt uses (first URI serving a bookworm suite
    that is not the security archive); deb.debian.org if none is found."""
    files = []
    if (apt_dir / "sources.list").exists():
        files.append(apt_dir / "sources.list")
    d = apt_dir / "sources.list.d"
    if d.is_dir():
        files += sorted(d.glob("*.list")) + sorted(d.glob("*.sources"))
    for f in files:
        text = f.read_text(errors="replace")
        if f.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(
                    (m.group(1).lower(), m.group(2).strip())
                    for m in re.finditer(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M)
                )
                suites = fields.get("suites", "").split()
                if SUITE in suites and "deb" in fields.get("types", "").split():
                    for uri in fields.get("uris", "").split():
                        if "security" not in uri:
                            return uri.rstrip("/")
        else:
            for line in text.splitlines():
                m = re.match(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
                if m and m.group(2) == SUITE and "security" not in m.group(1):
                    return m.group(1).rstrip("/")
    return DEFAULT_MIRROR


def recipe_hash(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def host_recipe(mirror: str | None = None) -> dict[str, Any]:
    return {
        "kind": "host",
        "version": HOST_RECIPE_VERSION,
        "suite": SUITE,
        "mirror": mirror or debian_mirror(),
        "variant": "minbase",
        "include": HOST_INCLUDE,
        "second_step": HOST_SECOND_STEP,
        **({"docker_from": HOST_DOCKER_FROM, "docker_packages": HOST_DOCKER_PACKAGES}
           if HOST_DOCKER_FROM != SUITE else {}),
    }


def image_recipe(mirror: str | None = None) -> dict[str, Any]:
    return {
        "kind": "image",
        "version": IMAGE_RECIPE_VERSION,
        "suite": SUITE,
        "mirror": mirror or debian_mirror(),
        "variant": "minbase",
        "include": IMAGE_INCLUDE,
        "trim": IMAGE_TRIM,
    }


def cached_path(recipe: dict[str, Any]) -> Path:
    return paths.CACHE_DIR / f"{recipe['kind']}-rootfs-{recipe_hash(recipe)}"


def is_complete(root: Path) -> bool:
    return (root / ".sparkfleet-recipe.json").is_file()


def ensure_rootfs(recipe: dict[str, Any]) -> Path:
    """Return the cached root for *recipe*, building it first if needed."""
    final = cached_path(recipe)
    if is_complete(final):
        return final
    if final.exists():  # a final-named dir without the marker: not ours to trust
        shutil.rmtree(final)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    t0 = time.monotonic()
    log(f"building {recipe['kind']} rootfs (debootstrap {SUITE}, once; cached as {final.name})")
    try:
        _debootstrap(recipe, tmp)
        if recipe["kind"] == "host":
            _host_second_step(recipe, tmp)
            _host_finish(tmp)
        else:
            _image_finish(recipe, tmp)
        (tmp / ".sparkfleet-recipe.json").write_text(json.dumps(recipe, indent=2, sort_keys=True))
    except BaseException:
        _umount_below(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.rename(tmp, final)
    log(f"{recipe['kind']} rootfs built in {time.monotonic() - t0:.0f}s")
    return final


def _debootstrap(recipe: dict[str, Any], target: Path) -> None:
    # The image root is built after the host root and reuses the .debs it downloaded.
    # (Building both at once was measured slower here: mirror and disk contention.)
    debs = DEB_CACHE
    debs.mkdir(parents=True, exist_ok=True)
    run(
        [
            "debootstrap", f"--variant={recipe['variant']}",
            f"--include={','.join(recipe['include'])}",
            f"--cache-dir={debs}",
            recipe["suite"], target, recipe["mirror"],
        ],
        timeout=1200,
    )


def _chroot_apt(root: Path, mirror: str, packages: list[str], extra_suite: str | None = None) -> None:
    """apt-get install *packages* inside *root*, with /proc mounted and services
    prevented from starting (policy-rc.d), then remove what we put in for it."""
    shutil.copy2("/etc/resolv.conf", root / "etc/resolv.conf", follow_symlinks=True)
    sources = root / "etc/apt/sources.list"
    sources.write_text("".join(f"deb {mirror} {suite} main\n" for suite in (SUITE, extra_suite) if suite))
    # Signatures are checked; a mirror that is a dated snapshot has an expired testing Release.
    valid = ["-o", "Acquire::Check-Valid-Until=false"] if extra_suite else []
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    run(["mount", "-t", "proc", "proc", root / "proc"], timeout=30)
    env = {"DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
    try:
        run(["chroot", root, "apt-get", *valid, "update"], timeout=600, env=env)
        run(
            ["chroot", root, "apt-get", *valid, "install", "-y", "--no-install-recommends", *packages],
            timeout=1200,
            env=env,
        )
        run(["chroot", root, "apt-get", "clean"], timeout=120, env=env)
    finally:
        run(["umount", "-l", root / "proc"], timeout=30, check=False)
        policy.unlink(missing_ok=True)


def _host_second_step(recipe: dict[str, Any], root: Path) -> None:
    newer = recipe.get("docker_from")
    if newer:
        # The rest first, from bookworm alone; then Docker from the newer suite, which upgrades
        # what it needs. In one run apt mixes the suites into a half t64 transition that dpkg
        # refuses (openssl-provider-legacy over libssl3).
        rest = [p for p in recipe["second_step"] if p != "docker.io"]
        if rest:
            _chroot_apt(root, recipe["mirror"], rest)
        _chroot_apt(root, recipe["mirror"], [f"{p}/{newer}" for p in recipe["docker_packages"]],
                    extra_suite=newer)
    else:
        _chroot_apt(root, recipe["mirror"], recipe["second_step"])


def _host_finish(root: Path) -> None:
    """Make the root boot cleanly as an offline host in a container."""
    # Hosts have no internet: no apt sources (the deploy adds only the sim NVIDIA repo)
    # and no package lists that would make apt think otherwise.
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
    for d in ("var/lib/apt/lists", "var/cache/apt/archives"):
        for p in (root / d).glob("*"):
            if p.is_file():
                p.unlink()
    (root / "etc/resolv.conf").write_text("# no DNS on the testbed network\n")
    # Per-host identity is made at provisioning: sshd host keys, machine-id (an empty
    # file makes systemd generate a fresh one per boot), hostname.
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/machine-id").write_text("")
    (root / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    # Units that only make sense on real hardware or need the network slow the boot
    # down or mark the system degraded inside a container.
    # systemd-networkd-wait-online: the management interface is up before the host boots
    # (network.py configures it from outside), so the network is online from the start;
    # bookworm's netplan (0.106) enables the wait for its networkd links and, with every
    # one of them `optional` (link.py's), the wait held each boot for 2 minutes, then failed.
    wants = root / "etc/systemd/system"
    for unit in ("apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer",
                 "e2scrub_reap.service", "fstrim.timer", "systemd-timesyncd.service",
                 "systemd-networkd-wait-online.service"):
        link = wants / unit
        if not link.exists():
            link.symlink_to("/dev/null")
    # `netplan apply` ends with `udevadm trigger` so that udevd re-applies .link files. In
    # the container /sys is read-only and no udevd runs (its unit needs /sys writable; on
    # DGX OS it runs), so the trigger could only fail writing uevent files: skip that verb
    # there; every other udevadm call is the real one.
    shim = root / "usr/local/sbin/udevadm"
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_text(UDEVADM_SHIM)
    shim.chmod(0o755)


def _image_finish(recipe: dict[str, Any], root: Path) -> None:
    for rel in recipe["trim"]:
        p = root / rel
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            p.mkdir()
        elif p.exists():
            p.unlink()
    (root / "etc/resolv.conf").write_text("")
    (root / "etc/hostname").write_text("")


def _umount_below(root: Path) -> None:
    """Lazily unmount anything left mounted under *root* (e.g. /proc of a chroot)."""
    for mp in mounts_below(root):
        run(["umount", "-l", mp], timeout=30, check=False)


def mounts_below(root: Path) -> list[str]:
    """Mount points at or under *root*, deepest first (for unmounting)."""
    prefix = str(root).rstrip("/")
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == prefix or mp.startswith(prefix + "/"):
                found.append(mp)
    return sorted(set(found), key=lambda m: (-m.count("/"), m))


def stale_builds() -> list[Path]:
    """Half-built roots of interrupted runs (`*.tmp-<pid>` whose pid is gone)."""
    out = []
    if paths.CACHE_DIR.is_dir():
        for p in paths.CACHE_DIR.glob("*.tmp-*"):
            pid = p.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or not Path(f"/proc/{pid}").exists() or int(pid) == os.getpid():
                out.append(p)
    return out


def remove_stale_builds() -> None:
    for p in stale_builds():
        log(f"removing half-built cache {p}")
        _umount_below(p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


if __name__ == "__main__":  # manual: python -m sparkfleet.testbed.rootfs
    print(ensure_rootfs(host_recipe()))
    print(ensure_rootfs(image_recipe()))
