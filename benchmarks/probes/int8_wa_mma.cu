// A hand-written weight-as-A kernel for 17..64 batch rows, to measure what mma.sync gives the
// int8 lm-head at B = 64 beyond what Triton's code does (benchmarks/probes/int8_wa_probe.py runs it;
// the runtime does not use it: see benchmarks/results/int8_lmhead_h200.txt).
//
// out^T = W x^T on pack_tiles(q) and the fp16 row-scaled x of runtime/int8_lmhead.py, with the
// weight as the A operand of mma.sync m16n8k16 (fp16 x fp16 -> fp32).  NVRTC compiles it with
// NB (batch columns per program), WARPS, MT (16-row tiles per warp), BK (64 or 128) and STAGES
// defined.  A program takes ROWS = WARPS * MT * 16 weight rows; per K step a weight block and
// NB x BK of x come in by cp.async, swizzled so that the warps' 8- and 16-byte shared loads are
// free of bank conflicts.
//
// k order: in each 32-wide k span, thread t of a quad holds physical k 8t..8t+7 of its rows (one
// 8-byte load of int8, one 16-byte load of x); mma k16 block 0 takes 8t..8t+3 and block 1
// 8t+4..8t+7.  A and B use the same assignment, so the sum over k is unchanged, and no register
// moves re-assemble fragments (Triton's code spends ~1.7 moves per mma on that).
typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(8) u32x2 { u32 x, y; };

__device__ __forceinline__ void dec(u32 q, u32& lo, u32& hi) {
  // 4 int8 -> 2 f16x2: u = b ^ 0x80 into the low byte of fp16 1024 (0x64uu = 1024 + u), minus 1152.
  u32 t = q ^ 0x80808080u;
  asm("prmt.b32 %0, %1, 0x64646464, 0x5140;" : "=r"(lo) : "r"(t));
  asm("prmt.b32 %0, %1, 0x64646464, 0x5342;" : "=r"(hi) : "r"(t));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(0x64806480u));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(0x64806480u));
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp16(u32 dst, const void* src, u32 bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}

#define ROWS (WARPS * MT * 16)
// Weight chunk swizzle by row: 8-byte loads of 16 threads (4 rows x 32 bytes) hit 8 distinct
// 16-byte bank groups.  Rows are BK bytes: 128 -> rows r..r+3 share a bank line period; 64 -> pairs.
__device__ __forceinline__ int swz(int row) { return BK == 128 ? (row & 3) << 1 : ((row >> 1) & 1) << 1; }
#define NT (WARPS * 32)
extern "C" __global__ void __launch_bounds__(NT) int8_lmhead_wa(
    const u16* __restrict__ x, const signed char* __restrict__ w, const float* __restrict__ s,
    const float* __restrict__ xs, u16* __restrict__ out, int B, int V, int K, int KT, int stride_x,
    int stride_o) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int WB = ROWS * BK, SZ = WB + NB * BK * 2, CW = BK / 16, CX = BK / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  // Column blocks of one row block are adjacent in launch order: they run together and the
  // second reads the weight from L2.
  const int ncb = (B + NB - 1) / NB, pid = blockIdx.x / ncb, b0 = (blockIdx.x % ncb) * NB;
  const u32 sbase = (u32)__cvta_generic_to_shared(smem);
  const int tile0 = pid * ROWS / 128;

  // Per-thread copy plan, fixed for the whole K loop: NT threads copy 16-byte chunks; thread tid
  // always copies chunk column tid & 7 of weight rows (tid >> 3) + it * NT / 8 and chunk column
  // tid & 15 of x rows (tid >> 4) + it * NT / 16, so its swizzle is a constant.
  constexpr int WIT = ROWS * CW / NT, XIT = NB * CX / NT;
  const int wr = tid / CW, wc = tid % CW, xr = tid / CX, xc = tid % CX;
  const signed char* wsrc = w + (size_t)tile0 * KT * 16384 + wr * 128 + wc * 16;
  const u32 wdst = wr * BK + ((wc ^ swz(wr)) << 4);
  const int wleft = V - pid * ROWS - wr;  // rows of this thread's copies that exist: it * NT / 8 < wleft
  const u16* xsrc = x + (size_t)(b0 + xr) * stride_x + xc * 8;
  const u32 xdst = WB + xr * BK * 2 + ((xc ^ ((xr & 1) << 2)) << 4);
  const int xleft = B - b0 - xr;

  auto load = [&](int kt, int buf) {
    const u32 ws = sbase + buf * SZ;
#pragma unroll
    for (int it = 0; it < WIT; it++) {
      const int row = it * (NT / CW);  // + wr
      const bool ok = row < wleft;
      const signed char* src = wsrc + ((size_t)(row >> 7) * KT + (kt * BK >> 7)) * 16384 + (row & 127) * 128 + (kt * BK & 127);
      cp16(ws + wdst + row * BK, ok ? (const void*)src : (const void*)w, ok ? 16u : 0u);
    }
    const bool kok = kt * BK + xc * 8 < K;
#pragma unroll
    for (int it = 0; it < XIT; it++) {
      const int n = it * (NT / CX);  // + xr
      const bool ok = n < xleft && kok;
      cp16(ws + xdst + n * BK * 2, ok ? (const void*)(xsrc + (size_t)n * stride_x + kt * BK) : (const void*)x, ok ? 16u : 0u);
    }
  };

  float acc[MT][NB / 8][4];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int n = 0; n < NB / 8; n++) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;

#pragma unroll
  const int NK = KT * 128 / BK;
  for (int st = 0; st < STAGES - 1; st++) {
    if (st < NK) load(st, st);
    asm volatile("cp.async.commit_group;");
  }
  for (int kt = 0; kt < NK; kt++) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
    __syncthreads();
    if (kt + STAGES - 1 < NK) load(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
    asm volatile("cp.async.commit_group;");
    const unsigned char* ws = smem + (kt % STAGES) * SZ;
    const unsigned char* xsp = ws + WB;
#pragma unroll
    for (int j = 0; j < BK / 32; j++) {
      u32x4 b[NB / 8];
#pragma unroll
      for (int n = 0; n < NB / 8; n++) b[n] = *(const u32x4*)(xsp + (n * 8 + g) * BK * 2 + (((4 * j + t) ^ ((g & 1) << 2)) << 4));
#pragma unroll
      for (int m = 0; m < MT; m++) {
        const int r = warp * MT * 16 + m * 16 + g;  // rows r and r + 8; (r & 3) == (g & 3)
        const int off = (((2 * j + (t >> 1)) ^ swz(g)) << 4) + ((t & 1) << 3);
        const u32x2 q0 = *(const u32x2*)(ws + r * BK + off);
        const u32x2 q1 = *(const u32x2*)(ws + (r + 8) * BK + off);
        u32 a[2][4];
        dec(q0.x, a[0][0], a[0][2]);
        dec(q1.x, a[0][1], a[0][3]);
        dec(q0.y, a[1][0], a[1][2]);
        dec(q1.y, a[1][1], a[1][3]);
#pragma unroll
        for (int n = 0; n < NB / 8; n++) mma(acc[m][n], a[0][0], a[0][1], a[0][2], a[0][3], b[n].x, b[n].y);
#pragma unroll
        for (int n = 0; n < NB / 8; n++) mma(acc[m][n], a[1][0], a[1][1], a[1][2], a[1][3], b[n].z, b[n].w);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;");
  __syncthreads();

  // Epilogue: scale, cast to bf16, stage as [NB][128] in shared memory, write rows of out.
  u16* so = (u16*)smem;
  const int v0 = pid * ROWS;
#pragma unroll
  for (int m = 0; m < MT; m++) {
    const int r = warp * MT * 16 + m * 16 + g;
    const float s0 = v0 + r < V ? s[v0 + r] : 0.f, s1 = v0 + r + 8 < V ? s[v0 + r + 8] : 0.f;
#pragma unroll
    for (int n = 0; n < NB / 8; n++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int col = n * 8 + 2 * t + e;
        const float f = b0 + col < B ? xs[b0 + col] : 0.f;
        u16 h0, h1;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h0) : "f"(acc[m][n][e] * s0 * f));
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h1) : "f"(acc[m][n][2 + e] * s1 * f));
        so[col * ROWS + r] = h0;
        so[col * ROWS + r + 8] = h1;
      }
    }
  }
  __syncthreads();
  const bool vec = ((stride_o & 7) == 0) && ((((size_t)out) & 15) == 0);
  for (int i = tid; i < NB * ROWS / 8; i += NT) {
    const int n = i / (ROWS / 8), c = i % (ROWS / 8), v = v0 + c * 8;
    if (b0 + n >= B) continue;
    u16* dst = out + (size_t)(b0 + n) * stride_o + v;
    if (vec && v + 8 <= V) {
      *(u32x4*)dst = *(const u32x4*)(so + n * ROWS + c * 8);
    } else {
      for (int e = 0; e < 8 && v + e < V; e++) dst[e] = so[n * ROWS + c * 8 + e];
    }
  }
}
