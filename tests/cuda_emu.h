// CPU emulation of the CUDA features kernels/quantize.cu and kernels/decode_attention.cu use, for
// tests/test_kernels.py and tests/test_decode_emulated.py: one std::thread per CUDA thread, barriers for
// __syncthreads/__syncwarp, the warp shuffles, votes and tensor-core products, IEEE host arithmetic for the
// device math (build with -ffp-contract=off -frounding-math) and host versions of the PTX the kernels use
// (the tests rewrite each asm statement, or the helper around it, into a call of an emu_ function).
#pragma once
#include <barrier>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
using std::min;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 blockDim, gridDim;

struct EmuMmaFragment { unsigned a[4], b[2]; };
struct EmuWarp { std::unique_ptr<std::barrier<>> bar; uint64_t slot[32]; EmuMmaFragment frag[32]; };
struct EmuBlock { std::unique_ptr<std::barrier<>> bar; std::vector<EmuWarp> warps; unsigned char* smem; };
inline EmuBlock* emu_block;  // blocks run one after the other
inline unsigned char* emu_smem() { return emu_block->smem; }
inline void __syncthreads() { emu_block->bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_block->warps[threadIdx.x / 32].bar->arrive_and_wait(); }

template <class T> T emu_exchange(T v, int src) {
  EmuWarp& w = emu_block->warps[threadIdx.x / 32];
  uint64_t x = 0;
  memcpy(&x, &v, sizeof(T));
  w.slot[threadIdx.x & 31] = x;
  w.bar->arrive_and_wait();
  T r;
  memcpy(&r, &w.slot[src & 31], sizeof(T));
  w.bar->arrive_and_wait();
  return r;
}
template <class T> T __shfl_xor_sync(unsigned, T v, int m) { return emu_exchange(v, (threadIdx.x & 31) ^ m); }
template <class T> T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src); }
inline int __any_sync(unsigned, int p) {
  EmuWarp& w = emu_block->warps[threadIdx.x / 32];
  w.slot[threadIdx.x & 31] = p != 0;
  w.bar->arrive_and_wait();
  int any = 0;
  for (int i = 0; i < 32; ++i) any |= (int)w.slot[i];
  w.bar->arrive_and_wait();
  return any;
}

// mma.sync m16n8kK (K = 8 or 16), row-major A [16 x K], column-major B [K x 8], fp32 C/D, 16-bit elements
// read by value(): lane 4r + q holds A rows (r, r + 8) at k = (2q, 2q + 1) (+ 8 in registers 2, 3) and B
// column r at the same k; D rows (r, r + 8), columns (2q, 2q + 1). Products are exact in fp32 for 16-bit
// inputs and are summed in k order.
inline void emu_mma(float c[4], const unsigned* a, const unsigned* b, int K, float (*value)(unsigned short)) {
  EmuWarp& w = emu_block->warps[threadIdx.x / 32];
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
  for (int i = 0; i < K / 4; ++i) w.frag[lane].a[i] = a[i];
  for (int i = 0; i < K / 8; ++i) w.frag[lane].b[i] = b[i];
  w.bar->arrive_and_wait();
  auto half = [&](unsigned reg, int k) { return value((unsigned short)(reg >> (16 * (k & 1)))); };
  for (int i = 0; i < 4; ++i) {
    const int row = r + 8 * (i >> 1), col = 2 * q + (i & 1);
    float acc = c[i];
    for (int k = 0; k < K; ++k) {
      const unsigned areg = w.frag[4 * (row & 7) + (k & 7) / 2].a[(row >= 8) + 2 * (k >= 8)];
      const unsigned breg = w.frag[4 * col + (k & 7) / 2].b[k >= 8];
      acc += half(areg, k) * half(breg, k);
    }
    c[i] = acc;
  }
  w.bar->arrive_and_wait();
}

inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }  // CUDA's is within 2 ulp of this
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const uint64_t x = ((uint64_t)b << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((x >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

// 16-bit float formats
inline unsigned short emu_cvt_rn_bf16_f32(float f) {
  unsigned u = __float_as_uint(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
inline unsigned short emu_cvt_rn_f16_f32(float f) {
  const _Float16 h = (_Float16)f;
  unsigned short r;
  memcpy(&r, &h, 2);
  return r;
}
inline float emu_f16(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
inline float emu_bf16(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
inline float emu_cvt_f32_f16(unsigned short h) { return emu_f16(h); }
inline unsigned emu_cvt_rn_bf16x2_f32(float hi, float lo) {
  return ((unsigned)emu_cvt_rn_bf16_f32(hi) << 16) | emu_cvt_rn_bf16_f32(lo);
}
inline unsigned emu_cvt_rn_f16x2_f32(float hi, float lo) {
  return ((unsigned)emu_cvt_rn_f16_f32(hi) << 16) | emu_cvt_rn_f16_f32(lo);
}
template <class F> unsigned emu_halves(unsigned a, unsigned b, float (*value)(unsigned short), F f) {
  unsigned r = 0;
  for (int i = 0; i < 2; ++i) {
    const unsigned short x = (unsigned short)(a >> (16 * i)), y = (unsigned short)(b >> (16 * i));
    r |= (unsigned)f(x, y, value(x), value(y)) << (16 * i);
  }
  return r;
}
inline unsigned short emu_min(unsigned short x, unsigned short y, float fx, float fy) { return fy < fx ? y : x; }
inline unsigned short emu_max(unsigned short x, unsigned short y, float fx, float fy) { return fy > fx ? y : x; }
inline unsigned short emu_ge(unsigned short, unsigned short, float fx, float fy) { return fx >= fy ? 0xffff : 0; }
inline unsigned emu_min_bf16x2(unsigned a, unsigned b) { return emu_halves(a, b, emu_bf16, emu_min); }
inline unsigned emu_max_bf16x2(unsigned a, unsigned b) { return emu_halves(a, b, emu_bf16, emu_max); }
inline unsigned emu_min_f16x2(unsigned a, unsigned b) { return emu_halves(a, b, emu_f16, emu_min); }
inline unsigned emu_max_f16x2(unsigned a, unsigned b) { return emu_halves(a, b, emu_f16, emu_max); }
inline unsigned emu_set_ge_u32_bf16x2(unsigned a, unsigned b) { return emu_halves(a, b, emu_bf16, emu_ge); }
inline unsigned emu_set_ge_u32_f16x2(unsigned a, unsigned b) { return emu_halves(a, b, emu_f16, emu_ge); }
inline float emu_cvt_rp_f32_f64(double d) {
  std::fesetround(FE_UPWARD);
  volatile double vd = d;
  volatile float f = (float)vd;
  std::fesetround(FE_TONEAREST);
  return f;
}
inline unsigned short emu_cvt_rp_f16_f32(float f) {
  unsigned short h = emu_cvt_rn_f16_f32(f);
  if (emu_f16(h) < f)  // one step up: toward zero for negatives, -0 to the smallest positive
    h = (h & 0x8000) ? ((h & 0x7fff) ? (unsigned short)(h - 1) : (unsigned short)1) : (unsigned short)(h + 1);
  return h;
}

// the bytes after a block's shared memory that must stay as they were: a block that writes past its smem_bytes (a
// launcher's size out of step with the kernel's layout) aborts the test's process with a message
constexpr size_t EMU_SMEM_GUARD = 256;
constexpr unsigned char EMU_SMEM_FILL = 0xcd;
inline void emu_check_smem_guard(const std::vector<unsigned char>& smem, size_t smem_bytes) {
  for (size_t i = smem_bytes; i < smem.size(); ++i) {
    if (smem[i] != EMU_SMEM_FILL) {
      std::fprintf(stderr, "emu_launch: a block wrote byte %zu of shared memory, past the %zu bytes launched\n", i,
                   smem_bytes);
      std::abort();
    }
  }
}

// runs body() as every thread of a grid of blocks of block.x threads with smem_bytes of shared memory
inline void emu_launch(Dim3 grid, Dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  gridDim = grid;
  blockDim = block;
  std::vector<unsigned char> smem(smem_bytes + EMU_SMEM_GUARD, EMU_SMEM_FILL);
  for (unsigned b = 0; b < grid.x * grid.y * grid.z; ++b) {
    const unsigned bx = b % grid.x, by = b / grid.x % grid.y, bz = b / (grid.x * grid.y);
    EmuBlock blk;
    blk.bar = std::make_unique<std::barrier<>>(block.x);
    blk.warps.resize((block.x + 31) / 32);
    for (EmuWarp& w : blk.warps) w.bar = std::make_unique<std::barrier<>>(32);
    blk.smem = smem.data();
    emu_block = &blk;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block.x; ++t)
      threads.emplace_back([&, t, bx, by, bz] {
        threadIdx = {t, 0, 0};
        blockIdx = {bx, by, bz};
        body();
        blk.warps[t / 32].bar->arrive_and_drop();  // a thread that returned early waits no more
        blk.bar->arrive_and_drop();
      });
    for (std::thread& t : threads) t.join();
    emu_check_smem_guard(smem, smem_bytes);
  }
}
