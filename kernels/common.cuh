// Helpers shared by the CUDA sources (NVRTC friendly: no CUDA headers). The including file defines
// HEAD_DIM (64, 128 or 256) and IS_BF16 (1: the model dtype is bf16, 0: fp16) before the include.
#pragma once
#define D HEAD_DIM
#define EPL (D / 32)
#define FULL_MASK 0xffffffffu
#if (D != 64) && (D != 128) && (D != 256)
#error "HEAD_DIM must be 64, 128 or 256"
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
// an fp16 value as float whatever the model dtype (TurboQuant+'s norms are stored in fp16)
__device__ __forceinline__ float f16_to_float(u16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
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
// scale and zero of one group from its min and max, as quantize_groups(zero_point="int") computes them (scale and
// zero stored in the model dtype; inv_levels = fp32(1 / levels), what CUDA torch multiplies by for `/ levels`)
__device__ __forceinline__ void group_params(float lo, float hi, float inv_levels, float& scale, float& zero) {
  float span = hi - lo;
  float s = (span == 0.f) ? ((lo == 0.f) ? 1.f : fabsf(lo)) : span * inv_levels;
  scale = round_dtype(s);
  zero = round_dtype(rintf(-lo / scale));
}
// (lo, hi) rounded to the dtype as one packed pair, lo in bits 0-15
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if IS_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
// (lo, hi) rounded to fp16 as one packed pair, lo in bits 0-15 (whatever the model dtype)
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// a * b + c on fp16 pairs, rounded to fp16 (whatever the model dtype)
__device__ __forceinline__ u32 fma_half2(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
// c += A B: m16n8k16, fp16 operands, fp32 accumulate (A rows g, g + 8 and k = 2q, 2q + 1 | 2q + 8, 2q + 9 of
// lane (g, q); B column g, the same k; C rows g, g + 8, columns 2q, 2q + 1)
__device__ __forceinline__ void mma_f16(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void load_row(const u16* row, int lane, float v[EPL]) {
#pragma unroll
  for (int i = 0; i < EPL; ++i) v[i] = to_float(row[lane * EPL + i]);
}
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

// Decode layout of packed keys (kernels.ops.key_decode_layout): the scale/zero rows [D] keep their codes'
// channel blocks of one 32-bit code word (4 * 8 / bits channels), and inside a block channel hb * (8 / bits) + p
// (code position p of byte hb) moves to 4 p + 2 (hb % 2) + hb / 2: the channels of bytes (0, 2) and (1, 3) at
// code position p, which decode_attention pairs in one tensor-core register, are adjacent.
__host__ __device__ __forceinline__ int decode_key_param_offset(int c, int bits) {
  const int cpb = 8 / bits, i = c % (4 * cpb), hb = i / cpb, p = i % cpb;
  return c - i + 4 * p + 2 * (hb % 2) + hb / 2;
}

// Decode layout of packed values (kernels.ops.value_decode_layout; the backend stores values this way): inside
// every 16-token tile of the storage, the bytes move so that lane 4r + q of decode_attention loads its
// tensor-core operands as whole words. Lane 4r + q takes tokens t = 2q, 2q + 1, 2q + 8, 2q + 9 of the tile and
// code bytes r * NBG .. r * NBG + NBG - 1 of every value group (NBG = code bytes per group / 8).
//   codes [16 tokens x BPT bytes]: byte cb of token t to lane (r, q) word g * NBG + jb, byte slot
//   (t0, t8, t1, t9), so the word's 16-bit halves are the tokens (t0, t1) of two A-fragment rows;
//   scale/zero [16 tokens x NVG]: group g of token t to lane quad q, pair g, slot (t0, t1, t8, t9).
// code_bytes_per_group = G * bits / 8, a multiple of 8.
__host__ __device__ __forceinline__ int decode_code_offset(int t, int cb, int bytes_per_token,
                                                           int code_bytes_per_group) {
  const int nbg = code_bytes_per_group / 8, g = cb / code_bytes_per_group, w = cb % code_bytes_per_group;
  const int q = (t & 7) >> 1, slot = ((t & 1) << 1) | (t >> 3);
  return ((w / nbg) * 4 + q) * (bytes_per_token / 2) + (g * nbg + w % nbg) * 4 + slot;
}
__host__ __device__ __forceinline__ int decode_param_offset(int t, int g, int groups_per_token) {
  return (((t & 7) >> 1) * groups_per_token + g) * 4 + ((t & 1) | ((t >> 3) << 1));
}

// Decode layout of per-token key codes (QuaRot's and TurboQuant+'s keys; kernels.ops.token_key_decode_layout): the
// codes of every token row are permuted so that k-step ks of decode_attention's score product covers channels
// 16 ks .. 16 ks + 15, and a k-step never straddles two channel groups. Lane quad q4 reads row bytes q4 * BQ ..
// (BQ = bytes per row / 4) as words; code position p of byte j of its word wi is the A operand of k-step
// ks = wi * CPB + p (CPB = 8 / bits codes per byte) at k = 2 q4 + (j >> 1) + 8 (j & 1). Channel c = 16 ks + k sits
// at code position ks % CPB of this byte of its row:
__host__ __device__ __forceinline__ int token_key_code_byte(int c, int bytes_per_token, int bits) {
  const int cpb = 8 / bits, ks = c / 16, k = c % 16;
  return ((k & 7) >> 1) * (bytes_per_token / 4) + 4 * (ks / cpb) + (((k & 1) << 1) | (k >> 3));
}
// ... and its inverse: the channel at code position p of byte `byte` of a row
__host__ __device__ __forceinline__ int token_key_channel(int byte, int p, int bytes_per_token, int bits) {
  const int bq = bytes_per_token / 4, q4 = byte / bq, wi = (byte % bq) / 4, j = byte % 4;
  return 16 * (wi * (8 / bits) + p) + 2 * q4 + (j >> 1) + 8 * (j & 1);
}
