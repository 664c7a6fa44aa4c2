"""Helpers for tests of runtime/: profile serve.env fixtures and where runtime/ lives.

The golden env files (tests/runtime/envs/) and docs/architecture.md's serve.env table
are produced from runtime/serve_args.py's SERVE_ENV; tests fail when either drifts.
After changing SERVE_ENV or a default, rewrite both with
``python tests/support/runtime_env.py`` and review the diff.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME_DIR = REPO / "runtime"
PATCH_DIR = RUNTIME_DIR / "patches"
ENV_DIR = REPO / "tests" / "runtime" / "envs"
ARCHITECTURE = REPO / "docs" / "architecture.md"
# docs/architecture.md: the generated table sits between these two lines.
TABLE_BEFORE = "<!-- serve.env table: generated from SERVE_ENV in runtime/serve_args.py -->\n"
TABLE_AFTER = "\nPatch names:"
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
GUARD = ["--middleware", "key_guard.KeyGuard"]  # api_key=auto: every route needs the key
EXPECTED_ARGV = {
    "dense": ["vllm", "serve", "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid", *COMMON,
              "--speculative-config", DFLASH_SPEC, *GUARD],
    "dflash": ["vllm", "serve", INTEL, *COMMON, "--speculative-config", DFLASH_SPEC, *GUARD],
    "base": ["vllm", "serve", INTEL, *COMMON, *GUARD],
    "mtp": ["vllm", "serve", INTEL, *COMMON,
            "--speculative-config", '{"method":"qwen3_5_mtp","num_speculative_tokens":2}', *GUARD],
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


def rendered_env(profile: str) -> dict[str, str]:
    """serve.env as the deploy renders it for ``profile`` with group_data/all.py defaults."""
    from sparkfleet.config import validate_host_data

    defaults = runpy.run_path(str(REPO / "group_data" / "all.py"))
    data = {k: v for k, v in defaults.items() if not k.startswith("__")}
    return validate_host_data("spark-1", {**data, "profile": profile}).serve_env()


def golden_env_text(profile: str) -> str:
    lines = [f"# The {profile} profile as the deploy renders serve.env with group_data/all.py defaults."]
    lines += [f"{key}={value}" for key, value in rendered_env(profile).items()]
    return "\n".join(lines) + "\n"


def documented_table(text: str) -> str:
    """The serve.env table as docs/architecture.md has it."""
    start = text.index(TABLE_BEFORE) + len(TABLE_BEFORE)
    return text[start : text.index(TABLE_AFTER, start)].strip("\n") + "\n"


def write_contract_files() -> None:
    """Rewrite the golden env files and the doc's table from SERVE_ENV and the defaults."""
    from runtime.serve_args import doc_table

    for profile in PROFILES:
        (ENV_DIR / f"{profile}.env").write_text(golden_env_text(profile))
    text = ARCHITECTURE.read_text()
    old = documented_table(text)
    ARCHITECTURE.write_text(text.replace("\n" + old, "\n" + doc_table(), 1))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # run as a script: sparkfleet and runtime from this checkout
    write_contract_files()
