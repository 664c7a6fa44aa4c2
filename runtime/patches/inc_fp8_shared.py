#!/usr/bin/env python3
"""inc_fp8_shared: serve the hybrid INT4+FP8 checkpoint's FP8 dense layers with Fp8LinearMethod.

The hybrid checkpoint is Intel's INT4 AutoRound model with the BF16 shared-expert
projections swapped for FP8 E4M3 tensors (128x128 block scales ``weight_scale_inv``);
its ``quantization_config`` is unchanged, so INC still lists those layers as 16-bit and
would build BF16 parameters that the FP8 tensors cannot load into.

The patch adds ``INCConfig.maybe_update_config`` (vLLM calls it once after building the
quant config, with the model name) which reads the checkpoint's safetensors headers
(local files or hub metadata - no tensor data) and records every FP8 linear layer, and
a first check in ``INCConfig.get_quant_method`` that hands those layers an
``Fp8LinearMethod`` before INC's own 16-bit/INT4 dispatch. For a checkpoint without FP8
tensors nothing changes.

Already present: when INCConfig defines its own ``maybe_update_config`` that reads
safetensors metadata (the open upstream PR, which images carry as an overlay), or its
``get_quant_method`` already hands layers an ``Fp8LinearMethod``. ``inc.py`` became the
package ``quantization/inc/``; both layouts are patched.
"""
from __future__ import annotations

import sys

try:  # imported as runtime.patches.<name> (controller, tests)
    from . import _patchlib as pl
except ImportError:  # run as a program (/host/patches/<name>.py): its directory is sys.path[0]
    import _patchlib as pl

NAME = "inc_fp8_shared"
CANDIDATES = (
    "vllm/model_executor/layers/quantization/inc.py",
    "vllm/model_executor/layers/quantization/inc/inc.py",
)
SCOPE = "INCConfig.get_quant_method"

ANCHOR = """\
    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
"""

REPLACEMENT = f"""\
    def maybe_update_config(self, model_name, hf_config=None, revision=None):
        # {pl.sentinel(NAME)} find the checkpoint's FP8 dense layers (header scan).
        super().maybe_update_config(model_name, hf_config=hf_config, revision=revision)
        _sparkfleet_find_fp8_layers(self, model_name, revision)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        # {pl.sentinel(NAME)} FP8 dense layers of a hybrid INT4+FP8 checkpoint load
        # as block-FP8, ahead of INC's 16-bit/INT4 dispatch.
        _sf_method = _sparkfleet_fp8_dense_method(self, layer, prefix)
        if _sf_method is not None:
            return _sf_method
"""

HELPERS = f'''\
# {pl.sentinel(NAME)} helpers for INCConfig (sparkfleet runtime patch).
import re as _sf_re

# vLLM fuses some projections into one layer; the checkpoint keeps them apart.
_SPARKFLEET_FUSED = {{
    "gate_up_proj": ("gate_proj", "up_proj"),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
}}
_SPARKFLEET_LAYERS_RE = _sf_re.compile(r"(?:^|\\.)(layers\\.\\d+\\..+)$")
_SPARKFLEET_FP8_DTYPES = ("F8_E4M3",)


def _sparkfleet_layer_key(name):
    """Name-space independent key of a decoder-layer module: the checkpoint says
    ``model.language_model.layers.3.mlp.shared_expert.gate_proj``, vLLM's prefix
    ``language_model.model.layers.3.mlp.shared_expert.gate_up_proj``."""
    match = _SPARKFLEET_LAYERS_RE.search(name)
    if match is None:
        return None
    head = name[: match.start(1)]
    return ("mtp." if "mtp" in head.split(".") else "") + match.group(1)


def _sparkfleet_fp8_layers_from_metadata(metadata):
    """{{layer key: [block_n, block_k]}} for every FP8 ``*.weight`` in the
    safetensors metadata ({{tensor name: {{"dtype", "shape", ...}}}})."""
    found = {{}}
    for name, info in metadata.items():
        if not name.endswith(".weight") or info.get("dtype") not in _SPARKFLEET_FP8_DTYPES:
            continue
        module = name[: -len(".weight")]
        key = _sparkfleet_layer_key(module)
        if key is None:
            continue
        scale = metadata.get(module + ".weight_scale_inv")
        if scale is None:
            raise ValueError(
                f"sparkfleet inc_fp8_shared: {{name}} is FP8 without a block scale "
                f"({{module}}.weight_scale_inv); only 128x128 block FP8 is supported"
            )
        shape, sshape = list(info.get("shape") or []), list(scale.get("shape") or [])
        if len(shape) == 2 and len(sshape) == 2 and sshape != [
            -(-shape[0] // 128),
            -(-shape[1] // 128),
        ]:
            raise ValueError(
                f"sparkfleet inc_fp8_shared: {{module}}: scale shape {{sshape}} does not "
                f"match 128x128 blocks of weight shape {{shape}}"
            )
        found[key] = [128, 128]
    return found


def _sparkfleet_find_fp8_layers(cfg, model_name, revision=None):
    import os

    cfg._sparkfleet_fp8 = {{}}
    if os.environ.get("SPARKFLEET_INC_FP8", "1") == "0":
        return
    from vllm.logger import init_logger
    from vllm.transformers_utils.config import get_safetensors_params_metadata

    # vLLM does not pass the revision here; the serve wrapper's env has it.
    revision = revision or os.environ.get("SF_REVISION") or None
    source = model_name
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline and not os.path.exists(model_name):
        # Offline (the deploy pre-fetches): read the cached snapshot's headers
        # directly instead of letting the hub lookup fail, retry and log errors.
        from huggingface_hub import snapshot_download

        source = snapshot_download(
            model_name,
            revision=revision,
            allow_patterns=["*.safetensors"],
            local_files_only=True,
        )
    metadata = get_safetensors_params_metadata(source, revision=revision)
    cfg._sparkfleet_fp8 = _sparkfleet_fp8_layers_from_metadata(metadata)
    init_logger(__name__).info(
        "sparkfleet inc_fp8_shared: %d FP8 dense layers in %s%s",
        len(cfg._sparkfleet_fp8),
        model_name,
        " -> Fp8LinearMethod" if cfg._sparkfleet_fp8 else "",
    )


def _sparkfleet_fp8_dense_method(cfg, layer, prefix):
    found = getattr(cfg, "_sparkfleet_fp8", None)
    if not found or not prefix:
        return None
    from vllm.model_executor.layers.linear import LinearBase

    if not isinstance(layer, LinearBase):
        return None
    key = _sparkfleet_layer_key(prefix)
    if key is None:
        return None
    if key in found:
        parts = [key]
    else:
        head, _, leaf = key.rpartition(".")
        parts = [f"{{head}}.{{p}}" for p in _SPARKFLEET_FUSED.get(leaf, ())]
    hits = [p for p in parts if p in found]
    if not hits:
        return None
    if len(hits) != len(parts):
        raise ValueError(
            f"sparkfleet inc_fp8_shared: {{prefix}} fuses {{parts}} but only {{hits}} "
            "are FP8 in the checkpoint"
        )
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    fp8_config = Fp8Config(
        is_checkpoint_fp8_serialized=True,
        activation_scheme="dynamic",
        weight_block_size=found[hits[0]],
    )
    return Fp8LinearMethod(fp8_config)
'''


def detects_fp8_layers(text: str) -> str | None:
    """The fix in another form: INC finds FP8 layers itself (the upstream PR's shape)."""
    if pl.code_uses(text, "INCConfig.maybe_update_config", "get_safetensors_params_metadata"):
        return "INCConfig.maybe_update_config() already reads safetensors metadata for FP8 layers"
    if pl.code_uses(text, SCOPE, "Fp8LinearMethod"):
        return "INCConfig.get_quant_method() already dispatches FP8 layers to Fp8LinearMethod"
    return None


def apply(vllm: pl.Vllm) -> pl.Verdict:
    path = pl.find_defining_file(vllm, CANDIDATES, SCOPE)
    edit = pl.Edit("INC layer dispatch", ANCHOR, REPLACEMENT, scope=SCOPE)
    return pl.patch_file(vllm, NAME, path, [edit], append=HELPERS, present=detects_fp8_layers)


if __name__ == "__main__":
    sys.exit(pl.run(NAME, apply))
