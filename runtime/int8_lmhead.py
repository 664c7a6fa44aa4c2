"""int8 lm-head: per-row symmetric int8 weights, one batched Triton GEMV/GEMM.

The 248320 x 3072 lm-head is the largest dense weight read every decode step
(1.5 GB in bf16).  Stored as int8 with one scale per vocab row it is half the
bytes; since decode is bandwidth-bound, the logits cost about half the time.

    q, scales = quantize_rows(weight)          # once
    logits = int8_logits(hidden, q, scales)    # [B, V] bf16, B = 1 .. 64+

    head = Int8LMHead.for_weight(weight)       # cached, quantizes on first use
    logits = head(hidden)

Design notes (why, not what):
* Scales are float32.  They cost 4 bytes per row, 1 MB for the whole head,
  0.13% of the int8 bytes, so their bandwidth price is nil; fp16 scales would
  add a per-row relative error up to 2^-11 that moves whole rows' logits
  against each other (the very comparison argmax makes), and rows with tiny
  norms (unused / padded vocab entries) give max|row|/127 below fp16's normal
  range, where precision collapses.  fp32 has neither problem.
* One launch covers the whole batch (B <= 64 per program row): the grid
  tiles the vocab (rows of W); each program streams its [BLOCK_V, K] int8
  slab once.  Decode is bandwidth-bound, so what matters is the work per
  weight byte between DRAM and the multiply:
  - B >= 2: tensor cores, fp32 accumulation, computed as out = x W^T with the
    batch as the M side (one to four 16-row mma.sync tiles) and the weight as
    the B operand.  Triton then loads the int8 tile from shared memory
    straight into operand registers and decodes it there; bf16 weights never
    go back to shared memory (the old W-as-A kernel wrote them back: 6 B of
    shared traffic per weight byte instead of 2, 226 us instead of ~185 on
    the H200).  M = 16 also means mma.sync on every target, no wgmma/TMA:
    the H200 runs what a GB10 (sm_121) runs.
  - B = 1: CUDA cores, one fp32 FMA per weight byte, no padding to 16 rows.
* The per-row scale is applied once to the fp32 accumulator (exact for a
  per-row scale), then cast to bf16.
* The bf16 weight is never freed or modified: the DFlash drafter shares the
  target's lm_head (the reference recipe saw garbage drafts when a port zeroed it).

torch and triton are imported lazily so this module imports anywhere (the
runtime patch loader, CPU-only tests of other modules).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["quantize_rows", "int8_logits", "Int8LMHead", "pick_config", "KernelConfig", "compile_ptx"]

INSTALL_HINT = (
    "int8_lmhead needs torch and triton: `pip install torch==2.13.0 && pip install triton` "
    "(CPU: run with TRITON_INTERPRET=1)"
)

# Batches above this go to the bf16 matmul in Int8LMHead: there the product is
# compute-bound and cuBLAS on the kept bf16 weight wins (prefill logprobs etc.).
BF16_FALLBACK_ABOVE = 64


def _imports() -> tuple[Any, Any, Any]:
    try:
        import torch
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - exercised only without deps
        raise ImportError(INSTALL_HINT) from exc
    return torch, triton, tl


# --------------------------------------------------------------------------- quantization


def quantize_rows(weight: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Symmetric per-row int8: scale = max|row| / 127, q = round(w / scale).

    Returns (q int8 [V, K] contiguous, scales float32 [V]).  Works in chunks of
    rows so the fp32 temporaries stay small (the real head is 1.5 GB in bf16).
    All-zero rows get scale 1 (q = 0 anyway) to avoid 0/0.
    """
    torch, _, _ = _imports()
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got {tuple(weight.shape)}")
    v, k = weight.shape
    q = torch.empty((v, k), dtype=torch.int8, device=weight.device)
    scales = torch.empty((v,), dtype=torch.float32, device=weight.device)
    chunk = max(1, (64 << 20) // max(1, k * 4))  # ~64 MiB of fp32 per step
    with torch.no_grad():
        for s in range(0, v, chunk):
            w = weight[s:s + chunk].float()
            amax = w.abs().amax(dim=1)
            sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
            q[s:s + chunk] = torch.round(w / sc[:, None]).clamp_(-127, 127).to(torch.int8)
            scales[s:s + chunk] = sc
    return q, scales


def dequantize_rows(q: "torch.Tensor", scales: "torch.Tensor") -> "torch.Tensor":
    """float32 reference of the quantized weight (tests, benchmarks)."""
    return q.float() * scales.float()[:, None]


# --------------------------------------------------------------------------- kernel


class KernelConfig:
    """Tile sizes and launch parameters of one path.

    gemv=True is the CUDA-core path (B = 1); otherwise the tensor-core path
    with sub = 1, 2 or 4 batch tiles of 16 rows per program (from B at launch).
    """

    __slots__ = ("block_v", "block_k", "num_warps", "num_stages", "fast_cvt", "gemv")

    def __init__(self, block_v: int, block_k: int, num_warps: int, num_stages: int,
                 fast_cvt: bool = True, gemv: bool = False) -> None:
        self.block_v, self.block_k, self.num_warps, self.num_stages = block_v, block_k, num_warps, num_stages
        self.fast_cvt, self.gemv = fast_cvt, gemv

    def __repr__(self) -> str:
        return (f"V{self.block_v}_K{self.block_k}_w{self.num_warps}_s{self.num_stages}"
                + ("_gemv" if self.gemv else "") + ("" if self.fast_cvt else "_cvt"))

    @classmethod
    def parse(cls, s: str) -> "KernelConfig":
        """'V128_K256_w4_s2[_gemv][_cvt]' (the repr) -> config; used by SF_INT8_LMHEAD_CONFIG."""
        items = s.strip().split("_")
        flags = {"gemv", "cvt"}
        parts = {p[0]: int(p[1:]) for p in items if p not in flags}
        return cls(parts["V"], parts["K"], parts["w"], parts["s"], fast_cvt="cvt" not in items, gemv="gemv" in items)


# Tuned on an H200 at [248320, 3072] (benchmarks/int8_lmhead_bench.py), keyed by
# the padded batch (1 = the CUDA-core path).  The interpreter gets small tiles
# so CPU tests stay fast.
_TUNED: dict[int, KernelConfig] = {
    1: KernelConfig(32, 256, 4, 3, gemv=True),
    16: KernelConfig(128, 256, 4, 2),
    32: KernelConfig(128, 128, 4, 4),
    64: KernelConfig(128, 128, 4, 3),
}
# For parts with less shared memory per block than the H200 (GB10 / sm_121
# has ~100 KB): tried once when a tuned tile does not fit.
_SMALL = KernelConfig(64, 128, 4, 2)
_INTERPRET = {1: KernelConfig(32, 64, 4, 1, gemv=True), 0: KernelConfig(64, 64, 4, 1)}

_kernels: "tuple[Any, Any] | None" = None
_kernel_lock = threading.Lock()


def _get_kernels() -> "tuple[Any, Any]":
    """(tensor-core kernel, CUDA-core kernel), built once."""
    global _kernels
    if _kernels is not None:
        return _kernels
    with _kernel_lock:
        if _kernels is None:
            _kernels = _build_kernels()
    return _kernels


# int8 x4 -> bf16 x4 (8 integer/bf16x2 ops per 4 values).  Each byte b goes into
# the low mantissa of bf16 128.0 twice: once as 0x43 | (b & 0x7F) (= 128 + |low
# 7 bits|) and once as 0x43 | (b & 0x80) (= 128 or 256 by the sign bit); their
# difference is exactly the signed value.  sub.bf16x2 needs sm_90+.
_DECODE_BF16 = (
    "{\n.reg .b32 t0, t1, a0, a1, b0, b1;\n"
    "prmt.b32 t0, $2, 0x43, 0x4140;\nprmt.b32 t1, $2, 0x43, 0x4342;\n"
    "and.b32 a0, t0, 0x437F437F;\nand.b32 b0, t0, 0x43804380;\n"
    "and.b32 a1, t1, 0x437F437F;\nand.b32 b1, t1, 0x43804380;\n"
    "sub.bf16x2 $0, a0, b0;\nsub.bf16x2 $1, a1, b1;\n}\n"
)
# int8 x4 -> fp32 x4 (2.25 ops per value; I2F runs at 1/4 rate, too slow to
# keep up with DRAM): float(0x4B000000 | (b ^ 0x80)) = 2^23 + 128 + b exactly.
_DECODE_F32 = (
    "{\n.reg .b32 t;\nxor.b32 t, $4, 0x80808080;\n"
    "prmt.b32 $0, t, 0x4B000000, 0x7440;\nprmt.b32 $1, t, 0x4B000000, 0x7441;\n"
    "prmt.b32 $2, t, 0x4B000000, 0x7442;\nprmt.b32 $3, t, 0x4B000000, 0x7443;\n"
    "sub.f32 $0, $0, 0f4B000080;\nsub.f32 $1, $1, 0f4B000080;\n"
    "sub.f32 $2, $2, 0f4B000080;\nsub.f32 $3, $3, 0f4B000080;\n}\n"
)


def _build_kernels() -> "tuple[Any, Any]":
    _, triton, tl = _imports()
    # Triton kernels read module globals only as constexpr; set here so the
    # module itself imports without triton.
    globals()["_DECODE_BF16_ASM"] = tl.constexpr(_DECODE_BF16)
    globals()["_DECODE_F32_ASM"] = tl.constexpr(_DECODE_F32)

    @triton.jit
    def _int8_lmhead_mma(
        x_ptr, w_ptr, s_ptr, out_ptr, B, V, K, stride_xb, stride_wv, stride_ob,
        SUB: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_V: tl.constexpr, DOT_F32: tl.constexpr, FAST_CVT: tl.constexpr,
    ):
        # out^T = W x^T computed as out = x W^T with the batch as the M side
        # (16 rows per mma) and the weight as the B operand: Triton then loads
        # the int8 tile from shared memory straight into the mma operand
        # registers (8-byte shared loads), decodes it there, and never writes
        # bf16 weights back to shared memory.  M = 16 also keeps every target
        # on mma.sync (no wgmma): the same code path on Hopper and on sm_12x.
        pid_v = tl.program_id(0)
        b0 = tl.program_id(1) * (16 * SUB)
        offs_b = tl.arange(0, 16)
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        # int64 row offsets: V*K overflows int32 past ~700k x 3072.
        w_ptrs = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv + offs_k[None, :]
        x_ptrs = x_ptr + (b0 + offs_b).to(tl.int64)[:, None] * stride_xb + offs_k[None, :]
        m0 = (b0 + offs_b)[:, None] < B
        m1 = (b0 + 16 + offs_b)[:, None] < B
        m2 = (b0 + 32 + offs_b)[:, None] < B
        m3 = (b0 + 48 + offs_b)[:, None] < B
        acc0 = tl.zeros((16, BLOCK_V), dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            if EVEN_K:
                if EVEN_V:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=v_mask[:, None], other=0)
            else:
                w = tl.load(w_ptrs, mask=v_mask[:, None] & k_ok[None, :], other=0)
            if DOT_F32:
                # Triton's CPU interpreter multiplies bf16 as raw uint16 and
                # casts int8 -> bf16 by bit pattern (seen in 3.6 and 3.9), so
                # under TRITON_INTERPRET the same tiles are multiplied in fp32.
                wt = tl.trans(w.to(tl.float32))
            elif FAST_CVT:
                wt = tl.trans(tl.inline_asm_elementwise(_DECODE_BF16_ASM, "=r,=r,r", [w], dtype=tl.bfloat16,  # noqa: F821
                                                        is_pure=True, pack=4))
            else:
                # int8 values are exact in bf16/fp16 (|q| <= 127 < 2^8).
                wt = tl.trans(w.to(x_ptr.dtype.element_ty))
            if EVEN_K:  # row masks only: constant along K, so the x loads stay vectorized
                x0 = tl.load(x_ptrs, mask=m0, other=0.0)
                if SUB > 1:
                    x1 = tl.load(x_ptrs + 16 * stride_xb, mask=m1, other=0.0)
                if SUB > 2:
                    x2 = tl.load(x_ptrs + 32 * stride_xb, mask=m2, other=0.0)
                    x3 = tl.load(x_ptrs + 48 * stride_xb, mask=m3, other=0.0)
            else:
                x0 = tl.load(x_ptrs, mask=m0 & k_ok[None, :], other=0.0)
                if SUB > 1:
                    x1 = tl.load(x_ptrs + 16 * stride_xb, mask=m1 & k_ok[None, :], other=0.0)
                if SUB > 2:
                    x2 = tl.load(x_ptrs + 32 * stride_xb, mask=m2 & k_ok[None, :], other=0.0)
                    x3 = tl.load(x_ptrs + 48 * stride_xb, mask=m3 & k_ok[None, :], other=0.0)
            if DOT_F32:
                acc0 = tl.dot(x0.to(tl.float32), wt, acc0, input_precision="ieee")
                if SUB > 1:
                    acc1 = tl.dot(x1.to(tl.float32), wt, acc1, input_precision="ieee")
                if SUB > 2:
                    acc2 = tl.dot(x2.to(tl.float32), wt, acc2, input_precision="ieee")
                    acc3 = tl.dot(x3.to(tl.float32), wt, acc3, input_precision="ieee")
            else:
                acc0 = tl.dot(x0, wt, acc0)
                if SUB > 1:
                    acc1 = tl.dot(x1, wt, acc1)
                if SUB > 2:
                    acc2 = tl.dot(x2, wt, acc2)
                    acc3 = tl.dot(x3, wt, acc3)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        # The per-row scale is exact to apply once to the fp32 accumulator.
        scale = tl.load(s_ptr + offs_v, mask=v_mask, other=0.0)[None, :]
        o_ptrs = out_ptr + (b0 + offs_b).to(tl.int64)[:, None] * stride_ob + offs_v[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(o_ptrs, (acc0 * scale).to(ty), mask=m0 & v_mask[None, :])
        if SUB > 1:
            tl.store(o_ptrs + 16 * stride_ob, (acc1 * scale).to(ty), mask=m1 & v_mask[None, :])
        if SUB > 2:
            tl.store(o_ptrs + 32 * stride_ob, (acc2 * scale).to(ty), mask=m2 & v_mask[None, :])
            tl.store(o_ptrs + 48 * stride_ob, (acc3 * scale).to(ty), mask=m3 & v_mask[None, :])

    @triton.jit
    def _int8_lmhead_gemv(
        x_ptr, w_ptr, s_ptr, out_ptr, V, K, stride_wv,
        BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
        FAST_CVT: tl.constexpr,
    ):
        # B = 1 on CUDA cores: decode to fp32 in the load layout (16 bytes per
        # thread), FMA against x, reduce each K step.  One FMA per weight byte
        # is cheaper than padding the batch to an mma tile.
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        w_ptrs = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv + offs_k[None, :]
        acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            if EVEN_K:
                if EVEN_V:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=v_mask[:, None], other=0)
                x = tl.load(x_ptr + k0 + offs_k)
            else:
                w = tl.load(w_ptrs, mask=v_mask[:, None] & k_ok[None, :], other=0)
                x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            if FAST_CVT:
                wf = tl.inline_asm_elementwise(_DECODE_F32_ASM, "=r,=r,=r,=r,r", [w], dtype=tl.float32,  # noqa: F821
                                               is_pure=True, pack=4)
            else:
                wf = w.to(tl.float32)
            acc += tl.sum(wf * x.to(tl.float32)[None, :], 1)
            w_ptrs += BLOCK_K
        scale = tl.load(s_ptr + offs_v, mask=v_mask, other=0.0)
        tl.store(out_ptr + offs_v, (acc * scale).to(out_ptr.dtype.element_ty), mask=v_mask)

    return _int8_lmhead_mma, _int8_lmhead_gemv


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def batch_tile(b: int) -> int:
    """Padded batch handled by one program: 1 (CUDA cores), else 16, 32 or 64."""
    if b <= 1:
        return 1
    t = 16
    while t < b and t < 64:
        t *= 2
    return t


def pick_config(b: int) -> KernelConfig:
    env = os.environ.get("SF_INT8_LMHEAD_CONFIG")
    if env:
        return KernelConfig.parse(env)
    if _interpreting():
        return _INTERPRET[1 if b <= 1 else 0]
    return _TUNED[batch_tile(b)]


def _fast_cvt_ok(x: "torch.Tensor") -> bool:
    """The PTX decodes need a CUDA device (sub.bf16x2: sm_90+); bf16 for the mma path."""
    torch, _, _ = _imports()
    if not x.is_cuda or getattr(torch.version, "hip", None) or _interpreting():
        return False
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx] >= (9, 0)


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _launch(x: "torch.Tensor", q: "torch.Tensor", scales: "torch.Tensor", out: "torch.Tensor",
            cfg: KernelConfig) -> None:
    torch, triton, _ = _imports()
    b, k = x.shape
    v = q.shape[0]
    mma, gemv = _get_kernels()
    even = dict(EVEN_K=(k % cfg.block_k == 0), EVEN_V=(v % cfg.block_v == 0))
    fast = cfg.fast_cvt and _fast_cvt_ok(x)
    grid_v = triton.cdiv(v, cfg.block_v)
    if cfg.gemv:
        for i in range(b):  # b == 1 unless a gemv config is forced
            gemv[(grid_v,)](x[i], q, scales, out[i], v, k, q.stride(0),
                            BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, FAST_CVT=fast, **even,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    sub = max(1, min(4, batch_tile(b) // 16))
    mma[(grid_v, triton.cdiv(b, 16 * sub))](
        x, q, scales, out, b, v, k, x.stride(0), q.stride(0), out.stride(0),
        SUB=sub, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, DOT_F32=_interpreting(),
        FAST_CVT=fast and x.dtype == torch.bfloat16, **even,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def compile_ptx(capability: int, b: int, k: int = 3072, v: int = 248320,
                config: KernelConfig | None = None) -> str:
    """PTX of the kernel that `int8_logits` launches for batch b, compiled for a
    card of this compute capability (e.g. 121 for GB10, 90 for H200) without
    one: shows which instructions each target gets (mma.sync, never wgmma)."""
    _, triton, _ = _imports()
    from triton.backends.compiler import GPUTarget

    cfg = config or KernelConfig.parse(repr(_TUNED[batch_tile(b)]))
    mma, gemv = _get_kernels()
    even = dict(EVEN_K=(k % cfg.block_k == 0), EVEN_V=(v % cfg.block_v == 0))
    if cfg.gemv:
        fn, ptrs, ints = gemv, ("x_ptr", "w_ptr", "s_ptr", "out_ptr"), ("V", "K", "stride_wv")
        consts = dict(BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, FAST_CVT=cfg.fast_cvt, **even)
    else:
        fn, ptrs = mma, ("x_ptr", "w_ptr", "s_ptr", "out_ptr")
        ints = ("B", "V", "K", "stride_xb", "stride_wv", "stride_ob")
        consts = dict(SUB=max(1, min(4, batch_tile(b) // 16)), BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
                      DOT_F32=False, FAST_CVT=cfg.fast_cvt, **even)
    types = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": "*bf16"}
    sig = {**{n: types[n] for n in ptrs}, **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
    # What the launcher specializes on the real tensors: 16-byte aligned
    # pointers and strides/sizes divisible by 16.
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs + ints if n != "B"}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return compiled.asm["ptx"]


def int8_logits(
    hidden: "torch.Tensor",
    q: "torch.Tensor",
    scales: "torch.Tensor",
    out: "torch.Tensor | None" = None,
    config: KernelConfig | None = None,
) -> "torch.Tensor":
    """logits[B, V] = hidden[B, K] @ (q * scales[:, None])^T, bf16 out, fp32 accumulate.

    hidden: bf16 (or fp16) [B, K] or [K]; q: int8 [V, K] with unit stride along K;
    scales: fp32 [V].  One kernel launch for the whole batch.
    """
    torch, _, _ = _imports()
    squeeze = hidden.dim() == 1
    x = hidden.unsqueeze(0) if squeeze else hidden
    if x.dim() != 2:
        raise ValueError(f"hidden must be [B, K] or [K], got {tuple(hidden.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        x = x.to(torch.bfloat16)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if q.dtype != torch.int8 or q.dim() != 2 or q.stride(1) != 1:
        raise ValueError("q must be a row-major int8 [V, K] tensor")
    b, k = x.shape
    v = q.shape[0]
    if q.shape[1] != k or scales.shape != (v,):
        raise ValueError(f"shape mismatch: hidden {tuple(x.shape)}, q {tuple(q.shape)}, scales {tuple(scales.shape)}")
    if scales.dtype != torch.float32:
        scales = scales.float()
    if out is None:
        out = torch.empty((b, v), dtype=torch.bfloat16, device=x.device)
    if b == 0:
        return out[0] if squeeze else out
    cfg = config or pick_config(b)
    try:
        _launch(x, q, scales, out, cfg)
    except Exception as exc:
        # The table is tuned on an H200 (228 KB of shared memory per SM); a part
        # with less (GB10 / sm_121 has ~100 KB) may refuse the larger tiles.
        # Fall back to small tiles once and remember it for this batch tile.
        if config is not None or type(exc).__name__ != "OutOfResources" or cfg.gemv:
            raise
        _TUNED[batch_tile(b)] = _SMALL
        _launch(x, q, scales, out, _SMALL)
    return out[0] if squeeze else out


# --------------------------------------------------------------------------- cache


class Int8LMHead:
    """Quantize-once wrapper around a (bf16) lm-head weight.

    `for_weight(w)` returns the same object for the same storage/shape/dtype, so
    the target and a drafter that shares the head share one int8 copy.  The
    int8 copy is made lazily on first call (after weights are loaded and any
    post-load processing has run, not at construction).  The bf16 weight is
    referenced, never freed or modified.
    """

    _cache: dict[tuple, "Int8LMHead"] = {}
    _lock = threading.Lock()

    def __init__(self, weight: "torch.Tensor") -> None:
        self.weight = weight
        self.q: "torch.Tensor | None" = None
        self.scales: "torch.Tensor | None" = None
        self._qlock = threading.Lock()

    @staticmethod
    def _key(weight: "torch.Tensor") -> tuple:
        return (weight.data_ptr(), tuple(weight.shape), str(weight.dtype), str(weight.device))

    @classmethod
    def for_weight(cls, weight: "torch.Tensor") -> "Int8LMHead":
        key = cls._key(weight)
        with cls._lock:
            head = cls._cache.get(key)
            if head is None:
                head = cls._cache[key] = cls(weight)
            return head

    @classmethod
    def clear_cache(cls) -> None:
        with cls._lock:
            cls._cache.clear()

    def quantized(self) -> tuple["torch.Tensor", "torch.Tensor"]:
        if self.q is None:
            torch, _, _ = _imports()
            if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
                # Quantizing inside a CUDA graph capture would record the
                # quantization into the graph and replay it every step.
                raise RuntimeError("Int8LMHead: first use during CUDA graph capture; "
                                   "call .quantized() (or run one eager forward) before capturing")
            with self._qlock:
                if self.q is None:
                    q, s = quantize_rows(self.weight.detach())
                    self.scales = s
                    self.q = q
        assert self.q is not None and self.scales is not None
        return self.q, self.scales

    def __call__(self, hidden: "torch.Tensor") -> "torch.Tensor":
        rows = hidden.shape[0] if hidden.dim() == 2 else 1
        if rows > BF16_FALLBACK_ABOVE:
            return hidden.to(self.weight.dtype) @ self.weight.t()
        q, s = self.quantized()
        return int8_logits(hidden, q, s)
