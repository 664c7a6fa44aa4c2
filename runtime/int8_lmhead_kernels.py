"""Triton kernels of the int8 lm-head, and the tile configurations they launch with.

What ``int8_lmhead`` launches on the 128 x 128 int8 tiles of ``pack_tiles`` (TILE
here): the kernel source, the PTX decodes, the configuration table tuned per batch
tile, and ``compile_ptx`` to see what a target gets without a GPU.  The table and the
source change together: a tile that suits one kernel's register and shared-memory
use does not suit another's.

Design notes (why, not what):
* One launch covers the whole batch; the grid tiles the vocab (rows of W) and
  each program streams its rows once.  Decode is bandwidth-bound, so what
  matters is the work per weight byte between DRAM and the multiply:
  - B = 1: CUDA cores, one fp32 FMA per weight byte, no padding to 16 rows.
  - B <= 16: tensor cores, computed as out = x W^T with the batch as the M
    side of an m16n8k16 mma.sync and the weight as the B operand: Triton
    loads the int8 tile from shared memory straight into operand registers
    and decodes it there; bf16 weights never go back to shared memory.
  - B = 17 .. 64: the weight as the A operand (out^T = W x^T), as a batched
    (rank-3) dot over four 32-row slices, one per warp.  Rank-3 dots stay on
    mma.sync (no wgmma on Hopper), each warp decodes only its own rows, and
    the decoded weights sit in registers as whole A fragments; with x as A,
    ptxas re-assembled x's fragments with ~2.7 register moves per mma (Triton
    orders k for the int8 operand).  H200: B = 64 316 -> 299 us, B = 32
    204 -> 201 us (both with the tiled layout).
  - Batch tiles of 32 and 64 rows cast the activations to fp16 first (one
    small kernel, ~3 us) so the weight decodes to fp16 in 5 instructions
    per 4 bytes instead of bf16's 8 (fp16's 10-bit mantissa holds 1024 + u
    exactly; bf16's 7 bits need the two-part trick).  Each row is scaled by
    a power of two into fp16's range first (max|row| in [2^14, 2^15)), so
    the cast is exact for every bf16 value down to 2^-28 of the row's max
    and cannot overflow; the epilogue multiplies the power of two back out,
    exactly.  At B <= 16 the extra launch costs more than it saves.
  All of it is mma.sync (or CUDA cores): the H200 runs what a GB10 (sm_121)
  runs.
* The per-row scale is applied once to the fp32 accumulator (exact for a
  per-row scale), then cast to bf16.

torch and triton are imported lazily (``torch_triton``), as in ``int8_lmhead``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["TILE", "KernelConfig", "batch_tile", "pick_config", "use_small_tiles", "wa_columns", "get_kernels",
           "compile_ptx", "interpreting", "torch_triton"]

INSTALL_HINT = (
    "int8_lmhead needs torch and triton: `pip install torch==2.13.0 && pip install triton` "
    "(CPU: run with TRITON_INTERPRET=1)"
)

# Weight tile side (rows and columns): the stored layout of the int8 weight.
TILE = 128


def torch_triton() -> tuple[Any, Any, Any]:
    """(torch, triton, triton.language), or an ImportError that says what to install."""
    try:
        import torch
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - exercised only without deps
        raise ImportError(INSTALL_HINT) from exc
    return torch, triton, tl


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET), not compiled kernels."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class KernelConfig:
    """Tile sizes and launch parameters of one path.

    gemv=True is the CUDA-core path (B = 1); wa=True the weight-as-A path (one
    32-row slice of the BLOCK_V rows per warp, batch tile of 16..64 columns);
    otherwise x-as-A with 16-row batch tiles.  f16: activations cast to fp16
    first.  BLOCK_V must divide 128 (a program's rows lie in one tile row).
    """

    __slots__ = ("block_v", "block_k", "num_warps", "num_stages", "fast_cvt", "gemv", "wa", "f16")

    def __init__(self, block_v: int, block_k: int, num_warps: int, num_stages: int,
                 fast_cvt: bool = True, gemv: bool = False, f16: bool = False, wa: bool = False) -> None:
        if TILE % block_v or (block_k % TILE and TILE % block_k):
            raise ValueError(f"block_v must divide {TILE} and block_k divide or be a multiple of it "
                             f"(got V{block_v}_K{block_k})")
        if wa and (gemv or block_v % num_warps or block_v // num_warps < 16):
            raise ValueError(f"a wa config needs block_v / num_warps >= 16 rows per warp (got V{block_v}_w{num_warps})")
        self.block_v, self.block_k, self.num_warps, self.num_stages = block_v, block_k, num_warps, num_stages
        self.fast_cvt, self.gemv, self.wa, self.f16 = fast_cvt, gemv, wa, f16 and not gemv

    def __repr__(self) -> str:
        return (f"V{self.block_v}_K{self.block_k}_w{self.num_warps}_s{self.num_stages}"
                + ("_gemv" if self.gemv else "") + ("_wa" if self.wa else "") + ("_f16" if self.f16 else "")
                + ("" if self.fast_cvt else "_cvt"))

    @classmethod
    def parse(cls, s: str) -> "KernelConfig":
        """'V128_K128_w4_s3[_gemv|_wa][_f16][_cvt]' (the repr) -> config; used by SF_INT8_LMHEAD_CONFIG."""
        items = s.strip().split("_")
        flags = {"gemv", "wa", "cvt", "f16"}
        parts = {p[0]: int(p[1:]) for p in items if p not in flags}
        return cls(parts["V"], parts["K"], parts["w"], parts["s"], fast_cvt="cvt" not in items, gemv="gemv" in items,
                   f16="f16" in items, wa="wa" in items)


# Tuned on an H200 at [248320, 3072] (benchmarks/int8_lmhead_bench.py), keyed by
# the padded batch (1 = the CUDA-core path; f16 = activations cast to fp16
# first, see the design notes).  The interpreter gets small tiles so CPU tests
# stay fast.
_TUNED: dict[int, KernelConfig] = {
    1: KernelConfig(32, 256, 4, 3, gemv=True),
    16: KernelConfig(128, 128, 4, 3),
    32: KernelConfig(128, 128, 4, 3, wa=True, f16=True),
    64: KernelConfig(128, 128, 4, 3, wa=True, f16=True),
}
# For parts with less shared memory per block than the H200 (GB10 / sm_121
# has ~100 KB): tried once when a tuned tile does not fit.
_SMALL = KernelConfig(64, 128, 4, 2)
_INTERPRET = {1: KernelConfig(32, 64, 4, 1, gemv=True), 16: KernelConfig(64, 64, 4, 1),
              32: KernelConfig(64, 64, 4, 1, wa=True, f16=True), 64: KernelConfig(64, 64, 4, 1, wa=True, f16=True)}

_kernels: "tuple[Any, Any, Any, Any] | None" = None
_kernel_lock = threading.Lock()


def get_kernels() -> "tuple[Any, Any, Any, Any]":
    """(x-as-A tensor-core kernel, weight-as-A kernel, CUDA-core kernel, fp16 row cast), built once."""
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
# int8 x4 -> fp16 x4 (5 ops per 4 values): u = b ^ 0x80 goes into the low byte
# of fp16 1024.0 (0x64uu = 1024 + u, exact: fp16 has 10 mantissa bits), then
# 1024 + 128 comes off.
_DECODE_F16 = (
    "{\n.reg .b32 t, c;\nxor.b32 t, $2, 0x80808080;\nmov.b32 c, 0x64806480;\n"
    "prmt.b32 $0, t, 0x64646464, 0x5140;\nprmt.b32 $1, t, 0x64646464, 0x5342;\n"
    "sub.f16x2 $0, $0, c;\nsub.f16x2 $1, $1, c;\n}\n"
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


def _build_kernels() -> "tuple[Any, Any, Any, Any]":
    _, triton, tl = torch_triton()
    # Triton kernels read module globals only as constexpr; set here so the
    # module itself imports without triton.
    globals()["_DECODE_BF16_ASM"] = tl.constexpr(_DECODE_BF16)
    globals()["_DECODE_F16_ASM"] = tl.constexpr(_DECODE_F16)
    globals()["_DECODE_F32_ASM"] = tl.constexpr(_DECODE_F32)

    # Addressing shared by the three kernels (T = TILE): column c of a K step
    # sits at (c // T) * T*T + c % T from its tile row's start, row r at r % T * T.
    # A K step of BLOCK_K >= T advances BLOCK_K / T whole tiles; a smaller one
    # moves within the tile and jumps to the next at its end.

    @triton.jit
    def _int8_lmhead_mma(
        x_ptr, w_ptr, s_ptr, xs_ptr, out_ptr, B, V, K, KP, stride_xb, stride_ob,
        BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
        FAST_CVT: tl.constexpr, F16: tl.constexpr, T: tl.constexpr,
    ):
        # out = x W^T for 16 batch rows: the batch as the M side of the mma,
        # the weight as the B operand (Triton loads the int8 tile from shared
        # memory straight into operand registers and decodes it there).
        pid_v = tl.program_id(0)
        b0 = tl.program_id(1) * 16
        offs_b = b0 + tl.arange(0, 16)
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        # int64 tile-row offsets: V*K overflows int32 past ~700k x 3072.
        w_ptrs = (w_ptr + ((pid_v * BLOCK_V) // T).to(tl.int64) * KP * T
                  + (((pid_v * BLOCK_V) % T + tl.arange(0, BLOCK_V)) * T)[:, None]
                  + ((offs_k // T) * T * T + offs_k % T)[None, :])
        x_ptrs = x_ptr + offs_b.to(tl.int64)[:, None] * stride_xb + offs_k[None, :]
        b_mask = offs_b[:, None] < B
        acc = tl.zeros((16, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:  # row masks only: constant along K, so the x loads stay vectorized
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=b_mask, other=0.0)
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0)
                x = tl.load(x_ptrs, mask=b_mask & k_ok[None, :], other=0.0)
            if DOT_F32:
                # Triton's CPU interpreter multiplies bf16 as raw uint16 and
                # casts int8 -> bf16 by bit pattern (seen in 3.6 and 3.9), so
                # under TRITON_INTERPRET the same tiles are multiplied in fp32.
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                if FAST_CVT and x_ptr.dtype.element_ty == tl.float16:
                    wt = tl.inline_asm_elementwise(_DECODE_F16_ASM, "=r,=r,r", [w], dtype=tl.float16,  # noqa: F821
                                                   is_pure=True, pack=4)
                elif FAST_CVT:
                    wt = tl.inline_asm_elementwise(_DECODE_BF16_ASM, "=r,=r,r", [w], dtype=tl.bfloat16,  # noqa: F821
                                                   is_pure=True, pack=4)
                else:  # int8 values are exact in bf16/fp16 (|q| <= 127 < 2^8)
                    wt = w.to(x_ptr.dtype.element_ty)
                acc = tl.dot(x, tl.trans(wt), acc)
            x_ptrs += BLOCK_K
            if BLOCK_K >= T:
                w_ptrs += (BLOCK_K // T) * T * T
            else:
                w_ptrs += tl.where((k0 + BLOCK_K) % T == 0, T * T - T + BLOCK_K, BLOCK_K)
        # The per-row scale is exact to apply once to the fp32 accumulator; so
        # is the power of two each fp16 activation row was scaled by.
        acc = acc * tl.load(s_ptr + offs_v, mask=v_mask, other=0.0)[None, :]
        if F16:
            acc = acc * tl.load(xs_ptr + offs_b, mask=offs_b < B, other=0.0)[:, None]
        o_ptrs = out_ptr + offs_b.to(tl.int64)[:, None] * stride_ob + offs_v[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=b_mask & v_mask[None, :])

    @triton.jit
    def _int8_lmhead_wa(
        x_ptr, w_ptr, s_ptr, xs_ptr, out_ptr, B, V, K, KP, stride_xb, stride_ob,
        NB: tl.constexpr, NS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        DOT_F32: tl.constexpr, FAST_CVT: tl.constexpr, F16: tl.constexpr, T: tl.constexpr,
    ):
        # out^T = W x^T for NB batch columns: the weight as the A operand of a
        # rank-3 (batched) dot over NS slices of BLOCK_V / NS rows.  Triton
        # keeps rank-3 dots on mma.sync and gives each warp one slice, so every
        # weight byte is decoded once, straight into A fragments; x^T is the B
        # operand, the same for every slice.
        MV: tl.constexpr = BLOCK_V // NS
        pid = tl.program_id(0)
        b0 = tl.program_id(1) * NB
        offs_n = b0 + tl.arange(0, NB)
        offs_k = tl.arange(0, BLOCK_K)
        r = tl.arange(0, NS)[:, None] * MV + tl.arange(0, MV)[None, :]  # [NS, MV] rows of the program
        rows = pid * BLOCK_V + r
        n_ok = offs_n < B
        w_ptrs = (w_ptr + ((pid * BLOCK_V) // T).to(tl.int64) * KP * T + (((pid * BLOCK_V) % T + r) * T)[:, :, None]
                  + ((offs_k // T) * T * T + offs_k % T)[None, None, :])
        x_ptrs = x_ptr + offs_n.to(tl.int64)[None, :] * stride_xb + offs_k[:, None]  # x^T: [BLOCK_K, NB]
        acc = tl.zeros((NS, MV, NB), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                xt = tl.load(x_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, None, :], other=0)
                xt = tl.load(x_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:  # the interpreter, as in _int8_lmhead_mma
                xb = tl.broadcast_to(xt.to(tl.float32)[None, :, :], (NS, BLOCK_K, NB))
                acc = tl.dot(w.to(tl.float32), xb, acc, input_precision="ieee")
            else:
                if FAST_CVT and x_ptr.dtype.element_ty == tl.float16:
                    a = tl.inline_asm_elementwise(_DECODE_F16_ASM, "=r,=r,r", [w], dtype=tl.float16,  # noqa: F821
                                                  is_pure=True, pack=4)
                elif FAST_CVT:
                    a = tl.inline_asm_elementwise(_DECODE_BF16_ASM, "=r,=r,r", [w], dtype=tl.bfloat16,  # noqa: F821
                                                  is_pure=True, pack=4)
                else:
                    a = w.to(x_ptr.dtype.element_ty)
                acc = tl.dot(a, tl.broadcast_to(xt[None, :, :], (NS, BLOCK_K, NB)), acc)
            x_ptrs += BLOCK_K
            if BLOCK_K >= T:
                w_ptrs += (BLOCK_K // T) * T * T
            else:
                w_ptrs += tl.where((k0 + BLOCK_K) % T == 0, T * T - T + BLOCK_K, BLOCK_K)
        v_ok = rows < V
        acc = acc * tl.load(s_ptr + rows, mask=v_ok, other=0.0)[:, :, None]
        if F16:
            acc = acc * tl.load(xs_ptr + offs_n, mask=n_ok, other=0.0)[None, None, :]
        o_ptrs = out_ptr + offs_n.to(tl.int64)[None, None, :] * stride_ob + rows[:, :, None]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, None, :] & v_ok[:, :, None])

    @triton.jit
    def _int8_lmhead_gemv(
        x_ptr, w_ptr, s_ptr, out_ptr, V, K, KP,
        BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FAST_CVT: tl.constexpr,
        T: tl.constexpr,
    ):
        # B = 1 on CUDA cores: decode to fp32 in the load layout (16 bytes per
        # thread), FMA against x, reduce each K step.  One FMA per weight byte
        # is cheaper than padding the batch to an mma tile.
        pid_v = tl.program_id(0)
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        w_ptrs = (w_ptr + ((pid_v * BLOCK_V) // T).to(tl.int64) * KP * T
                  + (((pid_v * BLOCK_V) % T + tl.arange(0, BLOCK_V)) * T)[:, None]
                  + ((offs_k // T) * T * T + offs_k % T)[None, :])
        acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptr + k0 + offs_k)
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0)
                x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            if FAST_CVT:
                wf = tl.inline_asm_elementwise(_DECODE_F32_ASM, "=r,=r,=r,=r,r", [w], dtype=tl.float32,  # noqa: F821
                                               is_pure=True, pack=4)
            else:
                wf = w.to(tl.float32)
            acc += tl.sum(wf * x.to(tl.float32)[None, :], 1)
            if BLOCK_K >= T:
                w_ptrs += (BLOCK_K // T) * T * T
            else:
                w_ptrs += tl.where((k0 + BLOCK_K) % T == 0, T * T - T + BLOCK_K, BLOCK_K)
        scale = tl.load(s_ptr + offs_v, mask=v_mask, other=0.0)
        tl.store(out_ptr + offs_v, (acc * scale).to(out_ptr.dtype.element_ty), mask=v_mask)

    @triton.jit
    def _rows_to_f16(x_ptr, y_ptr, rs_ptr, K, stride_xb, BLOCK: tl.constexpr):
        # One row per program: y = x * 2^k in fp16 with max|y| in [2^14, 2^15)
        # (exact: a power of two only moves the exponent), rs = 2^-k.
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xb + offs, mask=offs < K, other=0.0).to(tl.float32)
        e = ((tl.max(tl.abs(x), 0).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        k = tl.minimum(tl.maximum(14 - e, -126), 126)
        y = x * ((k + 127) << 23).to(tl.float32, bitcast=True)
        tl.store(y_ptr + row * K + offs, y.to(tl.float16), mask=offs < K)
        tl.store(rs_ptr + row, ((127 - k) << 23).to(tl.float32, bitcast=True))

    return _int8_lmhead_mma, _int8_lmhead_wa, _int8_lmhead_gemv, _rows_to_f16


def batch_tile(b: int) -> int:
    """Padded batch handled by one program: 1 (CUDA cores), else 16, 32 or 64."""
    if b <= 1:
        return 1
    t = 16
    while t < b and t < 64:
        t *= 2
    return t


def pick_config(b: int) -> KernelConfig:
    """The configuration a batch of b rows launches with: SF_INT8_LMHEAD_CONFIG if set, else the table's."""
    env = os.environ.get("SF_INT8_LMHEAD_CONFIG")
    if env:
        return KernelConfig.parse(env)
    if interpreting():
        return _INTERPRET[min(batch_tile(b), 64)]
    return _TUNED[batch_tile(b)]


def use_small_tiles(b: int) -> KernelConfig:
    """The small-tile configuration, from now on for b's batch tile: the table is tuned
    on an H200 (228 KB of shared memory per SM); a part with less (GB10 / sm_121 has
    ~100 KB) may refuse the larger tiles."""
    _TUNED[batch_tile(b)] = _SMALL
    return _SMALL


def wa_columns(b: int) -> int:
    """Batch columns per weight-as-A program: 16, 32 or 64."""
    return min(64, max(16, 1 << (b - 1).bit_length()))


def compile_ptx(capability: int, b: int, k: int = 3072, v: int = 248320,
                config: KernelConfig | None = None) -> str:
    """PTX of the kernel that `int8_logits` launches for batch b, compiled for a
    card of this compute capability (e.g. 121 for GB10, 90 for H200) without
    one: shows which instructions each target gets (mma.sync, never wgmma)."""
    _, triton, _ = torch_triton()
    from triton.backends.compiler import GPUTarget

    cfg = config or KernelConfig.parse(repr(_TUNED[batch_tile(b)]))
    mma, wa, gemv, to_f16 = get_kernels()
    kp = -(-k // TILE) * TILE
    even_k = k % cfg.block_k == 0 and kp % cfg.block_k == 0
    ints = ("B", "V", "K", "KP", "stride_xb", "stride_ob")
    ptrs = ("x_ptr", "w_ptr", "s_ptr", "xs_ptr", "out_ptr")
    common = dict(BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, EVEN_K=even_k, DOT_F32=False, FAST_CVT=cfg.fast_cvt,
                  F16=cfg.f16, T=TILE)
    if cfg.gemv:
        fn, ptrs, ints = gemv, ("x_ptr", "w_ptr", "s_ptr", "out_ptr"), ("V", "K", "KP")
        consts = dict(BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, EVEN_K=even_k, FAST_CVT=cfg.fast_cvt, T=TILE)
    elif cfg.wa:
        fn, consts = wa, dict(NB=wa_columns(b), NS=cfg.num_warps, **common)
    else:
        fn, consts = mma, common
    types = {"x_ptr": "*fp16" if cfg.f16 else "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "xs_ptr": "*fp32",
             "out_ptr": "*bf16", "y_ptr": "*fp16", "rs_ptr": "*fp32"}

    def ptx(fn, ptrs, ints, consts, num_warps, num_stages):
        sig = {**{n: types[n] for n in ptrs}, **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
        # What the launcher specializes on the real tensors: 16-byte aligned
        # pointers and strides/sizes divisible by 16.
        names = list(sig)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs + ints if n != "B"}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
        return compiled.asm["ptx"]

    out = ptx(fn, ptrs, ints, consts, cfg.num_warps, cfg.num_stages)
    if cfg.f16:  # the row cast that runs first is part of this path
        out += ptx(to_f16, ("x_ptr", "y_ptr", "rs_ptr"), ("K", "stride_xb"),
                   dict(BLOCK=triton.next_power_of_2(k)), 8, 1)
    return out

