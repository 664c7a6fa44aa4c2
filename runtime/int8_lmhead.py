"""int8 lm-head: per-row symmetric int8 weights, one batched Triton GEMV/GEMM.

The 248320 x 3072 lm-head is the largest dense weight read every decode step
(1.5 GB in bf16).  Stored as int8 with one scale per vocab row it is half the
bytes; since decode is bandwidth-bound, the logits cost about half the time.

    q, scales = quantize_rows(weight)          # once, row-major [V, K]
    tiles = pack_tiles(q)                      # once, the layout the kernels read
    logits = int8_logits(hidden, tiles, scales)  # [B, V] bf16, B = 1 .. 64+

    head = Int8LMHead.for_weight(weight)       # cached, quantizes on first use
    logits = head(hidden)

This module quantizes, packs, checks and launches; the Triton kernels, their
tuned configurations and ``compile_ptx`` are in ``int8_lmhead_kernels`` beside it.

Design notes (why, not what):
* Scales are float32.  They cost 4 bytes per row, 1 MB for the whole head,
  0.13% of the int8 bytes, so their bandwidth price is nil; fp16 scales would
  add a per-row relative error up to 2^-11 that moves whole rows' logits
  against each other (the very comparison argmax makes), and rows with tiny
  norms (unused / padded vocab entries) give max|row|/127 below fp16's normal
  range, where precision collapses.  fp32 has neither problem.
* The int8 weight is stored as 128 x 128 tiles ([V/128, K/128, 128, 128],
  zero padded), so each K step of a program reads one contiguous 16 KB block
  instead of 128 row pieces 3 KB apart: on the H200 that alone took the
  B <= 16 kernel from 1.10x to 1.08x of the read-only floor and B = 32 from
  1.23x to 1.20x.  Every path reads the same tiles (one copy of the weight).
* The bf16 weight is never freed or modified: the DFlash drafter shares the
  target's lm_head (the reference recipe saw garbage drafts when a port zeroed it).

torch and triton are imported lazily so this module imports anywhere (the
runtime patch loader, CPU-only tests of other modules).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

try:  # imported as runtime.int8_lmhead (the package)
    from . import int8_lmhead_kernels as kernels
except ImportError:  # by path: the vLLM patch loads /host/int8_lmhead.py under a private name,
    # with /host maybe not on sys.path; tests and benchmarks put runtime/ there themselves
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    import int8_lmhead_kernels as kernels

__all__ = ["quantize_rows", "pack_tiles", "int8_logits", "Int8LMHead"]

# The tile side of the stored layout (pack_tiles), the one the kernels read.
TILE = kernels.TILE

# Batches above this go to the bf16 matmul in Int8LMHead: there the product is
# compute-bound and cuBLAS on the kept bf16 weight wins (prefill logprobs etc.).
BF16_FALLBACK_ABOVE = 64


# --------------------------------------------------------------------------- quantization


def quantize_rows(weight: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Symmetric per-row int8: scale = max|row| / 127, q = round(w / scale).

    Returns (q int8 [V, K] contiguous, scales float32 [V]).  Works in chunks of
    rows so the fp32 temporaries stay small (the real head is 1.5 GB in bf16).
    All-zero rows get scale 1 (q = 0 anyway) to avoid 0/0.
    """
    torch, _, _ = kernels.torch_triton()
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


def pack_tiles(q: "torch.Tensor") -> "torch.Tensor":
    """Row-major int8 [V, K] -> [ceil(V/128), ceil(K/128), 128, 128] tiles, zero padded.

    The kernels read this layout: a program's K step is one contiguous block.
    Works in chunks of tile rows so the temporaries stay small."""
    torch, _, _ = kernels.torch_triton()
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"expected a row-major int8 [V, K] tensor, got {q.dtype} {tuple(q.shape)}")
    v, k = q.shape
    vt, kt = -(-v // TILE), -(-k // TILE)
    tiles = torch.zeros((vt, kt, TILE, TILE), dtype=torch.int8, device=q.device)
    step = 64  # tile rows per chunk (24 MB of a 3072-wide head)
    for t0 in range(0, vt, step):
        t1 = min(vt, t0 + step)
        rows = q[t0 * TILE:t1 * TILE]
        block = torch.zeros(((t1 - t0) * TILE, kt * TILE), dtype=torch.int8, device=q.device)
        block[:rows.shape[0], :k] = rows
        tiles[t0:t1] = block.view(t1 - t0, TILE, kt, TILE).permute(0, 2, 1, 3)
    return tiles


# --------------------------------------------------------------------------- launch


def _fast_cvt_ok(x: "torch.Tensor") -> bool:
    """The PTX decodes need a CUDA device (sub.bf16x2: sm_90+)."""
    torch, _, _ = kernels.torch_triton()
    if not x.is_cuda or getattr(torch.version, "hip", None) or kernels.interpreting():
        return False
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx] >= (9, 0)


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _launch(x: "torch.Tensor", tiles: "torch.Tensor", scales: "torch.Tensor", out: "torch.Tensor",
            cfg: kernels.KernelConfig) -> None:
    torch, triton, _ = kernels.torch_triton()
    b, k = x.shape
    v = scales.shape[0]
    kp = tiles.shape[1] * TILE
    mma, wa, gemv, to_f16 = kernels.get_kernels()
    even_k = k % cfg.block_k == 0 and kp % cfg.block_k == 0
    fast = cfg.fast_cvt and _fast_cvt_ok(x)
    grid_v = triton.cdiv(v, cfg.block_v)
    if cfg.gemv:
        for i in range(b):  # b == 1 unless a gemv config is forced
            gemv[(grid_v,)](x[i], tiles, scales, out[i], v, k, kp, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
                            EVEN_K=even_k, FAST_CVT=fast, T=TILE, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    xs = scales  # row scales of the fp16 copy; unused (any fp32 pointer) otherwise
    if cfg.f16:
        xh = torch.empty((b, k), dtype=torch.float16, device=x.device)
        xs = torch.empty((b,), dtype=torch.float32, device=x.device)
        to_f16[(b,)](x, xh, xs, k, x.stride(0), BLOCK=triton.next_power_of_2(k), num_warps=8)
        x = xh
    common = dict(BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, EVEN_K=even_k, DOT_F32=kernels.interpreting(),
                  FAST_CVT=fast, F16=cfg.f16, T=TILE, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.wa:
        nb = kernels.wa_columns(b)
        wa[(grid_v, triton.cdiv(b, nb))](x, tiles, scales, xs, out, b, v, k, kp, x.stride(0), out.stride(0),
                                         NB=nb, NS=cfg.num_warps, **common)
    else:
        mma[(grid_v, triton.cdiv(b, 16))](x, tiles, scales, xs, out, b, v, k, kp, x.stride(0), out.stride(0), **common)


def int8_logits(
    hidden: "torch.Tensor",
    tiles: "torch.Tensor",
    scales: "torch.Tensor",
    out: "torch.Tensor | None" = None,
    config: kernels.KernelConfig | None = None,
    *,
    k: int | None = None,
) -> "torch.Tensor":
    """logits[B, V] = hidden[B, K] @ (q * scales[:, None])^T, bf16 out, fp32 accumulate.

    hidden: bf16 (or fp16) [B, K] or [K]; tiles: `pack_tiles(q)` of the int8
    [V, K] weight; scales: fp32 [V].  One kernel launch for the whole batch.
    The tiles fix K only up to their 128-column padding: pass the weight's ``k``
    (Int8LMHead does) so that a hidden of another K in the same tile count is refused
    rather than multiplied by the first K columns.
    """
    torch, _, _ = kernels.torch_triton()
    squeeze = hidden.dim() == 1
    x = hidden.unsqueeze(0) if squeeze else hidden
    if x.dim() != 2:
        raise ValueError(f"hidden must be [B, K] or [K], got {tuple(hidden.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        x = x.to(torch.bfloat16)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if k is not None and x.shape[1] != k:
        raise ValueError(f"hidden has K = {x.shape[1]}, the weight's K is {k}")
    b, k = x.shape
    v = scales.shape[0] if scales.dim() == 1 else -1
    want = (-(-v // TILE), -(-k // TILE), TILE, TILE)
    if tiles.dtype != torch.int8 or tuple(tiles.shape) != want or not tiles.is_contiguous():
        raise ValueError(f"tiles must be pack_tiles(q) of an int8 [V, K] = [{v}, {k}] weight, i.e. a contiguous int8 "
                         f"{list(want)} tensor; got {tiles.dtype} {list(tiles.shape)}")
    if scales.dtype != torch.float32:
        scales = scales.float()
    if out is None:
        out = torch.empty((b, v), dtype=torch.bfloat16, device=x.device)
    if b == 0:
        return out[0] if squeeze else out
    cfg = config or kernels.pick_config(b)
    try:
        _launch(x, tiles, scales, out, cfg)
    except Exception as exc:
        # The table is tuned on an H200 (228 KB of shared memory per SM); a part
        # with less (GB10 / sm_121 has ~100 KB) may refuse the larger tiles.
        # Fall back to small tiles once and remember it for this batch tile.
        if config is not None or type(exc).__name__ != "OutOfResources" or cfg.gemv:
            raise
        _launch(x, tiles, scales, out, kernels.use_small_tiles(b))
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
        self.tiles: "torch.Tensor | None" = None
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
        """(pack_tiles(q), scales) of the weight, made on first use."""
        if self.tiles is None:
            torch, _, _ = kernels.torch_triton()
            if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
                # Quantizing inside a CUDA graph capture would record the
                # quantization into the graph and replay it every step.
                raise RuntimeError("Int8LMHead: first use during CUDA graph capture; "
                                   "call .quantized() (or run one eager forward) before capturing")
            with self._qlock:
                if self.tiles is None:
                    q, s = quantize_rows(self.weight.detach())
                    self.scales = s
                    self.tiles = pack_tiles(q)
        assert self.tiles is not None and self.scales is not None
        return self.tiles, self.scales

    def __call__(self, hidden: "torch.Tensor") -> "torch.Tensor":
        rows = hidden.shape[0] if hidden.dim() == 2 else 1
        if rows > BF16_FALLBACK_ABOVE:
            return hidden.to(self.weight.dtype) @ self.weight.t()
        tiles, s = self.quantized()
        return int8_logits(hidden, tiles, s, k=self.weight.shape[1])
