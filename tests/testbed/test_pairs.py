"""A simulated pair: `up --hosts 2 --pairs 1` cables spark-1 and spark-2 as two Sparks are
(the ConnectX-7 netdevs, MTU 9000, no address, ibdev2netdev, /dev/infiniband), and the
serving image's engine runs across that link by hand: the head answers /v1/models only
once the headless node joined it, and exits when that node's engine is killed.

Needs root (marked e2e); fails - does not skip - without it. Boots its own fleet (which
replaces any fleet of this instance that is up) and removes it at the end of the module.
"""
from __future__ import annotations

import json
import os
import shlex
import time
import urllib.error
import urllib.request

import pytest

from sparkfleet.testbed import fleet, pairs, paths
from sparkfleet.testbed.proc import TestbedError, missing_tools

pytestmark = pytest.mark.e2e

HEAD, WORKER = "spark-1", "spark-2"
LINK = {HEAD: "192.168.177.1", WORKER: "192.168.177.2"}  # what the deploy's netplan step will assign
MODEL, SHA = "acme/tiny-model", "a" * 40
PORT, RDV_PORT = 8000, 29501


def test_pairs_need_enough_hosts():
    with pytest.raises(TestbedError, match="--pairs 2 needs 4 hosts, the fleet has 3"):
        pairs.plan(["spark-1", "spark-2", "spark-3"], 2)
    assert [p.members for p in pairs.plan(["spark-1", "spark-2", "spark-3", "spark-4"], 2)] == [
        ("spark-1", "spark-2"), ("spark-3", "spark-4")]


@pytest.fixture(scope="module")
def tb():
    if os.geteuid() != 0:
        pytest.fail("the pair test needs root", pytrace=False)
    if missing_tools():
        pytest.fail(f"missing tools for the testbed: {missing_tools()}", pytrace=False)
    t0 = time.monotonic()
    bed = fleet.up(2, login_kind="root", names="plain", n_pairs=1)
    print(f"\nup --hosts 2 --pairs 1 took {time.monotonic() - t0:.1f}s")
    try:
        yield bed
    finally:
        fleet.down()
        for ns in (paths.netns_name(HEAD), paths.netns_name(WORKER)):
            assert ns not in os.listdir("/run/netns"), f"{ns} left behind"


def sh(tb, host: str, cmd: str, timeout: float = 60) -> str:
    cp = tb.exec(host, cmd, timeout=timeout)
    assert cp.returncode == 0, f"{host}: {cmd!r} -> {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    return cp.stdout


def test_the_link_is_cabled_as_on_a_spark(tb):
    record = json.loads(paths.HOSTS_JSON.read_text())["pairs"]
    assert record == [{"members": [HEAD, WORKER], "interface": "enp1s0f1np1",
                       "netdevs": ["enp1s0f1np1", "enP2p1s0f1np1"], "hcas": ["rocep1s0f1", "roceP2p1s0f1"],
                       "mtu": 9000, "link_speed_mbps": 200000}]
    for host in (HEAD, WORKER):
        links = {link["ifname"]: link for link in json.loads(sh(tb, host, "ip -j addr show"))}
        for netdev in ("enp1s0f1np1", "enP2p1s0f1np1"):
            assert links[netdev]["mtu"] == 9000 and links[netdev]["operstate"] == "UP", links[netdev]
            assert not [a for a in links[netdev]["addr_info"] if a["family"] == "inet"], "the link has an IPv4 address"
        assert links["enp1s0f0np0"]["operstate"] == "DOWN"  # the other QSFP port: no cable
        assert sh(tb, host, "ibdev2netdev").splitlines() == [
            "rocep1s0f0 port 1 ==> enp1s0f0np0 (Down)", "rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)",
            "roceP2p1s0f0 port 1 ==> enP2p1s0f0np0 (Down)", "roceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)"]
        assert sh(tb, host, "cat /sys/class/net/enp1s0f1np1/speed /sys/class/net/enP2p1s0f1np1/speed").split() == [
            "200000"] * 2
        assert sh(tb, host, "stat -c %F /dev/infiniband/uverbs0 /dev/infiniband/rdma_cm").split("\n")[:2] == [
            "character special file"] * 2


def _models(host: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{tb_address(host)}:{PORT}/v1/models", timeout=2) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return None


def tb_address(host: str) -> str:
    return paths.host_address(paths.host_index(host))


def _engine(tb, host: str, rank: int) -> None:
    """The serving image's `vllm serve` as one node of the pair, over the link."""
    env = {"HF_HOME": "/hf", "VLLM_HOST_IP": LINK[host], "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
           "GLOO_SOCKET_IFNAME": "enp1s0f1np1", "NCCL_IB_HCA": "rocep1s0f1,roceP2p1s0f1", "NCCL_IB_DISABLE": "0",
           "SIM_READY_DELAY_S": "0.5", "SIM_PEER_TIMEOUT_S": "3"}
    argv = ["vllm", "serve", MODEL, "--port", str(PORT), "--tensor-parallel-size", "2", "--nnodes", "2",
            "--node-rank", str(rank), "--master-addr", LINK[HEAD], "--master-port", str(RDV_PORT),
            # As the deploy renders a pair's member on a GB10: vLLM's 0.9 asks more than a Spark
            # has free at start, and CUDA graphs across nodes fail (vLLM #46253).
            "--gpu-memory-utilization", "0.82", "--enforce-eager"]
    argv += ["--headless"] if rank else []
    sh(tb, host, f"docker run -d --name sim-rank{rank} --network host --ipc host --device /dev/infiniband "
                 f"--cap-add IPC_LOCK --ulimit memlock=-1:-1 -v /var/lib/sim-hf:/hf "
                 + " ".join(f"-e {k}={shlex.quote(v)}" for k, v in env.items())
                 + f" {tb.data['image']} {shlex.join(argv)}")


def test_the_engine_serves_across_the_link_once_both_nodes_joined(tb):
    snapshot = f"/var/lib/sim-hf/hub/models--{MODEL.replace('/', '--')}/snapshots/{SHA}"
    for host in (HEAD, WORKER):
        sh(tb, host, f"ip addr add {LINK[host]}/24 dev enp1s0f1np1")
        files = {f"{snapshot}/config.json": '{"architectures": ["Qwen3_5MoeForConditionalGeneration"]}',
                 f"{snapshot}/model.safetensors.index.json": '{"weight_map": {"w": "model.safetensors"}}',
                 f"{snapshot}/model.safetensors": "0" * 64, f"{snapshot}/../../refs/main": SHA}
        sh(tb, host, f"mkdir -p {snapshot} {snapshot}/../../refs && "
                     + " && ".join(f"printf %s {shlex.quote(body)} > {path}" for path, body in files.items()))
        sh(tb, host, f"docker pull -q {tb.data['image']}", timeout=120)
    # The link carries traffic (the head's sshd answers on its link address).
    sh(tb, WORKER, f"python3 -c 'import socket; socket.create_connection((\"{LINK[HEAD]}\", 22), 2)'")

    _engine(tb, HEAD, 0)
    time.sleep(3)
    assert _models(HEAD) is None, "the head served before the other node joined"
    assert sh(tb, HEAD, "docker inspect -f '{{.State.Running}}' sim-rank0").strip() == "true", \
        sh(tb, HEAD, "docker logs sim-rank0 2>&1 | tail -20")
    _engine(tb, WORKER, 1)
    deadline = time.monotonic() + 30
    while _models(HEAD) != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _models(HEAD) == 200, sh(tb, HEAD, "docker logs sim-rank0 2>&1 | tail -20")
    assert f"node_rank 1 joined from {LINK[WORKER]}" in sh(tb, HEAD, "docker logs sim-rank0 2>&1")

    sh(tb, WORKER, "docker kill sim-rank1")  # the worker's engine dies
    assert sh(tb, HEAD, "timeout 20 docker wait sim-rank0", timeout=30).strip() == "1"
    assert "NCCL error" in sh(tb, HEAD, "docker logs sim-rank0 2>&1")
