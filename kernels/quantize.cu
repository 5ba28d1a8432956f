// OScaR quantization kernels: query/key Hadamard, fused key preprocessing, value quantization.
//
// Each kernel mirrors one torch reference function bit for bit (see kernels/ops.py):
//   hadamard_rows  <-> oscar.quant.hadamard                      (fp32 butterflies, natural order)
//   quantize_keys  <-> methods.oscar.OScaR.quantize_keys         (Hadamard, token norm, per-channel groups)
//   quantize_values<-> oscar.quant.quantize_groups(axis="token")  (per-token groups of G channels)
// Compile-time: HEAD_DIM, BITS, GROUP, IS_BF16 (model dtype bf16, else fp16).
// Storage dtype values travel as raw 16-bit words; no CUDA headers are needed (NVRTC friendly).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BITS
#define BITS 2
#endif
#ifndef GROUP
#define GROUP 32
#endif
#ifndef IS_BF16
#define IS_BF16 1
#endif
// quantize_keys benchmark variants that stop early (timed against the full kernel to place the time):
// 0 = full kernel, 1 = rotate + token norms only, 2 = ... + division by the norm (no quantization)
#ifndef MODE
#define MODE 0
#endif

#define D HEAD_DIM
#define G GROUP
#define EPL (D / 32)             // elements per lane when a warp holds one row of D
#define LEVELS ((1 << BITS) - 1)
#define CPB (8 / BITS)           // codes per byte
#define BPT (D * BITS / 8)       // packed bytes per row

#if (D != 64) && (D != 128) && (D != 256)
#error "HEAD_DIM must be 64, 128 or 256"
#endif
#if (BITS != 2) && (BITS != 4)
#error "BITS must be 2 or 4"
#endif

typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned int u32;

__device__ __forceinline__ float to_float(u16 x) {
#if IS_BF16
  return __uint_as_float(((u32)x) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#endif
}

__device__ __forceinline__ u16 to_dtype(float f) {
  u16 h;
#if IS_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

// x rounded to the model dtype and read back (what `.to(dtype).float()` does in torch)
__device__ __forceinline__ float round_dtype(float f) { return to_float(to_dtype(f)); }

// lane holds elements lane*EPL .. lane*EPL+EPL-1 of one row
__device__ __forceinline__ void load_row(const u16* row, int lane, float v[EPL]) {
  const u16* p = row + lane * EPL;
#if EPL == 2
  u32 w = *reinterpret_cast<const u32*>(p);
  v[0] = to_float((u16)(w & 0xffff)); v[1] = to_float((u16)(w >> 16));
#elif EPL == 4
  uint2 w = *reinterpret_cast<const uint2*>(p);
  v[0] = to_float((u16)(w.x & 0xffff)); v[1] = to_float((u16)(w.x >> 16));
  v[2] = to_float((u16)(w.y & 0xffff)); v[3] = to_float((u16)(w.y >> 16));
#else
  uint4 w = *reinterpret_cast<const uint4*>(p);
  u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) { v[2 * i] = to_float((u16)(ws[i] & 0xffff)); v[2 * i + 1] = to_float((u16)(ws[i] >> 16)); }
#endif
}

// Normalized Walsh-Hadamard transform of one row held by a warp, in torch's order:
// stages h = 1, 2, 4, ... with (a, b) -> (a + b, a - b) for the pair (i, i + h), then * (1/sqrt(D)).
__device__ __forceinline__ void warp_hadamard(float v[EPL], int lane, float inv_sqrt_d) {
#pragma unroll
  for (int h = 1; h < EPL; h *= 2) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (!(i & h)) { float a = v[i], b = v[i + h]; v[i] = a + b; v[i + h] = a - b; }
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m *= 2) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      float o = __shfl_xor_sync(0xffffffffu, v[i], m);
      v[i] = (lane & m) ? (o - v[i]) : (v[i] + o);
    }
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) v[i] = v[i] * inv_sqrt_d;
}

// y[r] = hadamard(x[r]) in the model dtype for `rows` rows of D (one warp per row, grid-stride).
extern "C" __global__ void hadamard_rows(const u16* __restrict__ x, u16* __restrict__ y, long long rows,
                                         float inv_sqrt_d) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long r = warp; r < rows; r += nwarps) {
    float v[EPL];
    load_row(x + r * D, lane, v);
    warp_hadamard(v, lane, inv_sqrt_d);
#pragma unroll
    for (int i = 0; i < EPL; ++i) y[r * D + lane * EPL + i] = to_dtype(v[i]);
  }
}

// scale and zero of one group from its min and max, as quantize_groups(zero_point="int") computes them
__device__ __forceinline__ void group_params(float lo, float hi, float inv_levels, float& scale, float& zero) {
  float span = hi - lo;
  float s = (span == 0.f) ? ((lo == 0.f) ? 1.f : fabsf(lo)) : span * inv_levels;
  scale = round_dtype(s);
  zero = round_dtype(rintf(-lo / scale));
}

__device__ __forceinline__ u32 quant_code(float x, float scale, float zero) {
  float q = rintf(x / scale) + zero;
  q = fminf(fmaxf(q, 0.f), (float)LEVELS);
  return (u32)q;
}

// Fused key preprocessing for one group of G tokens of one sequence (grid: T/G x b, 256 threads):
//   kh = hadamard(k) per head (if rotate; else k is already rotated), n_t = ||kh_t|| over all heads and
//   channels (fp32, 0 -> 1), x = (kh / n_t) in the model dtype, per-channel groups of G tokens with an
//   integer zero point, packed along D. Input k: [b, H, T, D] contiguous. Outputs are written into
//   storage of capacity `cap` tokens at batch row out_row[i] and token offset out_off[i] (a multiple of G):
//   codes [*, H, cap, D*BITS/8] u8, scale/zero [*, H, cap/G, D], norm [*, cap] fp32.
// Dynamic shared memory: G*H*D*2 + G*H*4 + G*4 bytes.
extern "C" __global__ void __launch_bounds__(256) quantize_keys(
    const u16* __restrict__ k, int H, int T, int rotate, float inv_sqrt_d, float inv_levels,
    u8* __restrict__ codes, u16* __restrict__ scale_out, u16* __restrict__ zero_out, float* __restrict__ norm_out,
    int cap, const int* __restrict__ out_row, const int* __restrict__ out_off) {
  extern __shared__ __align__(16) unsigned char smem[];
  u16* kh = reinterpret_cast<u16*>(smem);                        // [G][H][D], model dtype
  float* part = reinterpret_cast<float*>(smem + G * H * D * 2);  // [G][H] partial sums of squares
  float* nrm = part + G * H;                                     // [G]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
  const int b = blockIdx.y, t0 = blockIdx.x * G;

  // 1. rotate every (token, head) row, round to the model dtype, partial sums of squares
  for (int row = warp; row < G * H; row += nwarp) {
    const int t = row / H, h = row % H;
    float v[EPL];
    load_row(k + (((long long)b * H + h) * T + t0 + t) * D, lane, v);
    if (rotate) warp_hadamard(v, lane, inv_sqrt_d);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      u16 r = to_dtype(v[i]);
      float f = to_float(r);
      ss += f * f;
      kh[row * D + lane * EPL + i] = r;
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    if (lane == 0) part[row] = ss;
  }
  __syncthreads();
  const int orow = out_row[blockIdx.y], off = out_off[blockIdx.y] + t0;
  // 2. token norms over all heads and channels
  if (threadIdx.x < G) {
    float ss = 0.f;
    for (int h = 0; h < H; ++h) ss += part[threadIdx.x * H + h];
    float n = sqrtf(ss);
    n = (n == 0.f) ? 1.f : n;
    nrm[threadIdx.x] = n;
    norm_out[(long long)orow * cap + off + threadIdx.x] = n;
  }
#if MODE == 1
  return;
#endif
  __syncthreads();
  // 3. x = kh / n in the model dtype, in place
  for (int e = threadIdx.x; e < G * H * D; e += blockDim.x) {
    const int t = e / (H * D);
    kh[e] = to_dtype(to_float(kh[e]) / nrm[t]);
  }
#if MODE == 2
  return;
#endif
  __syncthreads();
  // 4. per (head, byte of CPB channels): group min/max over G tokens, scale/zero, codes, packed bytes
  for (int c = threadIdx.x; c < H * BPT; c += blockDim.x) {
    const int h = c / BPT, j = c % BPT;
    float sc[CPB], zr[CPB];
#pragma unroll
    for (int i = 0; i < CPB; ++i) {
      const int ch = j * CPB + i;
      float lo = 3.4e38f, hi = -3.4e38f;
      for (int t = 0; t < G; ++t) {
        float x = to_float(kh[(t * H + h) * D + ch]);
        lo = fminf(lo, x); hi = fmaxf(hi, x);
      }
      group_params(lo, hi, inv_levels, sc[i], zr[i]);
      const long long pidx = (((long long)orow * H + h) * (cap / G) + off / G) * D + ch;
      scale_out[pidx] = to_dtype(sc[i]);
      zero_out[pidx] = to_dtype(zr[i]);
    }
    for (int t = 0; t < G; ++t) {
      u32 byte = 0;
#pragma unroll
      for (int i = 0; i < CPB; ++i)
        byte |= quant_code(to_float(kh[(t * H + h) * D + j * CPB + i]), sc[i], zr[i]) << (i * BITS);
      codes[(((long long)orow * H + h) * cap + off + t) * BPT + j] = (u8)byte;
    }
  }
}

// Value quantization: per token and head, groups of G consecutive channels, integer zero point.
// Input v: [b, H, T, D] contiguous; one warp per (row, head, token). Outputs into storage of capacity
// `cap` at row out_row[i], token offset out_off[i]: codes [*, H, cap, D*BITS/8], scale/zero [*, H, cap, D/G].
extern "C" __global__ void quantize_values(
    const u16* __restrict__ v, int b, int H, int T, float inv_levels,
    u8* __restrict__ codes, u16* __restrict__ scale_out, u16* __restrict__ zero_out,
    int cap, const int* __restrict__ out_row, const int* __restrict__ out_off) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  const long long rows = (long long)b * H * T;
  constexpr int LPG = G / EPL;  // lanes per channel group
  for (long long r = warp; r < rows; r += nwarps) {
    const int t = (int)(r % T);
    const int h = (int)((r / T) % H);
    const int i = (int)(r / ((long long)T * H));
    float x[EPL];
    load_row(v + r * D, lane, x);
    float lo = x[0], hi = x[0];
#pragma unroll
    for (int e = 1; e < EPL; ++e) { lo = fminf(lo, x[e]); hi = fmaxf(hi, x[e]); }
#pragma unroll
    for (int m = 1; m < LPG; m *= 2) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, m));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, m));
    }
    float sc, zr;
    group_params(lo, hi, inv_levels, sc, zr);
    const long long tok = ((long long)out_row[i] * H + h) * cap + out_off[i] + t;
    if (lane % LPG == 0) {
      scale_out[tok * (D / G) + lane / LPG] = to_dtype(sc);
      zero_out[tok * (D / G) + lane / LPG] = to_dtype(zr);
    }
    u32 bits = 0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) bits |= quant_code(x[e], sc, zr) << (e * BITS);
    constexpr int LANE_BITS = EPL * BITS;  // 4, 8, 16 or 32
    u8* dst = codes + tok * BPT;
    if (LANE_BITS == 4) {
      u32 other = __shfl_down_sync(0xffffffffu, bits, 1);
      if ((lane & 1) == 0) dst[lane / 2] = (u8)(bits | (other << 4));
    } else {
#pragma unroll
      for (int byte = 0; byte < LANE_BITS / 8; ++byte) dst[lane * (LANE_BITS / 8) + byte] = (u8)(bits >> (8 * byte));
    }
  }
}

// One new token per sequence into the residual windows at position n_res[b]: the key row rotated (as
// hadamard_rows) when `rotate`, the value row copied. k, v: [B, H, D]; kr, vr: [B, H, rcap, D].
// One warp per (sequence, head).
extern "C" __global__ void append_residual(const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ kr,
                                           u16* __restrict__ vr, const int* __restrict__ n_res, int B, int H,
                                           int rcap, int rotate, float inv_sqrt_d) {
  const int lane = threadIdx.x & 31;
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (row >= B * H) return;
  const long long dst = ((long long)row * rcap + n_res[row / H]) * D;
  float x[EPL];
  load_row(k + (long long)row * D, lane, x);
  if (rotate) warp_hadamard(x, lane, inv_sqrt_d);
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    kr[dst + lane * EPL + i] = to_dtype(x[i]);
    vr[dst + lane * EPL + i] = v[(long long)row * D + lane * EPL + i];
  }
}
