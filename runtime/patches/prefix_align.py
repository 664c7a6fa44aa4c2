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
only for mamba groups that are *not* in align mode.

Already present: newer vLLM made exactly this change (the back-off condition reads
``mamba_cache_mode``); an image may instead drop the mamba back-off altogether, so that
every group hashes by the GCD. Either form is recognised as the fix.
"""
from __future__ import annotations

import sys

try:  # imported as runtime.patches.<name> (controller, tests)
    from . import _patchlib as pl
except ImportError:  # run as a program (/host/patches/<name>.py): its directory is sys.path[0]
    import _patchlib as pl

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


def hashes_aligned_by_gcd(text: str) -> str | None:
    """The fix in another form: align-mode mamba groups (or all groups) hash by the GCD."""
    if pl.code_uses(text, FUNC, "mamba_cache_mode"):
        return f"{FUNC}() already hashes align-mode mamba groups by the GCD"
    if pl.code_uses(text, FUNC, "gcd") and not pl.code_uses(text, FUNC, "MambaSpec"):
        return f"{FUNC}() has no mamba back-off: every group hashes by the GCD"
    return None


def apply(vllm: pl.Vllm) -> pl.Verdict:
    path = pl.find_defining_file(vllm, CANDIDATES, FUNC)
    edit = pl.Edit("mamba back-off to scheduler block size", ANCHOR, REPLACEMENT, scope=FUNC)
    return pl.patch_file(vllm, NAME, path, [edit], present=hashes_aligned_by_gcd)


if __name__ == "__main__":
    sys.exit(pl.run(NAME, apply))
