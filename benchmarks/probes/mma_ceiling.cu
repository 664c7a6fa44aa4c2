// How fast mma.sync can go on this card, with and without the work the int8 lm-head's batch of
// 64 adds around it (issue: int8 lm-head at the memory roofline).  No memory traffic: every
// operand is in registers or a small shared array, so each figure is a ceiling for a kernel that
// also streams its weight from DRAM.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/mma_ceiling benchmarks/probes/mma_ceiling.cu && /tmp/mma_ceiling
//
// mode 0: m16n8k16 (fp16 in, fp32 accumulate) only, 16 independent accumulators per warp
// mode 1: + the int8 -> fp16 decode of the A operand, 10 ALU instructions per 8 mma: one decoded
//         32-row weight slice serves the 8 column tiles of a 64-column batch
// mode 2: + ldmatrix.x4 of B from shared memory, 4 per 16 mma (a 32-row slice's x operand)
// mode 3: mode 2 with the decode's xor gone (a weight stored pre-biased), 8 ALU per 8 mma
// mode 4: mode 3 with 64-row slices: 32 mma per 4 ldmatrix, acc in 128 registers
#include <cstdio>
#include <cuda_runtime.h>

__device__ __forceinline__ void mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void dec2(unsigned t, unsigned& lo, unsigned& hi) {
  asm volatile("{\n.reg .b32 c;\nmov.b32 c, 0x64806480;\n"
               "prmt.b32 %0, %2, 0x64646464, 0x5140;\nprmt.b32 %1, %2, 0x64646464, 0x5342;\n"
               "sub.f16x2 %0, %0, c;\nsub.f16x2 %1, %1, c;\n}\n" : "=r"(lo), "=r"(hi) : "r"(t));
}
__device__ __forceinline__ void dec(unsigned q, unsigned& lo, unsigned& hi) {
  asm volatile("{\n.reg .b32 t, c;\nxor.b32 t, %2, 0x80808080;\nmov.b32 c, 0x64806480;\n"
               "prmt.b32 %0, t, 0x64646464, 0x5140;\nprmt.b32 %1, t, 0x64646464, 0x5342;\n"
               "sub.f16x2 %0, %0, c;\nsub.f16x2 %1, %1, c;\n}\n" : "=r"(lo), "=r"(hi) : "r"(q));
}

template <int MODE>
__global__ void probe(float* out, int iters) {
  __shared__ __align__(16) unsigned short xs[64 * 16 * 8];
  for (int i = threadIdx.x; i < 64 * 16 * 8; i += blockDim.x) xs[i] = 0x3c00;
  __syncthreads();
  constexpr int MT = MODE == 4 ? 4 : 2;
  float acc[MT * 8][4];
#pragma unroll
  for (int j = 0; j < MT * 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  unsigned q0 = threadIdx.x, q1 = q0 * 3u, q2 = q0 * 5u, q3 = q0 * 7u;
  unsigned a[4][4];
#pragma unroll
  for (int i = 0; i < 16; i++) a[i / 4][i % 4] = 0x3c003c00u;
  unsigned b[8][2];
#pragma unroll
  for (int n = 0; n < 8; n++) b[n][0] = b[n][1] = 0x3c003c00u;
  int lane = threadIdx.x & 31;
  unsigned base = (unsigned)__cvta_generic_to_shared(xs) + (lane * 16) ;
  for (int it = 0; it < iters; it++) {
    if (MODE >= 3) {
#pragma unroll
      for (int m = 0; m < MT; m++) { dec2(q0 + m, a[m][0], a[m][1]); dec2(q1 + m, a[m][2], a[m][3]); }
      q0 += 0x01010101u; q1 += 0x01010101u;
    } else if (MODE >= 1) {
      dec(q0, a[0][0], a[0][1]); dec(q1, a[0][2], a[0][3]);
      dec(q2, a[1][0], a[1][1]); dec(q3, a[1][2], a[1][3]);
      q0 += 0x01010101u; q1 += 0x01010101u; q2 += 0x01010101u; q3 += 0x01010101u;
    }
    if (MODE >= 2) {
#pragma unroll
      for (int n = 0; n < 4; n++) {
        unsigned addr = base + ((it & 7) * 4 + n) * 512;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b[2 * n][0]), "=r"(b[2 * n][1]), "=r"(b[2 * n + 1][0]), "=r"(b[2 * n + 1][1]) : "r"(addr));
      }
    }
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
      for (int n = 0; n < 8; n++) mma(acc[m * 8 + n], a[m][0], a[m][1], a[m][2], a[m][3], b[n][0], b[n][1]);
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < MT * 8; j++) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int MODE>
void run(int warps_per_block, int blocks_per_sm, int sms) {
  int blocks = sms * blocks_per_sm, threads = warps_per_block * 32, iters = 4096;
  float* out;
  cudaMalloc(&out, blocks * threads * sizeof(float));
  probe<MODE><<<blocks, threads>>>(out, 16);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int r = 0; r < 5; r++) probe<MODE><<<blocks, threads>>>(out, iters);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  double flops = 5.0 * blocks * warps_per_block * (double)iters * (MODE == 4 ? 32 : 16) * 4096;
  printf("mode %d  warps/block %2d blocks/SM %d: %7.1f TFLOP/s  (%s)\n", MODE, warps_per_block, blocks_per_sm,
         flops / (ms * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
  cudaFree(out);
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int cfg[][2] = {{4, 1}, {4, 2}, {4, 3}, {8, 1}, {8, 2}, {4, 4}};
  for (auto& c : cfg) run<0>(c[0], c[1], sms);
  for (auto& c : cfg) run<1>(c[0], c[1], sms);
  for (auto& c : cfg) run<2>(c[0], c[1], sms);
  for (auto& c : cfg) run<3>(c[0], c[1], sms);
  for (auto& c : cfg) run<4>(c[0], c[1], sms);
}
