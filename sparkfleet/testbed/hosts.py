"""Simulated Spark hosts: systemd-nspawn containers with real systemd, sshd and dockerd.

Each host boots from its own overlayfs over the cached host rootfs (nspawn locks the
tree it boots, and writes must stay per host), gets a plain directory of the controller
bound at /var/lib/docker (so its dockerd can use overlay2), and runs in its own network
namespace `sf-spark-i`. Per-host files (identity, SSH key, docker daemon.json, simulated
hardware, switches) are written into the overlay before the first boot; a restart boots
the same overlay again, like a reboot.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from . import aptrepo, cgroups, hostkinds, login, paths, simhw
from .proc import TestbedError, cmdline, kill_wait, log, pid_alive, pid_matches, run, start_detached, wait_until
from .state import HostState

SSHD_LIMITS = "etc/ssh/sshd_config.d/00-sparkfleet-sim-limits.conf"

DAEMON_JSON = {"insecure-registries": [paths.REGISTRY]}

#: containerd's configuration as a DGX OS host has it (Docker's containerd.io: the CRI plugin
#: off), plus the garbage collector's fixed interval: bookworm's containerd 1.6.20 predates
#: the fix for its scheduler spinning on a zero interval (containerd #5089, fixed in 1.6.31
#: by #10103), which cost each idle host 0.02-0.03 of a core here; the containerd a Spark
#: runs has the fix. pause_threshold 0 keeps the default one-second schedule.
CONTAINERD_TOML = """version = 2
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[plugins."io.containerd.gc.v1.scheduler"]
  pause_threshold = 0.0
"""

#: nspawn mounts the cgroup v1 controller hierarchies read-only; dockerd's runc must
#: create cgroups for its containers. Re-bind them writable (a per-mount flag: the
#: hierarchy itself is rooted at this host's own cgroup through the cgroup namespace).
CGROUPS_RW = """#!/usr/bin/python3
import subprocess
with open("/proc/self/mountinfo") as f:
    for line in f:
        p = line.split()
        sep = p.index("-")
        if p[sep + 1] == "cgroup" and "ro" in p[5].split(","):
            subprocess.run(["mount", "--bind", p[4], p[4]], check=True, timeout=30)
            subprocess.run(["mount", "-o", "remount,bind,rw", p[4]], check=True, timeout=30)
"""

CGROUPS_RW_UNIT = """[Unit]
Description=sparkfleet testbed: writable cgroup controllers for dockerd
DefaultDependencies=no
After=local-fs.target
Before=containerd.service docker.service sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/lib/sparkfleet-sim/cgroups-rw

[Install]
WantedBy=sysinit.target
"""

#: This machine's processes lack CAP_SYS_RESOURCE, so nobody here can raise the hard
#: RLIMIT_MEMLOCK (8 MiB), and runc fails a container asking for more (the deploy runs the
#: serving container with `--ulimit memlock=-1:-1`, right for a real Spark). runc is
#: therefore wrapped (dpkg-divert keeps the real one as runc.distrib): on `create`/`run`
#: it clamps the memlock limit of the bundle's config.json to what is allowed and logs it
#: to /run/sparkfleet-sim/runc-clamp.log. Where CAP_SYS_RESOURCE is present it only execs.
RUNC_WRAPPER = Path(__file__).resolve().parent / "simhw" / "runc_memlock.py"

SSH_OPTS = [
    "-o", "BatchMode=yes",
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "ConnectTimeout=5",
]


# --- filesystem ------------------------------------------------------------------------


def mount_overlay(h: HostState, rootfs: Path) -> None:
    d = h.dir
    for sub in ("upper", "work", "root", "docker", "containerd"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    if not _is_mountpoint(h.mnt):
        run(
            ["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={rootfs},upperdir={d / 'upper'},workdir={d / 'work'}", h.mnt],
            timeout=30,
        )


def _is_mountpoint(p: Path) -> bool:
    target = str(p)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def write_switches(h: HostState) -> None:
    sim = h.mnt / paths.SIM_DIR_IN_HOST.lstrip("/")
    sim.mkdir(parents=True, exist_ok=True)
    (sim / "switches.json").write_text(json.dumps(h.switches, indent=1, sort_keys=True) + "\n")


#: OpenSSH's HostKeyAlgorithms order for the key types ssh-keygen -A makes.
_KEY_ORDER = {"ssh-ed25519": 0, "ecdsa-sha2-nistp256": 1, "ssh-rsa": 2}


def by_preference(keys) -> list[str]:
    """Public keys ("TYPE BASE64") in OpenSSH's order of preference, any other type last."""
    return sorted(keys, key=lambda k: (_KEY_ORDER.get(k.split()[0], len(_KEY_ORDER)), k))


def provision(h: HostState, rootfs: Path, pubkey: str, toolkit_deb: Path, login_kind: str = "root",
              sudo_password: str | None = None) -> None:
    """Prepare a host's root before its first boot (overlay mounted, files written)."""
    mount_overlay(h, rootfs)
    root = h.mnt
    (root / "etc/hostname").write_text(h.name + "\n")
    # Only its own name: a host never resolves another's (nor a name only the controller knows).
    (root / "etc/hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{h.name}\n{h.address}\t{h.name}\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    login.provision(root, login_kind, pubkey, sudo_password)
    h.user = login.user(login_kind)
    # Unique sshd host keys per host (the cached root has none), which the controller checks;
    # Ed25519 first: paramiko asks a host for the first type known_hosts lists for it, and
    # an OpenSSH client would ask for Ed25519.
    run(["chroot", root, "ssh-keygen", "-A"], timeout=60)
    h.host_keys = by_preference(" ".join(p.read_text().split()[:2])
                                for p in (root / "etc/ssh").glob("ssh_host_*_key.pub"))
    # sshd's limits as DGX OS ships them (OpenSSH's defaults, never raised for tests): a
    # deploy that opens more than 10 channels on one host's connection fails here as there.
    simhw.write_files(root, {SSHD_LIMITS: ("# As on DGX OS: OpenSSH's defaults.\nMaxSessions 10\n"
                                           "MaxStartups 10:30:100\n", 0o644)})
    docker_dir = root / "etc/docker"
    docker_dir.mkdir(parents=True, exist_ok=True)
    (docker_dir / "daemon.json").write_text(json.dumps(DAEMON_JSON, indent=2) + "\n")
    simhw.write_files(root, {"etc/containerd/config.toml": (CONTAINERD_TOML, 0o644)})
    simhw.install_hardware(root)
    simhw.write_files(root, {
        "usr/lib/sparkfleet-sim/cgroups-rw": (CGROUPS_RW, 0o755),
        "etc/systemd/system/sparkfleet-sim-cgroups.service": (CGROUPS_RW_UNIT, 0o644),
    })
    wants = root / "etc/systemd/system/sysinit.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / "sparkfleet-sim-cgroups.service"
    if not link.is_symlink():
        link.symlink_to("/etc/systemd/system/sparkfleet-sim-cgroups.service")
    write_switches(h)
    if not (root / "usr/sbin/runc.distrib").exists():
        run(["chroot", root, "dpkg-divert", "--local", "--rename", "--divert", "/usr/sbin/runc.distrib",
             "--add", "/usr/sbin/runc"], timeout=60)
    simhw.write_files(root, {"usr/sbin/runc": (RUNC_WRAPPER.read_text(), 0o755)})
    # The toolkit is installed as the (simulated) package, like on DGX OS; the .deb is
    # kept on the host so a `no_nvidia_runtime` switch can be reverted offline.
    stash = root / "usr/lib/sparkfleet-sim/nvidia-container-toolkit.deb"
    stash.write_bytes(toolkit_deb.read_bytes())
    if not h.switches.get("no_nvidia_runtime"):
        run(["chroot", root, "dpkg", "-i", "/usr/lib/sparkfleet-sim/nvidia-container-toolkit.deb"],
            timeout=120, env={"DEBIAN_FRONTEND": "noninteractive"})
    # The driver and the kernel as DGX OS has them: packages, so the stack holds them and an
    # upgrade moves them (the kernel's scripts run the simulated update-grub).
    debs = [aptrepo.driver_deb(), *aptrepo.kernel_debs()]
    for deb in debs:
        (root / "var/cache/apt/archives" / deb.name).write_bytes(deb.read_bytes())
    run(["chroot", root, "dpkg", "-i", *(f"/var/cache/apt/archives/{deb.name}" for deb in debs)], timeout=120,
        env={"DEBIAN_FRONTEND": "noninteractive"})
    for deb in debs:
        (root / "var/cache/apt/archives" / deb.name).unlink()
    hostkinds.provision(root, h.switches)


# --- lifecycle -------------------------------------------------------------------------


def nspawn_argv(h: HostState) -> list[str]:
    return [
        "systemd-nspawn", "-b", "--register=no", "--keep-unit", "-q",
        "--capability=all",
        "--system-call-filter=@mount @keyring bpf",
        f"--bind={h.dir / 'docker'}:/var/lib/docker",
        # Docker's containerd image store keeps its overlay snapshots here: like docker's
        # own overlay2, they cannot live on the host's overlayfs root.
        f"--bind={h.dir / 'containerd'}:/var/lib/containerd",
        f"--network-namespace-path=/run/netns/{h.netns}",
        "--resolv-conf=off", "--link-journal=no",
        # The machine by its instance's name (nspawn keeps a directory per machine name under
        # /run/systemd/nspawn/propagate: spark-1 of two instances collided there), the
        # host by its own.
        "-D", str(h.mnt), "-M", h.netns, f"--hostname={h.name}",
    ]


#: nspawn's environment: /proc/sys/net writable (dockerd sets ip_forward in the host's
#: own netns); cgroup namespace kept (the default) so each host sees only its subtree.
NSPAWN_ENV = {"SYSTEMD_NSPAWN_API_VFS_WRITABLE": "network"}


#: The host's power: nspawn exits 133 when the host reboots itself (`systemctl reboot`, a
#: stack upgrade), and a Spark comes back on its own; this loop boots it again, as
#: systemd-nspawn@.service does with RestartForceExitStatus=133. SIGTERM (an orderly
#: poweroff) goes to nspawn; any other end of the container ends the loop.
POWER_SH = """\
trap 'kill -TERM "$c" 2>/dev/null; wait "$c"; exit $?' TERM
while :; do
    "$@" & c=$!
    wait "$c"; rc=$?
    [ "$rc" -eq 133 ] || exit "$rc"
done
"""
#: The loop's $0: how cleanup and nspawn_pid() tell it from nspawn.
POWER_NAME = "sparkfleet-testbed-power"


def boot(h: HostState) -> int:
    """Start the host's power loop (nspawn under it) detached; returns (and sets) its PID,
    the process group of both."""
    if h.pid and pid_matches(h.pid, "systemd-nspawn"):
        raise TestbedError(f"{h.name} is already running (pid {h.pid})")
    dirs = cgroups.create(h.name)
    h.pid = start_detached(
        ["/bin/sh", "-c", POWER_SH, POWER_NAME, *nspawn_argv(h)], h.dir / "console.log", env=NSPAWN_ENV,
        cwd=Path("/"), preexec_fn=lambda: cgroups.join(dirs),
    )
    return h.pid


def nspawn_pid(h: HostState) -> int | None:
    """The host's systemd-nspawn now (a reboot starts a new one under the power loop)."""
    if not h.pid or not pid_alive(h.pid):
        return None
    if cmdline(h.pid)[:1] == ["systemd-nspawn"]:
        return h.pid  # booted before the power loop
    try:
        children = Path(f"/proc/{h.pid}/task/{h.pid}/children").read_text().split()
    except OSError:
        return None
    return next((int(c) for c in children if cmdline(int(c))[:1] == ["systemd-nspawn"]), None)


def ssh_argv(h: HostState, key: Path, command: str) -> list[str]:
    return ["ssh", "-i", str(key), *SSH_OPTS, f"{h.user}@{h.address}", command]


def ssh(h: HostState, key: Path, command: str, timeout: float = 60, check: bool = False,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """*command* on *h* over SSH as its login user (see exec_cmd for root)."""
    return run(ssh_argv(h, key, command), timeout=timeout, check=check, input=input)


def probe(h: HostState, key: Path) -> dict[str, str]:
    """One readiness probe over real SSH: {"system": ..., "docker": ...} or {} if SSH
    does not answer yet."""
    try:
        cp = ssh(h, key, "systemctl is-system-running; systemctl is-active docker", timeout=15)
    except TestbedError:
        return {}
    if cp.returncode == 255:  # ssh itself failed
        return {}
    lines = cp.stdout.split()
    return {"system": lines[0] if lines else "", "docker": lines[1] if len(lines) > 1 else ""}


def wait_ready(h: HostState, key: Path, timeout: float = 180) -> None:
    """Wait until sshd answers, systemd is running (or degraded) and docker is active."""
    t0 = time.monotonic()
    last: dict[str, str] = {}

    def ready() -> bool:
        nonlocal last
        if not pid_alive(h.pid):
            raise TestbedError(f"{h.name}: systemd-nspawn exited; see {h.dir / 'console.log'}")
        last = probe(h, key)
        return last.get("system") in ("running", "degraded") and last.get("docker") == "active"

    try:
        wait_until(ready, timeout, interval=1.0, what=f"{h.name} to be ready")
    except TestbedError as exc:
        tail = ""
        try:
            tail = (h.dir / "console.log").read_text(errors="replace")[-1500:]
        except OSError:
            pass
        raise TestbedError(f"{exc}; last probe: {last or 'ssh not answering'}\nconsole tail:\n{tail}") from None
    if last.get("system") == "degraded":
        failed = ssh(h, key, "systemctl --failed --no-legend --plain", timeout=15).stdout.strip()
        log(f"{h.name}: systemd degraded; failed units: {failed or '?'}")
    log(f"{h.name} ready at {h.address} in {time.monotonic() - t0:.1f}s")


def shutdown(h: HostState, grace: float = 60) -> None:
    """Stop the host's container: SIGTERM makes nspawn power the container off in order;
    SIGKILL after *grace* seconds. Processes left in its netns are then killed."""
    if h.pid and pid_matches(h.pid, "systemd-nspawn"):
        try:
            os.kill(h.pid, signal.SIGTERM)
            wait_until(lambda: not pid_alive(h.pid), grace, interval=0.1, what=f"{h.name} to power off")
        except (ProcessLookupError, TestbedError):
            pass
    power_cut(h)


def power_cut(h: HostState) -> None:
    """SIGKILL the power loop and nspawn (one process group) and what runs in the host's netns."""
    if h.pid and pid_matches(h.pid, "systemd-nspawn"):
        nspawn = nspawn_pid(h)
        try:
            os.killpg(h.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in (h.pid, nspawn):
            if pid:
                kill_wait(pid, sig=signal.SIGKILL)
    h.pid = None
    kill_netns_processes(h.netns)


def kill_netns_processes(ns: str) -> None:
    from .network import netns_pids

    for pid in netns_pids(ns):
        try:
            kill_wait(pid, sig=signal.SIGKILL, grace=5)
        except TestbedError as exc:
            log(f"warning: {exc}")


def container_init_pid(h: HostState) -> int:
    """PID (in the controller's namespace) of the host's PID 1 (systemd)."""
    nspawn = nspawn_pid(h)
    if not nspawn:
        raise TestbedError(f"{h.name} is not running")
    try:
        children = Path(f"/proc/{nspawn}/task/{nspawn}/children").read_text().split()
    except OSError:
        children = []
    for c in children:
        try:
            status = Path(f"/proc/{c}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and line.split()[-1] == "1":
                return int(c)
    raise TestbedError(f"{h.name}: no container init found under nspawn pid {nspawn}")


def nsenter_exec(h: HostState, command: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run *command* inside the host without SSH (works while its network is cut)."""
    pid = container_init_pid(h)
    return run(
        ["nsenter", "-t", str(pid), "-m", "-u", "-i", "-n", "-p", "-C", "-r", "-w",
         "/usr/bin/env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
         "HOME=/root", "/bin/sh", "-c", command],
        timeout=timeout, check=check,
    )


def exec_cmd(h: HostState, key: Path, command: str | list[str], *, via: str,
             timeout: float = 60, check: bool = False, as_root: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a shell command (or argv, quoted for the shell) on host *h*, *via* "nsenter" (as
    root) or "ssh" (as root through the login user's sudo where that is not root, or as
    the login user with *as_root* False)."""
    if not isinstance(command, str):
        command = shlex.join(command)
    if via == "ssh":
        command, stdin = login.as_root(command, h.user) if as_root else (command, None)
        return ssh(h, key, command, timeout=timeout, check=check, input=stdin)
    if not as_root:
        raise ValueError("as the login user (as_root=False) only over SSH")
    if via == "nsenter":
        return nsenter_exec(h, command, timeout=timeout, check=check)
    raise ValueError(f"via must be 'ssh' or 'nsenter', not {via!r}")
