"""The serving host as DGX OS ships it: GPU access through the legacy hook with the runtime
in daemon.json (spark-1) or through CDI only (spark-2), and Docker's containerd image
store (spark-2), on Docker 28 hosts.

The module boots its own fleet of 2, as DGX OS logs in (it replaces the session's, which
the session's teardown then removes; it sorts after the session's modules), once for all
its tests: the Docker 28 host root is built once and cached. The simulated hosts see the machine's memory, shared with other
fleets: the fleet's data gives the preflight the simulated engine's real needs.
"""

from __future__ import annotations

import json
import re
import shlex
import threading
import time

import pytest
from support.failures import changes

from tests.e2e.test_deploy import completion, unit, wait_for_answer

pytestmark = pytest.mark.e2e

KINDS = {"spark-1": {"nvidia_runtime": True}, "spark-2": {"cdi": True, "containerd_store": True}}


@pytest.fixture(scope="module")
def kinds():
    from sparkfleet.testbed import rootfs
    from tests.e2e.conftest import module_fleet

    docker_from = rootfs.HOST_DOCKER_FROM
    rootfs.HOST_DOCKER_FROM = "forky"  # Docker 28: CDI and the containerd store
    try:
        with module_fleet(2, KINDS) as tb:
            rootfs.HOST_DOCKER_FROM = docker_from
            yield tb
    finally:
        rootfs.HOST_DOCKER_FROM = docker_from


def manifest_bytes(tb) -> int:
    """Config + layers of the fleet's image, as its registry lists them."""
    import urllib.request

    ref = tb.data["image"]
    registry, _, rest = ref.partition("/")
    repo, _, digest = rest.partition("@")
    repo = repo.rsplit(":", 1)[0]
    req = urllib.request.Request(f"http://{registry}/v2/{repo}/manifests/{digest}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json,"
                                                    "application/vnd.docker.distribution.manifest.v2+json"})
    doc = json.load(urllib.request.urlopen(req, timeout=10))
    return doc["config"]["size"] + sum(layer["size"] for layer in doc["layers"])


def prefix(tb, name: str) -> str:
    """How pyinfra's output names the host (its inventory name)."""
    from sparkfleet.testbed import login

    return login.inventory_name(name, tb.state.names)


def docker_started(tb, name: str) -> str:
    return tb.exec(name, "systemctl show docker -p ExecMainStartTimestampMonotonic -p NRestarts").stdout


def test_the_hosts_are_the_kinds_they_claim(kinds):
    assert "nvidia" in json.loads(kinds.exec("spark-1", "cat /etc/docker/daemon.json").stdout)["runtimes"]
    info = kinds.exec("spark-2", "docker info --format '{{json .DriverStatus}}'; "
                                 "command -v nvidia-container-runtime-hook || echo no-legacy-hook").stdout
    assert "io.containerd.snapshotter.v1" in info and "no-legacy-hook" in info


def test_containerd_store_need_is_checked_on_var_lib_containerd(kinds, deploy_run):
    # Nothing pulled yet: each host needs the image where its store keeps it. A huge unpack
    # ratio makes both needs fail, so the messages show the path and the amount.
    ratio = 200000
    result = deploy_run("deploy.py", "--data", f"image_unpack_ratio={ratio}")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    needed = {}
    for name, path in (("spark-1", "/var/lib/docker"), ("spark-2", "/var/lib/containerd")):
        line = next(line for line in out.splitlines()
                    if f"[{prefix(kinds, name)}]" in line and "GiB needed for" in line)
        assert f"needed for {path}" in line or f", {path}" in line, line
        needed[name] = float(re.search(r"([\d.]+) GiB needed", line).group(1)) - 5.0  # disk_margin_gib
        assert "nothing was changed on this host" in out
    # From the manifest: the classic store needs the unpacked layers, the containerd store
    # compressed + unpacked (the compressed part is below the message's 0.1 GiB here).
    compressed_gib = manifest_bytes(kinds) / 1024**3
    assert needed["spark-1"] == pytest.approx(compressed_gib * ratio, abs=0.1)
    assert needed["spark-2"] == pytest.approx(compressed_gib * (ratio + 1), abs=0.1)
    for name in kinds.names:
        assert kinds.exec(name, "docker images -q | wc -l").stdout.strip() == "0"


def test_both_kinds_serve_without_a_docker_restart(kinds, deploy_run):
    before = {name: docker_started(kinds, name) for name in kinds.names}
    daemon_before = kinds.exec("spark-2", "md5sum /etc/docker/daemon.json").stdout
    result = deploy_run("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in kinds.names:
        assert docker_started(kinds, name) == before[name], name
        assert "Paris" in wait_for_answer(kinds, name)
        # NVIDIA's /dev/char workaround ran once, the udev rule keeps it at boot.
        assert "create-dev-char-symlinks --create-all" in kinds.exec(name, "cat /run/sparkfleet-sim/ctk.log").stdout
        assert kinds.exec(name, "test -f /etc/udev/rules.d/71-nvidia-dev-char.rules && echo ok").stdout.strip() == "ok"
    unit = "/etc/systemd/system/sparkfleet-serve.service"
    assert "--gpus all" in kinds.exec("spark-1", f"cat {unit}").stdout
    assert "--device nvidia.com/gpu=all" in kinds.exec("spark-2", f"cat {unit}").stdout
    assert kinds.exec("spark-2", "md5sum /etc/docker/daemon.json").stdout == daemon_before
    assert "update-ldcache" in kinds.exec("spark-2", "cat /run/sparkfleet-sim/cdi-hook.log").stdout
    assert re.search(r"NVIDIA container toolkit installed\s+2\s+-\s+-\s+2", out), out[-3000:]
    assert re.search(r"restart docker for its new runtime\s+2\s+-\s+-\s+2", out), out[-3000:]


def reloads(tb, name: str) -> int:
    """How many times systemd reloaded its units since the host booted."""
    return int(tb.exec(name, "journalctl -b _PID=1 -o cat --no-pager | grep -c '^Reloading' || true").stdout)


def test_a_second_run_probes_and_changes_nothing(kinds, deploy_run):
    before = {name: docker_started(kinds, name) for name in kinds.names}
    reloaded = {name: reloads(kinds, name) for name in kinds.names}
    assert all(reloaded.values()), reloaded  # the first deploy's unit did reload
    result = deploy_run("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert changes(out) == [], out[-4000:]
    assert {name: docker_started(kinds, name) for name in kinds.names} == before
    # No unit changed, so no daemon-reload (it can detach a running container's GPU).
    assert {name: reloads(kinds, name) for name in kinds.names} == reloaded
    for name in kinds.names:
        assert "Paris" in completion(kinds, name)


#: The hog's ceiling: it grows to this and holds it, so the test never takes more of the
#: shared machine's memory than that. The guard's line is half of it under what is free,
#: so other fleets on the machine may take 4 GiB meanwhile before the guard sees them.
HOG_CAP_GIB = 8.0
# Named as vLLM names its engine core (setproctitle sets comm): what the guard prefers and
# why its hook ends the container. A python3 of any other name is not the engine.
HOG = ("import time\n"
       "open('/proc/self/comm', 'w').write('VLLM::EngineCore')\n"
       "chunks = []\n"
       f"for _ in range({int(HOG_CAP_GIB * 16)}):\n"
       "    chunks.append(bytearray(b'\\x01') * (64 << 20))  # written, so really resident\n"
       "    time.sleep(0.05)\n"
       "time.sleep(600)\n")


def mem_available_gib(tb, name: str) -> float:
    out = tb.exec(name, "grep MemAvailable /proc/meminfo").stdout
    return int(out.split()[1]) / 1024**2


def hog_pids(tb, name: str) -> dict[str, int]:
    """{host pid: RSS KiB} of the serving container's processes other than the engine."""
    out = tb.exec(name, "docker top sparkfleet-serve -o pid,rss,args").stdout.splitlines()[1:]
    return {line.split()[0]: int(line.split()[1]) for line in out if "chunks" in line}


def restarts_of(tb, name: str) -> int | None:
    """The serving unit's NRestarts, or None when the host did not answer this time."""
    value = unit(tb, name).get("NRestarts", "")
    return int(value) if value.isdigit() else None


def guard_story(tb, name: str) -> str:
    return tb.exec(name, "cat /var/lib/sparkfleet/oom-guard.log; journalctl -u earlyoom --no-pager -o cat -n 40; "
                         "grep MemAvailable /proc/meminfo").stdout


def test_the_oom_guard_kills_the_engine_not_the_host(kinds, deploy_run):
    name = "spark-1"
    available = mem_available_gib(kinds, name)
    assert available > HOG_CAP_GIB + 4, "the machine is too busy for this test"
    # The simulated hosts see the machine's memory (shared, and it moves): the guard's line
    # goes half the hog under what is available now, so the host is above it until the hog
    # has grown by that much, and again once it is killed (a Spark keeps the default 4 GiB).
    threshold = round(available - HOG_CAP_GIB / 2, 2)
    # The watchdog stops the engine cleanly a line above earlyoom's, on its tick; this hog
    # outruns a tick (the case earlyoom is there for), so the watchdog ticks once, at the deploy.
    result = deploy_run("deploy.py", "--data", f"oom_guard_min_available_gib={threshold}",
                        "--data", f"memory_stop_available_gib={threshold + 1}", "--data", "watchdog_interval_s=600",
                        "--limit", prefix(kinds, name))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert f"-M {int(threshold * 1024 * 1024)}" in kinds.exec(name, "cat /etc/default/earlyoom").stdout
    restarts = restarts_of(kinds, name)
    assert restarts is not None
    # sshd is asked every second from the hog's start until the engine is back.
    ssh_answers: list[bool] = []
    done = threading.Event()

    def ask_sshd() -> None:
        while not done.is_set():
            ssh_answers.append(kinds.exec(name, "true", via="ssh", timeout=10).returncode == 0)
            time.sleep(1)

    pinger = threading.Thread(target=ask_sshd, daemon=True)
    pinger.start()
    try:
        kinds.exec(name, "docker exec -d sparkfleet-serve python3 -c " + shlex.quote(HOG), check=True)
        # No deploy runs now: the restart is systemd's (Restart=on-failure).
        deadline = time.monotonic() + 90
        while restarts_of(kinds, name) in (None, restarts) and time.monotonic() < deadline:
            time.sleep(1)
        assert (restarts_of(kinds, name) or 0) > restarts, guard_story(kinds, name)
        answer = wait_for_answer(kinds, name)
        done.set()
        pinger.join(timeout=15)
        assert len(ssh_answers) >= 5 and all(ssh_answers), f"sshd did not always answer: {ssh_answers}"
        assert not hog_pids(kinds, name), "the hog survived"
        # What earlyoom killed was the hog, not the engine (~30 MiB): the hog holds GiB, or
        # hundreds of MiB when another fleet on this machine (make test's other shard) takes
        # memory at the same time and the threshold comes sooner.
        story = guard_story(kinds, name)
        killed = [int(rss) for rss in re.findall(r'sending SIG\w+ to process \d+ uid \d+ "VLLM::EngineCor".* '
                                                 r'VmRSS (\d+) MiB', story)]
        assert killed and max(killed) > 256, story
        journal = kinds.exec(name, "journalctl -u sparkfleet-serve --no-pager -o cat -n 300").stdout
        assert "OOM guard: earlyoom killed VLLM::EngineCor" in journal, journal[-2000:]
        assert "Paris" in answer
    finally:
        done.set()
        for pid in hog_pids(kinds, name):
            kinds.exec(name, f"kill -9 {pid}")
    # Back to the default line; the deploy says what the guard did.
    result = deploy_run("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert re.search(rf"\[{re.escape(prefix(kinds, name))}\] .*OOM guard: earlyoom killed VLLM::EngineCor", out), out[-3000:]
    assert "-M 4194304" in kinds.exec(name, "cat /etc/default/earlyoom").stdout
    kills = kinds.exec(name, "cat /var/lib/sparkfleet/oom-guard.log").stdout.splitlines()
    assert len(kills) == 1, guard_story(kinds, name)  # the hog, then nothing else
    # Reported once: a converged run says nothing more.
    again = deploy_run("deploy.py")
    assert again.returncode == 0 and "earlyoom killed" not in again.stdout + again.stderr
    assert changes(again.stdout + again.stderr) == []
