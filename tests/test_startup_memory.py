"""What a GB10 takes to start vLLM (runtime/startup.py) and what the preflight makes of it."""
from __future__ import annotations

import pytest

from runtime import startup
from sparkfleet.config import project_defaults, validate_host_data
from sparkfleet.facts import engine_phase
from sparkfleet.preflight import memory_findings
from sparkfleet.testbed.simhw import meminfo

GIB = 1024**3
TOTAL = int(startup.GB10_MEM_TOTAL_GIB * GIB)


def mem(available_gib: float) -> dict[str, int]:
    return {"MemTotal": TOTAL, "MemAvailable": int(available_gib * GIB)}


@pytest.mark.parametrize("available", [101.3, 101.7, 102.2])
def test_a_headless_spark_at_the_real_default_passes(available):
    """The field's headless Sparks (101.3-102.2 GiB available) start vLLM at 0.82 (99.8 GiB);
    the old rule (0.82 x MemTotal + 9 GiB = 108.8) refused every one of them."""
    problem, warning = memory_findings(mem(available), 0.82, 1.5, "multi-user.target")
    assert problem is None and warning is None
    assert startup.refusal(0.82, available - startup.ENGINE_PRECHECK_GIB, startup.GB10_MEM_TOTAL_GIB) is None


def test_the_preflight_never_refuses_what_vllm_would_start():
    for tenths in range(900, 1100):
        available = tenths / 10
        problem, _ = memory_findings(mem(available), 0.82, 1.5)
        if problem:  # vLLM, checking the same figure less its own share, refuses too
            assert startup.refusal(0.82, available, startup.GB10_MEM_TOTAL_GIB)


def test_a_desktop_spark_is_refused_naming_multi_user_target_and_the_share_last():
    problem, _ = memory_findings(mem(startup.DESKTOP_AVAILABLE_GIB), 0.82, 1.5, "graphical.target")
    assert problem and "would refuse to start" in problem
    assert "systemctl set-default multi-user.target" in problem
    assert problem.index("multi-user.target") < problem.index("gpu_memory_utilization=0.81")


def test_a_tight_host_gets_a_warning_not_a_refusal():
    problem, warning = memory_findings(mem(100.5), 0.82, 1.5, "multi-user.target")
    assert problem is None and "engine_startup_memory_gib=1.5" in warning


def test_vllms_refusal_is_its_own_message():
    message = startup.refusal(0.82, 98.2, 121.69)
    assert message == ("ValueError: Free memory on device cuda:0 (98.20/121.69 GiB) on startup is less than desired "
                       "GPU memory utilization (0.82, 99.79 GiB). Decrease GPU memory utilization or reduce GPU "
                       "memory used by other processes.")


def test_start_up_follows_the_seeds_figures_and_warm_caches_restart_faster():
    cold_fast = startup.estimate(67.0, "fastsafetensors", compile_warm=False, jit_warm=False).total_s
    cold_default = startup.estimate(62.0, "auto", compile_warm=False, jit_warm=False).total_s
    warm = startup.estimate(67.0, "fastsafetensors", compile_warm=True, jit_warm=True).total_s
    no_jit_kept = startup.estimate(67.0, "fastsafetensors", compile_warm=True, jit_warm=False).total_s
    assert 150 <= cold_fast <= 240  # seeds: time-to-READY ~3 min with fastsafetensors
    assert 540 <= cold_default <= 780  # seeds: ~12 min with the default loader (forum: ~9 min to load)
    assert warm < no_jit_kept < cold_fast


def test_the_ready_wait_derives_from_the_start_up_and_scales_with_the_fleets_time():
    defaults = project_defaults()
    real = validate_host_data("h", defaults)
    cold = startup.estimate(real.checkpoint_gib, "fastsafetensors", False, False).total_s
    assert real.ready_wait_s() == startup.READY_FLOOR_S + round(cold * startup.READY_SLACK)
    assert real.ready_wait_s() < 1200  # the old fixed guess
    slow = validate_host_data("h", {**defaults, "load_format": "auto"})
    assert slow.ready_wait_s() > 2.5 * real.ready_wait_s()
    sim = validate_host_data("h", {**defaults, "startup_time_scale": 0.05})
    assert sim.ready_wait_s() - startup.READY_FLOOR_S == pytest.approx(
        (real.ready_wait_s() - startup.READY_FLOOR_S) * 0.05, abs=1)
    # A pair (two Sparks, TP=2 over the link) starts slower, the field's 6-15 min: its members
    # wait for a pair's cold start (~18.6 min here), not a single Spark's (~10.6 min).
    pair_cold = startup.estimate(real.checkpoint_gib, "fastsafetensors", False, False, pair=True).total_s
    assert real.ready_wait_s(pair=True) == startup.READY_FLOOR_S + round(pair_cold * startup.READY_SLACK)
    assert real.ready_wait_s(pair=True) > 15 * 60 > real.ready_wait_s()
    given = validate_host_data("h", {**defaults, "ready_timeout_s": 900})
    assert given.ready_wait_s() == given.ready_wait_s(pair=True) == 900


def test_progress_names_the_engines_phase_from_its_log():
    assert engine_phase(["x", "INFO [default_loader.py:268] Loading safetensors checkpoint shards:  42% Completed | "
                         "6/14"]) == "loading weights 42%"
    assert engine_phase(["Loading weights took 32.00 seconds", "Compiling a graph for dynamic shape takes 72 s"]) \
        == "torch.compile"
    assert engine_phase(["Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%"]) == "capturing CUDA graphs"
    assert engine_phase(["nothing yet"]) == ""


def test_the_simulated_meminfo_says_what_startup_says():
    assert meminfo.TOTAL_KIB == int(startup.GB10_MEM_TOTAL_GIB * 1024 * 1024)
    assert meminfo.HEADLESS_KIB == int(startup.HEADLESS_AVAILABLE_GIB * 1024 * 1024)
    assert meminfo.DESKTOP_KIB == int(startup.DESKTOP_AVAILABLE_GIB * 1024 * 1024)
    text = meminfo.render(meminfo.TOTAL_KIB, meminfo.HEADLESS_KIB).decode()
    assert len(text) == len(meminfo.render(meminfo.TOTAL_KIB, 0))  # rewritten in place
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()}
    assert fields["MemTotal"] == meminfo.TOTAL_KIB and fields["MemAvailable"] == meminfo.HEADLESS_KIB
