"""The on-host bench program, run as it runs on a Spark, against a local fake server.

Timing tolerances here are loose on purpose: these tests prove the formulas and the
plumbing on a shared CI machine; benchmarks/bench_accuracy.py measures the accuracy.

The package is copied under the name it has on the host (``sparkfleet_onhost``) and run
with ``python3 -m`` from there: proof that it needs nothing of sparkfleet or pyinfra.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fakeserver import FakeConfig, FakeServer
from sparkfleet.bench.onhost.checks import BenchContext, run_decode_workload
from sparkfleet.bench.onhost.client import Client
from sparkfleet.bench.onhost.metrics import parse_spec_counters
from sparkfleet.bench.onhost.progress import Progress

ONHOST = Path(__file__).resolve().parents[2] / "sparkfleet" / "bench" / "onhost"


@pytest.fixture(scope="module")
def uploaded(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("host") / "code"
    shutil.copytree(ONHOST, root / "sparkfleet_onhost", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def run_program(uploaded: Path, tmp_path: Path, base_url: str, *args: str, env_key: str | None = None):
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    env["PYTHONPATH"] = str(uploaded)
    if env_key:
        env["VLLM_API_KEY"] = env_key
    proc = subprocess.run(
        [sys.executable, "-m", "sparkfleet_onhost", "--base-url", base_url, "--out", str(out),
         "--secrets-file", str(tmp_path / "absent.env"), "--heartbeat", "0.5", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def test_program_measures_decode_e2e_and_acceptance(uploaded, tmp_path):
    cfg = FakeConfig(decode_tok_s=250.0, ttft_s=0.08, accept_len=3.5, natural_tokens=40)
    with FakeServer(cfg) as srv:
        proc, r = run_program(uploaded, tmp_path, srv.base_url, "--checks", "smoke,decode,e2e",
                              "--runs", "2", "--warmup", "1", "--max-tokens", "48", "--prompt", "my prompt")
    assert proc.returncode == 0, proc.stderr
    assert r["status"] == "ok" and r["schema"] == "sparkfleet.bench/1"
    assert r["server"]["served_models"] == ["qwen"]
    assert r["checks"]["smoke"]["passed"] and "Paris" in r["checks"]["smoke"]["answer"]
    workloads = r["checks"]["decode"]["workloads"]
    assert set(workloads) == {"prose", "code", "counting", "user"}
    for w in workloads.values():
        assert w["decode_tok_s"]["median"] == pytest.approx(250.0, rel=0.1)
        assert w["ttft_ms"]["median"] == pytest.approx(80.0, abs=30.0)
        assert len(w["runs"]) == 2 and w["warmup_runs"] == 1
        assert all(run["completion_tokens"] == 48 for run in w["runs"])
        assert w["acceptance"]["mean_length"] == pytest.approx(3.5, rel=0.05)
    e2e = r["checks"]["e2e"]
    assert set(e2e["prompts"]) == {"Q&A", "Code", "JSON", "Math", "LongCode"}
    for p in e2e["prompts"].values():
        assert p["tok_s"] == p["completion_tokens"] / p["wall_s"]  # albond's formula, exactly
    assert e2e["tok_s"] == math.fsum(p["tok_s"] for p in e2e["prompts"].values()) / 5
    # e2e includes the prefill: 40 tokens / (0.08 + 39/250) s
    assert e2e["tok_s"] == pytest.approx(40 / (0.08 + 39 / 250), rel=0.1)
    # progress lines while it ran
    assert "decode/prose run 2/2" in proc.stderr and "e2e pass 2/2" in proc.stderr


def test_acceptance_equals_the_servers_counter_deltas_over_the_measured_window():
    with FakeServer(FakeConfig(decode_tok_s=500.0, ttft_s=0.01, accept_len=4.3, num_spec_tokens=6)) as srv:
        client = Client(srv.base_url, "qwen")
        client.stream_completion("warm", 40)  # traffic before the window must not count
        before = parse_spec_counters(client.metrics_text())
        ctx = BenchContext(client=client, progress=Progress(quiet=True), runs=3, warmup=0, max_tokens=60)
        out = run_decode_workload(ctx, "x", "prompt")
        after = parse_spec_counters(client.metrics_text())
        truth = (srv.state.drafts, srv.state.accepted)
    acc = out["acceptance"]
    assert acc["drafts"] == after.drafts - before.drafts
    assert acc["accepted"] == after.accepted - before.accepted
    assert acc["mean_length"] == 1 + (after.accepted - before.accepted) / (after.drafts - before.drafts)
    assert truth[0] == after.drafts  # the parsed counters are the server's own
    assert len(acc["per_position"]) == 6


@pytest.mark.parametrize("chunked,tokens_per_chunk", [(False, 1), (True, 4)])
def test_timing_holds_for_close_delimited_streams_and_multi_token_deltas(chunked, tokens_per_chunk):
    # Close-delimited SSE would stall a 512-byte reader; bursts of 4 tokens per delta (as
    # under speculative decoding) must be counted from usage, not from deltas.
    cfg = FakeConfig(decode_tok_s=300.0, ttft_s=0.02, chunked=chunked, tokens_per_chunk=tokens_per_chunk)
    with FakeServer(cfg) as srv:
        rec = Client(srv.base_url, "qwen").stream_completion("p", 61, ignore_eos=True, min_tokens=61)
    from sparkfleet.bench.onhost.timing import record_rates

    r = record_rates(rec)
    assert r["completion_tokens"] == 61 and r["tokens_source"] == "usage"
    assert rec.deltas == 1 + -(-60 // tokens_per_chunk)
    assert r["decode_tok_s"] == pytest.approx(300.0, rel=0.1)


def test_the_api_key_comes_from_the_secrets_file(uploaded, tmp_path):
    with FakeServer(FakeConfig(api_key="sk-fleet-0123456789abcdef")) as srv:
        proc, r = run_program(uploaded, tmp_path, srv.base_url, "--checks", "smoke")
        assert proc.returncode == 1 and r["status"] == "failed"
        assert "HTTP 401" in r["reason"] and "API key" in r["reason"]

        secrets = tmp_path / "secrets.env"
        secrets.write_text("HF_TOKEN=hf_x\nVLLM_API_KEY=sk-fleet-0123456789abcdef\n")
        out = tmp_path / "ok.json"
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
        env["PYTHONPATH"] = str(uploaded)
        proc = subprocess.run(
            [sys.executable, "-m", "sparkfleet_onhost", "--base-url", srv.base_url, "--out", str(out),
             "--secrets-file", str(secrets), "--checks", "smoke"],
            env=env, capture_output=True, text=True, timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["server"]["api_key"] is True
    assert "sk-fleet" not in out.read_text()  # the key never lands in the result


def test_an_unreachable_server_still_writes_a_failed_result(uploaded, tmp_path):
    with FakeServer() as srv:
        dead = srv.base_url  # the port is free again once the server is gone
    proc, r = run_program(uploaded, tmp_path, dead, "--checks", "smoke,decode")
    assert proc.returncode == 1
    assert r["status"] == "failed"
    assert "connection refused" in r["reason"]


def test_a_wrong_answer_fails_smoke_with_the_answer_and_skips_the_benches(uploaded, tmp_path):
    with FakeServer(FakeConfig(smoke_answer=" London")) as srv:
        proc, r = run_program(uploaded, tmp_path, srv.base_url, "--checks", "smoke,decode")
    assert proc.returncode == 1
    assert r["checks"]["smoke"]["status"] == "failed"
    assert r["checks"]["smoke"]["answer"] == " London"
    assert "London" in r["reason"]
    assert r["checks"]["decode"] == {"status": "skipped", "reason": "smoke check failed"}


def test_a_failing_check_does_not_stop_the_others(uploaded, tmp_path):
    with FakeServer(FakeConfig(fail_chat_with=500, decode_tok_s=1000.0, ttft_s=0.0)) as srv:
        proc, r = run_program(uploaded, tmp_path, srv.base_url, "--checks", "e2e,decode",
                              "--runs", "1", "--warmup", "0", "--max-tokens", "8")
    assert proc.returncode == 1
    assert r["checks"]["e2e"]["status"] == "failed" and "HTTP 500" in r["checks"]["e2e"]["reason"]
    assert r["checks"]["decode"]["status"] == "ok"


def test_unknown_checks_are_refused(uploaded, tmp_path):
    proc, r = run_program(uploaded, tmp_path, "http://127.0.0.1:9", "--checks", "smoke,nonsense")
    assert proc.returncode == 2 and r is None
    assert "nonsense" in proc.stderr
