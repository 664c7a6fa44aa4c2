"""runtime/serve.py end to end with a stand-in ``vllm`` on PATH and real vLLM source trees.

The stand-in records the argv and environment it was exec'd with; the patches edit a
copy of the real 0.23 (or 0.33) files through ``SPARKFLEET_VLLM_ROOT``.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.runtime_env import (
    EXPECTED_ARGV,
    EXPECTED_PATCHES,
    PROFILES,
    RUNTIME_DIR,
    profile_env,
)
from support.vllm_source import VLLM_IMAGE_VERSION, VLLM_NEWEST_VERSION

pytestmark = pytest.mark.network  # real vLLM sources: the PyPI sdists, downloaded once

API_KEY = "sk-sparkfleet-test-0123456789"
HF_TOKEN = "hf_testtoken0123456789"
PATCH_TARGETS_023 = {
    "kv_unify": "vllm/v1/core/kv_cache_utils.py",
    "prefix_align": "vllm/v1/core/kv_cache_utils.py",
    "inc_fp8_shared": "vllm/model_executor/layers/quantization/inc.py",
    "int8_lmhead": "vllm/model_executor/layers/logits_processor.py",
    "fla_shmem": "vllm/model_executor/layers/fla/ops/utils.py",
}

STANDIN = """#!{python}
# Stand-in for vLLM's `vllm` command: record how it was exec'd.
import json, os, sys
with open(os.environ["STANDIN_OUT"], "w") as fh:
    json.dump({{"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd()}}, fh)
"""


@pytest.fixture
def standin(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "vllm"
    exe.write_text(STANDIN.format(python=sys.executable))
    exe.chmod(0o755)
    return bindir


def base_env(bindir: Path, out: Path, vllm_root: Path) -> dict[str, str]:
    # A container-like environment: only what docker would pass (+ the test plumbing).
    return {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",  # keeps Python's locale coercion from adding LC_CTYPE
        "STANDIN_OUT": str(out),
        "SPARKFLEET_VLLM_ROOT": str(vllm_root),
        "VLLM_API_KEY": API_KEY,
        "HF_TOKEN": HF_TOKEN,
    }


def serve(env: dict[str, str], cwd: Path, runtime: Path = RUNTIME_DIR) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(runtime / "serve.py")],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=300,
    )


def recorded(out: Path) -> dict:
    return json.loads(out.read_text())


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_exec_exact_argv_and_env(profile: str, standin: Path, vllm_tree, tmp_path: Path) -> None:
    root = vllm_tree(VLLM_IMAGE_VERSION)
    out = tmp_path / "exec.json"
    env = base_env(standin, out, root) | profile_env(profile)
    proc = serve(env, cwd=Path("/"))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rec = recorded(out)
    assert Path(rec["argv"][0]).name == "vllm"
    assert rec["argv"][1:] == EXPECTED_ARGV[profile][1:]
    # Exactly what the container got, plus where the patched vLLM finds runtime/.
    assert rec["env"] == env | {"SPARKFLEET_RUNTIME_DIR": str(RUNTIME_DIR), "PYTHONPATH": str(RUNTIME_DIR)}

    log = proc.stdout
    for name in EXPECTED_PATCHES[profile]:
        assert f"sparkfleet-serve: patch {name}: applied:" in log
        assert f"[sparkfleet:{name}]" in (root / PATCH_TARGETS_023[name]).read_text()
    assert f"sparkfleet-serve: exec: {shlex.join(EXPECTED_ARGV[profile])}" in log
    assert f"sparkfleet-serve: profile {profile};" in log
    assert API_KEY not in log + proc.stderr and HF_TOKEN not in log + proc.stderr


def test_restart_logs_already_present(standin: Path, vllm_tree, tmp_path: Path) -> None:
    root = vllm_tree(VLLM_IMAGE_VERSION)
    out = tmp_path / "exec.json"
    env = base_env(standin, out, root) | profile_env("dense")
    assert serve(env, cwd=tmp_path).returncode == 0
    out.unlink()
    proc = serve(env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    for name in EXPECTED_PATCHES["dense"]:
        assert f"sparkfleet-serve: patch {name}: already present:" in proc.stdout
    assert recorded(out)["argv"][1:] == EXPECTED_ARGV["dense"][1:]


def test_newest_vllm_skips_what_upstream_fixed(standin: Path, vllm_tree, tmp_path: Path) -> None:
    root = vllm_tree(VLLM_NEWEST_VERSION)
    out = tmp_path / "exec.json"
    env = base_env(standin, out, root) | profile_env("dense")
    proc = serve(env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "sparkfleet-serve: patch kv_unify: already present:" in proc.stdout
    assert "sparkfleet-serve: patch fla_shmem: skipped (not needed):" in proc.stdout
    assert "sparkfleet-serve: patch inc_fp8_shared: applied:" in proc.stdout
    assert "sparkfleet-serve: patch int8_lmhead: applied:" in proc.stdout
    assert out.exists()


@pytest.mark.parametrize("profile", PROFILES)
def test_empty_parsers_reach_vllm_as_no_flags(profile: str, standin: Path, vllm_tree, tmp_path: Path) -> None:
    out = tmp_path / "exec.json"
    env = base_env(standin, out, vllm_tree(VLLM_IMAGE_VERSION)) | profile_env(profile)
    env |= {"SF_TOOL_CALL_PARSER": "", "SF_REASONING_PARSER": ""}
    assert serve(env, cwd=tmp_path).returncode == 0
    argv = recorded(out)["argv"]
    assert not {"--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"} & set(argv)
    assert argv[1:] == [
        a for a in EXPECTED_ARGV[profile][1:]
        if a not in ("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml", "--reasoning-parser", "qwen3")
    ]


def test_prefix_caching_on_with_dflash(standin: Path, vllm_tree, tmp_path: Path) -> None:
    root = vllm_tree(VLLM_IMAGE_VERSION)
    out = tmp_path / "exec.json"
    env = base_env(standin, out, root) | profile_env("dflash")
    env |= {"SF_PREFIX_CACHING": "1", "SF_PATCHES": "kv_unify,prefix_align,fla_shmem"}
    proc = serve(env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "--enable-prefix-caching" in recorded(out)["argv"]
    assert "sparkfleet-serve: patch prefix_align: applied:" in proc.stdout


def _break(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_required_patch_failure_stops_the_start(standin: Path, vllm_tree, tmp_path: Path) -> None:
    root = vllm_tree(VLLM_IMAGE_VERSION)
    _break(root, PATCH_TARGETS_023["kv_unify"], "ratio = max_page_size // layer_page_size", "ratio = 1")
    out = tmp_path / "exec.json"
    env = base_env(standin, out, root) | profile_env("dflash")
    proc = serve(env, cwd=tmp_path)
    assert proc.returncode == 1
    assert not out.exists(), "vLLM must not start without a required patch"
    line = next(ln for ln in proc.stdout.splitlines() if "patch kv_unify: CANNOT APPLY" in ln)
    assert "vllm/v1/core/kv_cache_utils.py" in line and f"vLLM {VLLM_IMAGE_VERSION}" in line
    assert "missing anchor" in line
    assert "patch fla_shmem" not in proc.stdout, "patches after a failed required one do not run"


def test_fla_shmem_failure_is_tolerated(standin: Path, vllm_tree, tmp_path: Path) -> None:
    root = vllm_tree(VLLM_IMAGE_VERSION)
    _break(root, PATCH_TARGETS_023["fla_shmem"],
           "return max_shared_memory >= Backend.get_shared_memory(arch)",
           "return Backend.get_shared_memory(arch) <= max_shared_memory")
    out = tmp_path / "exec.json"
    env = base_env(standin, out, root) | profile_env("base")
    proc = serve(env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "sparkfleet-serve: patch fla_shmem: CANNOT APPLY:" in proc.stdout
    assert "sparkfleet-serve: patch fla_shmem: failure tolerated" in proc.stdout
    assert recorded(out)["argv"][1:] == EXPECTED_ARGV["base"][1:]


def test_relocated_runtime_and_missing_patch_program(standin: Path, vllm_tree, tmp_path: Path) -> None:
    """runtime/ copied elsewhere (as at /host) works from any cwd; a missing program fails."""
    host = tmp_path / "host"
    shutil.copytree(RUNTIME_DIR, host, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "exec.json"
    env = base_env(standin, out, vllm_tree(VLLM_IMAGE_VERSION)) | profile_env("dflash")
    proc = serve(env, cwd=tmp_path, runtime=host)
    assert proc.returncode == 0, proc.stdout
    assert recorded(out)["env"]["SPARKFLEET_RUNTIME_DIR"] == str(host)

    (host / "patches" / "kv_unify.py").unlink()
    out.unlink()
    env["SPARKFLEET_VLLM_ROOT"] = str(vllm_tree(VLLM_IMAGE_VERSION))
    proc = serve(env, cwd=Path("/"), runtime=host)
    assert proc.returncode == 1 and not out.exists()
    assert "patch kv_unify: CANNOT APPLY: patch program" in proc.stdout


def test_invalid_serve_env_touches_nothing(standin: Path, vllm_tree, tmp_path: Path) -> None:
    root = vllm_tree(VLLM_IMAGE_VERSION)
    before = {p: p.read_bytes() for p in root.rglob("*.py")}
    out = tmp_path / "exec.json"
    env = base_env(standin, out, root) | profile_env("dense")
    del env["SF_MAX_MODEL_LEN"]
    proc = serve(env, cwd=tmp_path)
    assert proc.returncode == 2 and not out.exists()
    assert "SF_MAX_MODEL_LEN" in proc.stdout
    assert {p: p.read_bytes() for p in root.rglob("*.py")} == before


def test_secret_in_argv_is_refused(standin: Path, vllm_tree, tmp_path: Path) -> None:
    out = tmp_path / "exec.json"
    env = base_env(standin, out, vllm_tree(VLLM_IMAGE_VERSION)) | profile_env("base")
    env["SF_EXTRA_ARGS"] = json.dumps(["--middleware", API_KEY])
    proc = serve(env, cwd=tmp_path)
    assert proc.returncode == 2 and not out.exists()
    assert "VLLM_API_KEY" in proc.stdout and API_KEY not in proc.stdout


def test_missing_vllm_command(vllm_tree, tmp_path: Path) -> None:
    env = base_env(tmp_path / "nobin", tmp_path / "exec.json", vllm_tree(VLLM_IMAGE_VERSION))
    env |= profile_env("base") | {"PATH": str(tmp_path / "nobin")}
    proc = serve(env, cwd=tmp_path)
    assert proc.returncode == 127
    assert "cannot exec 'vllm'" in proc.stdout


def test_the_mounted_secrets_file_reaches_the_engine_environment_only(tmp_path):
    from runtime import serve

    secrets = tmp_path / "secrets.env"
    secrets.write_text("VLLM_API_KEY=sf-test-key\n")
    assert serve.read_secrets(str(secrets)) == {"VLLM_API_KEY": "sf-test-key"}
    assert serve.read_secrets(str(tmp_path / "absent")) == {}
