// OTT's key flush before KIVI's quantizer, on the device (kernels.ott_pool.pool_outliers): steps 1-4 of
// methods.ott.OTT.pool_outliers on a key chunk k [b, H, T, D] of stream positions start .. start + T, and the staging
// of the tokens it pools in the exact slots (kernels.kept_tokens.KeptTokens.stage), bit for bit:
//   1. per token and pool, the L2 norm of its key over the pool's heads (HPP = 1: per head, scope="head"; HPP = H:
//      over every head, scope="token") in fp32, as l2-safe as the reference: a slice whose largest magnitude lies
//      beyond 2^50 or below 2^-50 is scaled by its power of two first (oscar.quant.norm_scale);
//   2. per group of G tokens, the OPG smallest norms are candidates (ties: the earlier token);
//   3. candidates enter the pool (pool [B, m, PS] int64 stream positions, -1 = free, entries in use first) in token
//      order while it holds fewer than PS;
//   4. the chunk goes out as `filled`, each pooled token's slot holding a copy of its group's first token not pooled
//      (inside the group's range: the group's min and max are those of its other tokens);
//   staging, per head of the pool: a pooled token after the head's last staged position takes the next free slot
//      (keys and values as given, its position in slot_pos) and sets its skip bit; one past the slots sets only
//      the bit (the method never pools more than the slots).
// Two launches. ott_candidates: a warp per (chunk row i, pool j, group), grid (b * m, groups / NWARPS): the group's
// norms and candidates (cand [b, m, groups * OPG], token order), and its tokens copied into `filled`. ott_admit: a
// block per (i, j), rows[i] (int64) the row of the pool, the slots and the skip words: thread 0 admits (at most PS
// tokens) and stages, then the block copies the staged tokens into their slots and each pooled token's donor over it.
// Compile-time: HEAD_DIM, GROUP, IS_BF16, HPP (heads per pool), OPG (candidates per group, 1 .. G - 1).
// Dynamic shared memory: NWARPS * G floats (ott_candidates); (2 * HPP + 1) * PS + 2 ints (ott_admit).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 32
#endif
#ifndef IS_BF16
#define IS_BF16 1
#endif
#ifndef HPP
#define HPP 1
#endif
#ifndef OPG
#define OPG 1
#endif

#include "common.cuh"

#define G GROUP
#define NWARPS 4
#define PLAIN_NORM_RANGE 1125899906842624.f  // 2^50

#if (OPG < 1) || (OPG >= G)
#error "OTT's pool takes 1 .. G - 1 candidates per group"
#endif

// the L2 norm of token t over the pool's heads (a warp; every lane gets it)
__device__ __forceinline__ float token_norm(const u16* __restrict__ k, int T, int t, int lane) {
  float amax = 0.f;
#pragma unroll
  for (int h = 0; h < HPP; ++h) {
    const u16* row = k + ((long long)h * T + t) * D;
#pragma unroll
    for (int e = 0; e < EPL; ++e) amax = fmaxf(amax, fabsf(to_float(row[lane * EPL + e])));
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, m));
  float scale = 1.f;
  if (amax > PLAIN_NORM_RANGE || (amax < 1.f / PLAIN_NORM_RANGE && amax > 0.f)) {
    int exponent;
    frexpf(amax, &exponent);
    scale = ldexpf(1.f, exponent);
  }
  float sum = 0.f;
#pragma unroll
  for (int h = 0; h < HPP; ++h) {
    const u16* row = k + ((long long)h * T + t) * D;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const float x = to_float(row[lane * EPL + e]) / scale;
      sum += x * x;
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, m);
  return sqrtf(sum) * scale;
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32) ott_candidates(
    const u16* __restrict__ k, u16* __restrict__ filled, int H, int T, int m, int* __restrict__ cand) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int groups = T / G, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i = blockIdx.x / m, j = blockIdx.x % m, g = blockIdx.y * NWARPS + warp;
  if (g >= groups) return;  // no block-wide barrier below
  float* norms = (float*)smem + warp * G;
  const long long base = ((long long)i * H + j * HPP) * T * D;  // the pool's heads of chunk row i
  const u16* kb = k + base;
  for (int t = 0; t < G; ++t) {
    const float n = token_norm(kb, T, g * G + t, lane);
    if (lane == 0) norms[t] = n;
  }
  for (int h = 0; h < HPP; ++h) {  // the group's tokens, 16-byte words
    const uint4* from = (const uint4*)(kb + ((long long)h * T + g * G) * D);
    uint4* to = (uint4*)(filled + base + ((long long)h * T + g * G) * D);
    for (int w = lane; w < G * D / 8; w += 32) to[w] = from[w];
  }
  __syncwarp();
  int chosen[OPG];
  for (int r = 0; r < OPG; ++r) {
    float best = 0.f;
    int at = G;  // none yet
    for (int t = lane; t < G; t += 32) {
      bool taken = false;
      for (int q = 0; q < r; ++q) taken |= chosen[q] == t;
      if (!taken && (at == G || norms[t] < best)) { best = norms[t]; at = t; }
    }
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) {
      const float other_best = __shfl_xor_sync(FULL_MASK, best, s);
      const int other_at = __shfl_xor_sync(FULL_MASK, at, s);
      if (other_at != G && (at == G || other_best < best || (other_best == best && other_at < at))) {
        best = other_best;
        at = other_at;
      }
    }
    chosen[r] = at;
  }
  if (lane == 0) {
    for (int r = 1; r < OPG; ++r)  // token order
      for (int q = r; q > 0 && chosen[q - 1] > chosen[q]; --q) {
        const int x = chosen[q];
        chosen[q] = chosen[q - 1];
        chosen[q - 1] = x;
      }
    int* out = cand + ((long long)i * m + j) * groups * OPG + g * OPG;
    for (int r = 0; r < OPG; ++r) out[r] = g * G + chosen[r];
  }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32) ott_admit(
    const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ filled, int H, int T, int m,
    const int* __restrict__ cand, const long long* __restrict__ rows, long long start, long long* __restrict__ pool,
    int PS, u16* __restrict__ slot_keys, u16* __restrict__ slot_values, int* __restrict__ slot_pos, int S,
    int* __restrict__ skip, int W) {
  extern __shared__ __align__(16) unsigned char smem[];
  int* pooled = (int*)smem;          // [PS] tokens admitted, in token order
  int* staged = pooled + PS;         // [HPP * PS] pairs: (head * S + slot, index in pooled)
  int* counts = staged + 2 * HPP * PS;  // pooled, staged
  const int groups = T / G, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i = blockIdx.x / m, j = blockIdx.x % m, row = (int)rows[i];
  const long long base = ((long long)i * H + j * HPP) * T * D;
  const u16 *kb = k + base, *vb = v + base;
  if (threadIdx.x == 0) {
    const int* mine = cand + ((long long)i * m + j) * groups * OPG;
    long long* entries = pool + ((long long)row * m + j) * PS;
    int used = 0;
    for (int s = 0; s < PS; ++s) used += entries[s] >= 0;
    int n_pooled = 0;
    for (int c = 0; c < groups * OPG && used < PS; ++c) {
      pooled[n_pooled++] = mine[c];
      entries[used++] = start + mine[c];
    }
    int n_staged = 0;
    for (int h = 0; h < HPP; ++h) {
      const long long head = (long long)row * H + j * HPP + h;
      int* held = slot_pos + head * S;
      int in_use = 0, last = -1;
      for (int s = 0; s < S; ++s) {
        in_use += held[s] >= 0;
        last = held[s] > last ? held[s] : last;
      }
      for (int p = 0; p < n_pooled; ++p) {
        const long long position = start + pooled[p];
        if (position <= last) continue;  // staged already (a chunk quantized again)
        skip[head * W + position / 32] |= (int)(1u << (position % 32));
        if (in_use < S) {
          held[in_use] = (int)position;
          staged[2 * n_staged] = h * S + in_use;
          staged[2 * n_staged + 1] = p;
          ++n_staged;
          ++in_use;
        }
      }
    }
    counts[0] = n_pooled;
    counts[1] = n_staged;
  }
  __syncthreads();
  for (int e = warp; e < counts[1]; e += NWARPS) {  // the staged tokens into their slots
    const int h = staged[2 * e] / S, t = pooled[staged[2 * e + 1]];
    const long long to = (((long long)row * H + j * HPP) * S + staged[2 * e]) * D, from = ((long long)h * T + t) * D;
    for (int c = lane; c < D; c += 32) {
      slot_keys[to + c] = kb[from + c];
      slot_values[to + c] = vb[from + c];
    }
  }
  for (int e = warp; e < counts[0]; e += NWARPS) {  // a pooled token's slot: its group's first token not pooled
    const int t = pooled[e];
    int donor = t / G * G;
    for (int p = 0; p < counts[0]; ++p) donor += pooled[p] == donor;  // pooled is in token order
    for (int h = 0; h < HPP; ++h)
      for (int c = lane; c < D; c += 32)
        filled[base + ((long long)h * T + t) * D + c] = kb[((long long)h * T + donor) * D + c];
  }
}
