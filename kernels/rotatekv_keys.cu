// RotateKV's keys between the model's space and the packed storage, bit for bit as CUDA torch runs the method's own
// quantize_keys and dequantize (methods/rotatekv.py): the cache's key flushes and a prefill chunk's prefix read.
//   rotatekv_quantize    post-RoPE keys k [b, HKV, T, D] (contiguous) at stream positions out_off[i] + t:
//                        z = P H_g RoPE_t^-1(k), quantized per token in groups of G channels of z (integer zero,
//                        min and max times the clip ratio), written to storage row out_row[i], token out_off[i] + t
//                        (null pointers: row i, token t): the codes in x's channel order (x = P^T z: the order of
//                        kernels.method_layouts.rotatekv_key_layout, reference packing per head row), scale and zero
//                        [*, HKV, cap, D / G] of z's groups, in the model dtype;
//   rotatekv_dequantize  tokens start .. start + n of storage rows rows[i]: k = RoPE_s(H_g P^T z_hat) at each token's
//                        position s, into out[i, h, t, :] (strides in elements, the last dim contiguous).
// The arithmetic is the torch code's, each operation rounded once in fp32 (its elementwise kernels): RoPE^-1 is
// (x cos - rh(x) sin) / (cos^2 + sin^2) and RoPE x cos + rh(x) sin (rh: rotate-half, rh(x)_i = -x_(i+D/2) for
// i < D/2, x_(i-D/2) above); H_g is oscar.quant.hadamard over the g D channels of HEAD_GROUP consecutive heads: its
// fp32 butterflies (a + b, a - b) in its order (channel bit 0 first), then the product with fp32(1 / sqrt(g D)), as
// CUDA torch divides by a Python number; P moves channels (z_j = x_order[j]); z is rounded to the model dtype, then
// quantize_groups: lo, hi = min, max times the clip ratio, scale = (hi - lo) * fp32(1 / levels) and zero =
// rint(-lo / scale) each rounded to the dtype (common.cuh's group_params), code = clamp(rint(z / scale) + zero);
// z_hat = (code - zero) * scale.
// cos/sin: `rope` [positions, D / 2] float2 (cos, sin), the model's own table (oscar.rope.rope_tables at positions
// 0, 1, ..: its two halves repeat), read at each token's position.
//
// A warp holds the head group of one token, E = g D / 32 channels per lane in the pair layout: value e of lane l is
// channel (l / LPH) D + e % HALF + (l % LPH) HALF + (e / HALF) D / 2 of the group (LPH = D / E lanes per head), so
// each RoPE pair (i, i + D/2) sits in one lane; the butterflies over the channel bits e holds are local, the others
// shuffles.
//   rotatekv_dequantize: blocks of 8 warps, one (token, head group, row) per warp, grid-stride.
//   rotatekv_quantize:   one block of HKV / HEAD_GROUP warps per token (P mixes every head of it), grid-stride;
//                        dynamic shared memory: z [HKV * D] fp32, then its codes [HKV * D] bytes.
// Compile-time: HEAD_DIM, BITS (2 or 4), GROUP, HEAD_GROUP (1, 2, 4 or 8), HKV (rotatekv_quantize), IS_BF16.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BITS
#define BITS 2
#endif
#ifndef GROUP
#define GROUP 32
#endif
#ifndef HEAD_GROUP
#define HEAD_GROUP 4
#endif
#ifndef HKV
#define HKV 8
#endif
#ifndef IS_BF16
#define IS_BF16 1
#endif

#include "common.cuh"

#define GD (HEAD_GROUP * D)  // channels of a head group
#define E (GD / 32)          // channels per lane
#define HALF (E / 2)
#define LPH (D / E)          // lanes per head
#define NG (D / GROUP)       // groups per head row
#define CPB (8 / BITS)       // codes per byte
#define BPT (D * BITS / 8)   // code bytes per head row
#define LEVELS ((1 << BITS) - 1)

#if (BITS != 2) && (BITS != 4)
#error "BITS must be 2 or 4"
#endif
#if (HEAD_GROUP != 1) && (HEAD_GROUP != 2) && (HEAD_GROUP != 4) && (HEAD_GROUP != 8)
#error "HEAD_GROUP must be 1, 2, 4 or 8"
#endif
#if (D % GROUP) || (GROUP % 8) || (HKV % HEAD_GROUP) || (HKV / HEAD_GROUP > 32)
#error "unsupported GROUP / HKV"
#endif

// channel (within the head group) of the lane's value e
__device__ __forceinline__ int pair_channel(int lane, int e) {
  return (lane / LPH) * D + e % HALF + (lane % LPH) * HALF + (e / HALF) * (D / 2);
}

// the RoPE frequency (channel mod D / 2) of the lane's value e
__device__ __forceinline__ int pair_frequency(int lane, int e) { return e % HALF + (lane % LPH) * HALF; }

// oscar.quant.hadamard's butterflies over the group's channels (unnormalized): channel bit b is e's bit for b below
// log2 HALF and for the D / 2 bit, a lane bit otherwise (within the head, then the group's heads)
__device__ __forceinline__ void group_hadamard(float y[E], int lane) {
#pragma unroll
  for (int bit = 1; bit < GD; bit *= 2) {
    const int local = bit < HALF ? bit : bit == D / 2 ? HALF : 0;
    if (local) {
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (!(e & local)) { const float a = y[e], b = y[e + local]; y[e] = a + b; y[e + local] = a - b; }
    } else {
      const int m = bit < D / 2 ? bit / HALF : LPH * (bit / D);  // the lane bit that holds channel bit `bit`
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float o = __shfl_xor_sync(FULL_MASK, y[e], m);
        y[e] = (lane & m) ? o - y[e] : y[e] + o;
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(256) rotatekv_dequantize(
    const u8* __restrict__ codes, const u16* __restrict__ scale, const u16* __restrict__ zero,
    const short* __restrict__ z_index,  // [H * D]: the z position of each x channel (argsort of the order)
    const float2* __restrict__ rope, int H, int cap, const int* __restrict__ rows, int start, int n, long long tasks,
    float inv_sqrt_gd, u16* __restrict__ out, long long stride_b, long long stride_h, long long stride_t) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  const int groups = H / HEAD_GROUP;
  for (long long r = warp; r < tasks; r += nwarps) {
    const int t = (int)(r % n), hg = (int)(r / n % groups), i = (int)(r / n / groups);
    const int s = start + t;
    const long long row = rows[i];
    float y[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int x = hg * GD + pair_channel(lane, e), head = x / D, c = x % D;
      const int code = (codes[((row * H + head) * cap + s) * BPT + c / CPB] >> (c % CPB * BITS)) & LEVELS;
      const int gz = z_index[x] / GROUP;  // its z group among the token's H * D / G
      const long long p = ((row * H + gz / NG) * cap + s) * NG + gz % NG;
      y[e] = __fmul_rn(__fsub_rn((float)code, to_float(zero[p])), to_float(scale[p]));
    }
    group_hadamard(y, lane);
    u16* dst = out + i * stride_b + (long long)(hg * HEAD_GROUP + lane / LPH) * stride_h + t * stride_t;
#pragma unroll
    for (int e = 0; e < HALF; ++e) {
      const int f = pair_frequency(lane, e);
      const float2 cs = rope[(long long)s * (D / 2) + f];
      const float lo = __fmul_rn(y[e], inv_sqrt_gd), hi = __fmul_rn(y[e + HALF], inv_sqrt_gd);
      dst[f] = to_dtype(__fadd_rn(__fmul_rn(lo, cs.x), __fmul_rn(-hi, cs.y)));
      dst[f + D / 2] = to_dtype(__fadd_rn(__fmul_rn(hi, cs.x), __fmul_rn(lo, cs.y)));
    }
  }
}

#define NW (HKV / HEAD_GROUP)  // warps of a rotatekv_quantize block
#define NGA (HKV * NG)         // z groups of a token

extern "C" __global__ void __launch_bounds__(32 * NW) rotatekv_quantize(
    const u16* __restrict__ k, const float2* __restrict__ rope,
    const short* __restrict__ z_index,  // [HKV * D]: the z position of each x channel (argsort of the order)
    int T, long long tokens, float inv_sqrt_gd, float clip, float inv_levels, u8* __restrict__ codes,
    u16* __restrict__ scale_out, u16* __restrict__ zero_out, int cap, const int* __restrict__ out_row,
    const int* __restrict__ out_off) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* z_s = reinterpret_cast<float*>(smem);  // [HKV * D]
  u8* code_s = smem + 4 * HKV * D;               // [HKV * D]
  const int lane = threadIdx.x & 31, hg = threadIdx.x >> 5;
  for (long long token = blockIdx.x; token < tokens; token += gridDim.x) {
    const int i = (int)(token / T), t = (int)(token % T);
    const long long orow = out_row ? out_row[i] : i;
    const int pos = (out_off ? out_off[i] : 0) + t;
    // RoPE undone at the token's position, then the head group's Hadamard: z in the dtype, at its z position
    const u16* src = k + (((long long)i * HKV + hg * HEAD_GROUP + lane / LPH) * T + t) * D;
    float y[E];
#pragma unroll
    for (int e = 0; e < HALF; ++e) {
      const int f = pair_frequency(lane, e);
      const float2 cs = rope[(long long)pos * (D / 2) + f];
      const float lo = to_float(src[f]), hi = to_float(src[f + D / 2]);
      const float norm = __fadd_rn(__fmul_rn(cs.x, cs.x), __fmul_rn(cs.y, cs.y));
      y[e] = __fdiv_rn(__fsub_rn(__fmul_rn(lo, cs.x), __fmul_rn(-hi, cs.y)), norm);
      y[e + HALF] = __fdiv_rn(__fsub_rn(__fmul_rn(hi, cs.x), __fmul_rn(lo, cs.y)), norm);
    }
    group_hadamard(y, lane);
#pragma unroll
    for (int e = 0; e < E; ++e)
      z_s[z_index[hg * GD + pair_channel(lane, e)]] = round_dtype(__fmul_rn(y[e], inv_sqrt_gd));
    __syncthreads();
    // each z group: min and max over the warp, the parameters, every code
    for (int gz = hg; gz < NGA; gz += NW) {
      float lo = z_s[gz * GROUP + lane % GROUP], hi = lo;
      for (int j = lane + 32; j < GROUP; j += 32) {
        lo = fminf(lo, z_s[gz * GROUP + j]);
        hi = fmaxf(hi, z_s[gz * GROUP + j]);
      }
#pragma unroll
      for (int m = 16; m >= 1; m /= 2) {
        lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, m));
        hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, m));
      }
      float sc, zr;
      group_params(__fmul_rn(lo, clip), __fmul_rn(hi, clip), inv_levels, sc, zr);
      if (lane == 0) {
        const long long p = ((orow * HKV + gz / NG) * cap + pos) * NG + gz % NG;
        scale_out[p] = to_dtype(sc);
        zero_out[p] = to_dtype(zr);
      }
      for (int j = lane; j < GROUP; j += 32) {
        const float q = __fadd_rn(rintf(__fdiv_rn(z_s[gz * GROUP + j], sc)), zr);
        code_s[gz * GROUP + j] = (u8)fminf(fmaxf(q, 0.f), (float)LEVELS);
      }
    }
    __syncthreads();
    // the codes in x's order, CPB channels a byte
    for (int b = threadIdx.x; b < HKV * BPT; b += 32 * NW) {
      const int head = b / BPT, cb = b % BPT;
      u32 byte = 0u;
#pragma unroll
      for (int p = 0; p < CPB; ++p) byte |= (u32)code_s[z_index[head * D + cb * CPB + p]] << (p * BITS);
      codes[((orow * HKV + head) * cap + pos) * BPT + cb] = (u8)byte;
    }
    __syncthreads();  // z_s and code_s are the next token's
  }
}
