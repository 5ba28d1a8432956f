// Packed tokens of the storage back in the model dtype: a prefill chunk's view of its stored prefix
// (kernels.cupy_storage), bit for bit the methods' torch dequantize.
//   dequantize (oscar.quant.dequantize_groups in fp32, then OScaR's token norm multiplied in fp32, one rounding to
//   the dtype last), by LAYOUT:
//     0: per-channel keys (KIVI, OScaR): codes [*, H, cap, D*BITS/8] packed along D, scale/zero [*, H, cap/G, D] in
//        the key decode layout (common.cuh), OScaR's norms [*, 1, cap, 1] fp32 (KEY_NORM);
//     1: value tiles (every method's values): codes and scale/zero [*, H, cap, D/G] in the 16-token tile layout;
//     2: per-token keys (QuaRot, OSCAR): codes in the per-token key layout, scale/zero [*, H, cap, D/G] unpermuted.
//   Integer zero point: (q - zero) * scale; ZERO_FLOAT: q * scale + zero (two roundings, as torch: no FMA).
//   PARAM32: scale/zero stored in fp32 (OSCAR's (scale, zero), or its Lloyd-Max (std, mean)); with LEVEL_TABLE (2-bit
//   codes) the code's value is the level l[q] of the four runtime arguments (methods.spectral: mean + std * l[q],
//   the same two roundings as l[q] * std + mean), else q itself.
//   Thread x of the grid-stride loop writes the 8/BITS channels of reference code byte x % BPT of token
//   t = x / BPT % n, head h, sequence i (x / (BPT n H)): out[i, h, t, :] (strides in elements, the last dim
//   contiguous) from storage row rows[i], token start + t.
//   dequantize_turboquant (TURBO; methods.turboquant.TurboQuant.dequantize), 2-bit codes in LAYOUT 1 (values) or 2
//   (keys), fp16 corrected norms [*, H, cap, D/G] in the same layout as the scales above: one warp per row (token,
//   head, sequence), lane l rebuilding channels l * EPL ..: y = L[code] * n_block in fp32, the fp32 butterflies of
//   oscar.quant.hadamard (warp_hadamard), times the sign, one rounding.
#include "common.cuh"
#ifndef BITS
#define BITS 2
#endif
#ifndef GROUP
#define GROUP 32
#endif
#ifndef LAYOUT
#define LAYOUT 0
#endif
#ifndef KEY_NORM
#define KEY_NORM 0
#endif
#ifndef ZERO_FLOAT
#define ZERO_FLOAT 0
#endif
#ifndef PARAM32
#define PARAM32 0
#endif
#ifndef LEVEL_TABLE
#define LEVEL_TABLE 0
#endif
#if LEVEL_TABLE && (BITS != 2 || !ZERO_FLOAT || !PARAM32)
#error "the Lloyd-Max levels are OSCAR's: 2-bit codes, fp32 (std, mean), x = level * std + mean"
#endif
#define CPB (8 / BITS)
#define BPT (D * BITS / 8)
#define NG (D / GROUP)

// code of channel c, token s of storage row `row` (sequence * H + head), and the index of its scale / zero / norm
__device__ __forceinline__ int code_at(const u8* __restrict__ codes, long long row, int cap, int s, int c) {
#if LAYOUT == 0
  return (codes[(row * cap + s) * BPT + c / CPB] >> (c % CPB * BITS)) & ((1 << BITS) - 1);
#elif LAYOUT == 1
  return (codes[(row * cap + s / 16 * 16) * BPT + decode_code_offset(s % 16, c / CPB, BPT, GROUP * BITS / 8)] >>
          (c % CPB * BITS)) & ((1 << BITS) - 1);
#else
  return (codes[(row * cap + s) * BPT + token_key_code_byte(c, BPT, BITS)] >> ((c / 16) % CPB * BITS)) &
         ((1 << BITS) - 1);
#endif
}
__device__ __forceinline__ long long param_at(long long row, int cap, int s, int c) {
#if LAYOUT == 0
  return (row * (cap / GROUP) + s / GROUP) * D + decode_key_param_offset(c, BITS);
#elif LAYOUT == 1
  return (row * cap + s / 16 * 16) * NG + decode_param_offset(s % 16, c / GROUP, NG);
#else
  return (row * cap + s) * NG + c / GROUP;
#endif
}

#ifndef TURBO
#if PARAM32
typedef float param_t;
__device__ __forceinline__ float param_value(float x) { return x; }
#else
typedef u16 param_t;
__device__ __forceinline__ float param_value(u16 x) { return to_float(x); }
#endif

extern "C" __global__ void __launch_bounds__(256) dequantize(
    const u8* __restrict__ codes, const param_t* __restrict__ scale, const param_t* __restrict__ zero,
    const float* __restrict__ norm, int H, int cap, const int* __restrict__ rows, int start, int n, long long total,
    u16* __restrict__ out, long long stride_b, long long stride_h, long long stride_t, float l0, float l1, float l2,
    float l3) {
  for (long long x = (long long)blockIdx.x * blockDim.x + threadIdx.x; x < total;
       x += (long long)gridDim.x * blockDim.x) {
    const int rb = (int)(x % BPT);
    const long long token = x / BPT;
    const int t = (int)(token % n), h = (int)(token / n % H), i = (int)(token / n / H);
    const long long row = (long long)rows[i] * H + h;  // the storage's (sequence, head)
    const int s = start + t;
    u16* dst = out + i * stride_b + h * stride_h + t * stride_t + rb * CPB;
#pragma unroll
    for (int p = 0; p < CPB; ++p) {
      const int c = rb * CPB + p, code = code_at(codes, row, cap, s, c);
      const long long param = param_at(row, cap, s, c);
      const float sc = param_value(scale[param]), zr = param_value(zero[param]);
#if LEVEL_TABLE
      const float q = code == 0 ? l0 : code == 1 ? l1 : code == 2 ? l2 : l3;
#else
      const float q = (float)code;
#endif
#if ZERO_FLOAT
      float v = __fadd_rn(__fmul_rn(q, sc), zr);
#else
      float v = __fmul_rn(__fsub_rn(q, zr), sc);
#endif
#if KEY_NORM
      v = __fmul_rn(v, norm[(long long)rows[i] * cap + s]);
#endif
      dst[p] = to_dtype(v);
    }
  }
}

#else  // TURBO
#if BITS != 2 || LAYOUT == 0
#error "TurboQuant+ codes are 2-bit, in the value tiles or the per-token key layout"
#endif
extern "C" __global__ void __launch_bounds__(256) dequantize_turboquant(
    const u8* __restrict__ codes, const u16* __restrict__ norm, const float* __restrict__ signs, int H, int cap,
    const int* __restrict__ rows, int start, int n, long long total_rows, float l0, float l1, float l2, float l3,
    float inv_sqrt_d, u16* __restrict__ out, long long stride_b, long long stride_h, long long stride_t) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long r = warp; r < total_rows; r += nwarps) {
    const int t = (int)(r % n), h = (int)(r / n % H), i = (int)(r / n / H);
    const long long row = (long long)rows[i] * H + h;
    const int s = start + t;
    float v[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int c = lane * EPL + e, code = code_at(codes, row, cap, s, c);
      const float level = code == 0 ? l0 : code == 1 ? l1 : code == 2 ? l2 : l3;
      v[e] = __fmul_rn(level, f16_to_float(norm[param_at(row, cap, s, c)]));
    }
    warp_hadamard(v, lane, inv_sqrt_d);
    u16* dst = out + i * stride_b + h * stride_h + t * stride_t + lane * EPL;
#pragma unroll
    for (int e = 0; e < EPL; ++e) dst[e] = to_dtype(__fmul_rn(v[e], signs[lane * EPL + e]));
  }
}
#endif  // TURBO
