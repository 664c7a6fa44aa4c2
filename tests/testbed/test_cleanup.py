"""`up` removes what an earlier run left; `down` leaves nothing of ours behind.

Needs root (marked e2e). Runs after test_boot.py (alphabetically), with no fleet up.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparkfleet.testbed import cgroups, cleanup, fleet, paths
from sparkfleet.testbed.proc import cmdline, run, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def root_only():
    if os.geteuid() != 0:
        pytest.fail("the testbed cleanup test needs root", pytrace=False)


STRAY_NETNS = paths.netns_name("spark-77")  # sf-spark-77 in the default instance
STRAY_VETH = paths.veth_name("spark-77")


def _make_leftovers() -> subprocess.Popen:
    """What a crashed run could leave: a netns + veth, a mount and a server process under
    the state dir, a cgroup, a half-built cache directory."""
    run(["ip", "netns", "add", STRAY_NETNS])
    run(["ip", "link", "add", STRAY_VETH, "type", "veth", "peer", "name", "eth0", "netns", STRAY_NETNS])
    mnt = paths.HOSTS_DIR / "spark-77" / "root"
    mnt.mkdir(parents=True, exist_ok=True)
    run(["mount", "-t", "tmpfs", "stray", mnt])
    apt_dir = paths.STATE_DIR / "apt"
    apt_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory",
                             str(apt_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: str(apt_dir) in cmdline(proc.pid), 10, interval=0.05, what="the stray server to exec")
    cg = "/sys/fs/cgroup/pids/" + paths.CGROUP_PARENT + "/spark-77"
    if os.path.isdir("/sys/fs/cgroup/pids"):
        os.makedirs(cg, exist_ok=True)
    half = paths.CACHE_DIR / "host-rootfs-0000000000000000.tmp-999999"
    (half / "etc").mkdir(parents=True, exist_ok=True)
    return proc


def test_up_removes_leftovers_and_down_leaves_nothing(root_only):
    fleet.down()
    stray = _make_leftovers()
    try:
        found = cleanup.leftovers()
        assert STRAY_NETNS in found["netns"] and STRAY_VETH in found["links"]
        assert found["mounts"] and str(stray.pid) in found["processes"]

        earlier = paths.KNOWN_HOSTS.with_name(f"{paths.KNOWN_HOSTS.name}.earlier")
        earlier.parent.mkdir(parents=True, exist_ok=True)
        earlier.write_text("spark-1 ssh-ed25519 OLD\n")
        tb = fleet.up(4)
        assert stray.wait(timeout=15) is not None, "the stray server was not stopped"
        assert not earlier.exists()  # an earlier fleet's keys go
        assert [p.name for p in paths.KNOWN_HOSTS.parent.glob(f"{paths.KNOWN_HOSTS.name}.*")] == [
            f"{paths.KNOWN_HOSTS.name}.{tb.state.run_id}"]
        assert STRAY_NETNS not in cleanup.leftovers()["netns"]
        assert not list(paths.CACHE_DIR.glob("*.tmp-999999"))
        assert [h.name for h in tb.hosts] == ["spark-1", "spark-2", "spark-3", "spark-4"]
        st = fleet.status()
        assert all(h["ssh"] and h["system"] in ("running", "degraded") for h in st["hosts"]), st
        assert len({h.pid for h in tb.hosts}) == 4
        # Each host's systemd manages its own cgroup subtree, not a shared one.
        for h in tb.hosts:
            systemd_cg = next(d for d in cgroups.host_cgroup_dirs(h.name) if "/systemd/" in d)
            assert os.path.isdir(os.path.join(systemd_cg, "payload", "system.slice", "ssh.service")), h.name
        assert not os.path.isdir("/sys/fs/cgroup/systemd/system.slice/ssh.service"), "hosts share a cgroup"
        assert len(set(tb.exec(h.name, "cat /etc/machine-id").stdout for h in tb.hosts)) == 4
        assert len(set(tb.exec(h.name, "cat /etc/ssh/ssh_host_ed25519_key.pub").stdout for h in tb.hosts)) == 4
    finally:
        if stray.poll() is None:
            stray.kill()
        fleet.down()
    assert cleanup.leftovers() == {k: [] for k in cleanup.leftovers()}
    assert not paths.HOSTS_JSON.exists()
    assert not list(paths.KNOWN_HOSTS.parent.glob(f"{paths.KNOWN_HOSTS.name}.*"))
    for name in (paths.netns_name("spark-1"), paths.netns_name("spark-4")):
        assert name not in run(["ip", "netns", "list"]).stdout
    mounts = open("/proc/mounts").read()
    # Exact mount points: another testbed instance (-1, -2...) may be up beside ours.
    mount_points = [line.split()[1] for line in mounts.splitlines()]
    assert not any(m == str(paths.STATE_DIR) or m.startswith(str(paths.STATE_DIR) + "/") for m in mount_points)
    assert f" {paths.BRIDGE}:" not in run(["ip", "link"]).stdout


def test_down_is_idempotent(root_only):
    fleet.down()
    fleet.down()
    assert not any(cleanup.leftovers().values())
