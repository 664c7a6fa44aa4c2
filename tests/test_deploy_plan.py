"""deploy.py planned (--dry) against @fake hosts: validation and preflight decide what runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plan(fleet: str, *data: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pyinfra", "--dry", "tests/fixtures/fake_fleet.py", "deploy.py"]
    for item in data:
        args += ["--data", item]
    env = {**os.environ, "FAKE_FLEET": fleet}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def changes(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def assert_in_order(out: str, steps: list[str]) -> None:
    """Every step is planned, each after the one before it."""
    positions = [out.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), out[-3000:]


def test_a_fresh_gb10_plans_every_step_in_order():
    out = changes(plan("gb10"))
    steps = [
        "NVIDIA container toolkit installed",
        "serving image present",
        "weights in the HF cache",
        "systemd unit sparkfleet-serve.service",
        "READY: the served model answers",
    ]
    assert_in_order(out, steps)


def test_the_wan_starts_before_the_hosts_own_setup():
    # The WAN is a first deploy's bound: the mirror starts both artifacts across it before
    # the steps that move no bytes (OOM guard, watchdog), which run while the bytes come;
    # only then does the deploy wait for the image.
    out = changes(plan("gb10,gb10"))
    steps = [
        "HF token in a 0600 file",  # olah forwards it upstream
        "the HF mirror fetches every file of the locked commits",
        "serving image copy from upstream started",
        "earlyoom installed",
        "watchdog program",
        "serving image copied from upstream",
        "serving image present",
    ]
    assert_in_order(out, steps)


def test_a_wrong_gpu_plans_only_its_failing_preflight():
    out = changes(plan("gb10,h100"))
    preflight_line = next(line for line in out.splitlines() if line.strip().startswith("preflight:"))
    assert "spark-2-h100" in preflight_line and "spark-1-gb10" not in preflight_line
    image_line = next(line for line in out.splitlines() if "serving image present" in line)
    assert "spark-1-gb10" in image_line and "spark-2-h100" not in image_line


def test_force_turns_the_gpu_gate_into_a_warning():
    out = changes(plan("h100", "force=true"))
    assert "preflight warning: GPU is NVIDIA H100" in out
    assert "try anyway" not in out  # the hint is for a run without force
    assert "serving image present" in out


def test_a_full_disk_fails_preflight():
    out = changes(plan("full"))
    preflight_line = next(line for line in out.splitlines() if line.strip().startswith("preflight:"))
    assert "spark-1-full" in preflight_line


def test_invalid_data_exits_before_any_host_is_touched():
    for item, needle in (("profile=nonsense", "valid profiles: base, dense, dflash, mtp"),
                         ("gpu_memory_utilization=1.5", "`gpu_memory_utilization` = 1.5")):
        result = plan("gb10,gb10", item)
        assert result.returncode != 0
        out = changes(result)
        assert needle in out and "nothing was changed" in out
        assert "Detected changes" not in out


def test_planning_writes_nothing_on_the_controller(tmp_path):
    """--dry on a fresh controller: the API key and the mirror's certificate are planned,
    and made only by a deploy that executes."""
    key, tls = tmp_path / "api-key", tmp_path / "mirror-tls"
    result = plan("gb10,gb10", f"api_key_file={key}", f"mirror_tls_dir={tls}")
    out = changes(result)
    assert result.returncode == 0, out[-3000:]
    assert "API key in 0600 files" in out and "registry certificate made on the controller" in out
    assert not key.exists() and not tls.exists()


def test_the_mirror_starts_on_the_weights_before_the_image_crosses_the_wan():
    """The weights need not wait for every host's pull: the fleet's mirror starts fetching
    them as soon as its HF mirror answers, and the deploy reads the result at the end."""
    out = changes(plan("gb10,gb10"))
    steps = ["registry and HF mirror answer", "the HF mirror fetches every file of the locked commits",
             "serving image copied from upstream", "serving image present", "weights in the HF cache",
             "the HF mirror holds every file of the locked commits"]
    assert_in_order(out, steps)


def test_relays_copy_the_image_in_turns_down_the_tree():
    """fleet_fanout=1 makes a chain: each turn copies on the one host at its depth, after
    the turn above, whatever operations the fleet's mirror alone declares before its copy."""
    out = changes(plan("gb10,gb10,gb10,gb10", "fleet_fanout=1"))
    turns = ["serving image copied from upstream", "serving image copied into the relays 1 hop down",
             "serving image copied into the relays 2 hops down"]
    assert_in_order(out, [f"Mirror | {turn}" for turn in turns])
