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
__device__ __forceinline__ u16 to_dtype(float f) {
  u16 h;
#if IS_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
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
