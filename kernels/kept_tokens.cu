// The exact slots of kernels.kept_tokens.KeptTokens (slots [B, H, S, D] in the model dtype; slot_pos [B, H, S] int32
// stream positions, -1 = free; skip [B, H, W] int32 words, a bit per packed token). A block per (i, h) of the storage
// rows rows[i], a warp per token. Compile-time: HEAD_DIM, IS_BF16.
//   write_kept: the kept tokens at stream positions start .. start + n copied over their places in
//     out[i, h, position - start, :] (strides sb, sh, st in elements, channels contiguous); everything else of out
//     stays as it was. Reference: oscar.exact.restore_exact of KeptTokens.restore.
//   stage_kept: a chunk's tokens at the positions a method keeps staged (KeptTokens.stage_positions). Reference:
//     KeptTokens.stage of the positions' mask.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef IS_BF16
#define IS_BF16 1
#endif

#include "common.cuh"

#define NWARPS 4

extern "C" __global__ void __launch_bounds__(NWARPS * 32) write_kept(
    const u16* __restrict__ slots, const int* __restrict__ slot_pos, int H, int S, const int* __restrict__ rows,
    long long start, int n, u16* __restrict__ out, long long sb, long long sh, long long st) {
  const int i = blockIdx.x / H, h = blockIdx.x % H, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long head = (long long)rows[i] * H + h;
  for (int s = warp; s < S; s += NWARPS) {
    const long long position = slot_pos[head * S + s];
    if (position < start || position >= start + n) continue;
    const u16* from = slots + (head * S + s) * D;
    u16* to = out + i * sb + h * sh + (position - start) * st;
    for (int c = lane; c < D; c += 32) to[c] = from[c];
  }
}

// The chunk keys / values [b, H, n, D] (strides kb, kh, kt and vb, vh, vt, channels contiguous) hold stream positions
// start .. start + n of storage rows rows[i]; positions [.., m, K] (int64, -1 = none; row rows[i] at rows[i] * prow,
// prow = 0: one list for every row; m = 1: one list for every head) name the tokens kept. Each kept token of the chunk
// after the (row, head)'s last staged position sets its skip bit and, while the (row, head) has a free slot, takes
// the next one (stream order) with its key and value.
extern "C" __global__ void __launch_bounds__(NWARPS * 32) stage_kept(
    const u16* __restrict__ keys, long long kb, long long kh, long long kt, const u16* __restrict__ values,
    long long vb, long long vh, long long vt, int H, const long long* __restrict__ rows, long long start, int n,
    const long long* __restrict__ positions, long long prow, int m, int K, u16* __restrict__ slot_keys,
    u16* __restrict__ slot_values, int* __restrict__ slot_pos, int S, int* __restrict__ skip, int W) {
  extern __shared__ __align__(16) unsigned char smem[];
  int* staged = (int*)smem;  // [K] tokens of the chunk to stage (ascending), then [K] their slots, then their count
  int* count = staged + 2 * K;
  const int i = blockIdx.x / H, h = blockIdx.x % H, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long row = rows[i], head = row * H + h;
  if (threadIdx.x == 0) {
    int* held = slot_pos + head * S;
    int used = 0, last = -1;
    for (int s = 0; s < S; ++s) {
      used += held[s] >= 0;
      last = held[s] > last ? held[s] : last;
    }
    const long long* mine = positions + row * prow + (m == 1 ? 0 : h) * (long long)K;
    int found = 0;
    for (int k = 0; k < K; ++k) {  // the chunk's kept positions after the last staged one, ascending, each once
      const long long p = mine[k];
      if (p < start || p >= start + n || p <= last) continue;
      const int t = (int)(p - start);
      int at = found;
      while (at > 0 && staged[at - 1] > t) --at;
      if (at > 0 && staged[at - 1] == t) continue;
      for (int q = found; q > at; --q) staged[q] = staged[q - 1];
      staged[at] = t;
      ++found;
    }
    int taken = 0;
    for (int e = 0; e < found; ++e) {
      const long long p = start + staged[e];
      skip[head * W + p / 32] |= (int)(1u << (p % 32));
      if (used < S) {
        held[used] = (int)p;
        staged[K + taken] = used++;
        staged[taken++] = staged[e];
      }
    }
    *count = taken;
  }
  __syncthreads();
  for (int e = warp; e < *count; e += NWARPS) {
    const int t = staged[e];
    const long long to = (head * S + staged[K + e]) * D;
    const u16 *key = keys + i * kb + h * kh + t * kt, *value = values + i * vb + h * vh + t * vt;
    for (int c = lane; c < D; c += 32) {
      slot_keys[to + c] = key[c];
      slot_values[to + c] = value[c];
    }
  }
}
