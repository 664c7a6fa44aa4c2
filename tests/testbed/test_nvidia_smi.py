"""The simulated nvidia-smi / nvidia-ctk, run as the hosts run them (no root needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparkfleet.gpu import Gpu
from sparkfleet.preflight import GB10_COMPUTE_CAPABILITY, GB10_NAME
from sparkfleet.testbed import simhw

SMI = simhw.HERE / "nvidia_smi.py"
CTK = simhw.HERE / "nvidia_ctk.py"


def smi(*args: str, sim_dir: Path, switches: dict | None = None) -> subprocess.CompletedProcess:
    if switches is not None:
        (sim_dir / "switches.json").write_text(json.dumps(switches))
    return subprocess.run([sys.executable, str(SMI), *args], capture_output=True, text=True, timeout=30,
                          env={"SPARKFLEET_SIM_DIR": str(sim_dir), "PATH": "/usr/bin:/bin"})


def parse_csv(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


def test_gb10_query_with_header(tmp_path):
    cp = smi("--query-gpu=name,compute_cap,driver_version,memory.total,memory.used,memory.free",
             "--format=csv", sim_dir=tmp_path)
    assert cp.returncode == 0, cp.stderr
    header, row = parse_csv(cp.stdout)
    assert header == ["name", "compute_cap", "driver_version", "memory.total [MiB]", "memory.used [MiB]",
                      "memory.free [MiB]"]
    assert row[:2] == ["NVIDIA GB10", "12.1"]
    assert row[2].count(".") == 2 and row[2].split(".")[0].isdigit()
    # unified memory: GB10 reports no framebuffer memory
    assert row[3:] == ["[N/A]", "[N/A]", "[N/A]"]


def test_noheader_nounits(tmp_path):
    cp = smi("--query-gpu=name,memory.total,utilization.gpu,index", "--format=csv,noheader,nounits",
             sim_dir=tmp_path)
    assert cp.returncode == 0
    assert parse_csv(cp.stdout) == [["NVIDIA GB10", "[N/A]", "0", "0"]]


def test_the_deploys_gpu_fact_reads_it_as_a_gb10(tmp_path):
    fact = Gpu()
    cp = smi(*fact.command().split(" 2>")[0].split()[1:], sim_dir=tmp_path)
    got = fact.process(cp.stdout.splitlines())
    assert got["name"] == GB10_NAME and got["compute_cap"] == GB10_COMPUTE_CAPABILITY
    assert got["driver_version"] and not got["driver_version"].startswith("[")


def test_wrong_gpu_switch(tmp_path):
    cp = smi("--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader", sim_dir=tmp_path,
             switches={"gpu": "NVIDIA H100 80GB HBM3"})
    name, cc, mem = parse_csv(cp.stdout)[0]
    assert (name, cc) == ("NVIDIA H100 80GB HBM3", "9.0")
    assert mem.endswith(" MiB") and int(mem.split()[0]) > 0
    cp = smi("--query-gpu=compute_cap", "--format=csv,noheader", sim_dir=tmp_path,
             switches={"gpu": "Some GPU", "compute_cap": "7.5"})
    assert cp.stdout.strip() == "7.5"


def test_table_and_list(tmp_path):
    cp = smi(sim_dir=tmp_path)
    assert cp.returncode == 0
    assert "NVIDIA GB10" in cp.stdout and "Driver Version: 580.95.05" in cp.stdout
    assert "Not Supported" in cp.stdout  # Memory-Usage of a unified-memory GPU
    widths = {len(line) for line in cp.stdout.splitlines()[1:] if line.startswith(("|", "+"))}
    assert widths == {91}, "table rows must line up"
    cp = smi("-L", sim_dir=tmp_path)
    assert cp.stdout.startswith("GPU 0: NVIDIA GB10 (UUID: GPU-")


@pytest.mark.parametrize("args", [["--query-gpu=name,bogus.field", "--format=csv"],
                                  ["--query-gpu=name"], ["--frobnicate"]])
def test_errors_like_the_real_tool(tmp_path, args):
    cp = smi(*args, sim_dir=tmp_path)
    assert cp.returncode != 0 and cp.stdout == ""


def test_nvidia_ctk_merges_runtime_into_daemon_json(tmp_path):
    cfg = tmp_path / "daemon.json"
    cfg.write_text(json.dumps({"insecure-registries": ["10.213.0.1:5000"], "log-driver": "journald"}))
    cp = subprocess.run([sys.executable, str(CTK), "runtime", "configure", "--runtime=docker",
                         f"--config={cfg}"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cfg.read_text())
    assert doc["insecure-registries"] == ["10.213.0.1:5000"] and doc["log-driver"] == "journald"
    assert doc["runtimes"]["nvidia"]["path"] == "nvidia-container-runtime"
    assert "default-runtime" not in doc


def test_toolkit_package_holds_what_docker_gpus_needs():
    files = simhw.toolkit_files()
    assert set(files) == {"usr/bin/nvidia-container-runtime-hook", "usr/bin/nvidia-container-runtime",
                          "usr/bin/nvidia-ctk"}
    assert all(mode == 0o755 and text.startswith("#!") for text, mode in files.values())


def test_driver_mismatch_switch_fails_like_a_driver_updated_without_a_reboot(tmp_path):
    from sparkfleet.testbed import switches

    assert switches.normalize({"driver_mismatch": "yes"}) == {"driver_mismatch": True}
    fact = Gpu()
    cp = smi(*fact.command().split(" 2>")[0].split()[1:], sim_dir=tmp_path, switches={"driver_mismatch": True})
    assert cp.returncode == 18
    assert cp.stdout.splitlines()[0] == "Failed to initialize NVML: Driver/library version mismatch"
    assert fact.process(cp.stdout.splitlines())["mismatch"] == {"kernel_module": "", "library": "580.126"}
    assert smi("-L", sim_dir=tmp_path).returncode == 18
