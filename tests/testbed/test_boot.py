"""A real simulated host: boot, SSH, systemd, docker with --gpus from the registry image,
the simulated hardware and its switches, the apt repo, reboot and unreachability.

Needs root (marked e2e); fails - does not skip - without it. Boots its own 1-host fleet
(which replaces any fleet that is up) and removes it at the end of the module.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest
from pyinfra.facts.server import Arch as Architecture

from sparkfleet.gpu import Gpu
from sparkfleet.testbed import fleet, image, paths
from sparkfleet.testbed.proc import missing_tools

pytestmark = pytest.mark.e2e

HOST = "spark-1"
ADDRESS = paths.host_address(1)  # 10.213.0.11 in the default instance


@pytest.fixture(scope="module")
def tb():
    if os.geteuid() != 0:
        pytest.fail("the testbed boot test needs root", pytrace=False)
    if missing_tools():
        pytest.fail(f"missing tools for the testbed: {missing_tools()}", pytrace=False)
    t0 = time.monotonic()
    bed = fleet.up(1, login_kind="root", names="plain")
    print(f"\nup --hosts 1 took {time.monotonic() - t0:.1f}s")
    try:
        yield bed
    finally:
        fleet.down()


def sh(tb, cmd: str, timeout: float = 120, check: bool = True) -> str:
    cp = tb.exec(HOST, cmd, timeout=timeout)
    if check:
        assert cp.returncode == 0, f"{cmd!r} -> {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    return cp.stdout


def test_ssh_with_the_controller_key(tb):
    # The real ssh client, the key from .testbed, nothing else.
    cp = subprocess.run(["ssh", "-i", str(paths.SSH_KEY), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"root@{ADDRESS}",
                         "hostname; id -u; ip -4 -o addr show eth0"],
                        capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    name, uid, addr = cp.stdout.splitlines()
    assert (name, uid) == (HOST, "0")
    assert f"{ADDRESS}/24" in addr
    assert sh(tb, "ip route show default").startswith(f"default via {paths.CONTROLLER_IP}")


def test_systemd_and_docker_run(tb):
    assert sh(tb, "systemctl is-system-running", check=False).strip() in ("running", "degraded")
    assert sh(tb, "systemctl is-active docker ssh").split() == ["active", "active"]
    daemon = json.loads(sh(tb, "cat /etc/docker/daemon.json"))
    assert daemon["insecure-registries"] == [paths.REGISTRY]


def test_docker_runs_the_registry_image_with_gpus(tb):
    pinned = tb.data["image"]
    assert pinned == f"{paths.IMAGE_REF}@{tb.image['digest']}"
    sh(tb, f"docker pull -q {pinned}", timeout=300)
    sh(tb, ": > /run/sparkfleet-sim/hook.log 2>/dev/null || true")
    sh(tb, f"docker run --rm --gpus all {pinned} true")
    out = sh(tb, f"docker run --rm --gpus all --network host --ulimit memlock=-1:-1 --entrypoint python3 {pinned} "
                 "-c 'import huggingface_hub, requests, prometheus_client, shutil, importlib.util as u, "
                 "importlib.metadata as m; print(shutil.which(\"vllm\"), m.version(\"vllm\"), "
                 "u.find_spec(\"vllm\").submodule_search_locations[0])'")
    # the simulated engine as the CLI, the real vLLM 0.23.0 source for the patches
    assert out.split() == ["/usr/local/bin/vllm", "0.23.0", "/usr/local/lib/python3.11/dist-packages/vllm"]
    assert "prestart" in sh(tb, "cat /run/sparkfleet-sim/hook.log"), "docker --gpus did not run the NVIDIA hook"
    digests = sh(tb, f"docker image inspect --format '{{{{json .RepoDigests}}}}' {pinned}")
    assert tb.image["digest"] in digests


def test_image_digest_is_stable(tb):
    config, layers = image.build()  # from the cache: same inputs, same bytes
    import hashlib

    from sparkfleet.testbed.registry import manifest_bytes

    digest = "sha256:" + hashlib.sha256(manifest_bytes(config, [(layer.blob, layer.digest, layer.size) for layer in layers])).hexdigest()
    assert digest == tb.image["digest"]


def test_simulated_hardware_as_the_deploy_sees_it(tb):
    gpu = Gpu().process(sh(tb, Gpu().command()).splitlines())
    assert gpu == {"name": "NVIDIA GB10", "compute_cap": "12.1", "driver_version": "580.95.05"}
    assert Architecture().process(sh(tb, Architecture().command()).splitlines()) == "aarch64"
    assert sh(tb, "arch").strip() == "aarch64"
    assert sh(tb, "for p in nvidia-container-runtime-hook nvidia-container-runtime nvidia-ctk; do command -v $p; done"
              ).count("/usr/bin/") == 3
    assert "ii  nvidia-container-toolkit" in sh(tb, "dpkg -l nvidia-container-toolkit")


def test_switches_flip_and_revert(tb):
    with tb.switched(HOST, gpu="NVIDIA H100 80GB HBM3", arch="x86_64", disk_full=True):
        assert sh(tb, "nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader").strip() == \
            "NVIDIA H100 80GB HBM3, 9.0"
        assert sh(tb, "uname -m").strip() == "x86_64"
        assert sh(tb, "uname -a").split()[-2] == "x86_64"  # the wrapper's other path: the real uname, edited
        size, used = sh(tb, "df -B1 --output=size,used /var/lib/sparkfleet | tail -1").split()
        assert int(size) == 16 << 20 and int(used) / int(size) > 0.9
        assert json.loads(paths.HOSTS_JSON.read_text())["hosts"][0]["switches"]["disk_full"] is True
    assert sh(tb, "uname -m").strip() == "aarch64"
    assert sh(tb, "uname -a").split()[-2] == "aarch64" and sh(tb, "uname -r") == sh(tb, "uname -a").split()[2] + "\n"
    assert "sparkfleet-sim-disk" not in sh(tb, "cat /proc/mounts")
    assert json.loads(paths.HOSTS_JSON.read_text())["hosts"][0]["switches"] == {}


def test_no_runtime_host_installs_the_toolkit_from_the_signed_repo(tb):
    pinned = tb.data["image"]
    with tb.switched(HOST, no_nvidia_runtime=True):
        assert sh(tb, "command -v nvidia-container-runtime-hook", check=False) == ""
        cp = tb.exec(HOST, f"docker run --rm --gpus all --entrypoint true {pinned}", timeout=120)
        assert cp.returncode != 0 and "could not select device driver" in cp.stderr
        key, src = "/usr/share/keyrings/nvidia-container-toolkit.asc", "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
        sh(tb, f"curl -fsS {tb.data['nvidia_apt_key_url']} -o {key} && grep -q 'BEGIN PGP PUBLIC KEY' {key}")
        sh(tb, f"echo 'deb [signed-by={key}] {tb.data['nvidia_apt_repo']} /' > {src}")
        out = sh(tb, f"apt-get update -o Dir::Etc::sourcelist={src} -o Dir::Etc::sourceparts=- 2>&1", timeout=120)
        assert "NO_PUBKEY" not in out and "not signed" not in out, out
        sh(tb, "DEBIAN_FRONTEND=noninteractive apt-get install -y nvidia-container-toolkit", timeout=180)
        sh(tb, "nvidia-ctk runtime configure --runtime=docker && systemctl restart docker")
        sh(tb, f"docker run --rm --gpus all --entrypoint true {pinned}", timeout=120)
        # A wrongly signed repo is refused: apt verifies, not just downloads.
        sh(tb, f"echo 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
               f"{tb.data['nvidia_apt_repo']} /' > {src}")
        cp = tb.exec(HOST, f"apt-get update -o Dir::Etc::sourcelist={src} -o Dir::Etc::sourceparts=- 2>&1",
                     timeout=120)
        assert "NO_PUBKEY" in cp.stdout or "not signed" in cp.stdout or cp.returncode != 0
        sh(tb, f"rm -f {src} {key}; rm -rf /var/lib/apt/lists/*")
    assert "ii  nvidia-container-toolkit" in sh(tb, "dpkg -l nvidia-container-toolkit")


def test_hub_and_registry_reachable_from_the_host(tb):
    assert sh(tb, f"curl -fsS -o /dev/null -w '%{{http_code}}' {paths.HUB_URL}/_testbed/stats") == "200"
    assert sh(tb, f"curl -fsS -o /dev/null -w '%{{http_code}}' http://{paths.REGISTRY}/v2/") == "200"
    # ... and nothing beyond the test network: no route out, no DNS.
    cp = tb.exec(HOST, "curl -sS -m 3 -o /dev/null http://deb.debian.org/ 2>&1", timeout=30)
    assert cp.returncode != 0


def test_pyinfra_over_the_inventory(tb):
    cp = subprocess.run(["pyinfra", "-y", str(paths.INVENTORY.relative_to(paths.REPO_ROOT)), "exec", "--", "uname -m; nvidia-smi -L"],
                        cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out = cp.stdout + cp.stderr  # pyinfra logs host output on stderr
    assert "aarch64" in out and "NVIDIA GB10" in out


def test_reboot_keeps_the_host(tb):
    boot_id = sh(tb, "cat /proc/sys/kernel/random/boot_id").strip()
    sh(tb, "echo kept > /root/marker")
    old_pid = tb.host(HOST).pid
    tb.restart_host(HOST)
    tb = fleet.load()
    assert tb.host(HOST).pid != old_pid
    assert sh(tb, "cat /proc/sys/kernel/random/boot_id").strip() != boot_id
    assert sh(tb, "cat /root/marker").strip() == "kept"
    assert tb.image["digest"] in sh(tb, "docker image ls --digests --format '{{.Repository}}@{{.Digest}}'")
    assert sh(tb, "systemctl is-active docker").strip() == "active"


def boot_id(tb) -> str:
    return sh(tb, "cat /proc/sys/kernel/random/boot_id").strip()


def test_a_host_that_reboots_itself_comes_back_on_a_new_boot(tb):
    """`systemctl reboot` inside (a stack upgrade's): nspawn exits 133 and the host's power
    loop boots it again, as a Spark comes back by itself; `testbed` needs no call."""
    before, power = boot_id(tb), tb.host(HOST).pid
    tb.exec(HOST, "(sleep 1; systemctl reboot) >/dev/null 2>&1 &", timeout=30)

    def new_boot() -> bool:
        try:
            cp = tb.exec(HOST, "systemctl is-system-running; cat /proc/sys/kernel/random/boot_id", timeout=15)
        except Exception:  # noqa: BLE001 - not answering yet
            return False
        lines = cp.stdout.split()
        return len(lines) == 2 and lines[0] in ("running", "degraded") and lines[1] != before

    deadline = time.monotonic() + 180
    while not new_boot():
        assert time.monotonic() < deadline, "no new boot within 180 s"
        time.sleep(2)
    assert fleet.load().host(HOST).pid == power  # the same power loop: nobody booted it from outside
    assert sh(tb, "systemctl is-active docker").strip() == "active"


def test_a_driver_installed_without_a_reboot_is_a_mismatch_until_the_reboot(tb):
    """The driver's package moves the userspace; the kernel module is the boot's: NVML's
    mismatch (nvidia-smi exit 18, every GPU container refused) until the host reboots."""
    from sparkfleet.testbed import aptrepo, simhw

    assert sh(tb, f"dpkg-query -W -f='${{Version}}' {simhw.DRIVER_PACKAGE}") == simhw.DRIVER_VERSION
    deb = f"/tmp/{simhw.DRIVER_PACKAGE}.deb"
    sh(tb, f"curl -fsS -o {deb} {aptrepo.STACK_URL}{simhw.DRIVER_PACKAGE}_{aptrepo.STACK_GOOD_DRIVER}_all.deb "
           f"&& dpkg -i {deb} >/dev/null && rm {deb}")
    try:
        cp = tb.exec(HOST, "nvidia-smi", timeout=30)
        assert cp.returncode == 18 and "Driver/library version mismatch" in cp.stdout, cp.stdout
        gpu = tb.exec(HOST, f"docker run --rm --gpus all {tb.data['image']} true", timeout=120)
        assert gpu.returncode != 0 and "version mismatch" in gpu.stderr, gpu.stderr
        tb.restart_host(HOST)
        new = aptrepo.STACK_GOOD_DRIVER.split("-")[0]
        assert sh(tb, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").strip() == new
    finally:
        sh(tb, f"curl -fsS -o {deb} {paths.APT_URL}{simhw.DRIVER_PACKAGE}_{simhw.DRIVER_VERSION}_all.deb "
               f"&& dpkg -i {deb} >/dev/null && rm {deb}")
        tb.restart_host(HOST)
    assert sh(tb, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").strip() == "580.95.05"


def test_a_hard_reset_keeps_the_kernel_errors_of_the_boot_before(tb):
    before = boot_id(tb)
    tb.hard_reset(HOST, kernel_errors=["NVRM: Xid (PCI:000f:01:00): 79, GPU has fallen off the bus."])
    assert boot_id(tb) != before
    last = sh(tb, "journalctl -b -1 -p err --no-pager -q -o short-iso | tail -n 3")
    assert re.search(r" kernel(\[\d+\])?: NVRM: Xid \(PCI:000f:01:00\): 79", last), last


def test_unreachable_and_stopped(tb):
    with tb.unreachable(HOST):
        with pytest.raises(OSError):
            socket.create_connection((ADDRESS, 22), timeout=2).close()
        # still running: reachable from inside
        assert tb.exec(HOST, "hostname", via="nsenter").stdout.strip() == HOST
    # The link comes back up at once; its carrier and the neighbour entry may take seconds
    # on a loaded machine.
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((ADDRESS, 22), timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    tb.stop_host(HOST)
    st = fleet.status()
    assert st["hosts"][0]["pid"] is None and st["hosts"][0]["ssh"] is False
    tb.start_host(HOST)
    assert fleet.status()["hosts"][0]["ssh"] is True
