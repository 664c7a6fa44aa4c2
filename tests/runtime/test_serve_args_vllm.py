"""Every flag and value serve_args emits exists in the real vLLM source.

vLLM cannot be imported here (no GPU build), so its CLI is read statically: literal
``add_argument("--flag", ...)`` calls, the frontend dataclass fields that ``cli_args.py``
turns into ``--field-name`` flags, and bool config fields (argparse
``BooleanOptionalAction``) for ``--no-`` forms. 0.23 is what the image runs; 0.33 is
checked too so an image upgrade knows where it stands.
"""
from __future__ import annotations

import ast
import re
from functools import cache

import pytest
from support.runtime_env import PROFILES, profile_env
from support.vllm_source import VLLM_TEST_VERSIONS, vllm_members, vllm_source_files

from runtime import serve_args as sa

pytestmark = pytest.mark.network  # real vLLM sources: the PyPI sdists, downloaded once


# The frontend (OpenAI server) args moved from openai/ to common/ after 0.23.
FRONTEND_FILES = ("vllm/entrypoints/openai/cli_args.py", "vllm/entrypoints/common/cli_args.py")
ENGINE_FILES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/cli/serve.py")
VALUE_FILES = (
    "vllm/tool_parsers/__init__.py",
    "vllm/reasoning/__init__.py",
    "vllm/config/speculative.py",
    "vllm/model_executor/model_loader/__init__.py",
    "vllm/v1/attention/backends/registry.py",
    "vllm/envs.py",
)


@cache
def _sources(version: str) -> dict[str, str]:
    """The vLLM files these checks read, fetched in one pass over the sdist."""
    members = set(vllm_members(version))
    wanted = [m for m in members if m.startswith("vllm/config/") and m.endswith(".py")]
    wanted += [f for f in FRONTEND_FILES + ENGINE_FILES + VALUE_FILES if f in members]
    return {rel: p.read_text(encoding="utf-8") for rel, p in vllm_source_files(version, wanted).items()}


def _text(version: str, rel: str) -> str:
    return _sources(version)[rel]


def frontend_file(version: str) -> str:
    found = [f for f in FRONTEND_FILES if f in _sources(version)]
    assert found, f"vLLM {version}: no frontend cli_args.py among {FRONTEND_FILES}"
    return found[0]


def cli_files(version: str) -> list[str]:
    return [*ENGINE_FILES, frontend_file(version)]


@cache
def cli_flags(version: str) -> frozenset[str]:
    flags: set[str] = set()
    for rel in cli_files(version):
        for node in ast.walk(ast.parse(_text(version, rel))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                        flags.add(arg.value)
    # Frontend args are generated from dataclass fields: f"--{key.replace('_', '-')}".
    text = _text(version, frontend_file(version))
    assert "f\"--{key.replace('_', '-')}\"" in text, "frontend flag generation changed"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name.endswith("FrontendArgs"):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    flags.add("--" + stmt.target.id.replace("_", "-"))
    return frozenset(flags)


@cache
def bool_fields(version: str) -> frozenset[str]:
    """Dataclass fields annotated as plain bool (-> BooleanOptionalAction: --x/--no-x)."""
    files = [m for m in _sources(version) if m.startswith("vllm/config/")] + cli_files(version)
    names: set[str] = set()
    for rel in files:
        for node in ast.walk(ast.parse(_text(version, rel))):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        ann = ast.unparse(stmt.annotation)
                        if re.search(r"\bbool\b", ann) and "str" not in ann:
                            names.add(stmt.target.id)
    # The mechanism itself: bool-typed fields get BooleanOptionalAction.
    assert "argparse.BooleanOptionalAction" in _text(version, "vllm/engine/arg_utils.py")
    return frozenset(names)


def emitted_flags() -> set[str]:
    flags: set[str] = set()
    variants = [{}, {"SF_CHUNKED_PREFILL": "0", "SF_PREFIX_CACHING": "1"}]
    for profile in PROFILES:
        for extra in variants:
            argv = sa.build_serve_argv(profile_env(profile) | extra)
            assert argv[:2] == ["vllm", "serve"]
            flags |= {a for a in argv[3:] if a.startswith("--")}
    return flags


def flag_exists(version: str, flag: str) -> bool:
    if flag in cli_flags(version):
        return True
    positive = "--" + flag[len("--no-"):]
    return (
        flag.startswith("--no-")
        and positive in cli_flags(version)
        and positive[2:].replace("-", "_") in bool_fields(version)
    )


@pytest.mark.parametrize("version", VLLM_TEST_VERSIONS)
def test_every_emitted_flag_exists(version: str) -> None:
    missing = [f for f in sorted(emitted_flags()) if not flag_exists(version, f)]
    assert not missing, f"vLLM {version} has no {missing}"


@pytest.mark.parametrize("version", VLLM_TEST_VERSIONS)
def test_the_check_can_fail(version: str) -> None:
    assert flag_exists(version, "--attention-backend")
    assert flag_exists(version, "--no-enable-prefix-caching")
    assert not flag_exists(version, "--attention-backends")
    assert not flag_exists(version, "--no-host")  # a str option has no --no- form


@pytest.mark.parametrize("version", VLLM_TEST_VERSIONS)
def test_serve_takes_the_model_positionally(version: str) -> None:
    text = _text(version, "vllm/entrypoints/cli/serve.py")
    assert '"model_tag"' in text and "vllm serve [model_tag] [options]" in text


@pytest.mark.parametrize("version", VLLM_TEST_VERSIONS)
def test_profile_values_exist(version: str) -> None:
    """The values the profiles pass: parsers, spec methods, load format, backend, env."""
    tool = _text(version, "vllm/tool_parsers/__init__.py")
    reasoning = _text(version, "vllm/reasoning/__init__.py")
    spec = _text(version, "vllm/config/speculative.py")
    loaders = _text(version, "vllm/model_executor/model_loader/__init__.py")
    backends = _text(version, "vllm/v1/attention/backends/registry.py")
    envs = _text(version, "vllm/envs.py")
    assert '"qwen3_xml"' in tool
    assert '"qwen3"' in reasoning
    assert '"dflash"' in spec and '"qwen3_5_mtp"' in spec
    assert '"fastsafetensors"' in loaders
    assert re.search(r"^\s+FLASH_ATTN\s*=", backends, re.M)
    assert '"VLLM_API_KEY"' in envs
    assert '"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"' in envs
