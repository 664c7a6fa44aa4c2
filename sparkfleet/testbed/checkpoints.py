"""Tiny synthetic Hugging Face repositories for the simulated fleet and the tests.

`write_synthetic_repos(root)` lays out, under `root/<org>/<name>/<revision>/`:

* `Intel/Qwen3.5-122B-A10B-int4-AutoRound`  INT4 AutoRound target (+ MTP in
  `model_extra_tensors.safetensors`)
* `Qwen/Qwen3.5-122B-A10B-FP8`               FP8 E4M3 donor, 128x128 block scales
* `bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid` made by running `runtime/build_hybrid.py`
  on the two above, exactly as a host would
* `z-lab/Qwen3.5-122B-A10B-DFlash`           the block-diffusion drafter

Tensor names follow the real Qwen3.5-MoE checkpoints (`model.language_model.*`,
Gated-DeltaNet `linear_attn.in_proj_{qkv,z,b,a}` / `conv1d` / `A_log` / `dt_bias`
on 3 of every 4 layers, gated full attention with `q_norm`/`k_norm` on every 4th,
128-expert-style MoE with `shared_expert` + `shared_expert_gate`, `mtp.*`); only the
dimensions are tiny.  Where the real layout could not be confirmed from public
sources, the choice is marked GUESS below.

All content is a pure function of the tensor name (seeded numpy), so file bytes,
and the revisions (sha1 over the files), are stable across runs and machines.

With an artifact scale S (``up --artifact-scale S``) each repo carries seeded random
padding so that what a host fetches of it is its real size divided by S
(:data:`REAL_FETCHED_GIB`): a file of its own, outside the index, in the INT4, drafter and
hybrid repos (the builder copies no `.safetensors` file the index does not name, so a
host's built hybrid stays small), and padding tensors inside the FP8 donor's shards that
a hybrid build reads (it fetches only those).
Only the standard library and numpy are used (safetensors written by hand). The
tokenizer is a real byte-level BPE in Qwen's format, trained here on fixed text
(engine/tokenizer.py), with a Qwen-shaped chat template (engine/template.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.safetensors_io import TensorSource, write_file
from sparkfleet.testbed.engine import template, tokenizer

INTEL = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
DONOR = "Qwen/Qwen3.5-122B-A10B-FP8"
HYBRID = "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid"
DFLASH = "z-lab/Qwen3.5-122B-A10B-DFlash"
REPOS = (INTEL, DONOR, HYBRID, DFLASH)

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILDER = REPO_ROOT / "runtime" / "build_hybrid.py"


@dataclass(frozen=True)
class Dims:
    """Tiny stand-ins for the real 122B-A10B dimensions (real values in comments)."""

    hidden: int = 128  # 3072
    layers: int = 8  # 48
    experts: int = 4  # 256
    experts_per_tok: int = 2  # 8
    moe_inter: int = 128  # 1024
    # 1024 in the real model; 192 here so the down_proj input (192) ends in a
    # partial 128-block, the case block-scale handling gets wrong most easily.
    shared_inter: int = 192
    vocab: int = 1024  # 248320
    heads: int = 2  # 32
    kv_heads: int = 1  # 2
    head_dim: int = 64  # 256
    lin_k_heads: int = 2  # 16
    lin_v_heads: int = 4  # 64
    lin_head_dim: int = 32  # 128
    conv_kernel: int = 4
    group_size: int = 128
    draft_layers: int = 2  # 6 in the DFlash drafter
    full_attention_interval: int = 4


D = Dims()
#: What a host fetches of each repository at real size, GiB (group_data/all.py's
#: artifact_sizes_gib: of the FP8 donor, only the non-expert shards a hybrid build reads).
REAL_FETCHED_GIB = {INTEL: 62.0, DONOR: 12.0, HYBRID: 67.0, DFLASH: 1.6}
PADDING_FILE = "sparkfleet-padding.safetensors"
PADDING_TENSOR = "sparkfleet_padding"
# Shards are cut at this size so each repo has several, and the donor has
# shards holding only routed experts (the builder must not fetch those).
SHARD_BYTES = 256 << 10


# --------------------------------------------------------------------------- values


def _rng(name: str) -> np.random.Generator:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(seed)


def master(name: str, shape: tuple[int, ...], scale: float = 0.02) -> np.ndarray:
    """The 'original' float weight of a tensor: both the INT4 and the FP8 repos
    are quantizations of it, so they agree numerically like the real ones do."""
    return (_rng(name).standard_normal(shape) * scale).astype(np.float32)


def to_bf16(x: np.ndarray) -> bytes:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # round to nearest even on the dropped 16 bits
    r = ((u >> 16) & 1) + 0x7FFF
    return ((u + r) >> 16).astype("<u2").tobytes()


def _e4m3_table() -> np.ndarray:
    codes = np.arange(0x7F)  # 0x7F is NaN in E4M3FN
    exp = (codes >> 3) & 0xF
    man = codes & 7
    return np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))


_E4M3 = _e4m3_table()  # increasing in the code, max 448


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> F8_E4M3 (fn) codes, round to nearest, saturating at 448."""
    mag = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(_E4M3, mag), 1, len(_E4M3) - 1)
    lo = hi - 1
    code = np.where(mag - _E4M3[lo] <= _E4M3[hi] - mag, lo, hi).astype(np.uint8)
    return code | np.where(x < 0, 0x80, 0).astype(np.uint8)


def fp8_block_quant(w: np.ndarray, block: int = 128) -> tuple[bytes, bytes, tuple[int, int]]:
    """Block FP8 as in the Qwen FP8 releases: per 128x128 block, the dequant
    multiplier `weight_scale_inv` = amax/448 (F32)."""
    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    scales = np.zeros((bo, bi), np.float32)
    q = np.zeros_like(w, dtype=np.uint8)
    for a in range(bo):
        for b in range(bi):
            blk = w[a * block:(a + 1) * block, b * block:(b + 1) * block]
            s = max(float(np.abs(blk).max()) / 448.0, 1e-12)
            scales[a, b] = s
            q[a * block:(a + 1) * block, b * block:(b + 1) * block] = to_e4m3(blk / s)
    return q.tobytes(), scales.astype("<f4").tobytes(), (bo, bi)


def int4_gptq(w: np.ndarray, group: int) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Symmetric 4-bit, AutoRound's `auto_round:auto_gptq` packing:
    qweight I32 [in/8, out], qzeros I32 [in/group, out/8], scales F16 [in/group, out]."""
    out_f, in_f = w.shape
    wt = w.T  # [in, out]
    g = wt.reshape(in_f // group, group, out_f)
    scale = np.maximum(np.abs(g).max(axis=1) / 7.0, 1e-8).astype(np.float16)  # [in/g, out]
    q = np.clip(np.rint(g / scale[:, None, :].astype(np.float32)) + 8, 0, 15).astype(np.uint32)
    q = q.reshape(in_f, out_f)
    packed = np.zeros((in_f // 8, out_f), np.uint32)
    for k in range(8):
        packed |= q[k::8] << (4 * k)
    # GPTQ v1 stores zero-1; symmetric zero 8 -> 7 in every nibble.
    zeros = np.full((in_f // group, out_f // 8), 0x77777777, np.uint32)
    return {
        "qweight": ("I32", packed.shape, packed.astype("<u4").tobytes()),
        "qzeros": ("I32", zeros.shape, zeros.astype("<u4").tobytes()),
        "scales": ("F16", scale.shape, scale.astype("<f2").tobytes()),
    }


# --------------------------------------------------------------------------- model layout

Tensor = tuple[str, str, tuple[int, ...], bytes]  # name, dtype, shape, data


def linear_shapes(prefix: str, layer: int, d: Dims) -> list[tuple[str, tuple[int, int]]]:
    """Every Linear weight of decoder layer `layer` in module order, [out, in]."""
    p = f"{prefix}.layers.{layer}"
    h = d.hidden
    out: list[tuple[str, tuple[int, int]]] = []
    if (layer + 1) % d.full_attention_interval == 0:
        # Gated full attention: q_proj emits query and output gate (2x).
        out += [
            (f"{p}.self_attn.q_proj", (2 * d.heads * d.head_dim, h)),
            (f"{p}.self_attn.k_proj", (d.kv_heads * d.head_dim, h)),
            (f"{p}.self_attn.v_proj", (d.kv_heads * d.head_dim, h)),
            (f"{p}.self_attn.o_proj", (h, d.heads * d.head_dim)),
        ]
    else:
        kd, vd = d.lin_k_heads * d.lin_head_dim, d.lin_v_heads * d.lin_head_dim
        out += [
            (f"{p}.linear_attn.in_proj_qkv", (2 * kd + vd, h)),
            (f"{p}.linear_attn.in_proj_z", (vd, h)),
            (f"{p}.linear_attn.in_proj_b", (d.lin_v_heads, h)),
            (f"{p}.linear_attn.in_proj_a", (d.lin_v_heads, h)),
            (f"{p}.linear_attn.out_proj", (h, vd)),
        ]
    for e in range(d.experts):
        out += [
            (f"{p}.mlp.experts.{e}.gate_proj", (d.moe_inter, h)),
            (f"{p}.mlp.experts.{e}.up_proj", (d.moe_inter, h)),
            (f"{p}.mlp.experts.{e}.down_proj", (h, d.moe_inter)),
        ]
    out += [
        (f"{p}.mlp.gate", (d.experts, h)),
        (f"{p}.mlp.shared_expert.gate_proj", (d.shared_inter, h)),
        (f"{p}.mlp.shared_expert.up_proj", (d.shared_inter, h)),
        (f"{p}.mlp.shared_expert.down_proj", (h, d.shared_inter)),
        (f"{p}.mlp.shared_expert_gate", (1, h)),
    ]
    return out


def other_tensors(prefix: str, layer: int, d: Dims) -> list[tuple[str, str, tuple[int, ...]]]:
    """Norms and GDN parameters (never quantized).  GUESS: A_log in F32 (it is
    kept in float32 by the modeling code); the rest BF16."""
    p = f"{prefix}.layers.{layer}"
    t: list[tuple[str, str, tuple[int, ...]]] = [
        (f"{p}.input_layernorm.weight", "BF16", (d.hidden,)),
        (f"{p}.post_attention_layernorm.weight", "BF16", (d.hidden,)),
    ]
    if (layer + 1) % d.full_attention_interval == 0:
        t += [(f"{p}.self_attn.q_norm.weight", "BF16", (d.head_dim,)),
              (f"{p}.self_attn.k_norm.weight", "BF16", (d.head_dim,))]
    else:
        conv_dim = 2 * d.lin_k_heads * d.lin_head_dim + d.lin_v_heads * d.lin_head_dim
        t += [
            (f"{p}.linear_attn.conv1d.weight", "BF16", (conv_dim, 1, d.conv_kernel)),
            (f"{p}.linear_attn.A_log", "F32", (d.lin_v_heads,)),
            (f"{p}.linear_attn.dt_bias", "BF16", (d.lin_v_heads,)),
            (f"{p}.linear_attn.norm.weight", "BF16", (d.lin_head_dim,)),
        ]
    return t


def mtp_linear_shapes(d: Dims) -> list[tuple[str, tuple[int, int]]]:
    # The MTP block is one full-attention MoE decoder layer after `mtp.fc`
    # ([hidden, 2*hidden]: concat of normed embedding and normed hidden state).
    layer = [(n.replace("model.language_model.layers.3", "mtp.layers.0"), s)
             for n, s in linear_shapes("model.language_model", 3, d)]
    return [("mtp.fc", (d.hidden, 2 * d.hidden))] + layer


def mtp_other(d: Dims) -> list[tuple[str, str, tuple[int, ...]]]:
    t = [(n.replace("model.language_model.layers.3", "mtp.layers.0"), dt, s)
         for n, dt, s in other_tensors("model.language_model", 3, d)]
    return t + [
        ("mtp.pre_fc_norm_embedding.weight", "BF16", (d.hidden,)),
        ("mtp.pre_fc_norm_hidden.weight", "BF16", (d.hidden,)),
        ("mtp.norm.weight", "BF16", (d.hidden,)),
    ]


def visual_tensors(d: Dims) -> list[tuple[str, str, tuple[int, ...]]]:
    # A token vision tower (one block + merger).  GUESS on the exact sub-names;
    # nothing in sparkfleet reads them, they only make the layout realistic.
    vh = 64
    return [
        ("model.visual.patch_embed.proj.weight", "BF16", (vh, 3, 2, 16, 16)),
        ("model.visual.blocks.0.norm1.weight", "BF16", (vh,)),
        ("model.visual.blocks.0.attn.qkv.weight", "BF16", (3 * vh, vh)),
        ("model.visual.blocks.0.attn.proj.weight", "BF16", (vh, vh)),
        ("model.visual.blocks.0.mlp.linear_fc1.weight", "BF16", (4 * vh, vh)),
        ("model.visual.blocks.0.mlp.linear_fc2.weight", "BF16", (vh, 4 * vh)),
        ("model.visual.merger.linear_fc2.weight", "BF16", (d.hidden, 4 * vh)),
    ]


def _plain(name: str, dtype: str, shape: tuple[int, ...]) -> Tensor:
    if name.endswith(("layernorm.weight", "norm.weight")) and "linear_attn.norm" not in name:
        x = 1.0 + master(name, shape, 0.05)
    elif name.endswith("A_log"):
        x = np.log(np.linspace(1.0, 16.0, int(np.prod(shape)), dtype=np.float32)).reshape(shape)
    else:
        x = master(name, shape)
    data = to_bf16(x) if dtype == "BF16" else x.astype("<f4").tobytes()
    return (name, dtype, shape, data)


def _bf16_linear(name: str, shape: tuple[int, int]) -> Tensor:
    return (f"{name}.weight", "BF16", shape, to_bf16(master(f"{name}.weight", shape)))


def intel_quantized(name: str) -> bool:
    """Which Linears AutoRound quantized to INT4 in the Intel checkpoint:
    routed experts and attention (the reference recipe: 'attention as INT4'); BF16 are the
    shared experts, the router `mlp.gate`, `shared_expert_gate`, embeddings,
    lm_head, MTP and vision.  GUESS: the tiny-output `in_proj_a/b` stay BF16."""
    if name.startswith(("mtp.", "model.visual.")):
        return False
    if ".mlp.experts." in name:
        return True
    return any(k in name for k in (".self_attn.", "in_proj_qkv", "in_proj_z", "out_proj"))


def donor_fp8(name: str) -> bool:
    """Which Linears the FP8 release stores as F8_E4M3.  GUESS: every Linear
    except the router, `shared_expert_gate`, `in_proj_a/b`, embeddings,
    lm_head and vision; the MTP layer is FP8 too (the builder must still keep
    the INT4 checkpoint's BF16 MTP tensors)."""
    if name.startswith("model.visual."):
        return False
    return not name.endswith(("mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b"))


def intel_tensors(d: Dims = D) -> tuple[list[Tensor], list[Tensor]]:
    """(main tensors in save order, MTP tensors for model_extra_tensors)."""
    lm = "model.language_model"
    main: list[Tensor] = [_plain(f"{lm}.embed_tokens.weight", "BF16", (d.vocab, d.hidden))]
    for layer in range(d.layers):
        for n, dt, s in other_tensors(lm, layer, d):
            main.append(_plain(n, dt, s))
        for n, s in linear_shapes(lm, layer, d):
            if intel_quantized(n):
                for part, (dt, shp, data) in int4_gptq(master(f"{n}.weight", s), d.group_size).items():
                    main.append((f"{n}.{part}", dt, shp, data))
            else:
                main.append(_bf16_linear(n, s))
    main.append(_plain(f"{lm}.norm.weight", "BF16", (d.hidden,)))
    main.append(_plain("lm_head.weight", "BF16", (d.vocab, d.hidden)))
    main += [_plain(n, dt, s) for n, dt, s in visual_tensors(d)]
    mtp = [_plain(n, dt, s) for n, dt, s in mtp_other(d)] + [_bf16_linear(n, s) for n, s in mtp_linear_shapes(d)]
    return main, mtp


def donor_tensors(d: Dims = D) -> list[Tensor]:
    lm = "model.language_model"
    out: list[Tensor] = [_plain(f"{lm}.embed_tokens.weight", "BF16", (d.vocab, d.hidden))]

    def linear(n: str, s: tuple[int, int]) -> None:
        if donor_fp8(n):
            q, sc, sshape = fp8_block_quant(master(f"{n}.weight", s))
            out.append((f"{n}.weight", "F8_E4M3", s, q))
            out.append((f"{n}.weight_scale_inv", "F32", sshape, sc))
        else:
            out.append(_bf16_linear(n, s))

    for layer in range(d.layers):
        for n, dt, s in other_tensors(lm, layer, d):
            out.append(_plain(n, dt, s))
        for n, s in linear_shapes(lm, layer, d):
            linear(n, s)
    out.append(_plain(f"{lm}.norm.weight", "BF16", (d.hidden,)))
    out.append(_plain("lm_head.weight", "BF16", (d.vocab, d.hidden)))
    out += [_plain(n, dt, s) for n, dt, s in visual_tensors(d)]
    out += [_plain(n, dt, s) for n, dt, s in mtp_other(d)]
    for n, s in mtp_linear_shapes(d):
        linear(n, s)
    return out


def dflash_tensors(d: Dims = D) -> list[Tensor]:
    """The drafter has no embeddings / lm_head of its own (it shares the
    target's).  GUESS: names as in z-lab's reference DFlash model (`fc` over the
    concatenated target hidden states, `hidden_norm`, Qwen3-style layers)."""
    n_target = 3  # target layers tapped
    out: list[Tensor] = [
        _bf16_linear("fc", (d.hidden, n_target * d.hidden)),
        _plain("hidden_norm.weight", "BF16", (d.hidden,)),
    ]
    for i in range(d.draft_layers):
        p = f"layers.{i}"
        out += [
            _plain(f"{p}.input_layernorm.weight", "BF16", (d.hidden,)),
            _bf16_linear(f"{p}.self_attn.q_proj", (d.heads * d.head_dim, d.hidden)),
            _bf16_linear(f"{p}.self_attn.k_proj", (d.kv_heads * d.head_dim, d.hidden)),
            _bf16_linear(f"{p}.self_attn.v_proj", (d.kv_heads * d.head_dim, d.hidden)),
            _bf16_linear(f"{p}.self_attn.o_proj", (d.hidden, d.heads * d.head_dim)),
            _plain(f"{p}.self_attn.q_norm.weight", "BF16", (d.head_dim,)),
            _plain(f"{p}.self_attn.k_norm.weight", "BF16", (d.head_dim,)),
            _plain(f"{p}.post_attention_layernorm.weight", "BF16", (d.hidden,)),
            _bf16_linear(f"{p}.mlp.gate_proj", (2 * d.hidden, d.hidden)),
            _bf16_linear(f"{p}.mlp.up_proj", (2 * d.hidden, d.hidden)),
            _bf16_linear(f"{p}.mlp.down_proj", (d.hidden, 2 * d.hidden)),
        ]
    out.append(_plain("norm.weight", "BF16", (d.hidden,)))
    return out


# --------------------------------------------------------------------------- configs


def text_config(d: Dims = D) -> dict:
    return {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "attn_output_gate": True,
        "full_attention_interval": d.full_attention_interval,
        "layer_types": ["full_attention" if (i + 1) % d.full_attention_interval == 0 else "linear_attention"
                        for i in range(d.layers)],
        "linear_conv_kernel_dim": d.conv_kernel,
        "linear_key_head_dim": d.lin_head_dim,
        "linear_value_head_dim": d.lin_head_dim,
        "linear_num_key_heads": d.lin_k_heads,
        "linear_num_value_heads": d.lin_v_heads,
        "num_experts": d.experts,
        "num_experts_per_tok": d.experts_per_tok,
        "moe_intermediate_size": d.moe_inter,
        "shared_expert_intermediate_size": d.shared_inter,
        "mtp_num_hidden_layers": 1,
        "vocab_size": d.vocab,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "mamba_ssm_dtype": "float32",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def model_config(d: Dims = D) -> dict:
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_config(d),
        "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 64, "out_hidden_size": d.hidden},
        "image_token_id": d.vocab - 4,
        "video_token_id": d.vocab - 3,
        "vision_start_token_id": d.vocab - 2,
        "vision_end_token_id": d.vocab - 1,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "sparkfleet_synthetic": True,
    }


def autoround_qconfig(d: Dims = D) -> dict:
    """Like AutoRound's export: W4G128 sym, GPTQ packing, and the layers left
    in 16 bits listed in `extra_config` (GUESS on the exact keys kept)."""
    extra: dict[str, dict] = {}
    for layer in range(d.layers):
        for n, _ in linear_shapes("model.language_model", layer, d):
            if not intel_quantized(n) and not n.endswith("mlp.gate"):
                extra[n] = {"bits": 16, "data_type": "float"}
    return {
        "quant_method": "auto-round",
        "packing_format": "auto_round:auto_gptq",
        "bits": 4,
        "group_size": d.group_size,
        "sym": True,
        "data_type": "int",
        "iters": 200,
        "autoround_version": "0.9.0",
        "block_name_to_quantize": "model.language_model.layers",
        "extra_config": extra,
    }


def fp8_qconfig() -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.visual", "mlp.gate", "shared_expert_gate",
                                   "in_proj_a", "in_proj_b"],
    }


def dflash_config(d: Dims = D) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": d.hidden,
        "intermediate_size": 2 * d.hidden,
        "num_hidden_layers": d.draft_layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "vocab_size": d.vocab,
        "rms_norm_eps": 1e-6,
        "block_size": 16,
        "num_target_layers": d.layers,
        "dflash_config": {"mask_token_id": d.vocab - 5, "target_layer_ids": [1, d.layers // 2, d.layers - 2]},
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


# --------------------------------------------------------------------------- writing


def write_safetensors(path: Path, tensors: list[Tensor]) -> None:
    """One safetensors file, written by the runtime's own writer (the hybrid builder's)."""
    write_file(path, [TensorSource.from_bytes(name, dt, shape, data) for name, dt, shape, data in tensors],
               metadata={"format": "pt"})


def write_sharded(d: Path, tensors: list[Tensor], extra: dict[str, list[Tensor]] | None = None,
                  shard_bytes: int = SHARD_BYTES, padding: int = 0, pad_into=None) -> None:
    """Greedy size-capped shards in save order (like `save_pretrained`), plus
    extra named files (the Intel MTP file), all listed in the index. *padding* bytes are
    spread over the shards for which ``pad_into(tensors)`` holds, as U8 tensors."""
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + len(t[3]) > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += len(t[3])
    chosen = [g for g in groups if pad_into and pad_into(g)] if padding > 0 else []
    for i, g in enumerate(chosen):
        size = padding // len(chosen) + (1 if i < padding % len(chosen) else 0)
        g.append((f"{PADDING_TENSOR}.{i}", "U8", (size,), _random_bytes(f"{d.name}-{i}", size)))
    n = len(groups)
    wmap: dict[str, str] = {}
    total = 0
    files = [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]
    files += list((extra or {}).items())
    for fname, group in files:
        write_safetensors(d / fname, group)
        for name, _, _, data in group:
            wmap[name] = fname
            total += len(data)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _random_bytes(seed: str, n: int) -> bytes:
    return _rng(seed).bytes(n)


def _padding_needed(repo: str, fetched: int, artifact_scale: float | None) -> int:
    return max(0, round(REAL_FETCHED_GIB[repo] * 2**30 / artifact_scale) - fetched) if artifact_scale else 0


def _repo_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def pad_repo(d: Path, repo: str, artifact_scale: float | None) -> None:
    """Bring the repo in *d* to its real size over *artifact_scale* with a padding file."""
    # ~100 bytes of safetensors header around the padding tensor.
    n = _padding_needed(repo, _repo_bytes(d) + 128, artifact_scale)
    if n:
        write_safetensors(d / PADDING_FILE, [(PADDING_TENSOR, "U8", (n,), _random_bytes(repo, n))])


def donor_read(name: str, names: set[str]) -> bool:
    """Whether a hybrid build reads the donor tensor *name* (hybrid_plan.make_plan: a
    non-expert, non-MTP ``.weight`` the INT4 checkpoint holds unquantized, with its block
    scales in the donor; or those scales)."""
    if name.endswith("_scale_inv"):
        return donor_read(name[:-len("_scale_inv")], names)
    if ".mlp.experts." in name or name.startswith("mtp.") or not name.endswith(".weight"):
        return False
    return not intel_quantized(name[:-len(".weight")]) and name + "_scale_inv" in names


def write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def tokenizer_config(doc: dict) -> dict:
    """Qwen's ``tokenizer_config.json``: the class, the special tokens, the chat template."""
    return {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None,
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in doc["added_tokens"]},
        "chat_template": template.CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": tokenizer.EOS, "errors": "replace", "model_max_length": 262144, "pad_token": tokenizer.PAD,
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
        "sparkfleet_synthetic": True,
    }


def common_files(d: Path, dims: Dims) -> None:
    """What a Qwen repo carries beside the weights: generation config, tokenizer, chat template."""
    doc = tokenizer.build(dims.vocab)
    eos = next(t["id"] for t in doc["added_tokens"] if t["content"] == tokenizer.EOS)
    write_json(d / "generation_config.json", {"bos_token_id": None, "eos_token_id": [eos],
                                              "do_sample": True, "temperature": 0.6, "top_p": 0.95})
    (d / "tokenizer.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    write_json(d / "tokenizer_config.json", tokenizer_config(doc))
    (d / "chat_template.jinja").write_text(template.CHAT_TEMPLATE, encoding="utf-8")


def content_revision(d: Path) -> str:
    """sha1 over (relative path, sha256 of content) of every file: stable and
    changes whenever any byte does, like a commit hash would."""
    h = hashlib.sha1()
    for p in sorted(x for x in d.rglob("*") if x.is_file()):
        h.update(str(p.relative_to(d)).encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _publish(tmp: Path, root: Path, repo: str) -> str:
    rev = content_revision(tmp)
    dst = root / repo / rev
    if dst.exists():  # same bytes already there (deterministic): keep it
        shutil.rmtree(tmp)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, dst)
    return rev


def write_intel(d: Path, dims: Dims = D) -> None:
    main, mtp = intel_tensors(dims)
    write_sharded(d, main, {"model_extra_tensors.safetensors": mtp})
    cfg = model_config(dims)
    cfg["quantization_config"] = autoround_qconfig(dims)
    write_json(d / "config.json", cfg)
    common_files(d, dims)


def write_donor(d: Path, dims: Dims = D, artifact_scale: float | None = None) -> None:
    # Smaller shards than the others: like the real 122B FP8 release, several
    # shards then hold routed experts only, which the builder must not fetch.
    tensors = donor_tensors(dims)
    names = {t[0] for t in tensors}
    read = [t for t in tensors if donor_read(t[0], names)]
    # Padding goes into the shards a build reads: what a host fetches grows, nothing else.
    write_sharded(d, tensors, shard_bytes=128 << 10,
                  padding=_padding_needed(DONOR, sum(len(t[3]) for t in read), artifact_scale),
                  pad_into=lambda group: any(donor_read(t[0], names) for t in group))
    cfg = model_config(dims)
    cfg["quantization_config"] = fp8_qconfig()
    write_json(d / "config.json", cfg)
    common_files(d, dims)


def write_dflash(d: Path, dims: Dims = D) -> None:
    write_sharded(d, dflash_tensors(dims))
    write_json(d / "config.json", dflash_config(dims))


def run_builder(int4: Path, donor: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run the real builder CLI (as the serving image would)."""
    return subprocess.run([sys.executable, str(BUILDER), "--int4", str(int4), "--donor", str(donor),
                           "--out", str(out), *extra], capture_output=True, text=True)


def write_synthetic_repos(root: Path, artifact_scale: float | None = None) -> dict[str, str]:
    """Write the four synthetic repos under root/<org>/<name>/<revision>/;
    return {repo id: revision}.  Idempotent and deterministic. *artifact_scale*: padded to
    their real sizes divided by it (see the module's docstring)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    revs: dict[str, str] = {}
    for repo in (INTEL, DONOR, DFLASH):
        (root / repo).mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root / repo))
        if repo == DONOR:
            write_donor(tmp, artifact_scale=artifact_scale)
        else:
            (write_intel if repo == INTEL else write_dflash)(tmp)
            pad_repo(tmp, repo, artifact_scale)
        revs[repo] = _publish(tmp, root, repo)

    (root / HYBRID).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root / HYBRID))
    out = work / "out"
    res = run_builder(root / INTEL / revs[INTEL], root / DONOR / revs[DONOR], out)
    if res.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"build_hybrid failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    tmp = work / "repo"
    os.rename(out, tmp)
    pad_repo(tmp, HYBRID, artifact_scale)
    revs[HYBRID] = _publish(tmp, root, HYBRID)
    shutil.rmtree(work, ignore_errors=True)
    return {r: revs[r] for r in REPOS}


def fetched_bytes(root: Path, revisions: dict[str, str], build_hybrid: bool = False) -> dict[str, int]:
    """What a host of the dense profile fetches of each repo written here: the hosted
    hybrid and the drafter whole; with *build_hybrid*, instead of the hybrid, the INT4
    checkpoint whole and of the FP8 donor its config, index and the shards the hub's hybrid
    build read (its config.json names them)."""
    root = Path(root)
    dflash = {DFLASH: _repo_bytes(root / DFLASH / revisions[DFLASH])}
    if not build_hybrid:
        return {HYBRID: _repo_bytes(root / HYBRID / revisions[HYBRID]), **dflash}
    hybrid = json.loads((root / HYBRID / revisions[HYBRID] / "config.json").read_text())
    donor = root / DONOR / revisions[DONOR]
    read = ["config.json", "model.safetensors.index.json", *hybrid["sparkfleet_hybrid"]["donor"]["shards_read"]]
    return {INTEL: _repo_bytes(root / INTEL / revisions[INTEL]),
            DONOR: sum((donor / f).stat().st_size for f in read), **dflash}


def main() -> None:  # pragma: no cover - convenience
    import argparse

    ap = argparse.ArgumentParser(description="write the synthetic checkpoint repos")
    ap.add_argument("root", type=Path)
    for repo, rev in write_synthetic_repos(ap.parse_args().root).items():
        print(f"{repo} {rev}")


if __name__ == "__main__":  # pragma: no cover
    main()
