"""On the simulated fleet: one command deploys 3 hosts, checks them, writes the report.

    pyinfra -y inventory/testbed.py deploy.py --data checks='["smoke","decode","e2e"]'

Runs on the session's fleet (tests/e2e/conftest.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from sparkfleet.testbed import paths
from sparkfleet.testbed.engine import perf

REPO = Path(__file__).resolve().parents[2]
INVENTORY = str(paths.INVENTORY.relative_to(REPO))
N_HOSTS = 3
# The dense profile on the simulated engine: DFlash n=12 with both dense levers (the int8
# lm-head patch lands in the image's real vLLM source; the hybrid checkpoint is served).
DENSE = perf.perf_model("dflash", 12, perf.Levers(fp8_shared_experts=True, int8_lm_head=True), {})


@pytest.fixture(scope="module")
def fleet_up(testbed):
    return testbed


def test_one_command_deploys_checks_and_reports_three_hosts(fleet_up, tmp_path):
    run_id = f"e2e-checks-{int(time.time())}"
    proc = subprocess.run(
        ["pyinfra", "-y", INVENTORY, "deploy.py",
         "--data", 'checks=["smoke","decode","e2e"]', "--data", f"run_id={run_id}",
         "--data", f"results_dir={tmp_path}", "--data", "bench_runs=2", "--data", "bench_max_tokens=64"],
        cwd=REPO, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    run_dir = tmp_path / run_id
    hosts = sorted(p.stem for p in run_dir.glob("spark-*.json"))
    assert hosts == [fleet_up.inventory_name(f"spark-{i}") for i in range(1, N_HOSTS + 1)]
    for name in hosts:
        r = json.loads((run_dir / f"{name}.json").read_text())
        assert r["status"] == "ok", r.get("reason")
        assert r["runner"] == "docker"  # inside the serving image, over SSH
        assert "Paris" in r["checks"]["smoke"]["answer"]
        for name, w in r["checks"]["decode"]["workloads"].items():
            # each workload at its own speed: the performance model, through the real bench
            assert w["decode_tok_s"]["median"] == pytest.approx(DENSE.speed(name).tok_s, rel=0.25), name  # CPU-starved pacing runs slow
            assert w["acceptance"]["mean_length"] == pytest.approx(DENSE.speed(name).accept, rel=0.05), name
        assert r["checks"]["e2e"]["tok_s"] > 0
    for ext in ("txt", "csv", "json", "png"):
        assert (run_dir / f"fleet-report.{ext}").exists()
    report = json.loads((run_dir / "fleet-report.json").read_text())
    assert sorted(report["hosts"]) == hosts and report["failed"] == []
    assert "sparkfleet fleet report" in out
    assert re.search(r"\[spark-2(?:\.local)?\] \[bench", out)  # progress streamed per host


def test_the_tools_check_fails_naming_the_missing_parser(fleet_up, tmp_path):
    """A host deployed without a tool-call parser serves, answers Paris, and cannot call tools."""
    def deploy(*data: str) -> subprocess.CompletedProcess:
        args = ["pyinfra", "-y", INVENTORY, "deploy.py", "--limit", fleet_up.inventory_name("spark-1"),
                "--data", f"results_dir={tmp_path}", "--data", "run_id=tools"]
        for d in data:
            args += ["--data", d]
        return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)

    try:
        # rollout=all: a rolling deploy's gate would catch it first and roll the host back
        # (tests/e2e/test_endpoint_rollout.py); here the check itself is under test.
        proc = deploy("tool_call_parser=", "checks=smoke,tools", "rollout=all")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-6000:]
        r = json.loads((tmp_path / "tools" / f"{fleet_up.inventory_name('spark-1')}.json").read_text())
        assert r["checks"]["smoke"]["status"] == "ok"
        tools = r["checks"]["tools"]
        assert tools["status"] == "failed" and "no tool-call parser" in tools["reason"]
        assert "tool_call_parser" in tools["reason"]  # the data key that fixes it
        assert "tools: the server has no tool-call parser" in out
    finally:
        restored = deploy("checks=smoke,tools", "run_id=tools-restored")
    assert restored.returncode == 0, (restored.stdout + restored.stderr)[-6000:]
    ok = json.loads((tmp_path / "tools-restored" / f"{fleet_up.inventory_name('spark-1')}.json").read_text())
    assert ok["checks"]["tools"]["passed"] and ok["checks"]["tools"]["arguments"]["city"] == "Paris"
