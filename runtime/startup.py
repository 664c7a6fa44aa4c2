"""What a GB10 takes to start vLLM: memory and time, from real figures (stdlib only).

One model for both sides: the deploy derives its READY wait from it, and the simulated
engine (sparkfleet/testbed/engine, which ships this file beside itself) starts by it, in
the same seconds scaled by one factor (``SIM_TIME_SCALE``; 1 on a Spark). Every figure
names its source; "assumed" marks the ones no source gives.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3

# --- memory ---------------------------------------------------------------------------
# vLLM 0.23 on unified memory compares psutil's `available` (MemAvailable) with
# gpu_memory_utilization x total when its worker starts (vllm/v1/worker/utils.py,
# request_memory), and refuses below it with this message.
GB10_MEM_TOTAL_GIB = 121.69  # MemTotal of a GB10 (field reports; ../shared/facts.md)
# MemAvailable at rest, caches dropped: the field's 101.3-102.2 GiB on headless Sparks
# (MiaAI-Lab GLM-5.3-Flash-EXL3-2x-DGX-Sparks #47); the desktop (GNOME, graphical.target,
# DGX OS's default) holds more: ~3.5 GiB assumed (gnome-shell, Xwayland, tracker, snaps).
HEADLESS_AVAILABLE_GIB = 102.2
DESKTOP_AVAILABLE_GIB = HEADLESS_AVAILABLE_GIB - 3.5
# What the engine's process holds before its check (python, torch, the CUDA context):
# assumed 0.5 GiB, bounded by the field (0.82 = 99.8 GiB starts on hosts at 101.3).
ENGINE_PRECHECK_GIB = 0.5


def requested_gib(utilization: float, total_gib: float = GB10_MEM_TOTAL_GIB) -> float:
    """What vLLM asks for at start: gpu_memory_utilization of the device's total."""
    return utilization * total_gib


def refusal(utilization: float, free_gib: float, total_gib: float) -> str | None:
    """vLLM 0.23's refusal for ``free_gib`` available at its check, or None: it starts."""
    want = requested_gib(utilization, total_gib)
    if free_gib >= want:
        return None
    return (f"ValueError: Free memory on device cuda:0 ({free_gib:.2f}/{total_gib:.2f} GiB) on startup is less "
            f"than desired GPU memory utilization ({utilization}, {want:.2f} GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes.")


# --- time -------------------------------------------------------------------------------
# Reading the checkpoint: the seeds measured ~8 min for 62-71 GiB with vLLM's default
# loader and ~32 s with fastsafetensors (Time-to-READY ~3 min against ~12); NVIDIA's forum
# (361819) ~9 min and ~2 min. The seeds' figures are the recipe's own: they are used.
LOAD_GIB_S = {"fastsafetensors": 67.0 / 32.0, "auto": 62.0 / 480.0, "safetensors": 62.0 / 480.0}
PROCESS_START_S = 20.0  # assumed: imports, config, the CUDA context
# torch.compile of the 122B graph and the Triton/FlashInfer kernels it JITs: cold is what
# is left of the seeds' ~3 min once the 32 s load and the graphs are taken out; warm loads
# both from their caches (assumed: vLLM logs ~10 s for a cached graph).
COMPILE_COLD_S = 90.0
COMPILE_WARM_S = 10.0
JIT_COLD_S = 30.0  # Triton autotune and FlashInfer JIT: lost with the container unless kept
JIT_WARM_S = 3.0
GRAPHS_S = 20.0  # assumed: KV cache profile and CUDA graph capture (3 sequences)
# Two Sparks (TP=2) start slower: the field saw cold starts of 6-15 min (../shared/facts.md).
# Each rank reads its half of the weights; the rest (NCCL's setup over the link, compile,
# JIT, graphs) takes twice as long: ~6 min cold with fastsafetensors, the field's low end,
# and the READY wait (3x) ~19 min covers its high end.
PAIR_FACTOR = 2.0
#: A start this many times the model's estimate is a stall, not a slow start.
READY_SLACK = 3.0
#: Added unscaled: the container's own start (docker run of a local image), seconds on a
#: Spark and on the simulated fleet's busy cores alike.
READY_FLOOR_S = 60


@dataclass(frozen=True)
class Startup:
    """The phases of one start, in real seconds."""

    process_s: float
    load_s: float
    compile_s: float
    jit_s: float
    graphs_s: float

    @property
    def total_s(self) -> float:
        return self.process_s + self.load_s + self.compile_s + self.jit_s + self.graphs_s


def load_rate_gib_s(load_format: str) -> float:
    return LOAD_GIB_S.get(load_format, LOAD_GIB_S["auto"])


def estimate(checkpoint_gib: float, load_format: str, compile_warm: bool, jit_warm: bool,
             pair: bool = False) -> Startup:
    """One start of a checkpoint of ``checkpoint_gib`` read with ``load_format``; the
    compile and JIT caches warm or cold."""
    factor = PAIR_FACTOR if pair else 1.0
    return Startup(
        process_s=PROCESS_START_S * factor,
        load_s=checkpoint_gib / load_rate_gib_s(load_format),
        compile_s=(COMPILE_WARM_S if compile_warm else COMPILE_COLD_S) * factor,
        jit_s=(JIT_WARM_S if jit_warm else JIT_COLD_S) * factor,
        graphs_s=GRAPHS_S * factor,
    )


def ready_timeout_s(checkpoint_gib: float, load_format: str, pair: bool = False, time_scale: float = 1.0) -> int:
    """How long the deploy waits for READY: a cold start's estimate times ``READY_SLACK``,
    in the fleet's time (``time_scale``: 1 on Sparks, the simulated fleet's factor there)."""
    cold = estimate(checkpoint_gib, load_format, compile_warm=False, jit_warm=False, pair=pair).total_s
    return READY_FLOOR_S + int(round(cold * READY_SLACK * time_scale))
