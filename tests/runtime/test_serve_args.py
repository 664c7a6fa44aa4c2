"""runtime/serve_args.py: the contract table, exactly, per profile; and its validation."""
from __future__ import annotations

import json

import pytest
from support.runtime_env import (
    DFLASH_SPEC,
    EXPECTED_ARGV,
    EXPECTED_PATCHES,
    PROFILES,
    profile_env,
)

from runtime import serve_args as sa


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_argv_exact(profile: str) -> None:
    env = profile_env(profile)
    assert sa.build_serve_argv(env) == EXPECTED_ARGV[profile]
    assert sa.patches_for(env) == EXPECTED_PATCHES[profile]


@pytest.mark.parametrize("profile", PROFILES)
def test_empty_parsers_disable_parser_flags(profile: str) -> None:
    env = profile_env(profile) | {"SF_TOOL_CALL_PARSER": "", "SF_REASONING_PARSER": ""}
    argv = sa.build_serve_argv(env)
    for flag in ("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"):
        assert flag not in argv
    only_reasoning = sa.build_serve_argv(profile_env(profile) | {"SF_TOOL_CALL_PARSER": ""})
    assert "--tool-call-parser" not in only_reasoning
    assert only_reasoning[only_reasoning.index("--reasoning-parser") + 1] == "qwen3"


def test_switches_both_ways() -> None:
    env = profile_env("dflash") | {"SF_CHUNKED_PREFILL": "0", "SF_PREFIX_CACHING": "1"}
    argv = sa.build_serve_argv(env)
    assert "--no-enable-chunked-prefill" in argv and "--enable-chunked-prefill" not in argv
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv


def test_local_model_path_drops_revision() -> None:
    argv = sa.build_serve_argv(profile_env("dense") | {"SF_MODEL": "/model", "SF_REVISION": "main"})
    assert argv[:3] == ["vllm", "serve", "/model"] and "--revision" not in argv
    argv = sa.build_serve_argv(profile_env("dense") | {"SF_REVISION": ""})
    assert "--revision" not in argv
    sha = "0123456789abcdef0123456789abcdef01234567"
    argv = sa.build_serve_argv(profile_env("dense") | {"SF_REVISION": sha})
    assert argv[argv.index("--revision") + 1] == sha


def test_extra_args_appended_verbatim_last() -> None:
    extra = ["--kv-cache-dtype", "fp8", "--limit-mm-per-prompt", '{"image": 0}']
    argv = sa.build_serve_argv(profile_env("base") | {"SF_EXTRA_ARGS": json.dumps(extra)})
    assert argv[-4:] == extra
    assert sa.build_serve_argv(profile_env("base") | {"SF_EXTRA_ARGS": "[]"}) == EXPECTED_ARGV["base"]


@pytest.mark.parametrize("var", sa.REQUIRED_VARS)
def test_missing_required_variable_is_named(var: str) -> None:
    env = profile_env("dense")
    del env[var]
    with pytest.raises(sa.ServeEnvError, match=var):
        sa.build_serve_argv(env)
    with pytest.raises(sa.ServeEnvError, match=var):
        sa.build_serve_argv(env | {var: "  "})


@pytest.mark.parametrize("var", sa.PRESENT_VARS)
def test_absent_off_switch_is_an_error_not_a_silent_off(var: str) -> None:
    env = profile_env("dense")
    del env[var]
    with pytest.raises(sa.ServeEnvError, match=var):
        sa.build_serve_argv(env)


@pytest.mark.parametrize("var", sa.OPTIONAL_VARS)
def test_optional_variables_may_be_absent(var: str) -> None:
    env = profile_env("base")
    del env[var]
    argv = sa.build_serve_argv(env)
    assert argv[:3] == ["vllm", "serve", "Intel/Qwen3.5-122B-A10B-int4-AutoRound"]


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SF_PORT", "80a"),
        ("SF_PORT", "70000"),
        ("SF_MAX_MODEL_LEN", "0"),
        ("SF_MAX_NUM_SEQS", "-3"),
        ("SF_MAX_NUM_BATCHED_TOKENS", "8k"),
        ("SF_GPU_MEMORY_UTILIZATION", "82"),
        ("SF_GPU_MEMORY_UTILIZATION", "high"),
        ("SF_CHUNKED_PREFILL", "true"),
        ("SF_PREFIX_CACHING", "yes"),
        ("SF_SPECULATIVE_CONFIG", "{not json"),
        ("SF_SPECULATIVE_CONFIG", '["dflash"]'),
        ("SF_SPECULATIVE_CONFIG", '{"num_speculative_tokens": 2}'),
        ("SF_EXTRA_ARGS", '"--foo"'),
        ("SF_EXTRA_ARGS", "[1, 2]"),
        ("SF_EXTRA_ARGS", '["--api-key", "sk-123"]'),
        ("SF_EXTRA_ARGS", '["--api-key=sk-123"]'),
        ("SF_PATCHES", "kv_unify,nonsense"),
        ("SF_PATCHES", "kv_unify,kv_unify"),
        ("SF_MODEL", "--help"),
        ("SF_TOOL_CALL_PARSER", "qwen3_xml --evil"),
        ("SF_HOST", "-0.0.0.0"),
    ],
)
def test_invalid_values_are_named(var: str, value: str) -> None:
    with pytest.raises(sa.ServeEnvError, match=var):
        sa.build_serve_argv(profile_env("dense") | {var: value})


def test_render_command_quotes_json() -> None:
    line = sa.render_command(profile_env("dense"))
    assert line.startswith("vllm serve bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid --revision main")
    assert f"--speculative-config '{DFLASH_SPEC}'" in line


def test_stdlib_only() -> None:
    """serve_args runs in the serving image and on the controller: stdlib only."""
    import ast
    import sys

    tree = ast.parse(open(sa.__file__).read())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods
