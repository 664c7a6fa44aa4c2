"""The simulated NVIDIA container-toolkit apt repository at http://10.213.0.1:8091/.

A flat repository (`deb [signed-by=...] http://10.213.0.1:8091/ /`) holding
`nvidia-container-toolkit` and the driver package (Architecture: all, no dependencies, so
they install on the offline hosts), built with dpkg-deb from the stand-ins in simhw, and Debian's real
`docker-registry`, `skopeo`, `haproxy`, `prometheus` and `prometheus-node-exporter` (what a Spark's
mirror, fleet endpoint and fleet monitor install
from Ubuntu's archive; downloaded once with `apt-get download` and cached, with the libraries
the host root lacks); indexed
with apt-ftparchive and signed (InRelease, Release.gpg) with a testbed key generated once
and cached. The ASCII-armored public key is served at /gpgkey, as NVIDIA serves theirs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import paths, services, simhw
from .proc import TestbedError, log, run
from .state import ServiceState

GNUPGHOME = paths.CACHE_DIR / "gnupg"
#: Real Debian packages the hosts may install from this repository: the mirror's registry and
#: skopeo (the image copy), the fleet endpoint's haproxy, the OOM guard's earlyoom, the
#: mirror's nftables (its fleet-only rules), the fleet monitor's prometheus and every host's
#: prometheus-node-exporter, and the libraries they need that the host root lacks
#: (Prometheus' web pages use Debian's packaged JavaScript).
ARCHIVE_PACKAGES = ("docker-registry", "skopeo", "libgpgme11", "golang-github-containers-common",
                    "golang-github-containers-image", "containernetworking-plugins",
                    "haproxy", "earlyoom", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1",
                    "nftables", "libnftables1", "libjansson4", "libedit2",
                    "prometheus", "prometheus-node-exporter", "javascript-common", "libjs-jquery",
                    "libjs-jquery-hotkeys", "fonts-glyphicons-halflings", "libjs-popper.js", "libjs-bootstrap4",
                    "libjs-bootstrap", "libjs-moment", "libjs-eonasdan-bootstrap-datetimepicker",
                    "libjs-moment-timezone", "libjs-mustache", "libjs-d3", "libjs-rickshaw")
ARCHIVE_DEBS = paths.CACHE_DIR / "debs-archive"
KEY_UID = "sparkfleet testbed apt signing key <testbed@sparkfleet.invalid>"
REPO_DIR = paths.STATE_DIR / "apt"
#: The stack updates (build_stack_updates): a flat repository of its own, signed with the same key.
STACK_URL = f"{paths.APT_URL}stack/"
STACK_GOOD_TOOLKIT = "1.17.9-1"
STACK_BAD_TOOLKIT = "1.18.0-1"
#: A later driver: installed, it leaves NVML's mismatch until the host reboots.
STACK_GOOD_DRIVER = "580.126.09-1"
#: A later kernel the NVIDIA module was not built for: on it the driver does not load (the DGX
#: OS 7.4.0 OTA's 6.17.0-1008-nvidia: "Failed to query NVIDIA devices" on every boot).
STACK_BAD_KERNEL = ("6.17.0-1008-nvidia", "6.17.0-1008.8")
STACK_CANARY = "sparkfleet-sim-canary"
STACK_CANARY_VERSIONS = ("1.0", "1.1")
BUILD_DIR = paths.STATE_DIR / "apt-build"


def _gpg(*args: str, timeout: float = 60, input: str | None = None):
    GNUPGHOME.mkdir(mode=0o700, parents=True, exist_ok=True)
    return run(["gpg", "--batch", "--yes", "--pinentry-mode", "loopback", "--passphrase", "",
                "--homedir", str(GNUPGHOME), *args], timeout=timeout, input=input)


def _stop_agent() -> None:
    """gpg starts a gpg-agent for the key; stop it so nothing of ours lingers."""
    run(["gpgconf", "--homedir", str(GNUPGHOME), "--kill", "all"], timeout=30, check=False)


def ensure_key() -> str:
    """Fingerprint of the testbed signing key (created once, kept in the cache)."""
    def fpr() -> str | None:
        out = _gpg("--with-colons", "--list-secret-keys").stdout
        for line in out.splitlines():
            if line.startswith("fpr:"):
                return line.split(":")[9]
        return None

    found = fpr()
    if not found:
        _gpg("--quick-gen-key", KEY_UID, "ed25519", "sign", "never", timeout=120)
        found = fpr()
    if not found:
        raise TestbedError("could not create the testbed apt signing key")
    return found


def build_deb(out_dir: Path, version: str = simhw.TOOLKIT_VERSION, hook: str = simhw.HOOK_SH) -> Path:
    """Build the simulated nvidia-container-toolkit .deb into *out_dir*."""
    stage = BUILD_DIR / "pkg"
    if stage.exists():
        shutil.rmtree(stage)
    simhw.write_files(stage, simhw.toolkit_files(hook))
    (stage / "DEBIAN").mkdir(parents=True)
    (stage / "DEBIAN/control").write_text(
        f"Package: {simhw.TOOLKIT_PACKAGE}\n"
        f"Version: {version}\n"
        "Architecture: all\n"
        "Maintainer: sparkfleet testbed <testbed@sparkfleet.invalid>\n"
        "Section: utils\n"
        "Priority: optional\n"
        "Description: NVIDIA Container Toolkit (simulated by the sparkfleet testbed)\n"
        " Stand-ins for nvidia-container-runtime-hook, nvidia-container-runtime and\n"
        " nvidia-ctk, so `docker run --gpus all` starts containers on hosts without a GPU.\n"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    deb = out_dir / f"{simhw.TOOLKIT_PACKAGE}_{version}_all.deb"
    run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", stage, deb], timeout=60)
    return deb


def build_driver_deb(out_dir: Path, version: str = simhw.DRIVER_VERSION) -> Path:
    """The simulated NVIDIA driver package: its userspace's version (simhw.DRIVER_LIBRARY)."""
    stage = BUILD_DIR / "driver"
    shutil.rmtree(stage, ignore_errors=True)
    simhw.write_files(stage, {simhw.DRIVER_LIBRARY: (version.split("-")[0] + "\n", 0o644)})
    (stage / "DEBIAN").mkdir(parents=True)
    (stage / "DEBIAN/control").write_text(
        f"Package: {simhw.DRIVER_PACKAGE}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: sparkfleet testbed <testbed@sparkfleet.invalid>\nSection: kernel\nPriority: optional\n"
        "Description: NVIDIA driver metapackage (simulated by the sparkfleet testbed)\n"
        " Its version is the userspace's; the kernel module's is the one of the last boot.\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    deb = out_dir / f"{simhw.DRIVER_PACKAGE}_{version}_all.deb"
    run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", stage, deb], timeout=60)
    return deb


def driver_deb() -> Path:
    """The driver every host boots with, in the built repository."""
    return REPO_DIR / f"{simhw.DRIVER_PACKAGE}_{simhw.DRIVER_VERSION}_all.deb"


#: A kernel image's maintainer scripts, as Ubuntu's run GRUB's (simhw/kernel.py).
_KERNEL_SCRIPT = "#!/bin/sh\nif [ -x /usr/sbin/update-grub ]; then update-grub; fi\n"


def build_kernel_debs(out_dir: Path, release: str = simhw.KERNEL_RELEASE, version: str = simhw.KERNEL_VERSION,
                      nvidia_module: bool = True) -> list[Path]:
    """A simulated kernel: its image package (``/boot/vmlinuz-<release>`` and, unless
    ``nvidia_module`` is False, the driver's DKMS module for it) and the meta-package at
    ``version`` that depends on it. Returns both .debs, the image first."""
    image = f"linux-image-{release}"
    files = {f"boot/vmlinuz-{release}": (f"simulated kernel {release}\n", 0o600)}
    if nvidia_module:
        files[simhw.NVIDIA_MODULE.format(release=release)] = (f"simulated NVIDIA module for {release}\n", 0o644)
    debs = []
    for package, depends, content in ((image, "", files), (simhw.KERNEL_META, f"{image} (= {version})", {})):
        stage = BUILD_DIR / package
        shutil.rmtree(stage, ignore_errors=True)
        simhw.write_files(stage, content)
        (stage / "DEBIAN").mkdir(parents=True)
        (stage / "DEBIAN/control").write_text(
            f"Package: {package}\nVersion: {version}\nArchitecture: all\n"
            + (f"Depends: {depends}\n" if depends else "")
            + "Maintainer: sparkfleet testbed <testbed@sparkfleet.invalid>\nSection: kernel\nPriority: optional\n"
            f"Description: Linux kernel {release} (simulated by the sparkfleet testbed)\n"
            " GRUB's choice among the installed images is the release the host boots.\n")
        if not depends:
            for script in ("postinst", "postrm"):
                (stage / "DEBIAN" / script).write_text(_KERNEL_SCRIPT)
                (stage / "DEBIAN" / script).chmod(0o755)
        out_dir.mkdir(parents=True, exist_ok=True)
        deb = out_dir / f"{package}_{version}_all.deb"
        run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", stage, deb], timeout=60)
        debs.append(deb)
    return debs


def kernel_debs() -> list[Path]:
    """The kernel every host boots first (its image, then its meta-package), in the built repository."""
    return [REPO_DIR / f"linux-image-{simhw.KERNEL_RELEASE}_{simhw.KERNEL_VERSION}_all.deb",
            REPO_DIR / f"{simhw.KERNEL_META}_{simhw.KERNEL_VERSION}_all.deb"]


def archive_debs() -> list[Path]:
    """The .debs of ARCHIVE_PACKAGES for this machine's Debian, downloaded once."""
    ARCHIVE_DEBS.mkdir(parents=True, exist_ok=True)
    found = []
    for package in ARCHIVE_PACKAGES:
        have = sorted(ARCHIVE_DEBS.glob(f"{package}_*.deb"))
        if not have:
            log(f"downloading the {package} .deb (once)")
            tmp = ARCHIVE_DEBS / f".tmp-{package}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            tmp.chmod(0o777)  # apt's download user writes here
            cp = run(["apt-get", "download", package], cwd=tmp, timeout=300, check=False)
            debs = sorted(tmp.glob(f"{package}_*.deb"))
            if cp.returncode != 0 or not debs:
                raise TestbedError(f"apt-get download {package} failed: {cp.stderr.strip()[-300:]}")
            debs[0].rename(ARCHIVE_DEBS / debs[0].name)
            shutil.rmtree(tmp, ignore_errors=True)
            have = sorted(ARCHIVE_DEBS.glob(f"{package}_*.deb"))
        found.append(have[-1])
    return found


def _canary_deb(out_dir: Path, version: str) -> Path:
    """A package nobody holds: `apt-get upgrade` moving it shows the upgrade saw the updates."""
    stage = BUILD_DIR / "canary"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "DEBIAN").mkdir(parents=True)
    (stage / "DEBIAN/control").write_text(
        f"Package: {STACK_CANARY}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: sparkfleet testbed <testbed@sparkfleet.invalid>\nSection: misc\nPriority: optional\n"
        "Description: an unheld package of the stack updates (sparkfleet testbed)\n")
    deb = out_dir / f"{STACK_CANARY}_{version}_all.deb"
    run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", stage, deb], timeout=60)
    return deb


def _index(directory: Path, label: str) -> None:
    """Packages, Release, and their signatures in a flat repository directory."""
    packages = run(["apt-ftparchive", "packages", "."], cwd=directory, timeout=60).stdout
    (directory / "Packages").write_text(packages)
    run(["gzip", "-9nk", "Packages"], cwd=directory, timeout=30)
    release = run(
        ["apt-ftparchive",
         "-o", "APT::FTPArchive::Release::Origin=sparkfleet-testbed",
         "-o", f"APT::FTPArchive::Release::Label={label}",
         "release", "."],
        cwd=directory, timeout=60,
    ).stdout
    (directory / "Release").write_text(release)
    fpr = ensure_key()
    try:
        _gpg("--local-user", fpr, "--clearsign", "-o", str(directory / "InRelease"), str(directory / "Release"))
        _gpg("--local-user", fpr, "--armor", "--detach-sign", "-o", str(directory / "Release.gpg"),
             str(directory / "Release"))
        (directory / "gpgkey").write_text(_gpg("--armor", "--export", fpr).stdout)
    finally:
        _stop_agent()


def build_stack_updates() -> None:
    """The vendor's later releases, at STACK_URL (REPO_DIR/stack): a good toolkit, a bad one
    (its hook fails every GPU container), a later driver (it needs a reboot), a later kernel
    the driver's module was not built for and an unheld canary in two versions. No host lists
    it until a test does (an update published upstream), so the main repository stays as is."""
    stack = REPO_DIR / "stack"
    stack.mkdir(parents=True)
    build_deb(stack, STACK_GOOD_TOOLKIT)
    build_deb(stack, STACK_BAD_TOOLKIT, simhw.BROKEN_HOOK_SH)
    build_driver_deb(stack, STACK_GOOD_DRIVER)
    build_kernel_debs(stack, *STACK_BAD_KERNEL, nvidia_module=False)
    for version in STACK_CANARY_VERSIONS:
        _canary_deb(stack, version)
    _index(stack, "stack updates (simulated)")


def build_repo() -> Path:
    """(Re)build the signed repository in REPO_DIR; return the toolkit .deb's path."""
    if REPO_DIR.exists():
        shutil.rmtree(REPO_DIR)
    REPO_DIR.mkdir(parents=True)
    deb = build_deb(REPO_DIR)
    build_driver_deb(REPO_DIR)
    build_kernel_debs(REPO_DIR)
    for extra in archive_debs():
        shutil.copy2(extra, REPO_DIR / extra.name)
    _index(REPO_DIR, "nvidia-container-toolkit (simulated)")
    # After the main index: apt-ftparchive would list a subdirectory's packages in it too.
    build_stack_updates()
    shutil.rmtree(BUILD_DIR, ignore_errors=True)
    log(f"apt repo built: {deb.name}, signed by {ensure_key()[-16:]}; stack updates at {STACK_URL}")
    return deb


def start_server() -> ServiceState:
    """Serve REPO_DIR at http://10.213.0.1:8091/ with python's http.server."""
    if not (REPO_DIR / "InRelease").exists():
        raise TestbedError("apt repo not built")
    return services.start(
        "apt",
        [services.python(), "-m", "http.server", str(paths.APT_PORT), "--bind", paths.CONTROLLER_IP,
         "--directory", str(REPO_DIR)],
        url=paths.APT_URL, marker=str(REPO_DIR), port=paths.APT_PORT,
    )
