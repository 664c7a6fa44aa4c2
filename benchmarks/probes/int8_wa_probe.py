#!/usr/bin/env python3
"""Time the hand-written weight-as-A kernel (int8_wa_mma.cu) against the runtime's Triton kernel.

At the lm-head shape [248320, 3072], B in {32, 64}, on the same tiles and fp16 row cast the
runtime uses; each row of the table is one tile configuration.  Exactness is checked against the
fp32 reference on the dequantized weight, as in benchmarks/int8_lmhead_bench.py.

    python benchmarks/probes/int8_wa_probe.py        (a CUDA GPU; NVRTC through torch)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "benchmarks")]

import int8_lmhead as m  # noqa: E402
import int8_lmhead_kernels as kern  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from int8_lmhead_bench import read_floor, time_gpu, ulps  # noqa: E402

V, K = 248320, 3072
SOURCE = (Path(__file__).parent / "int8_wa_mma.cu").read_text()
# (warps, 16-row tiles per warp, stages, K step): ROWS = warps * tiles * 16
CONFIGS = [(4, 2, 2, 128), (4, 4, 2, 128), (2, 4, 2, 128), (4, 2, 4, 64), (4, 4, 3, 64)]


class Probe:
    def __init__(self, nb: int, warps: int, mt: int, stages: int, bk: int) -> None:
        self.nb, self.rows = nb, warps * mt * 16
        self.threads, self.smem = warps * 32, stages * (self.rows * bk + nb * bk * 2)
        defines = f"#define NB {nb}\n#define WARPS {warps}\n#define MT {mt}\n#define STAGES {stages}\n#define BK {bk}\n"
        self.kernel = torch.cuda._compile_kernel(defines + SOURCE, "int8_lmhead_wa")
        self.kernel.set_shared_memory_config(self.smem)
        self.to_f16 = kern.get_kernels()[3]

    def __call__(self, x: torch.Tensor, tiles: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        b = x.shape[0]
        xh = torch.empty((b, K), dtype=torch.float16, device=x.device)
        xs = torch.empty((b,), dtype=torch.float32, device=x.device)
        self.to_f16[(b,)](x, xh, xs, K, x.stride(0), BLOCK=triton.next_power_of_2(K), num_warps=8)
        grid = triton.cdiv(V, self.rows) * triton.cdiv(b, self.nb)
        self.kernel(grid=(grid, 1, 1), block=(self.threads, 1, 1), shared_mem=self.smem,
                    args=[xh, tiles, s, xs, out, b, V, K, tiles.shape[1], K, out.stride(0)])


def main() -> int:
    torch.manual_seed(0)
    w = (torch.randn(V, K, device="cuda") * 0.02).bfloat16()
    q, s = m.quantize_rows(w)
    tiles, deq = m.pack_tiles(q), m.dequantize_rows(q, s)
    del w
    floor = read_floor(q)
    del q
    print(f"# {torch.cuda.get_device_name()}; floor (stream the int8 weight): {floor * 1e6:.1f} us")
    print(f"{'B':>3} | {'kernel':<34} | {'us':>6} | {'x floor':>7} | {'max err':>8} | argmax")
    for b in (32, 64):
        x = torch.randn(b, K, device="cuda").bfloat16()
        ref = x.float() @ deq.t()
        out = m.int8_logits(x, tiles, s)
        t = time_gpu(lambda: m.int8_logits(x, tiles, s), 40)  # noqa: B023
        print(f"{b:>3} | {'triton ' + repr(kern.pick_config(b)):<34} | {t * 1e6:6.1f} | {t / floor:7.3f} | "
              f"{ulps(out, ref):4.2f} ulp | {int((out.float().argmax(1) == ref.argmax(1)).sum())}/{b} same")
        for warps, mt, stages, bk in CONFIGS:
            probe = Probe(64 if b > 32 else 32, warps, mt, stages, bk)
            out = torch.empty((b, V), dtype=torch.bfloat16, device="cuda")
            probe(x, tiles, s, out)
            t = time_gpu(lambda: probe(x, tiles, s, out), 40)  # noqa: B023
            name = f"cuda NB{probe.nb} W{warps} MT{mt} S{stages} BK{bk}"
            print(f"{b:>3} | {name:<34} | {t * 1e6:6.1f} | {t / floor:7.3f} | {ulps(out, ref):4.2f} ulp | "
                  f"{int((out.float().argmax(1) == ref.argmax(1)).sum())}/{b} same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
