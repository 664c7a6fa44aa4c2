"""Helpers for tests of runtime/: profile serve.env fixtures and where runtime/ lives."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME_DIR = REPO / "runtime"
PATCH_DIR = RUNTIME_DIR / "patches"
ENV_DIR = REPO / "tests" / "runtime" / "envs"
PROFILES = ("dense", "dflash", "base", "mtp")


# What each profile fixture (tests/runtime/envs/) must turn into: the exact argv of
# docs/architecture.md's table and the patch list.
DFLASH_SPEC = (
    '{"method":"dflash","model":"z-lab/Qwen3.5-122B-A10B-DFlash",'
    '"num_speculative_tokens":12,"attention_backend":"FLASH_ATTN"}'
)
COMMON = [
    "--revision", "main",
    "--served-model-name", "qwen",
    "--host", "0.0.0.0",
    "--port", "8000",
    "--max-model-len", "262144",
    "--max-num-seqs", "3",
    "--max-num-batched-tokens", "8192",
    "--gpu-memory-utilization", "0.82",
    "--load-format", "fastsafetensors",
    "--attention-backend", "FLASH_ATTN",
    "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml",
    "--reasoning-parser", "qwen3",
    "--enable-chunked-prefill",
    "--no-enable-prefix-caching",
]
INTEL = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
EXPECTED_ARGV = {
    "dense": ["vllm", "serve", "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid", *COMMON,
              "--speculative-config", DFLASH_SPEC],
    "dflash": ["vllm", "serve", INTEL, *COMMON, "--speculative-config", DFLASH_SPEC],
    "base": ["vllm", "serve", INTEL, *COMMON],
    "mtp": ["vllm", "serve", INTEL, *COMMON,
            "--speculative-config", '{"method":"qwen3_5_mtp","num_speculative_tokens":2}'],
}
EXPECTED_PATCHES = {
    "dense": ["kv_unify", "inc_fp8_shared", "int8_lmhead", "fla_shmem"],
    "dflash": ["kv_unify", "fla_shmem"],
    "base": ["fla_shmem"],
    "mtp": ["fla_shmem"],
}


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a docker ``--env-file``: ``KEY=VALUE`` per line, ``#`` comments, no quoting
    (docker passes the rest of the line verbatim, JSON included)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line!r}"
        env[key.strip()] = value
    return env


def profile_env(profile: str) -> dict[str, str]:
    return read_env_file(ENV_DIR / f"{profile}.env")
