"""Fixtures for runtime/ tests: writable copies of real vLLM source files."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from support.vllm_source import vllm_source_tree

# Every file a patch reads (targets and capability-gate inputs), both layouts; a
# version simply lacks some of them. vllm/_version.py gives the version in messages.
PATCH_FILES = (
    "vllm/__init__.py",
    "vllm/_version.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/kv_cache_planning.py",
    "vllm/model_executor/layers/quantization/inc.py",
    "vllm/model_executor/layers/quantization/inc/__init__.py",
    "vllm/model_executor/layers/quantization/inc/inc.py",
    "vllm/model_executor/layers/logits_processor.py",
    "vllm/model_executor/layers/fla/ops/utils.py",
    "vllm/third_party/flash_linear_attention/ops/utils.py",
    "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
)


@pytest.fixture
def vllm_tree(tmp_path: Path) -> Callable[..., Path]:
    """``vllm_tree(version, extra=())`` -> a fresh writable directory holding ``vllm/`` with
    the patch-relevant files of that version's sdist, plus ``extra`` ones (use as
    ``--vllm-root``)."""
    counter = iter(range(1000))

    def make(version: str, files: Iterable[str] = PATCH_FILES, extra: Iterable[str] = ()) -> Path:
        dest = tmp_path / f"vllm-{version}-{next(counter)}"
        return vllm_source_tree(version, [*files, *extra], dest)

    return make
