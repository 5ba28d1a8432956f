// The kept tokens of a range written back over their places (kernels.kept_tokens.KeptTokens.write): for storage rows
// rows[i] and stream positions start .. start + n, each slot of (rows[i], h) whose position (slot_pos [B, H, S]
// int32, -1 = free) lies in the range copies its token (slots [B, H, S, D], the model dtype) to
// out[i, h, position - start, :] (strides sb, sh, st in elements, channels contiguous); everything else of out stays
// as it was. Its reference is oscar.exact.restore_exact of KeptTokens.restore. A block per (i, h), a warp per slot.
// Compile-time: HEAD_DIM, IS_BF16.

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
