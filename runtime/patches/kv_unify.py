#!/usr/bin/env python3
"""kv_unify: let a hybrid GDN/mamba target absorb the DFlash drafter's attention KV spec.

vLLM aligns the hybrid target's pages (mamba pages padded up to the attention page), so
the largest page is a *padded* size. 0.23's ``unify_kv_cache_spec_page_size`` can only
scale another layer's block size by an exact integer ratio and asserts the result equals
that maximum, so the drafter's attention spec (whose page does not divide it) is rejected
- and a mamba spec below the maximum can never get there, since its page ignores
``block_size``.

Fix: scale the block size by the integer ratio *and* pad the remaining (< one original
page) bytes, for attention and mamba specs alike. Keeping the scaled block size matters:
padding alone (block size unchanged) mis-strides the drafter's KV and collapses
acceptance. A scaled mamba block differs from ``cache_config.block_size``; with prefix
caching on, ``prefix_align`` makes the hash block size cope with that.

Already present: newer vLLM (function moved to ``kv_cache_planning.py``) pads pages
itself, and an image may carry its own padding edit; either way the function's code then
handles ``page_size_padded``, and the patch reports the fix as already present.
"""
from __future__ import annotations

import sys

try:  # imported as runtime.patches.<name> (controller, tests)
    from . import _patchlib as pl
except ImportError:  # run as a program (/host/patches/<name>.py): its directory is sys.path[0]
    import _patchlib as pl

NAME = "kv_unify"
FUNC = "unify_kv_cache_spec_page_size"
CANDIDATES = ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_planning.py")

ANCHOR = """\
            layer_page_size = layer_spec.page_size_bytes
            if max_page_size % layer_page_size != 0:
                raise NotImplementedError(
                    "The page size of the layer is not divisible by the "
                    "maximum page size. Cannot unify by adjusting block_size."
                )
            ratio = max_page_size // layer_page_size
            new_block_size = layer_spec.block_size * ratio
            new_spec = replace(layer_spec, block_size=new_block_size)
            assert new_spec.page_size_bytes == max_page_size
            new_kv_cache_spec[layer_name] = new_spec
"""

REPLACEMENT = f"""\
            # {pl.sentinel(NAME)} scale the block size and pad the remainder
            # (helper at the end of this module).
            new_kv_cache_spec[layer_name] = _sparkfleet_unify_page(
                layer_spec, max_page_size
            )
"""

HELPER = f'''\
# {pl.sentinel(NAME)} helper for unify_kv_cache_spec_page_size (sparkfleet runtime patch).
def _sparkfleet_unify_page(layer_spec, max_page_size):
    """Return ``layer_spec`` grown to ``page_size_bytes == max_page_size``.

    Scale block_size by the integer ratio (as vLLM does), then pad what remains
    (less than one original page) instead of asserting it away. Attention scales
    from its real (unpadded) page; a mamba page ignores block_size, so its padded
    page is the unit and its block size stays in step with the attention groups.
    MLA and other specs keep vLLM's exact-ratio rule (their layout cannot pad).
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_interface import MambaSpec as _MambaSpec

    is_mamba = isinstance(layer_spec, _MambaSpec)
    is_attention = isinstance(layer_spec, AttentionSpec) and not isinstance(
        layer_spec, MLAAttentionSpec
    )
    base = layer_spec
    if is_attention and layer_spec.page_size_padded is not None:
        base = replace(layer_spec, page_size_padded=None)
    unit = base.page_size_bytes
    paddable = is_mamba or is_attention
    if unit <= 0 or unit > max_page_size or (
        not paddable and max_page_size % unit != 0
    ):
        raise NotImplementedError(
            f"Cannot unify the page size of {{type(layer_spec).__name__}} "
            f"({{unit}} bytes) to {{max_page_size}} bytes."
        )
    new_spec = replace(base, block_size=base.block_size * (max_page_size // unit))
    if paddable and new_spec.page_size_bytes != max_page_size:
        new_spec = replace(new_spec, page_size_padded=max_page_size)
    assert new_spec.page_size_bytes == max_page_size, (
        new_spec.page_size_bytes,
        max_page_size,
    )
    return new_spec
'''


def pads_pages(text: str) -> str | None:
    """The fix in another form: the function pads pages (upstream's, or an image's edit)."""
    if pl.code_uses(text, FUNC, "page_size_padded"):
        return f"{FUNC}() already pads pages (the fix, in this vLLM's own form)"
    return None


def apply(vllm: pl.Vllm) -> pl.Verdict:
    path = pl.find_defining_file(vllm, CANDIDATES, FUNC)
    edit = pl.Edit("ratio-only unify", ANCHOR, REPLACEMENT, scope=FUNC)
    return pl.patch_file(vllm, NAME, path, [edit], append=HELPER, present=pads_pages)


if __name__ == "__main__":
    sys.exit(pl.run(NAME, apply))
