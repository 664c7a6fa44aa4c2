"""The simulated engine's start-up, phase by phase, as long as a GB10's (runtime/startup.py).

What it loads decides how long: the real checkpoint this synthetic one stands for, the
load format, and whether the compile and JIT caches are warm. Time runs ``SIM_TIME_SCALE``
times as fast (1: a Spark's minutes); the log says the real seconds, as vLLM's would, with
vLLM's phase lines (loading %, torch.compile, CUDA graphs) for the deploy's progress.
The caches are real files: torch.compile's under ``VLLM_CACHE_ROOT``, the Triton and
FlashInfer kernels under ``TRITON_CACHE_DIR`` / ``FLASHINFER_WORKSPACE_BASE`` (else the
container's home, lost with it), keyed by what they were compiled for.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from .logs import log
from .memory import Memory, startup

#: The real checkpoints' sizes (group_data/all.py's artifact_sizes_gib), by what they stand for.
REAL_CHECKPOINT_GIB = {"int4-fp8-hybrid": 67.0, "int4-autoround": 62.0}
DEFAULT_CHECKPOINT_GIB = 62.0
DRAFTER_GIB = 1.6


def checkpoint_gib(model: str, config: dict, drafter: bool) -> float:
    name = model.lower()
    gib = 67.0 if config.get("sparkfleet_hybrid") else next(
        (g for key, g in REAL_CHECKPOINT_GIB.items() if key in name), DEFAULT_CHECKPOINT_GIB)
    return gib + (DRAFTER_GIB if drafter else 0.0)


def time_scale(env: dict[str, str]) -> float:
    try:
        value = float(env.get("SIM_TIME_SCALE", "") or 1.0)
    except ValueError:
        value = 1.0
    return value if value > 0 else 1.0


def _home(env: dict[str, str]) -> Path:
    return Path(env.get("HOME") or "/root")


def cache_dirs(env: dict[str, str]) -> dict[str, Path]:
    """Where each cache lives in this container (vLLM's defaults without the variables)."""
    vllm_root = Path(env.get("VLLM_CACHE_ROOT") or _home(env) / ".cache/vllm")
    return {
        "compile": vllm_root / "torch_compile_cache",
        "triton": Path(env.get("TRITON_CACHE_DIR") or _home(env) / ".triton/cache"),
        "flashinfer": Path(env.get("FLASHINFER_WORKSPACE_BASE") or _home(env)) / ".cache/flashinfer",
    }


def _entry(directory: Path, key: str) -> Path:
    return directory / hashlib.sha256(key.encode()).hexdigest()[:10] / "sparkfleet-sim-cache"


class Boot:
    """One start: its phases slept through (scaled), logged, and the memory grown as it loads."""

    def __init__(self, env: dict[str, str], model: str, config: dict, compile_key: str, load_format: str,
                 drafter: bool, memory: Memory, final_gib: float, pair: bool = False) -> None:
        self.env, self.scale = env, time_scale(env)
        self.gib = checkpoint_gib(model, config, drafter)
        self.load_format = load_format
        self.dirs = cache_dirs(env)
        self.compile_entry = _entry(self.dirs["compile"], compile_key)
        # Triton/FlashInfer kernels depend on the kernels the model runs (its graph), not the weights' revision.
        self.jit_entries = [_entry(self.dirs[k], compile_key) for k in ("triton", "flashinfer")]
        self.compile_warm = self.compile_entry.is_file()
        self.jit_warm = all(p.is_file() for p in self.jit_entries)
        self.plan = startup.estimate(self.gib, load_format, self.compile_warm, self.jit_warm, pair=pair)
        self.memory, self.final_gib = memory, final_gib

    def run(self, stop: threading.Event) -> bool:
        """Go through the phases; False when stopped before the end."""
        p, s = self.plan, self.scale
        log("INFO", "sim", f"SIMULATED start-up of a GB10 at {s:g}x time: {p.total_s:.0f} s "
            f"({'warm' if self.compile_warm else 'cold'} compile, {'warm' if self.jit_warm else 'cold'} JIT, "
            f"{self.gib:g} GiB with {self.load_format})")
        if stop.wait(p.process_s * s):
            return False
        weights_gib = self.gib
        label = ("Loading safetensors using Fastsafetensor loader" if self.load_format == "fastsafetensors"
                 else "Loading safetensors checkpoint shards")
        shards = 14
        for i in range(1, shards + 1):
            if stop.wait(p.load_s * s / shards):
                return False
            self.memory.hold(max(startup.ENGINE_PRECHECK_GIB, min(self.final_gib, weights_gib * i / shards)))
            log("INFO", "default_loader.py:268", f"{label}: {100 * i // shards:3d}% Completed | {i}/{shards}")
        log("INFO", "default_loader.py:308", f"Loading weights took {p.load_s:.2f} seconds")
        log("INFO", "gpu_model_runner.py:2634", f"Model loading took {weights_gib:.4f} GiB memory and "
            f"{p.process_s + p.load_s:.2f} seconds")
        if self.compile_warm:
            log("INFO", "backends.py:215", f"Directly load the compiled graph(s) for dynamic shape from the cache, "
                f"took {p.compile_s:.3f} s")
        else:
            log("INFO", "backends.py:548", f"Compiling a graph for dynamic shape takes {p.compile_s * 0.8:.2f} s")
        if stop.wait(p.compile_s * s):
            return False
        log("INFO", "monitor.py:34", f"torch.compile takes {p.compile_s:.2f} s in total")
        self._write(self.compile_entry)
        log("INFO", "sim", f"Triton/FlashInfer kernels: {'loaded from cache' if self.jit_warm else 'JIT compiling'}")
        if stop.wait(p.jit_s * s):
            return False
        for entry in self.jit_entries:
            self._write(entry)
        self.memory.hold(self.final_gib)
        log("INFO", "gpu_worker.py:298", f"Available KV cache memory: {max(0.0, self.final_gib - weights_gib):.2f} GiB")
        log("INFO", "gpu_model_runner.py:3480", "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%")
        if stop.wait(p.graphs_s * s):
            return False
        log("INFO", "gpu_model_runner.py:3603", f"Graph capturing finished in {p.graphs_s:.0f} secs, took 0.50 GiB")
        log("INFO", "core.py:210", f"init engine (profile, create kv cache, warmup model) took {p.total_s:.2f} seconds")
        return True

    @staticmethod
    def _write(entry: Path) -> None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            entry.write_text("compiled\n")
        except OSError as exc:
            log("WARNING", "sim", f"could not write the cache {entry}: {exc}")
