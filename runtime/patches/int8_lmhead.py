#!/usr/bin/env python3
"""int8_lmhead: compute the vocab projection with sparkfleet's int8 w8a16 Triton GEMV.

The lm-head (248 320 x hidden, 1.5 GB in BF16) is the largest dense read of every
decode step. ``LogitsProcessor._get_logits`` is patched to call
the kernel in ``runtime/int8_lmhead.py`` (at ``$SPARKFLEET_RUNTIME_DIR``, default
``/host``): ``int8_logits(hidden, weight)``, or ``Int8LMHead.for_weight(weight)(hidden)``
(quantized per row on first use, cached per weight). The BF16 weight is left untouched: the DFlash drafter shares
this very head module, and zeroing/replacing it corrupts the drafter (the reference recipe's lesson).
Anything unusual (bias, a quantized or non-BF16 head, CPU, a fp32 head dtype, the
kernel not importable, ``SPARKFLEET_INT8_LMHEAD=0``) falls back to vLLM's own path.

No capability gate: the int8 head is not upstream in any vLLM. Both the 0.23 call
(``lm_head.quant_method.apply``) and the later ``self._apply_head`` seam are handled.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _patchlib as pl  # noqa: E402

NAME = "int8_lmhead"
FILE = "vllm/model_executor/layers/logits_processor.py"
SCOPE = "LogitsProcessor._get_logits"

# (anchor, stock call) per vLLM generation: 0.23 applies the head inline, later
# releases go through _apply_head (which also honours head_dtype).
_SEAMS = (
    "lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)",
    "self._apply_head(lm_head, hidden_states, embedding_bias)",
)


def _edit(call: str) -> pl.Edit:
    anchor = f"        logits = {call}\n"
    replacement = (
        f"        # {pl.sentinel(NAME)} int8 w8a16 vocab projection; the bf16 weight\n"
        "        # stays (the DFlash drafter shares this head). None: stock path.\n"
        "        logits = _sparkfleet_int8_logits(self, lm_head, hidden_states, embedding_bias)\n"
        "        if logits is None:\n"
        f"            logits = {call}\n"
    )
    return pl.Edit("lm-head projection", anchor, replacement, scope=SCOPE)


HELPERS = f'''\
# {pl.sentinel(NAME)} helpers for LogitsProcessor._get_logits (sparkfleet runtime patch).
_SPARKFLEET_INT8_KERNEL = []  # [callable(hidden, weight) or None], resolved once


def _sparkfleet_int8_entry(module):
    """``logits = f(hidden, weight)`` from runtime/int8_lmhead.py: its
    ``int8_logits(hidden, weight)`` if it has that shape, else a per-weight cached
    ``Int8LMHead.for_weight(weight)`` / ``.from_weight(weight)`` called on hidden."""
    import inspect

    fn = getattr(module, "int8_logits", None)
    if callable(fn):
        required = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(required) == 2:
            return fn
    head_cls = getattr(module, "Int8LMHead", None)
    for ctor in ("for_weight", "from_weight"):
        make = getattr(head_cls, ctor, None)
        if make is not None:
            heads = {{}}

            def call(hidden, weight, _make=make, _heads=heads):
                key = (weight.data_ptr(), tuple(weight.shape), str(weight.device))
                head = _heads.get(key)
                if head is None:
                    head = _heads[key] = _make(weight)
                return head(hidden)

            return call
    raise AttributeError(
        "neither int8_logits(hidden, weight) nor Int8LMHead.for_weight/from_weight"
    )


def _sparkfleet_int8_kernel():
    if _SPARKFLEET_INT8_KERNEL:
        return _SPARKFLEET_INT8_KERNEL[0]
    import importlib.util
    import os
    import sys

    from vllm.logger import init_logger

    log = init_logger(__name__)
    fn = None
    if os.environ.get("SPARKFLEET_INT8_LMHEAD", "1") != "0":
        path = os.path.join(
            os.environ.get("SPARKFLEET_RUNTIME_DIR", "/host"), "int8_lmhead.py"
        )
        try:
            # Loaded by path under a private name: nothing else on sys.path can shadow it.
            spec = importlib.util.spec_from_file_location("sparkfleet_int8_lmhead", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            fn = _sparkfleet_int8_entry(module)
            log.info("sparkfleet int8_lmhead: int8 w8a16 lm-head from %s", path)
        except Exception as exc:
            sys.modules.pop("sparkfleet_int8_lmhead", None)
            log.warning(
                "sparkfleet int8_lmhead: kernel unavailable (%s: %s); using the bf16 head",
                type(exc).__name__,
                exc,
            )
    _SPARKFLEET_INT8_KERNEL.append(fn)
    return fn


def _sparkfleet_int8_logits(proc, lm_head, hidden_states, embedding_bias):
    if embedding_bias is not None or hidden_states.dim() != 2:
        return None
    head_dtype = getattr(proc, "head_dtype", None)
    if head_dtype is not None and head_dtype != hidden_states.dtype:
        return None
    weight = getattr(lm_head, "weight", None)
    if (
        weight is None
        or not hidden_states.is_cuda
        or weight.dtype != torch.bfloat16
        or hidden_states.dtype != torch.bfloat16
        or type(lm_head.quant_method).__name__
        not in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")
    ):
        return None
    fn = _sparkfleet_int8_kernel()
    if fn is None:
        return None
    return fn(hidden_states, weight)
'''


def apply(vllm: pl.Vllm) -> tuple[str, str]:
    path = vllm.path(FILE)
    if not path.is_file():
        raise pl.PatchFailed(f"{FILE} (vLLM {vllm.version}) is missing: anchor {SCOPE}() not found")
    text = path.read_text(encoding="utf-8")
    body = pl.def_source(text, SCOPE) or ""
    # Pick the seam this vLLM has; an unknown one fails naming the 0.23 anchor.
    call = next((c for c in _SEAMS if f"logits = {c}\n" in body), _SEAMS[0])
    return pl.patch_file(vllm, NAME, path, [_edit(call)], append=HELPERS)


if __name__ == "__main__":
    sys.exit(pl.run(NAME, apply))
