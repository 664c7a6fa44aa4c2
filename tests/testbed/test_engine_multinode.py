"""The simulated engine's multi-node contract (vLLM >= 0.11.1 without Ray): what it refuses,
the rendezvous over real TCP (loopback addresses 127.0.0.x), and a pair of engine processes:
the head answers only once the headless node joined and exits 1 when it goes."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sparkfleet.testbed.engine import flags, multinode, perf
from sparkfleet.testbed.engine.logs import StartupError

MODEL = "acme/tiny-model"
SHA = "a" * 40
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def args_of(*argv: str):
    return flags.build_parser().parse_args(flags.normalize_argv(["serve", MODEL, *argv]))


def pair_flags(rank: int, port: int = 29501, *extra: str) -> list[str]:
    return ["-tp", "2", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", HEAD_IP,
            "--master-port", str(port), "--enforce-eager", *(["--headless"] if rank else []), *extra]


# ---------------------------------------------------------------------------------------
# Refusals before any connection
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["-tp", "2"], "World size (2) is larger than the number of available GPUs (1) in this node"),
    (["-tp", "3", "--nnodes", "2"], "world_size=3 must be divisible by nnodes=2."),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--headless"], "node_rank=2 must be less than nnodes=2."),
    (["-tp", "4", "--nnodes", "2"], "local world size 2"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1"], "Remote engine 1 must use --headless"),
    (["-tp", "2", "--nnodes", "2", "--headless"], "node_rank=0 is the head"),
    (["-tp", "2", "--nnodes", "2", "--distributed-executor-backend", "ray"], "backend is mp, uni or external_launcher"),
    (["-tp", "2", "--nnodes", "2", "-r", "1", "--headless", "--api-server-count", "1"],
     "--api-server-count=1 cannot be used with --headless"),
])
def test_flags_vllm_refuses(argv, message):
    with pytest.raises(StartupError, match=re.escape(message)):
        multinode.node_of(args_of(*argv), {})


def test_one_node_is_not_multinode_and_a_pair_node_is():
    assert multinode.node_of(args_of(), {}) is None
    node = multinode.node_of(args_of(*pair_flags(1), "--distributed-timeout-seconds", "7"), {})
    assert (node.node_rank, node.nnodes, node.world_size, node.headless, node.timeout_s) == (1, 2, 2, True, 7.0)
    assert node.contract() == {"model": MODEL, "revision": None, "tensor_parallel_size": 2,
                               "pipeline_parallel_size": 1, "nnodes": 2, "master_addr": HEAD_IP, "master_port": 29501}


def test_cross_node_graph_capture_aborts_on_this_image_without_enforce_eager(monkeypatch):
    """vLLM #46253: on GB10 a multi-node engine of this generation serves with --enforce-eager."""
    node = multinode.node_of(args_of(*pair_flags(1)), {})
    graphs = args_of(*[a for a in pair_flags(1) if a != "--enforce-eager"])
    with pytest.raises(StartupError, match=r"operation not permitted when stream is capturing.*needs --enforce-eager"):
        multinode.capture_graphs(graphs, node)
    multinode.capture_graphs(args_of(*pair_flags(1)), node)  # eager: no capture
    monkeypatch.setattr(multinode, "VERSION", "0.27.1")
    monkeypatch.setattr(multinode, "NCCL_VERSION", "2.30.4")
    multinode.capture_graphs(graphs, node)  # the image builder's 0.27.1 image captures


def test_nccl_stand_in_uses_roce_only_on_the_right_gid_and_mtu(monkeypatch, tmp_path):
    from sparkfleet.testbed.engine import nccl

    port = free_port()
    sysfs = {"mtu": 9000, "speed": 10000}
    monkeypatch.setattr(nccl, "_netdev", lambda interface, name: sysfs[name])
    monkeypatch.setattr(nccl.os.path, "exists", lambda path: True)
    env = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_HCA": "rocep1s0f1", "NCCL_IB_GID_INDEX": "3"}

    def pair_run(envs):
        out = {}
        threads = [threading.Thread(target=lambda r: out.__setitem__(r, nccl.all_gather(
            r, 2, "127.0.0.1", port, 10, envs[r])), args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        return out

    healthy = pair_run([env, env])
    assert healthy[0]["transport"] == healthy[1]["transport"] == "IB"
    # 10 Gb/s veth x the testbed's factor = 25 GB/s of cable; RoCE stays above NVIDIA's 21.875.
    assert healthy[0]["busbw_gbs"] == round(10000 * nccl.LINK_FACTOR / 8 / 1000 * nccl.EFFICIENCY["IB"], 2) > 21.875
    wrong = pair_run([env, {**env, "NCCL_IB_GID_INDEX": "1"}])
    assert wrong[0]["transport"] == "Socket" and wrong[0]["busbw_gbs"] < 21.875 / 4
    assert "rank 1: GID index 1" in wrong[0]["fallback"]
    sysfs["mtu"] = 1500
    assert pair_run([env, env])[1]["transport"] == "Socket"


def test_nccl_socket_ifname_forms():
    names = ["lo", "eth0", "enp1s0f1np1", "enP2p1s0f1np1", "docker0"]
    assert multinode.nccl_matches("enp1s0f1np1", names) == ["enp1s0f1np1"]
    assert multinode.nccl_matches("en", names) == ["enp1s0f1np1", "enP2p1s0f1np1"]
    assert multinode.nccl_matches("=enp1", names) == []
    assert multinode.nccl_matches("^docker,lo", names) == ["eth0", "enp1s0f1np1", "enP2p1s0f1np1"]


@pytest.mark.parametrize(("env", "message"), [
    ({"NCCL_SOCKET_IFNAME": "enp9s9f9np9"}, "Bootstrap : no socket interface found"),
    ({"GLOO_SOCKET_IFNAME": "enp9s9f9np9"}, "Unable to find interface for: [enp9s9f9np9]"),
    ({"TP_SOCKET_IFNAME": "enp9s9f9np9"}, "Unable to find interface for: [enp9s9f9np9]"),
    ({"VLLM_HOST_IP": "192.0.2.77"}, "Cannot assign requested address"),
])
def test_wrong_interface_or_address_fails_startup(env, message):
    with pytest.raises(StartupError) as err:
        multinode.node_of(args_of(*pair_flags(1)), env)
    assert message in str(err.value)


def test_the_right_interface_gives_the_address_to_talk_from():
    assert multinode.check_interfaces({"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert multinode.check_interfaces({"NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": WORKER_IP}) == WORKER_IP
    assert multinode.check_interfaces({}) is None


def test_an_interface_without_an_address_fails_startup():
    """In a namespace of this test's own: the link exists, is up, has no IPv4 address."""
    if os.geteuid() != 0:
        pytest.fail("needs root (a network namespace)", pytrace=False)
    ns = f"sfmn-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=15)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "enp1s0f1np1", "type", "veth", "peer", "name", "sfmn-peer"],
                       check=True, timeout=15)
        subprocess.run(["ip", "-n", ns, "link", "set", "enp1s0f1np1", "up"], check=True, timeout=15)
        code = ("import sys; from sparkfleet.testbed.engine import multinode as m\n"
                "try:\n m.check_interfaces({sys.argv[1]: 'enp1s0f1np1'})\n"
                "except m.StartupError as e:\n print(e); sys.exit(3)\n")
        for var, message in (("NCCL_SOCKET_IFNAME", "no socket interface found"),
                             ("GLOO_SOCKET_IFNAME", "Unable to find address for: enp1s0f1np1")):
            cp = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, var], capture_output=True,
                                text=True, timeout=30)
            assert cp.returncode == 3 and message in cp.stdout, (cp.stdout, cp.stderr)
    finally:
        subprocess.run(["ip", "netns", "del", ns], timeout=15)
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# ---------------------------------------------------------------------------------------
# The rendezvous, in this process
# ---------------------------------------------------------------------------------------
def node(rank: int, port: int, timeout: float = 5.0, **changes) -> multinode.Node:
    base = multinode.Node(model=MODEL, revision=None, tensor_parallel_size=2, pipeline_parallel_size=1, nnodes=2,
                          master_addr=HEAD_IP, master_port=port, node_rank=rank, headless=rank > 0,
                          host_ip=WORKER_IP if rank else None, timeout_s=timeout, peer_timeout_s=2.0)
    return dataclasses.replace(base, **changes)


def rendezvous(head: multinode.Node, *workers: multinode.Node):
    """Run node 0 and the workers at once; returns (head result, [worker results]), each
    the peers dict / socket or the StartupError raised."""
    stop = threading.Event()
    out: dict[object, object] = {}

    def run(key, fn, *a):
        try:
            out[key] = fn(*a)
        except StartupError as exc:
            out[key] = exc

    threads = [threading.Thread(target=run, args=("head", multinode._serve_rendezvous, head, stop))]
    threads += [threading.Thread(target=run, args=(i, multinode._connect, w, stop)) for i, w in enumerate(workers)]
    threads[0].start()
    time.sleep(0.2)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(30)
    return out["head"], [out[i] for i in range(len(workers))]


def test_rendezvous_joins_over_tcp_from_the_workers_address():
    port = free_port(HEAD_IP)
    peers, (sock,) = rendezvous(node(0, port), node(1, port))
    try:
        assert set(peers) == {1}
        assert peers[1].getpeername()[0] == WORKER_IP  # it came from VLLM_HOST_IP's address
        assert sock.getpeername() == (HEAD_IP, port)
    finally:
        peers[1].close()
        sock.close()


@pytest.mark.parametrize(("field", "value"), [
    ("model", "acme/other-model"), ("revision", "b" * 40), ("tensor_parallel_size", 4),
    ("pipeline_parallel_size", 2), ("nnodes", 3),
])
def test_a_node_that_disagrees_fails_both_sides(field, value):
    port = free_port(HEAD_IP)
    head, (worker,) = rendezvous(node(0, port), node(1, port, **{field: value}))
    assert isinstance(head, StartupError) and isinstance(worker, StartupError)
    assert f"disagrees with node_rank 0 on {field}: {value!r} there" in str(head)
    assert "node_rank 0 at" in str(worker) and f"on {field}" in str(worker)


def test_a_node_that_is_not_headless_or_twice_the_same_rank_is_refused():
    port = free_port(HEAD_IP)
    head, (worker,) = rendezvous(node(0, port), node(1, port, headless=False))
    assert "Remote engine 1 must use --headless" in str(head) and "must use --headless" in str(worker)
    port = free_port(HEAD_IP)
    head, workers = rendezvous(node(0, port, nnodes=3, tensor_parallel_size=3),
                               *[node(1, port, nnodes=3, tensor_parallel_size=3)] * 2)
    assert "node_rank 1 joined twice" in str(head)
    assert any(isinstance(w, StartupError) for w in workers)


def test_an_unreachable_master_fails_after_the_timeout():
    port = free_port(HEAD_IP)  # nobody listens there
    t0 = time.monotonic()
    with pytest.raises(StartupError, match=r"DistNetworkError: The client socket has timed out after 1.5s while "
                                           rf"trying to connect to \({HEAD_IP}, {port}\)"):
        multinode._connect(node(1, port, timeout=1.5), threading.Event())
    assert 1.4 < time.monotonic() - t0 < 5


def test_sigterm_while_node_0_has_not_answered_is_a_clean_stop():
    # Something accepts on the master port and never answers (a head still waiting for other
    # nodes, or another program on that port): SIGTERM must still end the worker's wait.
    with socket.socket() as silent:
        silent.bind((HEAD_IP, 0))
        silent.listen(1)
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as ended:
            multinode._connect(node(1, silent.getsockname()[1], timeout=60), stop)
        assert ended.value.code == 0 and time.monotonic() - t0 < 5


def test_the_head_waits_a_bounded_time_and_needs_its_own_address_and_a_free_port():
    port = free_port(HEAD_IP)
    with pytest.raises(StartupError, match=r"Timed out after 1 seconds waiting for clients. 1/2 clients joined"):
        multinode._serve_rendezvous(node(0, port, timeout=1.0), threading.Event())
    with pytest.raises(StartupError, match="Cannot assign requested address.*an address of node 0"):
        multinode._serve_rendezvous(node(0, port, master_addr="192.0.2.77"), threading.Event())
    with socket.socket() as taken:
        taken.bind((HEAD_IP, port))
        taken.listen(1)
        with pytest.raises(StartupError, match="failed to listen.*EADDRINUSE"):
            multinode._serve_rendezvous(node(0, port), threading.Event())


def test_a_silent_or_closed_peer_is_an_nccl_error():
    for hang_up in (False, True):
        mine, theirs = socket.socketpair()
        lost: list[str] = []
        group = multinode.Group(node=node(0, 1, peer_timeout_s=1.0), peers={1: mine}, on_lost=lost.append).start()
        if hang_up:
            theirs.close()
        assert group.lost.wait(5), "the loss was not noticed"
        assert "NCCL error" in lost[0] and ("closed the connection" if hang_up else "sent nothing for 1 s") in lost[0]
        group.close()
        if not hang_up:
            theirs.close()


# ---------------------------------------------------------------------------------------
# Two engine processes
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf")
    folder = home / "hub" / f"models--{MODEL.replace('/', '--')}"
    snap = folder / "snapshots" / SHA
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                  "text_config": {"max_position_embeddings": 8192}}))
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    (snap / "model.safetensors").write_bytes(b"\0" * 64)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(SHA)
    return home


def engine(hf_home: Path, *argv: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sparkfleet.testbed.engine", "serve", MODEL, *argv],
        env={**os.environ, "HF_HOME": str(hf_home), "SIM_READY_DELAY_S": "0.2", "SIM_PEER_TIMEOUT_S": "3", **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def models(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{HEAD_IP}:{port}/v1/models", timeout=2) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return None


def wait_for(what, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.1)
    return what()


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


def test_the_head_serves_only_after_the_worker_joined_and_exits_when_it_goes(hf_home):
    http, rdv = free_port(HEAD_IP), free_port(HEAD_IP)
    head = engine(hf_home, "--host", HEAD_IP, "--port", str(http), *pair_flags(0, rdv), NCCL_SOCKET_IFNAME="lo")
    worker = None
    try:
        time.sleep(1.5)
        assert head.poll() is None and models(http) is None, "the head served before every node joined"
        worker = engine(hf_home, *pair_flags(1, rdv), VLLM_HOST_IP=WORKER_IP, NCCL_SOCKET_IFNAME="lo")
        assert wait_for(lambda: models(http)) == 200
        worker.send_signal(signal.SIGKILL)  # the worker's engine dies
        assert head.wait(10) == 1
        out = head.communicate()[0]
        assert "node_rank 1 joined from 127.0.0.3" in out and "NCCL error" in out and "tp=2" in out
    finally:
        stop(head, *([worker] if worker else []))


def test_the_worker_exits_1_when_the_head_goes_and_0_on_sigterm(hf_home):
    http, rdv = free_port(HEAD_IP), free_port(HEAD_IP)
    head = engine(hf_home, "--host", HEAD_IP, "--port", str(http), *pair_flags(0, rdv))
    worker = engine(hf_home, *pair_flags(1, rdv))
    try:
        assert wait_for(lambda: models(http)) == 200
        head.send_signal(signal.SIGTERM)
        assert head.wait(10) == 0
        assert worker.wait(10) == 1
    finally:
        stop(head, worker)
    head = engine(hf_home, "--host", HEAD_IP, "--port", str(http), *pair_flags(0, rdv))
    worker = engine(hf_home, *pair_flags(1, rdv))
    try:
        assert wait_for(lambda: models(http)) == 200
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(10) == 0
        assert head.wait(10) == 1
    finally:
        stop(head, worker)


def test_a_worker_started_wrong_fails_like_vllm(hf_home):
    rdv = free_port(HEAD_IP)
    worker = engine(hf_home, *pair_flags(1, rdv, "--distributed-timeout-seconds", "1"))
    out = worker.communicate(timeout=20)[0]
    assert worker.returncode == 1 and "EngineCore failed to start" in out and "client socket has timed out" in out
    worker = engine(hf_home, *pair_flags(1, rdv)[:-1])  # without --headless
    out = worker.communicate(timeout=20)[0]
    assert worker.returncode == 1 and "must use --headless" in out


def test_a_pair_decodes_faster_than_one_spark():
    one = perf.perf_model(None, 0, perf.Levers(), {})
    two = dataclasses.replace(one, tensor_parallel=2)
    assert one.speed(perf.CODE).tok_s == pytest.approx(28.2)
    # 35.5 ms / 2 + 97 all-reduces of ~25 us over the link (perf.py's docstring)
    assert two.speed(perf.CODE).tok_s == pytest.approx(1 / (1 / 28.2 / 2 + 97 * (25e-6 + 6144 / 25e9)), rel=1e-6)
    for method, k in (("dflash", 12), ("mtp", 2), (None, 0)):
        a = perf.perf_model(method, k, perf.Levers(), {})
        b = dataclasses.replace(a, tensor_parallel=2)
        for w in perf.WORKLOADS:
            assert 1.5 < b.speed(w).tok_s / a.speed(w).tok_s < 2.0
            assert b.speed(w).accept == a.speed(w).accept


def test_sigterm_before_every_node_joined_is_a_clean_stop(hf_home):
    http, rdv = free_port(HEAD_IP), free_port(HEAD_IP)
    for argv in (["--host", HEAD_IP, "--port", str(http), *pair_flags(0, rdv)],  # waits for node 1
                 pair_flags(1, free_port(HEAD_IP))):  # nobody listens there
        proc = engine(hf_home, *argv)
        try:
            # Signalled once it waits for its peers (a fixed sleep loses on a loaded machine:
            # a SIGTERM before Python even imported the engine is no clean stop).
            seen = _line_matching(proc, ("waiting for 1 node(s)", "headless multiproc executor"), timeout=30)
            assert seen and proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0  # a clean stop; 5 s was lost once to a loaded machine
            assert "Shutting down before startup completed." in proc.communicate()[0]
        finally:
            stop(proc)


def _line_matching(proc: subprocess.Popen, needles: tuple[str, ...], timeout: float) -> str | None:
    """The first line of ``proc``'s output holding one of ``needles`` (None after ``timeout``)."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            lines.put(line)
            if any(n in line for n in needles):
                return

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return None
        if any(n in line for n in needles):
            return line
    return None
