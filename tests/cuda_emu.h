// CPU emulation of the CUDA features kernels/quantize.cu and kernels/decode_attention.cu use, for
// tests/test_kernels.py and tests/test_decode_emulated.py: one fiber per CUDA thread (ucontext, run in turn on the
// calling thread), fiber barriers for __syncthreads/__syncwarp, the warp shuffles, votes and tensor-core products,
// IEEE host arithmetic for the device math (build with -ffp-contract=off -frounding-math) and host versions of the
// PTX the kernels use (the tests rewrite each asm statement, or the helper around it, into a call of an emu_
// function).
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
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
inline Dim3 threadIdx, blockIdx;  // the running fiber's (set by the scheduler before it resumes one)
inline Dim3 blockDim, gridDim;

// A block's threads are fibers that run in turn until each returns or waits at a barrier. A barrier's phase ends
// when its last expected thread arrives; a thread that returns drops out of its warp's and its block's barriers.
struct EmuBarrier {
  unsigned expected = 0, arrived = 0;
  unsigned long phase = 0;
  void arrive_and_wait();
  void arrive_and_drop() {
    if (--expected == arrived && arrived) arrived = 0, ++phase;
  }
};
struct EmuFiber {
  ucontext_t context;
  Dim3 thread;
  const EmuBarrier* waits_on = nullptr;  // resumed once this barrier's phase is past waits_phase
  unsigned long waits_phase = 0;
  bool done = false;
};
inline ucontext_t emu_scheduler;
inline EmuFiber* emu_running;
inline void EmuBarrier::arrive_and_wait() {
  if (++arrived == expected) {
    arrived = 0, ++phase;
    return;
  }
  emu_running->waits_on = this, emu_running->waits_phase = phase;
  swapcontext(&emu_running->context, &emu_scheduler);
}

struct EmuMmaFragment { unsigned a[4], b[2]; };
struct EmuWarp { EmuBarrier bar; uint64_t slot[32]; EmuMmaFragment frag[32]; };
struct EmuBlock { EmuBarrier bar; std::vector<EmuWarp> warps; unsigned char* smem; };
inline EmuBlock* emu_block;  // blocks run one after the other
inline unsigned char* emu_smem() { return emu_block->smem; }
inline void __syncthreads() { emu_block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_block->warps[threadIdx.x / 32].bar.arrive_and_wait(); }

template <class T> T emu_exchange(T v, int src) {
  EmuWarp& w = emu_block->warps[threadIdx.x / 32];
  uint64_t x = 0;
  memcpy(&x, &v, sizeof(T));
  w.slot[threadIdx.x & 31] = x;
  w.bar.arrive_and_wait();
  T r;
  memcpy(&r, &w.slot[src & 31], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}
template <class T> T __shfl_xor_sync(unsigned, T v, int m) { return emu_exchange(v, (threadIdx.x & 31) ^ m); }
template <class T> T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src); }
inline int __any_sync(unsigned, int p) {
  EmuWarp& w = emu_block->warps[threadIdx.x / 32];
  w.slot[threadIdx.x & 31] = p != 0;
  w.bar.arrive_and_wait();
  int any = 0;
  for (int i = 0; i < 32; ++i) any |= (int)w.slot[i];
  w.bar.arrive_and_wait();
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
  w.bar.arrive_and_wait();
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
  w.bar.arrive_and_wait();
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

// the fibers' stacks, kept from launch to launch (pages never touched cost no memory)
constexpr size_t EMU_STACK_BYTES = 1 << 20;
inline std::vector<std::unique_ptr<char[]>> emu_stacks;
inline const std::function<void()>* emu_body;
inline void emu_thread_main() {
  (*emu_body)();
  emu_block->warps[threadIdx.x / 32].bar.arrive_and_drop();  // a thread that returned early waits no more
  emu_block->bar.arrive_and_drop();
  emu_running->done = true;  // returns to the scheduler (uc_link)
}

// runs body() as every thread of a grid of blocks of block.x threads with smem_bytes of shared memory: the block's
// threads as fibers, resumed in thread order and in reverse on alternate rounds, odd blocks starting in reverse (so
// that a read of another thread's write with no barrier between them finds the old bytes in one block or another);
// a block whose threads all wait at barriers that cannot complete (a __syncthreads or warp operation some threads
// skip) aborts the test's process with a message
inline void emu_launch(Dim3 grid, Dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  gridDim = grid;
  blockDim = block;
  std::vector<unsigned char> smem(smem_bytes + EMU_SMEM_GUARD);
  while (emu_stacks.size() < block.x) emu_stacks.emplace_back(new char[EMU_STACK_BYTES]);
  std::vector<EmuFiber> fibers(block.x);
  emu_body = &body;
  for (unsigned b = 0; b < grid.x * grid.y * grid.z; ++b) {
    blockIdx = {b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
    EmuBlock blk;
    blk.bar.expected = block.x;
    blk.warps.resize((block.x + 31) / 32);
    for (unsigned w = 0; w < blk.warps.size(); ++w) blk.warps[w].bar.expected = min(32u, block.x - 32 * w);
    std::fill(smem.begin(), smem.end(), EMU_SMEM_FILL);  // no block reads what another left
    blk.smem = smem.data();
    emu_block = &blk;
    for (unsigned t = 0; t < block.x; ++t) {
      EmuFiber& f = fibers[t];
      f = EmuFiber{};
      f.thread = {t, 0, 0};
      getcontext(&f.context);
      f.context.uc_stack = {emu_stacks[t].get(), 0, EMU_STACK_BYTES};
      f.context.uc_link = &emu_scheduler;
      makecontext(&f.context, emu_thread_main, 0);
    }
    for (unsigned round = 0, left = block.x; left; ++round) {
      bool resumed = false;
      for (unsigned i = 0; i < block.x; ++i) {
        EmuFiber& f = fibers[(round + b) % 2 ? block.x - 1 - i : i];
        if (f.done || (f.waits_on && f.waits_on->phase == f.waits_phase)) continue;
        f.waits_on = nullptr;
        emu_running = &f;
        threadIdx = f.thread;
        swapcontext(&emu_scheduler, &f.context);
        resumed = true;
        left -= f.done;
      }
      if (!resumed) {
        std::fprintf(stderr, "emu_launch: block %u's threads all wait at barriers that cannot complete\n", b);
        std::abort();
      }
    }
    emu_check_smem_guard(smem, smem_bytes);
  }
}
