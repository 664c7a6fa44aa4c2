"""Each runtime patch against the real vLLM source of the image (0.23) and the newest (0.33).

Asserted per patch: the true outcome per version (applies / already present / not
needed), ``--check`` predicts it writing nothing, the patched file compiles and carries
the sentinel, a second run changes no byte, file mode is kept, no temp files are left,
and a missing anchor cannot apply, naming file, version and anchor.
"""
from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
from support.runtime_env import PATCH_DIR
from support.vllm_source import VLLM_IMAGE_VERSION, VLLM_NEWEST_VERSION

pytestmark = pytest.mark.network  # real vLLM sources: the PyPI sdists, downloaded once

V23, V33 = VLLM_IMAGE_VERSION, VLLM_NEWEST_VERSION
PATCHES = ("kv_unify", "prefix_align", "inc_fp8_shared", "int8_lmhead", "fla_shmem")

# The true outcome of every patch on every tested vLLM, and the file it edits there.
EXPECTED: dict[tuple[str, str], tuple[str, str]] = {
    ("kv_unify", V23): ("applied", "vllm/v1/core/kv_cache_utils.py"),
    # 0.33 pads mamba / non-dividing attention pages itself (kv_cache_planning.py).
    ("kv_unify", V33): ("already-present", "vllm/v1/core/kv_cache_planning.py"),
    ("prefix_align", V23): ("applied", "vllm/v1/core/kv_cache_utils.py"),
    # 0.33 backs off from the GCD only for mamba groups outside align mode.
    ("prefix_align", V33): ("already-present", "vllm/v1/core/kv_cache_utils.py"),
    ("inc_fp8_shared", V23): ("applied", "vllm/model_executor/layers/quantization/inc.py"),
    # Still not upstream; INC is a package now and the same dispatch seam exists there.
    ("inc_fp8_shared", V33): ("applied", "vllm/model_executor/layers/quantization/inc/inc.py"),
    ("int8_lmhead", V23): ("applied", "vllm/model_executor/layers/logits_processor.py"),
    # Not upstream; 0.33 routes the head through self._apply_head, patched the same way.
    ("int8_lmhead", V33): ("applied", "vllm/model_executor/layers/logits_processor.py"),
    ("fla_shmem", V23): ("applied", "vllm/model_executor/layers/fla/ops/utils.py"),
    # 0.33 sends sm12x GDN prefill to FlashInfer by default.
    ("fla_shmem", V33): (
        "not-needed",
        "vllm/third_party/flash_linear_attention/ops/utils.py",
    ),
}

# A line of each patch's 0.23 anchor and a harmless rewrite of it, to simulate a vLLM
# whose code moved on (first occurrence in the file is the anchored one).
BREAK_ANCHOR = {
    "kv_unify": (
        "ratio = max_page_size // layer_page_size",
        "ratio = max_page_size // (layer_page_size)",
    ),
    "prefix_align": (
        "and g.kv_cache_spec.block_size != cache_config.block_size",
        "and cache_config.block_size != g.kv_cache_spec.block_size",
    ),
    "inc_fp8_shared": (
        "def get_quant_method(self, layer: torch.nn.Module, prefix: str):",
        "def get_quant_method(self, layer: torch.nn.Module, prefix: str = ''):",
    ),
    "int8_lmhead": (
        "logits = lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)",
        "logits = lm_head.quant_method.apply(lm_head, hidden_states, embedding_bias)",
    ),
    "fla_shmem": (
        "return max_shared_memory >= Backend.get_shared_memory(arch)",
        "return Backend.get_shared_memory(arch) <= max_shared_memory",
    ),
}


def run_patch(name: str, root: Path | None, env: dict[str, str] | None = None, cwd: Path | None = None,
              check: bool = False):
    """(exit code, outcome, detail, status object) of one patch program."""
    cmd = [sys.executable, str(PATCH_DIR / f"{name}.py")]
    if root is not None:
        cmd += ["--vllm-root", str(root)]
    if check:
        cmd.append("--check")
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("sparkfleet-patch:")]
    assert len(lines) == 1, f"expected one status line, got stdout={proc.stdout!r} stderr={proc.stderr!r}"
    status = json.loads(lines[0][len("sparkfleet-patch:"):])
    assert status["name"] == name
    return proc.returncode, status["outcome"], status["detail"], status


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("version", [V23, V33])
@pytest.mark.parametrize("name", PATCHES)
def test_outcome_and_idempotence(name: str, version: str, vllm_tree) -> None:
    want, target_rel = EXPECTED[(name, version)]
    root = vllm_tree(version)
    target = root / target_rel
    assert target.is_file()
    target.chmod(0o640)  # an unusual mode must survive the atomic write
    before = snapshot(root)

    # --check predicts the outcome and writes nothing.
    rc, outcome, detail, status = run_patch(name, root, check=True)
    assert (rc, outcome) == (0, "would-apply" if want == "applied" else want), detail
    assert status["file"] == target_rel and status["vllm"] == version
    assert snapshot(root) == before, "--check writes nothing"

    rc, outcome, detail, status = run_patch(name, root)
    assert (rc, outcome) == (0, want), detail
    assert f"vLLM {version}" in detail and target_rel in detail
    assert status["file"] == target_rel
    after = snapshot(root)

    if want == "applied":
        changed = [k for k in after if after[k] != before.get(k)]
        assert changed == [target_rel], "only the target file changes"
        assert f"[sparkfleet:{name}]".encode() in after[target_rel]
        py_compile.compile(str(target), doraise=True, cfile=str(target) + "c.test")
        assert (target.stat().st_mode & 0o7777) == 0o640
        assert not list(target.parent.glob("*.sparkfleet-tmp")), "temp file left behind"
    else:
        assert after == before, "a skipped patch writes nothing"

    # Second run: a no-op, byte for byte.
    after = snapshot(root)
    rc2, outcome2, detail2, _ = run_patch(name, root)
    assert rc2 == 0
    assert outcome2 == ("already-present" if want == "applied" else want), detail2
    assert snapshot(root) == after


@pytest.mark.parametrize("name", PATCHES)
def test_missing_anchor_fails_clearly(name: str, vllm_tree) -> None:
    _, target_rel = EXPECTED[(name, V23)]
    root = vllm_tree(V23)
    target = root / target_rel
    old, new = BREAK_ANCHOR[name]
    text = target.read_text()
    assert old in text
    target.write_text(text.replace(old, new, 1))
    before = snapshot(root)

    for check in (True, False):
        rc, outcome, detail, status = run_patch(name, root, check=check)
        assert rc == 1 and outcome == "cannot-apply"
        assert status["file"] == target_rel, status  # the file
        assert f"vLLM {V23}" in detail, detail  # the version
        assert "missing anchor" in detail, detail  # what is missing
        assert snapshot(root) == before, "a patch that cannot apply writes nothing"


def test_kv_patches_share_a_file_in_either_order(vllm_tree) -> None:
    for order in (("kv_unify", "prefix_align"), ("prefix_align", "kv_unify")):
        root = vllm_tree(V23)
        for name in order:
            assert run_patch(name, root)[:2] == (0, "applied")
        for name in order:
            assert run_patch(name, root)[:2] == (0, "already-present")
        target = root / "vllm/v1/core/kv_cache_utils.py"
        py_compile.compile(str(target), doraise=True, cfile=str(target) + "c.test")


def test_locates_vllm_by_import_and_by_env(vllm_tree, tmp_path: Path) -> None:
    root = vllm_tree(V23)
    base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARKFLEET_VLLM_ROOT")}
    # As in the container: vllm importable, no flag; run from an unrelated directory.
    env = dict(base_env, PYTHONPATH=str(root))
    rc, outcome, detail, _ = run_patch("fla_shmem", None, env=env, cwd=tmp_path)
    assert (rc, outcome) == (0, "applied"), detail
    # The env var points at a tree too.
    root2 = vllm_tree(V23)
    env = dict(base_env, SPARKFLEET_VLLM_ROOT=str(root2))
    rc, outcome, detail, _ = run_patch("fla_shmem", None, env=env, cwd=tmp_path)
    assert (rc, outcome) == (0, "applied"), detail
    assert "[sparkfleet:fla_shmem]" in (root2 / EXPECTED[("fla_shmem", V23)][1]).read_text()


def test_no_vllm_is_a_clear_failure(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARKFLEET_VLLM_ROOT")}
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is not None)"],
        env=env,
    )
    if probe.returncode:
        pytest.skip("a vllm package is importable in this environment")
    rc, outcome, detail, _ = run_patch("kv_unify", None, env=env, cwd=tmp_path)
    assert (rc, outcome) == (1, "cannot-apply")
    assert "not importable" in detail


def test_bad_root_is_a_clear_failure(tmp_path: Path) -> None:
    rc, outcome, detail, _ = run_patch("kv_unify", tmp_path)
    assert (rc, outcome) == (1, "cannot-apply")
    assert "no vllm/ package" in detail
