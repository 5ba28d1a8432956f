// OSCAR's uniform quantizer (methods.spectral.Spectral._quantize, codebook=uniform) in one kernel, bit for bit as
// CUDA torch computes it (kernels.reference.spectral_quantize):
//   per row (token, head) of x [b, H, T, D] (keys already rotated by the layer's matrix), in fp32:
//   t = the value of rank `rank` (0-based, ascending) of |x| over the row, y = clamp(x, -t, t) (rank < 0: y = x);
//   per group of G channels: lo, hi = min, max of y; s = (hi - lo) * RN(1 / levels) (a zero span: |lo|, or 1 for
//   lo = 0), z = lo, code = clamp(rint((y - z) / s), 0, levels) (IEEE division); s and z stored in fp32.
// One warp per row, lane l holding channels l * EPL ..; the rank by counting (each lane's values against the row's,
// broadcast by shuffles; ties at the threshold give the same value), the group range by butterflies over its lanes.
// Codes are staged per row in shared memory and stored in the reference layout (DECODE_LAYOUT 0), the value tiles
// (1) or the per-token key layout (2) of common.cuh; scale/zero [*, H, cap, D/G] fp32 (in the value tiles' parameter
// layout with 1). Outputs go to storage row out_row[i] at token out_off[i] + t (null: row i, token t).
// Compile-time: HEAD_DIM, BITS (2 or 4), GROUP, IS_BF16, DECODE_LAYOUT. Block of 8 warps; dynamic shared memory
// 8 * D bytes.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BITS
#define BITS 2
#endif
#ifndef GROUP
#define GROUP 128
#endif
#ifndef IS_BF16
#define IS_BF16 1
#endif
#ifndef DECODE_LAYOUT
#define DECODE_LAYOUT 0
#endif

#include "common.cuh"

#define G GROUP
#define LEVELS ((1 << BITS) - 1)
#define CPB (8 / BITS)             // codes per byte
#define BPT (D * BITS / 8)         // packed bytes per row
#define TLANES (G / EPL)           // lanes per group

#if ((BITS != 2) && (BITS != 4)) || (D % G) || (EPL > G)
#error "OSCAR's kernel packs 2 or 4 bits in groups of G >= D / 32 channels dividing the head dim"
#endif

extern "C" __global__ void __launch_bounds__(256) quantize_spectral(
    const u16* __restrict__ x, int H, int T, long long rows, int rank, float inv_levels, u8* __restrict__ codes,
    float* __restrict__ scale_out, float* __restrict__ zero_out, int cap, const int* __restrict__ out_row,
    const int* __restrict__ out_off) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  u8* row_codes = smem + (threadIdx.x >> 5) * D;  // the warp's codes of one row, one byte per channel
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long row = warp; row < rows; row += nwarps) {
    float y[EPL];
    load_row(x + row * D, lane, y);
    if (rank >= 0) {  // the clip threshold: the lane value with `rank` values below it and rank + 1 at most
      float a[EPL], threshold = -1.f;
      int below[EPL], at_most[EPL];
#pragma unroll
      for (int i = 0; i < EPL; ++i) { a[i] = fabsf(y[i]); below[i] = at_most[i] = 0; }
      for (int src = 0; src < 32; ++src) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
          const float o = __shfl_sync(FULL_MASK, a[e], src);
#pragma unroll
          for (int i = 0; i < EPL; ++i) { below[i] += o < a[i]; at_most[i] += o <= a[i]; }
        }
      }
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (below[i] <= rank && rank < at_most[i]) threshold = a[i];
#pragma unroll
      for (int m = 1; m < 32; m *= 2) threshold = fmaxf(threshold, __shfl_xor_sync(FULL_MASK, threshold, m));
#pragma unroll
      for (int i = 0; i < EPL; ++i) y[i] = fmaxf(fminf(y[i], threshold), -threshold);
    }
    float lo = y[0], hi = y[0];
#pragma unroll
    for (int i = 1; i < EPL; ++i) { lo = fminf(lo, y[i]); hi = fmaxf(hi, y[i]); }
#pragma unroll
    for (int m = 1; m < TLANES; m *= 2) {
      lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, m));
      hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, m));
    }
    const float span = __fsub_rn(hi, lo);
    const float s = span == 0.f ? (lo == 0.f ? 1.f : fabsf(lo)) : __fmul_rn(span, inv_levels);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const float q = rintf(__fdiv_rn(__fsub_rn(y[i], lo), s));
      row_codes[lane * EPL + i] = (u8)fminf(fmaxf(q, 0.f), (float)LEVELS);
    }
    __syncwarp();
    const long long ht = (long long)H * T;
    const int i = (int)(row / ht), h = (int)((row % ht) / T), t = (int)(row % T);
    const long long tok = ((long long)(out_row ? out_row[i] : i) * H + h) * cap + (out_off ? out_off[i] : 0) + t;
    if (lane % TLANES == 0) {
      const int grp = lane / TLANES;
#if DECODE_LAYOUT == 1
      const long long at = (tok - tok % 16) * (D / G) + decode_param_offset((int)(tok % 16), grp, D / G);
#else
      const long long at = tok * (D / G) + grp;
#endif
      scale_out[at] = s;
      zero_out[at] = lo;
    }
    for (int bb = lane; bb < BPT; bb += 32) {  // output byte bb of the row
      u32 byte = 0u;
#pragma unroll
      for (int p = 0; p < CPB; ++p) {
#if DECODE_LAYOUT == 2
        byte |= (u32)row_codes[token_key_channel(bb, p, BPT, BITS)] << (BITS * p);
#else
        byte |= (u32)row_codes[CPB * bb + p] << (BITS * p);
#endif
      }
#if DECODE_LAYOUT == 1
      codes[(tok - tok % 16) * BPT + decode_code_offset((int)(tok % 16), bb, BPT, G * BITS / 8)] = (u8)byte;
#else
      codes[tok * BPT + bb] = (u8)byte;
#endif
    }
    __syncwarp();  // the row's codes are read before the next row writes them
  }
}
