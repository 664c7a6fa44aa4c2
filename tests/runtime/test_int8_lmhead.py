"""int8 lm-head kernel on the CPU through Triton's interpreter.

CI must have torch and triton; without them these tests FAIL (not skip) with
the install commands, so a missing dependency can't pass silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Before the kernel is first built (it is built lazily on first launch).
os.environ["TRITON_INTERPRET"] = "1"

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
sys.path.insert(0, str(RUNTIME))

import int8_lmhead as m  # noqa: E402  (must import without torch/triton)
import int8_lmhead_kernels as kern  # noqa: E402

try:
    import torch
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on a broken CI image
    torch = None
    _MISSING = f"{exc}. Install: pip install torch==2.13.0 && pip install triton"
else:
    _MISSING = ""


@pytest.fixture(autouse=True)
def _require_torch_triton():
    if torch is None:
        pytest.fail(f"int8 lm-head tests need torch and triton: {_MISSING}", pytrace=False)


ULP = 2**-7  # one bf16 ulp, relative


def _weight(v: int, k: int, seed: int = 0) -> "torch.Tensor":
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(v, k, generator=g) * 0.02).bfloat16()


def _hidden(b: int, k: int, seed: int = 1) -> "torch.Tensor":
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, k, generator=g).bfloat16()


def test_quantize_rows_symmetric_per_row():
    w = _weight(37, 70)
    w[5] = 0  # all-zero row: no 0/0
    q, s = m.quantize_rows(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (37,)
    wf = w.float()
    amax = wf.abs().amax(1)
    nz = amax > 0
    torch.testing.assert_close(s[nz], amax[nz] / 127, rtol=0, atol=0)
    assert s[5] == 1 and not q[5].any()
    assert int(q.abs().max()) == 127  # the row max maps to +-127
    err = (m.dequantize_rows(q, s) - wf).abs()
    assert bool((err <= s[:, None] / 2 + 1e-9).all())  # round to nearest


@pytest.mark.parametrize("b", [1, 5, 13, 32])
@pytest.mark.parametrize("v,k", [(1000, 200), (4099, 96)])  # odd vocab; K not a multiple of the K tile
def test_matches_float_reference_of_dequantized_weight(b, v, k):
    w = _weight(v, k, seed=v + k)
    x = _hidden(b, k, seed=b)
    q, s = m.quantize_rows(w)
    y = m.int8_logits(x, m.pack_tiles(q), s)
    assert y.dtype == torch.bfloat16 and y.shape == (b, v)
    ref = x.float() @ m.dequantize_rows(q, s).t()
    # Only the final bf16 rounding and fp32 summation order separate the two:
    # one bf16 ulp (2^-7 relative), since Triton's interpreter truncates
    # fp32 -> bf16 where the GPU rounds to nearest.
    torch.testing.assert_close(y.float(), ref, rtol=ULP, atol=1e-3)


def test_even_tiles_and_vector_hidden():
    # V and K multiples of the tile: the unmasked (EVEN_V / EVEN_K) load path.
    w = _weight(1024, 128)
    q, s = m.quantize_rows(w)
    x = _hidden(3, 128)
    ref = x.float() @ m.dequantize_rows(q, s).t()
    t = m.pack_tiles(q)
    torch.testing.assert_close(m.int8_logits(x, t, s).float(), ref, rtol=ULP, atol=1e-3)
    y1 = m.int8_logits(x[1], t, s)  # [K] -> [V]
    assert y1.shape == (1024,)
    torch.testing.assert_close(y1.float(), ref[1], rtol=ULP, atol=1e-3)


def test_batch_above_one_tile():
    # B=70 > 64: a second program row over the batch (grid axis 1).
    w = _weight(300, 64)
    q, s = m.quantize_rows(w)
    x = _hidden(70, 64)
    ref = x.float() @ m.dequantize_rows(q, s).t()
    torch.testing.assert_close(m.int8_logits(x, m.pack_tiles(q), s).float(), ref, rtol=ULP, atol=1e-3)


@pytest.mark.parametrize("b", [5, 20, 40])
def test_f16_path_exact_over_any_row_magnitude(b):
    # The 32/64-row tiles cast the activations to fp16 first, each row scaled
    # by a power of two: rows far outside fp16's range (1e5 overflows it,
    # 1e-6 is subnormal there) still match the fp32 reference.
    w = _weight(700, 96, seed=b)
    q, s = m.quantize_rows(w)
    mags = torch.tensor([1e5, 1e-6, 1.0, 300.0] * 10)[:b, None]
    x = (_hidden(b, 96, seed=b).float() * mags).bfloat16()
    x[0, 3] = 0  # a zero inside a row
    if b > 6:
        x[6] = 0  # an all-zero row
    ref = x.float() @ m.dequantize_rows(q, s).t()
    for cfg in ("V64_K32_w4_s1_f16", "V64_K32_w4_s1_wa_f16"):  # both tensor-core kernels
        y = m.int8_logits(x, m.pack_tiles(q), s, config=kern.KernelConfig.parse(cfg))
        assert torch.isfinite(y.float()).all()
        if b > 6:
            assert not y[6].any()
        # rows span 11 decades: compare each in units of its own magnitude
        torch.testing.assert_close(y.float() / mags, ref / mags, rtol=ULP, atol=1e-3)


def test_fp16_hidden():
    w = _weight(500, 64)
    q, s = m.quantize_rows(w)
    x = _hidden(4, 64).half()
    ref = x.float() @ m.dequantize_rows(q, s).t()
    torch.testing.assert_close(m.int8_logits(x, m.pack_tiles(q), s).float(), ref, rtol=ULP, atol=1e-3)


def test_argmax_agreement_with_bf16_matmul():
    v, k = 4099, 256
    w = _weight(v, k, seed=7)
    q, s = m.quantize_rows(w)
    g = torch.Generator().manual_seed(3)
    rows = 64
    x_iid = torch.randn(rows, k, generator=g)
    # LM-like rows: the hidden state points at a target token, as in a
    # confident model, so the top logit stands out by a realistic margin.
    tgt = torch.randint(0, v, (rows,), generator=g)
    wt = w[tgt].float()
    x_lm = x_iid + 1.5 * wt / wt.norm(dim=1, keepdim=True) * k**0.5 * 0.1
    rates = {}
    for name, x in (("iid", x_iid.bfloat16()), ("lm", x_lm.bfloat16())):
        ref = (x @ w.t()).float().argmax(1)  # the bf16 matmul the kernel replaces
        got = torch.cat([m.int8_logits(x[i:i + 32], m.pack_tiles(q), s) for i in range(0, rows, 32)]).float().argmax(1)
        rates[name] = (got == ref).float().mean().item()
    # iid gaussian logits have top-2 gaps comparable to int8 noise (~97% at
    # the real shape); a peaked distribution must agree essentially always.
    print("argmax agreement", rates)
    assert rates["lm"] >= 0.98, rates
    assert rates["iid"] >= 0.85, rates


def test_lmhead_cache_quantizes_once_and_keeps_bf16_weight():
    m.Int8LMHead.clear_cache()
    w = _weight(600, 64)
    before = w.clone()
    head = m.Int8LMHead.for_weight(w)
    assert m.Int8LMHead.for_weight(w) is head  # the drafter sharing the head shares the int8 copy
    assert head.tiles is None  # lazy: nothing until the first forward
    x = _hidden(2, 64)
    y = head(x)
    q_first = head.tiles
    assert q_first is not None
    head(x)
    assert head.tiles is q_first  # quantized once
    assert head.weight is w
    assert torch.equal(w, before)  # never zeroed / freed / modified
    assert torch.equal(head.quantized()[0], m.pack_tiles(m.quantize_rows(w)[0]))
    torch.testing.assert_close(y.float(), x.float() @ m.dequantize_rows(*m.quantize_rows(w)).t(), rtol=ULP, atol=1e-3)
    other = m.Int8LMHead.for_weight(_weight(600, 64, seed=9))
    assert other is not head
    # large batches fall back to the bf16 matmul on the kept weight
    xb = _hidden(m.BF16_FALLBACK_ABOVE + 1, 64)
    torch.testing.assert_close(head(xb).float(), (xb @ w.t()).float())
    m.Int8LMHead.clear_cache()


def test_config_parse_and_env_override(monkeypatch):
    c = kern.KernelConfig.parse("V64_K128_w4_s3")
    assert (c.block_v, c.block_k, c.num_warps, c.num_stages, c.fast_cvt, c.gemv) == (64, 128, 4, 3, True, False)
    assert repr(kern.KernelConfig.parse("V128_K64_w8_s2_cvt")) == "V128_K64_w8_s2_cvt"
    assert kern.KernelConfig.parse("V32_K256_w4_s3_gemv").gemv
    assert repr(kern.KernelConfig.parse("V32_K256_w4_s3_gemv")) == "V32_K256_w4_s3_gemv"
    assert kern.KernelConfig.parse("V128_K128_w4_s3_f16").f16
    assert repr(kern.KernelConfig.parse("V128_K128_w4_s3_f16")) == "V128_K128_w4_s3_f16"
    c = kern.KernelConfig.parse("V128_K128_w4_s3_wa_f16")
    assert c.wa and c.f16 and not c.gemv and repr(c) == "V128_K128_w4_s3_wa_f16"
    for bad in ("V256_K128_w4_s3", "V128_K96_w4_s3", "V64_K128_w8_s3_wa"):  # > a tile; not tile-aligned; 8-row slices
        with pytest.raises(ValueError):
            kern.KernelConfig.parse(bad)
    monkeypatch.setenv("SF_INT8_LMHEAD_CONFIG", "V32_K32_w4_s1")
    assert repr(kern.pick_config(13)) == "V32_K32_w4_s1"
    w = _weight(100, 40)
    q, s = m.quantize_rows(w)
    x = _hidden(3, 40)
    torch.testing.assert_close(m.int8_logits(x, m.pack_tiles(q), s).float(), x.float() @ m.dequantize_rows(q, s).t(),
                               rtol=ULP, atol=1e-3)
    # a forced CUDA-core config also serves B > 1 (one launch per row)
    monkeypatch.setenv("SF_INT8_LMHEAD_CONFIG", "V32_K32_w4_s1_gemv")
    torch.testing.assert_close(m.int8_logits(x, m.pack_tiles(q), s).float(), x.float() @ m.dequantize_rows(q, s).t(),
                               rtol=ULP, atol=1e-3)


def test_dispatch_by_batch():
    tiles = {b: kern.batch_tile(b) for b in (1, 2, 13, 16, 17, 32, 33, 64, 70)}
    assert tiles == {1: 1, 2: 16, 13: 16, 16: 16, 17: 32, 32: 32, 33: 64, 64: 64, 70: 64}
    assert kern._TUNED[1].gemv and not any(kern._TUNED[t].gemv for t in (16, 32, 64))
    # fp16 activations where the decode, not DRAM, sets the time; not at
    # B <= 16, where the extra cast launch costs more than it saves
    assert [kern._TUNED[t].f16 for t in (1, 16, 32, 64)] == [False, False, True, True]
    # the weight as the A operand from 17 rows up; x as A at B <= 16
    assert [kern._TUNED[t].wa for t in (1, 16, 32, 64)] == [False, False, True, True]
    assert [kern.wa_columns(b) for b in (5, 17, 32, 33, 64, 70)] == [16, 32, 32, 64, 64, 64]


def test_same_source_compiles_for_gb10_without_hopper_instructions():
    # Cross-compiles (no GPU needed) what the launcher runs for each path, for
    # sm_121 (GB10) and sm_90 (H200): mma.sync only, never wgmma / TMA /
    # warp-specialization register moves.  Not under the interpreter (it
    # replaces @triton.jit), hence a subprocess.
    code = (
        f"import sys; sys.path.insert(0, {str(RUNTIME)!r})\n"
        "import int8_lmhead_kernels as kern\n"
        "for cc in (121, 90):\n"
        "    for b in (1, 16, 32, 64):\n"
        "        p = kern.compile_ptx(cc, b)\n"
        "        assert f'.target sm_{cc}' in p, (cc, b)\n"
        "        for op in ('wgmma', 'cp.async.bulk', 'setmaxnreg'):\n"
        "            assert op not in p, (cc, b, op)\n"
        "        assert ('mma.sync' in p) == (b > 1), (cc, b)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_shape_errors():
    q, s = m.quantize_rows(_weight(10, 200))
    t = m.pack_tiles(q)
    with pytest.raises(ValueError, match="pack_tiles"):
        m.int8_logits(_hidden(2, 100), t, s)  # K of another tile count
    with pytest.raises(ValueError, match="the weight's K is 200"):
        m.int8_logits(_hidden(2, 150), t, s, k=200)  # same tile count, another K
    with pytest.raises(ValueError, match="the weight's K is 200"):
        m.Int8LMHead(_weight(10, 200))(_hidden(2, 150))
    with pytest.raises(ValueError, match="pack_tiles"):
        m.int8_logits(_hidden(2, 200), t, torch.ones(129))  # V of another tile count
    with pytest.raises(ValueError, match="pack_tiles"):
        m.int8_logits(_hidden(2, 200), q, s)  # the row-major weight, not its tiles
    with pytest.raises(ValueError, match="pack_tiles"):
        m.int8_logits(_hidden(2, 200), t.float(), s)
    with pytest.raises(ValueError):
        m.pack_tiles(q.float())


def test_pack_tiles_layout():
    v, k = 300, 200  # neither a multiple of the 128 tile
    q, _ = m.quantize_rows(_weight(v, k))
    t = m.pack_tiles(q)
    assert t.dtype == torch.int8 and tuple(t.shape) == (3, 2, 128, 128) and t.is_contiguous()
    for r, c in ((0, 0), (127, 127), (128, 0), (5, 130), (299, 199), (200, 128)):
        assert t[r // 128, c // 128, r % 128, c % 128] == q[r, c]
    full = t.permute(0, 2, 1, 3).reshape(384, 256)
    assert torch.equal(full[:v, :k], q)
    assert not full[v:].any() and not full[:, k:].any()  # zero padding


def test_module_imports_without_torch_or_triton():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"sys.path.insert(0, {str(RUNTIME)!r})\n"
        "import int8_lmhead as m\n"
        "try:\n"
        "    m.quantize_rows(None)\n"
        "except ImportError as e:\n"
        "    assert 'pip install' in str(e), e\n"
        "    print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
