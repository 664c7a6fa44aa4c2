"""Every profile's whole rendered command line and environment.

The deploy renders serve.env from the validated settings; runtime/serve_args.py turns
that env into the argv inside the container. These tests run both halves, so what the
deploy declares is exactly what vLLM is started with.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from runtime.serve_args import build_serve_argv, patches_for
from sparkfleet.config import validate_host_data

ROOT = Path(__file__).resolve().parents[1]

DEFAULTS = {k: v for k, v in runpy.run_path(str(ROOT / "group_data" / "all.py")).items() if not k.startswith("__")}

COMMON = [
    "--served-model-name", "qwen", "--host", "0.0.0.0", "--port", "8000",
    "--max-model-len", "262144", "--max-num-seqs", "3", "--max-num-batched-tokens", "8192",
    "--gpu-memory-utilization", "0.82", "--load-format", "fastsafetensors",
    "--attention-backend", "FLASH_ATTN",
    "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml", "--reasoning-parser", "qwen3",
    "--enable-chunked-prefill", "--no-enable-prefix-caching",
]
DFLASH_SPEC = {
    "method": "dflash", "model": "z-lab/Qwen3.5-122B-A10B-DFlash",
    "num_speculative_tokens": 12, "attention_backend": "FLASH_ATTN",
}
EXPECTED = {
    "dense": (
        ["vllm", "serve", "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid", "--revision", "main", *COMMON,
         "--speculative-config", json.dumps(DFLASH_SPEC, separators=(",", ":"))],
        ["kv_unify", "inc_fp8_shared", "int8_lmhead", "fla_shmem"],
    ),
    "dflash": (
        ["vllm", "serve", "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "--revision", "main", *COMMON,
         "--speculative-config", json.dumps(DFLASH_SPEC, separators=(",", ":"))],
        ["kv_unify", "fla_shmem"],
    ),
    "base": (
        ["vllm", "serve", "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "--revision", "main", *COMMON],
        ["fla_shmem"],
    ),
    "mtp": (
        ["vllm", "serve", "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "--revision", "main", *COMMON,
         "--speculative-config", '{"method":"qwen3_5_mtp","num_speculative_tokens":2}'],
        ["fla_shmem"],
    ),
}
EXPECTED_ENV = {
    "HF_HOME": "/hf",
    "VLLM_CACHE_ROOT": "/hf/.vllm_cache",
    "HF_HUB_OFFLINE": "1",
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0",
}


def settings(**overrides):
    return validate_host_data("spark-1", {**DEFAULTS, **overrides})


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_profile_renders_the_seeds_serve_settings_exactly(profile):
    env = settings(profile=profile).serve_env()
    argv, patches = EXPECTED[profile]
    built = build_serve_argv(env)
    # sparkfleet's own addition: with an API key every route needs it (runtime/key_guard.py).
    at = built.index("--middleware")
    assert built[at:at + 2] == ["--middleware", "key_guard.KeyGuard"]
    assert built[:at] + built[at + 2:] == argv
    assert patches_for(env) == patches
    assert {k: env[k] for k in EXPECTED_ENV} == EXPECTED_ENV
    # sparkfleet's own addition: every JIT cache the engine writes is kept on the host, beside
    # VLLM_CACHE_ROOT, so a restart is warm (runtime/serve_args.py).
    own = {"TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH"}
    assert all(env[k].startswith(EXPECTED_ENV["VLLM_CACHE_ROOT"]) for k in own)
    assert set(env) - set(EXPECTED_ENV) - own == {k for k in env if k.startswith("SF_")}


def test_no_secret_reaches_the_environment_file_or_argv():
    s = settings(api_key="k" * 32, hf_token="hf_secret_token_value")
    rendered = json.dumps(s.serve_env()) + " ".join(build_serve_argv(s.serve_env()))
    assert "k" * 32 not in rendered and "hf_secret_token_value" not in rendered


def test_empty_parsers_disable_them_for_every_profile():
    for profile in EXPECTED:
        argv = build_serve_argv(settings(profile=profile, tool_call_parser="", reasoning_parser="").serve_env())
        assert not {"--tool-call-parser", "--reasoning-parser", "--enable-auto-tool-choice"} & set(argv)


def test_prefix_caching_brings_the_alignment_patch_for_dflash_only():
    dense = settings(prefix_caching=True).serve_env()
    assert "--enable-prefix-caching" in build_serve_argv(dense)
    assert patches_for(dense) == ["kv_unify", "prefix_align", "inc_fp8_shared", "int8_lmhead", "fla_shmem"]
    assert "prefix_align" not in patches_for(settings(profile="mtp", prefix_caching=True).serve_env())


def test_speculative_depth_override_and_zero_turns_it_off():
    four = json.loads(settings(profile="dflash", num_speculative_tokens=4).serve_env()["SF_SPECULATIVE_CONFIG"])
    assert four["num_speculative_tokens"] == 4
    off = settings(profile="dflash", num_speculative_tokens=0).serve_env()
    assert "--speculative-config" not in build_serve_argv(off)
    assert patches_for(off) == ["fla_shmem"]


def test_local_checkpoints_are_served_from_model_without_revision():
    for s in (settings(profile="dflash", model_dir="/data/int4"), settings(build_hybrid=True)):
        argv = build_serve_argv(s.serve_env())
        assert argv[2] == "/model" and "--revision" not in argv


def test_pinned_revisions_reach_model_and_drafter():
    s = settings(model_revisions={
        "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid": "a" * 40,
        "z-lab/Qwen3.5-122B-A10B-DFlash": "b" * 40,
    })
    argv = build_serve_argv(s.serve_env())
    assert argv[3:5] == ["--revision", "a" * 40]
    assert json.loads(argv[argv.index("--speculative-config") + 1])["revision"] == "b" * 40


def test_every_setting_is_overridable():
    argv = build_serve_argv(settings(
        port=9000, max_model_len=65536, max_num_seqs=1, gpu_memory_utilization=0.7,
        served_model_name="q35", bind_address="127.0.0.1", extra_serve_args=["--seed", "7"],
    ).serve_env())
    for flag, value in (("--port", "9000"), ("--max-model-len", "65536"), ("--max-num-seqs", "1"),
                        ("--gpu-memory-utilization", "0.7"), ("--served-model-name", "q35"),
                        ("--host", "127.0.0.1"), ("--seed", "7")):
        assert argv[argv.index(flag) + 1] == value


def test_only_the_drafter_the_profile_uses_is_fetched():
    assert settings(profile="base").repos_to_fetch == ["Intel/Qwen3.5-122B-A10B-int4-AutoRound"]
    assert settings(profile="mtp").repos_to_fetch == ["Intel/Qwen3.5-122B-A10B-int4-AutoRound"]
    assert settings(profile="dense").repos_to_fetch == [
        "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid", "z-lab/Qwen3.5-122B-A10B-DFlash"]
    assert settings(profile="dflash", model_dir="/data/x").repos_to_fetch == ["z-lab/Qwen3.5-122B-A10B-DFlash"]
