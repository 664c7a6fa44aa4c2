"""What the patched vLLM code *does*, run on CPU without vLLM.

The patched functions are cut out of the real (patched) 0.23 files and executed against
small stand-ins for the vLLM types they touch, which mirror vLLM's page-size rules.
The unpatched originals are run on the same inputs to show the failure each patch fixes.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from support.runtime_env import PATCH_DIR
from support.vllm_source import VLLM_IMAGE_VERSION

from runtime.patches import _patchlib as pl

pytestmark = pytest.mark.network  # real vLLM sources: the PyPI sdists, downloaded once

KV_FILE = "vllm/v1/core/kv_cache_utils.py"


def patched_tree(vllm_tree, *names: str) -> Path:
    root = vllm_tree(VLLM_IMAGE_VERSION)
    for name in names:
        proc = subprocess.run(
            [sys.executable, str(PATCH_DIR / f"{name}.py"), "--vllm-root", str(root)],
            capture_output=True, text=True,
        )
        assert proc.returncode == 0 and '"outcome": "applied"' in proc.stdout, proc.stdout
    return root


def cut(text: str, *qualnames: str) -> str:
    parts = []
    for q in qualnames:
        src = pl.def_source(text, q)
        assert src is not None, q
        parts.append(src)
    return "\n\n".join(parts)


def helper_block(text: str, name: str) -> str:
    """The module-level helpers a patch appended (from its sentinel comment to EOF)."""
    marker = f"# [sparkfleet:{name}] helper"
    return text[text.index(marker):]


def run_code(code: str, namespace: dict) -> dict:
    exec(compile(code, "<patched vllm>", "exec"), namespace)
    return namespace


# --- stand-ins for vllm.v1.kv_cache_interface (same page-size rules) -------------------


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype_size: int = 2
    page_size_padded: int | None = None

    @property
    def real_page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size

    @property
    def page_size_bytes(self) -> int:
        real = self.real_page_size_bytes
        if self.page_size_padded is not None:
            assert self.page_size_padded >= real
            return self.page_size_padded
        return real


class FullAttentionSpec(AttentionSpec):
    pass


class MLAAttentionSpec(AttentionSpec):
    pass


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    state_bytes: int
    page_size_padded: int | None = None
    mamba_cache_mode: str = "none"

    @property
    def page_size_bytes(self) -> int:  # state shapes only: block_size plays no part
        if self.page_size_padded is not None:
            assert self.page_size_padded >= self.state_bytes
            return self.page_size_padded
        return self.state_bytes


@pytest.fixture
def fake_kv_interface(monkeypatch):
    mod = types.ModuleType("vllm.v1.kv_cache_interface")
    mod.AttentionSpec, mod.MLAAttentionSpec, mod.MambaSpec = AttentionSpec, MLAAttentionSpec, MambaSpec
    for name in ("vllm", "vllm.v1"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_cache_interface", mod)
    return mod


def _unify_fns(text: str, patched: bool):
    code = cut(text, "unify_kv_cache_spec_page_size")
    if patched:
        code += "\n\n" + helper_block(text, "kv_unify")
    ns = run_code(code, {"replace": replace, "KVCacheSpec": KVCacheSpec, "MambaSpec": MambaSpec})
    return ns["unify_kv_cache_spec_page_size"]


def _hybrid_with_drafter(drafter_heads: int) -> dict:
    # Qwen3.5-style target: full attention 2 KV heads x 256 (2 KiB/token), block 2240,
    # GDN/mamba state padded up to the attention page; drafter attention 16-token blocks.
    attn_page = 2 * 2240 * 2 * 256 * 2
    return {
        "target.attn": FullAttentionSpec(block_size=2240, num_kv_heads=2, head_size=256),
        "target.gdn": MambaSpec(block_size=2240, state_bytes=attn_page - 24_640, page_size_padded=attn_page),
        "drafter.attn": FullAttentionSpec(block_size=16, num_kv_heads=drafter_heads, head_size=128),
    }


def test_kv_unify_absorbs_a_non_dividing_drafter(vllm_tree, fake_kv_interface) -> None:
    root = patched_tree(vllm_tree, "kv_unify")
    pristine = (vllm_tree(VLLM_IMAGE_VERSION) / KV_FILE).read_text()
    specs = _hybrid_with_drafter(drafter_heads=3)  # 1536 B/token: does not divide the page
    max_page = specs["target.attn"].page_size_bytes
    assert max_page % specs["drafter.attn"].page_size_bytes != 0

    with pytest.raises(NotImplementedError):
        _unify_fns(pristine, patched=False)(specs)

    out = _unify_fns((root / KV_FILE).read_text(), patched=True)(specs)
    assert {s.page_size_bytes for s in out.values()} == {max_page}
    drafter = out["drafter.attn"]
    # Scaled block size kept (this is what keeps the drafter's KV stride right) ...
    assert drafter.block_size == 16 * (max_page // specs["drafter.attn"].page_size_bytes)
    # ... and only the remainder (< one original page) is padding.
    assert 0 < max_page - drafter.real_page_size_bytes < specs["drafter.attn"].page_size_bytes
    assert out["target.attn"] is specs["target.attn"] and out["target.gdn"] is specs["target.gdn"]


def test_kv_unify_grows_the_padded_mamba_page(vllm_tree, fake_kv_interface) -> None:
    root = patched_tree(vllm_tree, "kv_unify")
    pristine = (vllm_tree(VLLM_IMAGE_VERSION) / KV_FILE).read_text()
    specs = _hybrid_with_drafter(drafter_heads=8)  # 4 KiB/token: the drafter is the max
    specs["drafter.attn"] = replace(specs["drafter.attn"], block_size=2240)
    max_page = specs["drafter.attn"].page_size_bytes

    # The 0.23 failure the reference recipe hit: a padded page ignores the scaled block size.
    with pytest.raises(AssertionError):
        _unify_fns(pristine, patched=False)(specs)

    out = _unify_fns((root / KV_FILE).read_text(), patched=True)(specs)
    assert {s.page_size_bytes for s in out.values()} == {max_page}
    assert out["target.attn"].block_size == 4480 and out["target.attn"].page_size_padded is None
    assert out["target.gdn"].block_size == 4480  # in step with the attention group
    assert out["target.gdn"].page_size_padded == max_page


def test_kv_unify_leaves_dividing_layouts_as_vllm_does(vllm_tree, fake_kv_interface) -> None:
    root = patched_tree(vllm_tree, "kv_unify")
    pristine = (vllm_tree(VLLM_IMAGE_VERSION) / KV_FILE).read_text()
    specs = {
        "a": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128),
        "b": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128),
        "mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=512),
    }
    assert _unify_fns((root / KV_FILE).read_text(), True)(specs) == _unify_fns(pristine, False)(specs)
    bad = specs | {"mla": MLAAttentionSpec(block_size=16, num_kv_heads=3, head_size=128)}
    with pytest.raises(NotImplementedError):  # MLA cannot pad: still refused
        _unify_fns((root / KV_FILE).read_text(), True)(bad)


def _resolve(text: str):
    ns = run_code(cut(text, "resolve_kv_cache_block_sizes"), {
        "math": math, "MambaSpec": MambaSpec, "KVCacheConfig": object, "VllmConfig": object,
    })
    return ns["resolve_kv_cache_block_sizes"]


def _config(groups: list, prefix_caching: bool = True):
    ns = types.SimpleNamespace
    return (
        ns(kv_cache_groups=[ns(kv_cache_spec=s) for s in groups]),
        ns(
            cache_config=ns(block_size=2240, enable_prefix_caching=prefix_caching, hash_block_size=None),
            parallel_config=ns(decode_context_parallel_size=1, prefill_context_parallel_size=1),
            kv_transfer_config=None,
        ),
    )


def test_prefix_align_hashes_by_gcd_for_align_mode_mamba(vllm_tree) -> None:
    root = patched_tree(vllm_tree, "kv_unify", "prefix_align")
    pristine = (vllm_tree(VLLM_IMAGE_VERSION) / KV_FILE).read_text()
    # After kv_unify with a larger drafter page: every group scaled to 4480 tokens
    # except one attention group that stayed at 2240 -> mamba diverges from cache block.
    groups = [
        FullAttentionSpec(block_size=2240, num_kv_heads=2, head_size=256),
        MambaSpec(block_size=4480, state_bytes=1, mamba_cache_mode="align"),
        FullAttentionSpec(block_size=4480, num_kv_heads=8, head_size=128),
    ]
    kv_config, vllm_config = _config(groups)
    # 0.23 backs off to the LCM, which the 2240-token group cannot divide: the hybrid
    # coordinator's "block_size must be divisible by hash_block_size" assert fires.
    sched, hashed = _resolve(pristine)(kv_config, vllm_config)
    assert (sched, hashed) == (4480, 4480) and 2240 % hashed != 0
    sched, hashed = _resolve((root / KV_FILE).read_text())(kv_config, vllm_config)
    assert (sched, hashed) == (4480, 2240)
    assert all(g.block_size % hashed == 0 for g in groups)

    # Outside align mode the back-off stays (its state is not block-aligned).
    groups[1] = replace(groups[1], mamba_cache_mode="none")
    kv_config, vllm_config = _config(groups)
    assert _resolve((root / KV_FILE).read_text())(kv_config, vllm_config) == (4480, 4480)
    # Prefix caching off: untouched path.
    kv_config, vllm_config = _config(groups, prefix_caching=False)
    assert _resolve((root / KV_FILE).read_text())(kv_config, vllm_config) == (4480, 4480)


# --- inc_fp8_shared ------------------------------------------------------------------

INC_FILE = "vllm/model_executor/layers/quantization/inc.py"


class LinearBase:
    pass


class Fp8Config:
    def __init__(self, **kw):
        self.kw = kw


class Fp8LinearMethod:
    def __init__(self, cfg):
        self.cfg = cfg


def _safetensors_metadata(path: Path) -> dict:
    """What vLLM's parse_safetensors_file_metadata returns: the JSON header."""
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header


@pytest.fixture
def hybrid_checkpoint(tmp_path: Path) -> Path:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    pre = "model.language_model.layers.0.mlp"
    tensors = {
        f"{pre}.shared_expert.gate_proj.weight": torch.zeros(256, 128, dtype=torch.float8_e4m3fn),
        f"{pre}.shared_expert.gate_proj.weight_scale_inv": torch.ones(2, 1),
        f"{pre}.shared_expert.up_proj.weight": torch.zeros(256, 128, dtype=torch.float8_e4m3fn),
        f"{pre}.shared_expert.up_proj.weight_scale_inv": torch.ones(2, 1),
        f"{pre}.shared_expert.down_proj.weight": torch.zeros(128, 256, dtype=torch.float8_e4m3fn),
        f"{pre}.shared_expert.down_proj.weight_scale_inv": torch.ones(1, 2),
        f"{pre}.shared_expert_gate.weight": torch.zeros(1, 128, dtype=torch.bfloat16),
        "model.language_model.layers.0.self_attn.o_proj.qweight": torch.zeros(16, 128, dtype=torch.int32),
        "lm_head.weight": torch.zeros(64, 128, dtype=torch.bfloat16),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.fixture
def inc_helpers(vllm_tree, monkeypatch, hybrid_checkpoint):
    root = patched_tree(vllm_tree, "inc_fp8_shared")
    text = (root / INC_FILE).read_text()
    body = pl.def_source(text, "INCConfig.get_quant_method")
    assert "_sparkfleet_fp8_dense_method(self, layer, prefix)" in body.split("if prefix and self.extra_config")[0]
    assert "def maybe_update_config(" in pl.def_source(text, "INCConfig")

    stubs = {
        "vllm.logger": {"init_logger": lambda name: types.SimpleNamespace(info=lambda *a: None)},
        "vllm.transformers_utils.config": {
            "get_safetensors_params_metadata": lambda model, revision=None: _safetensors_metadata(hybrid_checkpoint)
        },
        "vllm.model_executor.layers.linear": {"LinearBase": LinearBase},
        "vllm.model_executor.layers.quantization.fp8": {"Fp8Config": Fp8Config, "Fp8LinearMethod": Fp8LinearMethod},
    }
    for name in ("vllm", "vllm.transformers_utils", "vllm.model_executor", "vllm.model_executor.layers",
                 "vllm.model_executor.layers.quantization"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, attrs in stubs.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    return run_code(helper_block(text, "inc_fp8_shared"), {"__name__": "inc"})


def test_inc_dispatches_fp8_for_the_shared_expert_only(inc_helpers) -> None:
    cfg = types.SimpleNamespace()
    inc_helpers["_sparkfleet_find_fp8_layers"](cfg, "/model")
    assert set(cfg._sparkfleet_fp8) == {
        "layers.0.mlp.shared_expert.gate_proj",
        "layers.0.mlp.shared_expert.up_proj",
        "layers.0.mlp.shared_expert.down_proj",
    }
    dispatch = inc_helpers["_sparkfleet_fp8_dense_method"]
    vllm_prefix = "language_model.model.layers.0.mlp"
    fused = dispatch(cfg, LinearBase(), f"{vllm_prefix}.shared_expert.gate_up_proj")
    assert isinstance(fused, Fp8LinearMethod)
    assert fused.cfg.kw == {
        "is_checkpoint_fp8_serialized": True, "activation_scheme": "dynamic", "weight_block_size": [128, 128]
    }
    assert isinstance(dispatch(cfg, LinearBase(), f"{vllm_prefix}.shared_expert.down_proj"), Fp8LinearMethod)
    # Everything else falls through to INC's own dispatch.
    assert dispatch(cfg, LinearBase(), f"{vllm_prefix}.shared_expert_gate") is None
    assert dispatch(cfg, LinearBase(), "language_model.model.layers.0.self_attn.o_proj") is None
    assert dispatch(cfg, LinearBase(), "language_model.model.layers.1.mlp.shared_expert.down_proj") is None
    assert dispatch(cfg, object(), f"{vllm_prefix}.shared_expert.down_proj") is None  # not a linear layer
    assert dispatch(types.SimpleNamespace(), LinearBase(), f"{vllm_prefix}.shared_expert.down_proj") is None


def test_inc_reads_the_cached_snapshot_when_offline(inc_helpers, monkeypatch, tmp_path) -> None:
    calls = []
    hub = types.ModuleType("huggingface_hub")
    hub.snapshot_download = lambda repo, **kw: calls.append((repo, kw)) or str(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SF_REVISION", "abc123")
    cfg = types.SimpleNamespace()
    inc_helpers["_sparkfleet_find_fp8_layers"](cfg, "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid")
    assert calls == [("bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid",
                      {"revision": "abc123", "allow_patterns": ["*.safetensors"], "local_files_only": True})]
    assert len(cfg._sparkfleet_fp8) == 3
    monkeypatch.setenv("SPARKFLEET_INC_FP8", "0")
    inc_helpers["_sparkfleet_find_fp8_layers"](cfg, "/model")
    assert cfg._sparkfleet_fp8 == {}


def test_inc_refuses_half_fp8_fused_layers_and_odd_scales(inc_helpers) -> None:
    cfg = types.SimpleNamespace(_sparkfleet_fp8={"layers.0.mlp.shared_expert.gate_proj": [128, 128]})
    with pytest.raises(ValueError, match="only"):
        inc_helpers["_sparkfleet_fp8_dense_method"](cfg, LinearBase(), "m.layers.0.mlp.shared_expert.gate_up_proj")
    from_metadata = inc_helpers["_sparkfleet_fp8_layers_from_metadata"]
    w = {"dtype": "F8_E4M3", "shape": [256, 128]}
    with pytest.raises(ValueError, match="block scale"):
        from_metadata({"model.layers.0.mlp.down_proj.weight": w})
    with pytest.raises(ValueError, match="128x128"):
        from_metadata({"model.layers.0.mlp.down_proj.weight": w,
                       "model.layers.0.mlp.down_proj.weight_scale_inv": {"dtype": "F32", "shape": [1, 1]}})
    assert from_metadata({"model.layers.0.mlp.down_proj.weight": {"dtype": "BF16", "shape": [1, 1]}}) == {}


# --- int8_lmhead ---------------------------------------------------------------------

LOGITS_FILE = "vllm/model_executor/layers/logits_processor.py"


class UnquantizedEmbeddingMethod:
    pass


class FakeTensor:
    def __init__(self, dtype, is_cuda=True, ndim=2):
        self.dtype, self.is_cuda, self._ndim = dtype, is_cuda, ndim

    def dim(self):
        return self._ndim


@pytest.fixture
def int8_ns(vllm_tree, monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    root = patched_tree(vllm_tree, "int8_lmhead")
    text = (root / LOGITS_FILE).read_text()
    body = pl.def_source(text, "LogitsProcessor._get_logits")
    # The stock call stays as the fallback, and nothing writes the (drafter-shared) weight.
    assert "logits = lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)" in body
    assert "lm_head.weight =" not in text and ".weight.data" not in text

    warnings: list[str] = []
    logger_mod = types.ModuleType("vllm.logger")
    logger_mod.init_logger = lambda name: types.SimpleNamespace(
        info=lambda *a: None, warning=lambda msg, *a: warnings.append(msg % a)
    )
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.logger", logger_mod)
    monkeypatch.setenv("SPARKFLEET_RUNTIME_DIR", str(tmp_path))
    ns = run_code(helper_block(text, "int8_lmhead"), {"torch": torch, "__name__": "logits_processor"})
    ns["warnings"] = warnings
    return ns


def _head(torch, dtype=None):
    return types.SimpleNamespace(weight=FakeTensor(dtype or torch.bfloat16), quant_method=UnquantizedEmbeddingMethod())


def test_int8_head_calls_the_kernel_with_the_shared_bf16_weight(int8_ns, tmp_path) -> None:
    import torch

    (tmp_path / "int8_lmhead.py").write_text("def int8_logits(hidden, weight):\n    return ('int8', hidden, weight)\n")
    head, hidden = _head(torch), FakeTensor(torch.bfloat16)
    proc = types.SimpleNamespace()
    result = int8_ns["_sparkfleet_int8_logits"](proc, head, hidden, None)
    assert result == ("int8", hidden, head.weight)
    # Cases that must take vLLM's stock path.
    f = int8_ns["_sparkfleet_int8_logits"]
    assert f(proc, head, hidden, embedding_bias=object()) is None
    assert f(proc, head, FakeTensor(torch.bfloat16, is_cuda=False), None) is None
    assert f(proc, head, FakeTensor(torch.float16), None) is None
    assert f(proc, _head(torch, torch.float16), hidden, None) is None
    assert f(types.SimpleNamespace(head_dtype=torch.float32), head, hidden, None) is None
    quantized = types.SimpleNamespace(weight=head.weight, quant_method=object())
    assert f(proc, quantized, hidden, None) is None


def test_int8_head_adapts_to_the_kernel_modules_api(int8_ns, tmp_path) -> None:
    """runtime/int8_lmhead.py may offer Int8LMHead.for_weight (cached per weight) and an
    int8_logits(hidden, q, scales) of another shape: the head is then built per weight."""
    import torch

    (tmp_path / "int8_lmhead.py").write_text(
        "built = []\n"
        "def int8_logits(hidden, q, scales):\n    raise AssertionError('wrong entry point')\n"
        "class Int8LMHead:\n"
        "    def __init__(self, w):\n        self.w = w\n"
        "    @classmethod\n"
        "    def for_weight(cls, w):\n        built.append(w)\n        return cls(w)\n"
        "    def __call__(self, hidden):\n        return ('head', hidden, self.w)\n"
    )

    class W(FakeTensor):
        shape, device = (8, 4), "cuda:0"

        def data_ptr(self):
            return 1234

    head = types.SimpleNamespace(weight=W(torch.bfloat16), quant_method=UnquantizedEmbeddingMethod())
    hidden = FakeTensor(torch.bfloat16)
    f = int8_ns["_sparkfleet_int8_logits"]
    assert f(types.SimpleNamespace(), head, hidden, None) == ("head", hidden, head.weight)
    assert f(types.SimpleNamespace(), head, hidden, None) == ("head", hidden, head.weight)
    assert len(sys.modules["sparkfleet_int8_lmhead"].built) == 1  # quantized once


def test_int8_head_falls_back_when_the_kernel_is_missing(int8_ns) -> None:
    import torch

    assert int8_ns["_sparkfleet_int8_logits"](types.SimpleNamespace(), _head(torch), FakeTensor(torch.bfloat16), None) is None
    assert any("kernel unavailable" in w for w in int8_ns["warnings"])


def test_int8_head_can_be_switched_off(int8_ns, tmp_path, monkeypatch) -> None:
    import torch

    (tmp_path / "int8_lmhead.py").write_text("def int8_logits(hidden, weight):\n    return 'int8'\n")
    monkeypatch.setenv("SPARKFLEET_INT8_LMHEAD", "0")
    assert int8_ns["_sparkfleet_int8_logits"](types.SimpleNamespace(), _head(torch), FakeTensor(torch.bfloat16), None) is None


# --- fla_shmem -----------------------------------------------------------------------

FLA_FILE = "vllm/model_executor/layers/fla/ops/utils.py"


@pytest.mark.parametrize(
    ("capability", "shared_mem", "stock", "patched"),
    [
        ((12, 1), 101_376, False, True),   # GB10: 99 KiB -> big tiles with the patch
        ((8, 9), 101_376, False, False),   # Ada keeps FLA's own choice
        ((9, 0), 232_448, True, True),     # Hopper unaffected
        ((12, 1), 49_152, False, False),   # a small sm12x part still gets small tiles
    ],
)
def test_fla_shared_memory_bar(vllm_tree, capability, shared_mem, stock, patched) -> None:
    import enum
    import functools

    root = patched_tree(vllm_tree, "fla_shmem")
    pristine = (vllm_tree(VLLM_IMAGE_VERSION) / FLA_FILE).read_text()
    text = (root / FLA_FILE).read_text()
    fake_torch = types.SimpleNamespace(
        version=types.SimpleNamespace(hip=None),
        cuda=types.SimpleNamespace(is_available=lambda: True, get_device_capability=lambda i=0: capability),
    )

    def check(src: str, with_helper: bool) -> bool:
        code = cut(src, "Backend", "check_shared_mem")
        if with_helper:
            code += "\n\n" + helper_block(src, "fla_shmem")
        ns = run_code(code, {"Enum": enum.Enum, "functools": functools, "torch": fake_torch,
                             "get_all_max_shared_mem": lambda: [shared_mem]})
        return ns["check_shared_mem"]()

    assert check(pristine, False) is stock
    assert check(text, True) is patched


INT8_PROBE = """
import importlib.util, sys, torch
text = open(sys.argv[1]).read()
ns = {"torch": torch}
exec(text[text.index("# [sparkfleet:int8_lmhead] helper"):], ns)
spec = importlib.util.spec_from_file_location("sparkfleet_int8_lmhead", sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
f = ns["_sparkfleet_int8_entry"](module)
torch.manual_seed(0)
w = torch.randn(300, 64, dtype=torch.bfloat16)
h = torch.randn(3, 64, dtype=torch.bfloat16)
w0 = w.clone()
out = f(h, w)
ref = h.float() @ w.float().t()
assert out.shape == (3, 300) and out.dtype == torch.bfloat16, (out.shape, out.dtype)
assert torch.equal(out.float().argmax(-1), ref.argmax(-1))
assert torch.equal(w, w0), "the shared bf16 weight was modified"
print("ok")
"""


def test_int8_head_with_the_project_kernel(vllm_tree, tmp_path) -> None:
    """The patched helper drives the real runtime/int8_lmhead.py (Triton interpreter, CPU)."""
    from support.runtime_env import RUNTIME_DIR

    kernel = RUNTIME_DIR / "int8_lmhead.py"
    if not kernel.is_file():
        pytest.skip("runtime/int8_lmhead.py not present")
    pytest.importorskip("triton")
    root = patched_tree(vllm_tree, "int8_lmhead")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", INT8_PROBE, str(root / LOGITS_FILE), str(kernel)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
