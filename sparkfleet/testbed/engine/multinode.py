"""vLLM's multi-node mode without Ray (vLLM >= 0.11.1), as the simulated engine keeps it.

Every node runs ``vllm serve MODEL --tensor-parallel-size N --nnodes N --node-rank r
--master-addr <node 0's address> --master-port P``; nodes with ``r > 0`` add
``--headless``. Node 0 serves HTTP, and only once every node has joined it; the others
serve nothing. What vLLM (through torch.distributed and NCCL) would do, this module does
over real TCP on the network the nodes are told to use:

* **Refusals before any connection** (``node_of``): a world larger than the node's one
  GPU without ``--nnodes``; ``world_size`` not divisible by ``nnodes``; ``node_rank >=
  nnodes``; ``node_rank > 0`` without ``--headless`` (or node 0 with it); Ray as the
  backend; ``VLLM_HOST_IP`` not an address of this host; ``NCCL_SOCKET_IFNAME`` /
  ``GLOO_SOCKET_IFNAME`` / ``TP_SOCKET_IFNAME`` naming no interface that exists and has an
  IPv4 address (NCCL's prefix, ``=exact`` and ``^exclude`` forms).
* **The rendezvous** (``join``): node 0 listens on ``master_addr:master_port`` (as
  torch's TCPStore; a port in use or an address not its own fails as it does); every
  other node connects there from ``VLLM_HOST_IP`` (or its NCCL interface's address),
  retrying until ``--distributed-timeout-seconds`` (or ``SIM_RENDEZVOUS_TIMEOUT_S``,
  default 120 s; torch's own default is 600 s) and then fails with torch's
  ``DistNetworkError``. Each node sends what it was started with; node 0 compares model,
  revision, tensor and pipeline parallel sizes, nnodes, master address and port with its
  own, refuses a duplicate rank or a non-headless remote, and any mismatch fails both
  sides' startup naming the field and both values. When all ``nnodes - 1`` have joined,
  node 0 says so to each and goes on loading.
* **While serving**: every node sends a heartbeat each second; a node that hangs up
  (its engine died) or goes silent for ``SIM_PEER_TIMEOUT_S`` (default 10 s: a cut link)
  is an NCCL error. Node 0 then exits 1 at once (the API server dies with its engine),
  so systemd's ``Restart=on-failure`` restarts it; a headless node that loses node 0
  exits 1 as well, so neither half of a pair is left orphaned.

* **CUDA graphs across nodes** (``capture_graphs``): on GB10, vLLM of this generation
  aborts cross-node graph capture (vLLM #46253: multi-node GB10 serves with
  ``--enforce-eager``); graphs work from the image builder's 0.27.1 image with NCCL >=
  :data:`GRAPHS_MIN_NCCL`. Without ``--enforce-eager`` on an older image every node fails
  its start at capture, after the rendezvous, as the real engine does. vLLM's custom
  all-reduce is a single-node NVLink path: across nodes it turns itself off with a warning.

Decode on N nodes is faster: ``perf.tensor_parallel_step_s`` (the factor and why).
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .flags import NCCL_VERSION, VERSION
from .logs import StartupError, log

#: A DGX Spark has one GPU (GB10).
GPUS_PER_NODE = 1
DEFAULT_RENDEZVOUS_TIMEOUT_S = 120.0
DEFAULT_PEER_TIMEOUT_S = 10.0
HEARTBEAT_S = 1.0
#: What every node must agree on, in the order the messages name them.
CONTRACT_FIELDS = ("model", "revision", "tensor_parallel_size", "pipeline_parallel_size", "nnodes",
                   "master_addr", "master_port")
#: The cross-node CUDA graph floor (the image builder's 0.27.1 image: capture fix, NCCL 2.30.4).
GRAPHS_MIN_VLLM = "0.27.1"
GRAPHS_MIN_NCCL = "2.30.4"
SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


@dataclass(frozen=True)
class Node:
    """One node of a multi-node engine, as its flags and environment say."""

    model: str
    revision: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    nnodes: int
    master_addr: str
    master_port: int
    node_rank: int
    headless: bool
    #: The address this node talks from (VLLM_HOST_IP, or its NCCL interface's), if set.
    host_ip: str | None
    timeout_s: float
    peer_timeout_s: float

    def contract(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in CONTRACT_FIELDS}

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# --------------------------------------------------------------------------------------
# Interfaces and addresses of this host (stdlib only: the image has no iproute2)
# --------------------------------------------------------------------------------------
_SIOCGIFADDR = 0x8915


def interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def ipv4_of(ifname: str) -> str | None:
    """The interface's (first) IPv4 address, None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def is_local_address(address: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def nccl_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces NCCL_SOCKET_IFNAME selects: comma-separated prefixes, ``=`` for exact
    names, a leading ``^`` to exclude instead."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    wanted = [w for w in spec.split(",") if w]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [n for n in names if hit(n) != exclude]


def check_interfaces(env: dict[str, str]) -> str | None:
    """Refuse the interfaces and address the environment names, as NCCL, gloo and vLLM do.
    Returns the address this node talks from (None: the kernel's choice)."""
    names = interfaces()
    chosen: str | None = None
    for var in SOCKET_IFNAME_VARS:
        spec = env.get(var, "").strip()
        if not spec:
            continue
        if var == "NCCL_SOCKET_IFNAME":
            usable = [(n, a) for n in nccl_matches(spec, names) for a in [ipv4_of(n)] if a]
            if not usable:
                log("WARNING", "pynccl.py:72", f"NCCL WARN Bootstrap : no socket interface found ({var}={spec})")
                raise StartupError(
                    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
                    f"ProcessGroupNCCL.cpp:3690, internal error - please report this issue to the NCCL developers, "
                    f"NCCL version {NCCL_VERSION}\nncclInternalError: Internal check failed.\nLast error:\n"
                    f"Bootstrap : no socket interface found ({var}={spec}: interfaces here: {', '.join(names)})")
            chosen = chosen or usable[0][1]
            continue
        for name in [n for n in spec.split(",") if n]:
            if name not in names:
                raise StartupError(
                    "RuntimeError: [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] "
                    f"ifa != nullptr. Unable to find interface for: [{name}] ({var}; interfaces here: "
                    f"{', '.join(names)})")
            if ipv4_of(name) is None:
                raise StartupError(
                    "RuntimeError: [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] "
                    f"Unable to find address for: {name} ({var}: the interface has no IPv4 address)")
    host_ip = env.get("VLLM_HOST_IP", "").strip()
    if host_ip:
        if not is_local_address(host_ip):
            raise StartupError(
                f"zmq.error.ZMQError: Cannot assign requested address (addr='tcp://{host_ip}:0'): "
                f"VLLM_HOST_IP={host_ip} is not an address of this host")
        return host_ip
    return chosen


# --------------------------------------------------------------------------------------
# The flags: what vLLM refuses before it connects anywhere
# --------------------------------------------------------------------------------------
def _env_seconds(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise StartupError(f"ValueError: {name}={raw!r} is not a number") from None
    if value <= 0:
        raise StartupError(f"ValueError: {name}={raw!r} must be > 0")
    return value


def node_of(args: argparse.Namespace, env: dict[str, str]) -> Node | None:
    """This node of a multi-node engine, None for a single node; StartupError for what
    vLLM refuses."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    nnodes, rank = args.nnodes, args.node_rank
    world = tp * pp
    if nnodes < 1 or rank < 0:
        raise StartupError(f"pydantic_core._pydantic_core.ValidationError: 1 validation error for ParallelConfig\n"
                           f"{'nnodes' if nnodes < 1 else 'node_rank'}\n  Input should be greater than or equal to "
                           f"{1 if nnodes < 1 else 0}")
    if nnodes == 1:
        if world > GPUS_PER_NODE:
            raise StartupError(
                f"ValueError: World size ({world}) is larger than the number of available GPUs ({GPUS_PER_NODE}) "
                "in this node. If this is intentional and you are using:\n- ray, set '--distributed-executor-backend "
                "ray'.\n- multiprocessing, set '--nnodes' appropriately.")
        if args.headless or rank:
            raise StartupError(f"AssertionError: node_rank={rank} must be less than nnodes={nnodes}."
                               if rank else "ValueError: --headless needs --nnodes > 1: a single node serves the API")
        return None
    if args.distributed_executor_backend not in (None, "mp", "uni", "external_launcher"):
        raise StartupError("ValueError: nnodes > 1 can only be set when distributed executor backend is mp, uni or "
                           "external_launcher.")
    if world % nnodes:
        raise StartupError(f"AssertionError: world_size={world} must be divisible by nnodes={nnodes}.")
    if rank >= nnodes:
        raise StartupError(f"AssertionError: node_rank={rank} must be less than nnodes={nnodes}.")
    if world // nnodes > GPUS_PER_NODE:
        raise StartupError(
            f"RuntimeError: CUDA error: invalid device ordinal: local world size {world // nnodes} (world_size="
            f"{world} / nnodes={nnodes}) but this node has {GPUS_PER_NODE} GPU")
    if rank > 0 and not args.headless:
        raise StartupError(
            f"RuntimeError: Remote engine {rank} must use --headless unless in external or hybrid dp lb mode "
            f"(node_rank={rank}: only node 0 serves the API; start this node with `vllm serve ... --headless`)")
    if rank == 0 and args.headless:
        raise StartupError("ValueError: node_rank=0 is the head: it serves the API and must run without "
                           "--headless (the other nodes are headless)")
    if args.headless and args.api_server_count:
        raise StartupError(f"ValueError: --api-server-count={args.api_server_count} cannot be used with --headless "
                           "(no API servers are started in headless mode).")
    host_ip = check_interfaces(env)
    timeout = float(args.distributed_timeout_seconds or 0) or _env_seconds(
        env, "SIM_RENDEZVOUS_TIMEOUT_S", DEFAULT_RENDEZVOUS_TIMEOUT_S)
    return Node(
        model=args.model_tag or args.model, revision=args.revision, tensor_parallel_size=tp,
        pipeline_parallel_size=pp, nnodes=nnodes, master_addr=args.master_addr, master_port=args.master_port,
        node_rank=rank, headless=bool(args.headless), host_ip=host_ip, timeout_s=timeout,
        peer_timeout_s=_env_seconds(env, "SIM_PEER_TIMEOUT_S", DEFAULT_PEER_TIMEOUT_S),
    )


# --------------------------------------------------------------------------------------
# The wire: one JSON object per line
# --------------------------------------------------------------------------------------
def _send(sock: socket.socket, obj: dict[str, object]) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


class _Lines:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def read(self) -> dict[str, object] | None:
        """The next message; None when the peer hung up."""
        while b"\n" not in self.buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def _mismatch(node: Node, theirs: dict[str, object]) -> str | None:
    """The first contract field a remote node disagrees on, as a message; None if none."""
    ours = node.contract()
    for f in CONTRACT_FIELDS:
        if theirs.get(f) != ours[f]:
            return (f"disagrees with node_rank 0 on {f}: {theirs.get(f)!r} there, {ours[f]!r} on node_rank 0 "
                    "(every node must run `vllm serve` with the same model, revision, --tensor-parallel-size, "
                    "--pipeline-parallel-size, --nnodes, --master-addr and --master-port)")
    return None


# --------------------------------------------------------------------------------------
# The rendezvous and the connection that outlives it
# --------------------------------------------------------------------------------------
def _die(message: str) -> None:
    """Node 0 lost a node: the engine core is dead, and the API server exits with it."""
    log("ERROR", "core_client.py:564", "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.")
    os._exit(1)


@dataclass
class Group:
    """The joined nodes, as one node sees them: node 0 holds a connection per remote
    node, a headless node its connection to node 0."""

    node: Node
    peers: dict[int, socket.socket]  # node rank -> connection
    on_lost: Callable[[str], None] = _die
    lost: threading.Event = dataclasses.field(default_factory=threading.Event)
    lost_reason: str = ""
    _closing: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def headless(self) -> bool:
        return self.node.headless

    def start(self) -> "Group":
        for rank, sock in self.peers.items():
            sock.settimeout(self.node.peer_timeout_s)
            threading.Thread(target=self._watch, args=(rank, sock), name=f"nccl-peer-{rank}", daemon=True).start()
        threading.Thread(target=self._beat, name="nccl-heartbeat", daemon=True).start()
        return self

    def _lose(self, rank: int, why: str) -> None:
        with self._lock:
            if self._closing or self.lost_reason:
                return
            self.lost_reason = (
                f"torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network "
                f"error, NCCL version {NCCL_VERSION}\nncclRemoteError: node_rank {rank} ({why})")
        log("ERROR", "multiproc_executor.py:287", self.lost_reason)
        self.on_lost(self.lost_reason)
        self.lost.set()

    def _watch(self, rank: int, sock: socket.socket) -> None:
        lines = _Lines(sock)
        try:
            while True:
                if lines.read() is None:
                    return self._lose(rank, "closed the connection")
        except TimeoutError:
            self._lose(rank, f"sent nothing for {self.node.peer_timeout_s:g} s")
        except (OSError, ValueError) as exc:
            self._lose(rank, str(exc))

    def _beat(self) -> None:
        while not self.lost.wait(HEARTBEAT_S) and not self._closing and not self.lost_reason:
            for rank, sock in list(self.peers.items()):
                try:
                    _send(sock, {"heartbeat": True})
                except OSError as exc:
                    self._lose(rank, str(exc))

    def run_headless(self, stop: threading.Event) -> int:
        """A headless node's life after the rendezvous: nothing to serve, until SIGTERM
        (exit 0) or node 0 is lost (exit 1)."""
        log("INFO", "multiproc_executor.py:640", "Headless node ready: waiting on node 0's work")
        while not stop.wait(0.2):
            if self.lost.is_set():
                return 1
        self.close()
        return 0

    def close(self) -> None:
        self._closing = True
        for sock in self.peers.values():
            try:
                sock.close()
            except OSError:
                pass


def _stopped() -> None:
    """SIGTERM before every node joined: a clean stop, as before the model loaded."""
    log("INFO", "launcher.py:110", "Shutting down before startup completed.")
    raise SystemExit(0)


def _listen(node: Node) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind((node.master_addr, node.master_port))
        srv.listen(16)
    except OSError as exc:
        srv.close()
        code = errno.errorcode.get(exc.errno or 0, "?")
        raise StartupError(
            f"torch.distributed.DistNetworkError: The server socket has failed to listen on {node.master_addr}:"
            f"{node.master_port} (errno: {exc.errno} - {exc.strerror}, code: -{exc.errno}, name: {code})"
            + (": --master-addr must be an address of node 0 itself" if exc.errno == errno.EADDRNOTAVAIL else "")
        ) from None
    return srv


def _serve_rendezvous(node: Node, stop: threading.Event) -> dict[int, socket.socket]:
    """Node 0: accept every other node, check what it was started with, then release all."""
    srv = _listen(node)
    deadline = time.monotonic() + node.timeout_s
    peers: dict[int, socket.socket] = {}
    log("INFO", "parallel_state.py:1208", f"world_size={node.world_size} rank=0 local_rank=0 distributed_init_method="
        f"tcp://{node.master_addr}:{node.master_port} backend=nccl: waiting for {node.nnodes - 1} node(s)")
    try:
        while len(peers) < node.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, node.nnodes)) - set(peers))
                raise StartupError(
                    f"torch.distributed.DistStoreError: Timed out after {node.timeout_s:g} seconds waiting for "
                    f"clients. {len(peers) + 1}/{node.nnodes} clients joined (node_rank {missing} did not connect "
                    f"to {node.master_addr}:{node.master_port})")
            if stop.is_set():
                _stopped()
            srv.settimeout(min(left, 0.5))
            try:
                conn, addr = srv.accept()
            except TimeoutError:
                continue
            conn.settimeout(5.0)
            try:
                hello = _Lines(conn).read()
            except (OSError, ValueError):
                hello = None
            if not isinstance(hello, dict) or "node_rank" not in hello:
                conn.close()  # not a vLLM node (a port probe): nothing to say
                continue
            rank = hello.get("node_rank")
            problem = _mismatch(node, hello)
            if problem is None and rank in peers:
                problem = f"node_rank {rank} joined twice (the second from {addr[0]}): each node needs its own --node-rank"
            if problem is None and not (isinstance(rank, int) and 0 < rank < node.nnodes):
                problem = f"node_rank {rank!r} from {addr[0]} is not one of 1..{node.nnodes - 1}"
            if problem is None and not hello.get("headless"):
                problem = f"Remote engine {rank} must use --headless unless in external or hybrid dp lb mode"
            if problem is not None:
                try:
                    _send(conn, {"error": problem})
                finally:
                    conn.close()
                raise StartupError(f"RuntimeError: node_rank {rank} at {addr[0]} {problem}"
                                   if problem.startswith("disagrees") else f"RuntimeError: {problem}")
            peers[rank] = conn
            log("INFO", "parallel_state.py:1230", f"node_rank {rank} joined from {addr[0]} ({len(peers) + 1}/"
                f"{node.nnodes})")
        for conn in peers.values():
            _send(conn, {"start": True, "world_size": node.world_size})
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    finally:
        srv.close()
    return peers


def _connect(node: Node, stop: threading.Event) -> socket.socket:
    """A headless node: reach node 0 (retrying, as torch's store client does), say who we
    are, and wait until node 0 has every node."""
    deadline = time.monotonic() + node.timeout_s
    head = f"{node.master_addr}:{node.master_port}"
    log("INFO", "serve.py:213", f"Launching vLLM (v{VERSION}) headless multiproc executor, with head node address "
        f"{head} for torch.distributed process group.")
    last = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StartupError(
                f"torch.distributed.DistNetworkError: The client socket has timed out after {node.timeout_s:g}s "
                f"while trying to connect to ({node.master_addr}, {node.master_port}). Last error: {last or 'none'}")
        if stop.is_set():
            _stopped()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(min(left, 2.0))
        try:
            if node.host_ip:
                sock.bind((node.host_ip, 0))
            sock.connect((node.master_addr, node.master_port))
            break
        except OSError as exc:
            sock.close()
            last = str(exc) or type(exc).__name__
            stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
    deadline = max(deadline, time.monotonic() + 1.0)
    lines = _Lines(sock)
    try:
        _send(sock, {**node.contract(), "node_rank": node.node_rank, "headless": node.headless})
        while True:  # until node 0 has every node; SIGTERM ends this wait too, as it ends vLLM's
            if stop.is_set():
                sock.close()
                _stopped()
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError
            sock.settimeout(min(left, 0.5))
            try:
                reply = lines.read()
                break
            except TimeoutError:
                continue
    except TimeoutError:
        sock.close()
        raise StartupError(f"torch.distributed.DistStoreError: Timed out after {node.timeout_s:g} seconds waiting "
                           f"for the other nodes to join {head}") from None
    except (OSError, ValueError) as exc:
        sock.close()
        raise StartupError(f"torch.distributed.DistNetworkError: connection to {head} failed: {exc}") from None
    if reply is None or "error" in reply:
        sock.close()
        why = reply["error"] if reply else "it closed the connection before every node joined"
        raise StartupError(f"RuntimeError: node_rank 0 at {head} refused node_rank {node.node_rank}: {why}")
    return sock


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".") if p.isdigit())


def capture_graphs(args: argparse.Namespace, node: Node) -> None:
    """CUDA graph capture on a multi-node GB10 engine: aborts below the graph floor unless
    ``--enforce-eager``; custom all-reduce turns itself off across nodes."""
    if not getattr(args, "disable_custom_all_reduce", False):
        log("WARNING", "custom_all_reduce.py:88", "Custom allreduce is disabled because this process group spans "
            "across nodes.")
    if getattr(args, "enforce_eager", False):
        log("INFO", "gpu_model_runner.py:4190", "Skipping CUDA graph capture (--enforce-eager)")
        return
    if _version(VERSION) >= _version(GRAPHS_MIN_VLLM) and _version(NCCL_VERSION) >= _version(GRAPHS_MIN_NCCL):
        return
    log("INFO", "gpu_model_runner.py:4212", "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 0/67")
    raise StartupError(
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.cpp:77, "
        f"unhandled cuda error, NCCL version {NCCL_VERSION}\nncclUnhandledCudaError: Call to CUDA function "
        "failed.\nLast error:\nCuda failure 'operation not permitted when stream is capturing' (cross-node CUDA "
        f"graph capture on GB10, node_rank {node.node_rank} of {node.nnodes}: vLLM {VERSION} with NCCL "
        f"{NCCL_VERSION} needs --enforce-eager, vLLM #46253)")


def join(args: argparse.Namespace, env: dict[str, str], engine, stop: threading.Event,
         on_lost: Callable[[str], None] = _die) -> Group | None:
    """The engine's multi-node startup (None for a single node): refusals, rendezvous,
    and node 0's performance model for the pair. Call before loading the model."""
    node = node_of(args, env)
    if node is None:
        return None
    if node.node_rank == 0:
        peers = _serve_rendezvous(node, stop)
        engine.perf = dataclasses.replace(engine.perf, tensor_parallel=node.tensor_parallel_size)
    else:
        peers = {0: _connect(node, stop)}
    log("INFO", "pynccl.py:111", f"vLLM is using nccl=={NCCL_VERSION}: {node.nnodes} nodes, world_size="
        f"{node.world_size}, this is node_rank {node.node_rank}")
    try:
        capture_graphs(args, node)  # every node captures; each fails its own start alike
    except StartupError:
        for sock in peers.values():
            sock.close()
        raise
    # A headless node's loss ends run_headless (exit 1); node 0's ends the process.
    return Group(node=node, peers=peers, on_lost=on_lost if node.node_rank == 0 else lambda why: None).start()
