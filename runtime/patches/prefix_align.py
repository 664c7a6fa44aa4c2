#!/usr/bin/env python3
"""prefix_align: prefix caching with DFlash on the hybrid target - hash by the GCD.

With prefix caching on, the hybrid coordinator requires every KV-cache group's block
size to be divisible by the hash block size. vLLM 0.23 computes that as the GCD of the
group block sizes, *except* when a mamba group's block size differs from
``cache_config.block_size``: then it backs off to the LCM (the scheduler block size),
which the smaller groups cannot divide, and the coordinator's
"block_size must be divisible by hash_block_size" assert fires at startup. With the
DFlash drafter the groups' block sizes legitimately diverge (kv_unify scales them).

A mamba group in ``align`` mode (what vLLM selects for prefix caching on hybrid
models) checkpoints its state at block boundaries, so the GCD is valid for it: back off
only for mamba groups that are *not* in align mode. Newer vLLM made exactly this change;
when the back-off condition already reads ``mamba_cache_mode`` the patch is skipped.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _patchlib as pl  # noqa: E402

NAME = "prefix_align"
FUNC = "resolve_kv_cache_block_sizes"
CANDIDATES = ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_planning.py")

ANCHOR = """\
    if any(
        isinstance(g.kv_cache_spec, MambaSpec)
        and g.kv_cache_spec.block_size != cache_config.block_size
        for g in groups
    ):
        return scheduler_block_size, scheduler_block_size
"""

REPLACEMENT = f"""\
    # {pl.sentinel(NAME)} a mamba group in "align" mode keeps state at block
    # boundaries, so a diverged block size (DFlash drafter groups) still hashes by
    # the GCD; backing off to the LCM here trips the coordinator's divisibility assert.
    if any(
        isinstance(g.kv_cache_spec, MambaSpec)
        and g.kv_cache_spec.block_size != cache_config.block_size
        and getattr(g.kv_cache_spec, "mamba_cache_mode", "none") != "align"
        for g in groups
    ):
        return scheduler_block_size, scheduler_block_size
"""


def upstream_aligned(text: str) -> str | None:
    if pl.code_uses(text, FUNC, "mamba_cache_mode"):
        return f"upstream {FUNC}() already hashes align-mode mamba groups by the GCD"
    return None


def apply(vllm: pl.Vllm) -> tuple[str, str]:
    path = pl.find_defining_file(vllm, CANDIDATES, FUNC)
    edit = pl.Edit("mamba back-off to scheduler block size", ANCHOR, REPLACEMENT, scope=FUNC)
    return pl.patch_file(vllm, NAME, path, [edit], gate=upstream_aligned)


if __name__ == "__main__":
    sys.exit(pl.run(NAME, apply))
