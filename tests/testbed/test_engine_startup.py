"""The simulated engine starts as a GB10 does: vLLM 0.23's memory check on the host's
simulated memory, and a start-up as long as what it loads (runtime/startup.py), scaled."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import startup
from sparkfleet.testbed.engine import memory

MODEL = "acme/tiny-int4-AutoRound"
SHA = "d" * 40
KIB_GIB = 1024 * 1024


def cache_repo(hub: Path) -> None:
    folder = hub / f"models--{MODEL.replace('/', '--')}"
    snap = folder / "snapshots" / SHA
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                  "text_config": {"max_position_embeddings": 8192}}))
    (snap / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"layer.0.weight": "model-00001-of-00001.safetensors"}}))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(SHA)


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """An HF cache, a compile cache and a simulated host's memory (simhw/meminfo.py's state)."""
    cache_repo(tmp_path / "hf" / "hub")
    state = tmp_path / "mem"
    (state / "reserve").mkdir(parents=True)
    return {"hf": tmp_path / "hf", "mem": state, "cache": tmp_path / "hf" / ".vllm_cache"}


def set_memory(state: Path, available_gib: float) -> None:
    (state / "base").write_text(f"{int(startup.GB10_MEM_TOTAL_GIB * KIB_GIB)} {int(available_gib * KIB_GIB)}\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(host: dict[str, Path], port: int, scale: str = "0.02", util: str = "0.82") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIM_")}
    env.update(HF_HOME=str(host["hf"]), HF_HUB_OFFLINE="1", SIM_MEMORY_DIR=str(host["mem"]), SIM_TIME_SCALE=scale,
               VLLM_CACHE_ROOT=str(host["cache"]), TRITON_CACHE_DIR=str(host["cache"] / "triton"),
               FLASHINFER_WORKSPACE_BASE=str(host["cache"]), SIM_TTFT_S="0.01")
    return subprocess.Popen([sys.executable, "-m", "sparkfleet.testbed.engine", "serve", MODEL, "--port", str(port),
                             "--host", "127.0.0.1", "--gpu-memory-utilization", util, "--load-format",
                             "fastsafetensors"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def until_ready(proc: subprocess.Popen, port: int, timeout: float = 60) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        assert proc.poll() is None, proc.stdout.read()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return time.monotonic() - started
        except OSError:
            time.sleep(0.05)
    raise AssertionError("not ready")


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=20)
    return out


def test_a_desktop_host_is_refused_with_vllms_message(host):
    set_memory(host["mem"], startup.DESKTOP_AVAILABLE_GIB)
    proc = engine(host, free_port())
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "Free memory on device cuda:0 (98.20/121.69 GiB) on startup is less than desired GPU memory " \
           "utilization (0.82, 99.79 GiB)" in out


def test_a_headless_host_starts_and_holds_its_share_until_the_engine_dies(host):
    set_memory(host["mem"], startup.HEADLESS_AVAILABLE_GIB)
    port = free_port()
    proc = engine(host, port)
    until_ready(proc, port)
    held = sum(int(p.read_text()) for p in (host["mem"] / "reserve").iterdir()) / KIB_GIB
    # 0.82 of the device in use once loaded: what was used before counts against it (~22 GiB left).
    assert held == pytest.approx(0.82 * 121.69 - (121.69 - 102.2), abs=0.05)
    proc.kill()
    proc.wait()
    assert memory.others_reserved_kib(host["mem"] / "reserve") == 0  # a dead engine holds nothing
    # A second engine now sees the first's memory gone; while one lives, the next is refused.
    port2 = free_port()
    first = engine(host, port2)
    until_ready(first, port2)
    second = engine(host, free_port())
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 1 and "is less than desired GPU memory utilization" in out
    stop(first)


def test_start_up_is_as_long_as_a_gb10s_scaled_and_a_restart_finds_its_caches(host):
    set_memory(host["mem"], startup.HEADLESS_AVAILABLE_GIB)
    port = free_port()
    proc = engine(host, port, scale="0.02")
    cold = until_ready(proc, port)
    log = stop(proc)
    for phase in ("Loading safetensors using Fastsafetensor loader:  50% Completed", "Loading weights took",
                  "Compiling a graph for dynamic shape", "Capturing CUDA graphs"):
        assert phase in log, log
    proc = engine(host, port, scale="0.02")
    warm = until_ready(proc, port)
    log = stop(proc)
    assert "Directly load the compiled graph(s)" in log
    want_cold = startup.estimate(62.0, "fastsafetensors", False, False).total_s * 0.02
    want_warm = startup.estimate(62.0, "fastsafetensors", True, True).total_s * 0.02
    assert want_cold <= cold < want_cold + 3
    assert want_warm <= warm < want_warm + 3 and warm < cold
    assert (host["cache"] / "triton").is_dir() and (host["cache"] / ".cache" / "flashinfer").is_dir()


def test_the_flock_frees_a_dead_engines_share(tmp_path):
    (tmp_path / "reserve").mkdir()
    held = tmp_path / "reserve" / "live"
    held.write_text("1048576\n")
    fd = os.open(held, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (tmp_path / "reserve" / "dead").write_text("2097152\n")
    assert memory.others_reserved_kib(tmp_path / "reserve") == 1048576
    os.close(fd)
