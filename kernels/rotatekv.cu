// RotateKV's packed keys as base-2 logits for decode_attention.cu (METHOD 5), one new query token per sequence.
//
// RotateKV stores z = P H_g k_pre per token (k_pre the key before RoPE, H_g the Walsh-Hadamard transform over the
// g * D channels of HEAD_GROUP consecutive KV heads, P a calibrated permutation of all HKV * D channels) in
// per-token groups of G channels with a zero point, and attends k = RoPE_t(H_g P^T z_hat) (methods/rotatekv.py).
// RoPE's rotation depends on the token's position t, so the keys are rebuilt token by token:
//   x = P^T z_hat   the codes are stored permuted (kernels.ops.rotatekv_key_layout): row h of the code storage
//                   holds x's channels h D .. h D + D - 1, and key_group[c] names the z group (scale, zero) of x's
//                   channel c among the token's HKV * D / G groups;
//   y = H_g x       the unnormalized transform over the head group's g D channels (1 / sqrt(g D) is in `scale`);
//   k = RoPE_t(y)   per head, rotate-half pairs (i, i + D/2): k_i = y_i cos_ti - y_(i+D/2) sin_ti, and
//                   k_(i+D/2) = y_(i+D/2) cos_ti + y_i sin_ti; cos/sin from the model's table at the multiple of
//                   RUN below t (`anchors`, attention scaling included) advanced by the one-position rotation
//                   `step` (cos theta_f, sin theta_f) once per position, in fp32;
//   logit = scale * q . k in fp32 for each of the HPG query heads of every head (q as the model made it), -inf for
//   the tokens whose skip bit is set (kept exactly: decode_attention attends them from its exact buffer).
// Why per key: the logit q . RoPE_t(H_g x) equals (H_g RoPE_t^-1 q) . x, and RoPE_t's position-dependent pair
// rotations (a frequency per pair) do not commute with H_g, which mixes every pair of the group's heads; so
// whichever side takes RoPE_t^-1 also takes a g D-channel Hadamard at every key position (no transform of the
// query once per step is exact). The paper's pre-RoPE rotation fixes that cost; quantizing post-RoPE keys instead
// would be another method (other codes), not a faster form of this one.
// Packed token t has stream position t (pad tokens are never stored). Grid (ceil(n / TPB), HKV / HEAD_GROUP, B),
// blocks of WARPS warps; warp w takes the w-th quarter of the block's TPB tokens (RUNS runs of RUN positions, each
// from its anchor), one token at a time.
//
// The transform runs in registers, E = g D / 32 channels per lane, with as few shuffles as the layout allows:
//   loaded      lane l holds channels E l + e (its codes are one run of the packed row); the log2 E butterflies
//               over e are local;
//   swapped     each butterfly over a lane bit inside the head (W = log2(D / E) of them) exchanges half of the
//               lane's values with its partner (E / 2 shuffles, not E): the partners keep one half each, so the
//               lane bit and e's top bit trade places. After the W swaps e's top bit is the RoPE pair bit (D / 2),
//               and the lane's channels are i = (e mod E/2) + (l mod LPH) E / 2 + (e >= E / 2) D / 2 of head
//               l / LPH (LPH = D / E lanes per head);
//   head bits   the butterflies across the group's heads (lane bits above W) are plain: E shuffles each;
//   RoPE, dot   each (i, i + D/2) pair is in one lane, so RoPE needs no shuffle; q is held in registers in the
//               same layout, and each query's dot sums over the head's LPH lanes.
// Dynamic shared memory: the block's (scale, -zero * scale) [TPB][HKV * D / G] as fp32 pairs
// (rotatekv_smem_bytes in kernels/plans.py). Compile-time: HEAD_DIM, K_BITS (2 or 4), GROUP, HEAD_GROUP (1, 2, 4,
// 8), HKV, HPG, IS_BF16, TPB (tokens per block: a multiple of RUN * WARPS; more of them spread the block's set-up,
// its parameters' and queries' loads, over more tokens).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef K_BITS
#define K_BITS 2
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
#ifndef HPG
#define HPG 4
#endif
#ifndef IS_BF16
#define IS_BF16 1
#endif

#include "common.cuh"

#define GD (HEAD_GROUP * D)        // channels of a head group
#define E (GD / 32)                // channels per lane
#define LPH (D / E)                // lanes per head
#define HALF (E / 2)
#define NG (D / GROUP)             // groups per head row
#define NGA (HKV * NG)             // groups per token over all heads
#ifndef TPB
#define TPB 128                    // tokens per block
#endif
#define RUN 16                     // positions per run (one anchor each): kernels.plans.ROPE_RUN
#define WARPS 4
#define RUNS (TPB / (RUN * WARPS))  // runs per warp
#define CODE_BITS (E * K_BITS)     // code bits per lane and token
#define CODE_WORDS ((CODE_BITS + 31) / 32)
#define MAGIC 8388608.f            // 2^23: __uint_as_float(0x4B000000 | c) - MAGIC == c for c < 2^23

#if (K_BITS != 2) && (K_BITS != 4)
#error "K_BITS must be 2 or 4"
#endif
#if (HEAD_GROUP != 1) && (HEAD_GROUP != 2) && (HEAD_GROUP != 4) && (HEAD_GROUP != 8)
#error "HEAD_GROUP must be 1, 2, 4 or 8"
#endif
#if (TPB % (RUN * WARPS)) || (TPB < RUN * WARPS)
#error "TPB must be a multiple of RUN * WARPS"
#endif
#if (D % GROUP) || (HKV % HEAD_GROUP) || (HPG < 1) || (HPG > 8) || (E < 2) || (NGA > 65535)
#error "unsupported GROUP / HKV / HPG"
#endif

// the lane's E codes of one token: bits E K_BITS l .. of its head row (word-aligned when CODE_BITS >= 32)
__device__ __forceinline__ void load_codes(u32 w[CODE_WORDS], const u8* __restrict__ row, int lane) {
  const int bit0 = (lane % LPH) * CODE_BITS;
  if (CODE_BITS >= 32) {
#pragma unroll
    for (int i = 0; i < CODE_WORDS; ++i) w[i] = reinterpret_cast<const u32*>(row)[bit0 / 32 + i];
  } else {
    w[0] = reinterpret_cast<const u32*>(row)[bit0 / 32] >> (bit0 % 32);
  }
}

// log2 of a power of two, at compile time
__host__ __device__ constexpr int log2_of(int x) { return x <= 1 ? 0 : 1 + log2_of(x / 2); }
#define LOG_E log2_of(E)
#define W log2_of(LPH)               // lane bits inside a head

// channel (within the head group) of the lane's value e once the swaps are done (see the top)
__device__ __forceinline__ int swapped_channel(int lane, int e) {
  return (lane / LPH) * D + (e % HALF) + (lane % LPH) * HALF + (e / HALF) * (D / 2);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) rotatekv_scores(
    const u16* __restrict__ q,                 // [B, HKV * HPG, D]
    const u8* __restrict__ kc,                 // [B, HKV, cap, D * K_BITS / 8], x's channels (see the top)
    const u16* __restrict__ ks, const u16* __restrict__ kz,  // [B, HKV, cap, D / G], z groups
    const u16* __restrict__ key_group,         // [HKV * D]: z group of each of x's channels
    const float* __restrict__ anchors,         // [ceil(cap / RUN), D / 2, 2]: cos, sin at positions RUN i
    const float* __restrict__ step,            // [D / 2, 2]: cos, sin of one position
    const int* __restrict__ n_packed, const u32* __restrict__ skip,  // [B]; [B, HKV, ceil(cap / 32)] or null
    float* __restrict__ out, int cap, float scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  float2* par_s = reinterpret_cast<float2*>(smem);  // [TPB][NGA] (scale, -zero * scale)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t_block = blockIdx.x * TPB, hg = blockIdx.y, b = blockIdx.z;
  const int n = n_packed[b];
  if (t_block >= n) return;
  const int HQ = HKV * HPG;

  // the block's parameters of every group (a fixed trip count: the loads issue together)
#pragma unroll 8
  for (int r = 0; r < (HKV * TPB * NG + 32 * WARPS - 1) / (32 * WARPS); ++r) {
    const int i = r * 32 * WARPS + threadIdx.x;
    if (i >= HKV * TPB * NG) break;
    const int h = i / (TPB * NG), t = (i / NG) % TPB, g = i % NG;
    float2 pair = float2{0.f, 0.f};
    if (t_block + t < cap) {
      const long long at = (((long long)b * HKV + h) * cap + t_block + t) * NG + g;
      const float s = to_float(ks[at]);
      pair = float2{s, -to_float(kz[at]) * s};
    }
    par_s[t * NGA + h * NG + g] = pair;
  }
  __syncthreads();

  const int t_warp = t_block + warp * RUNS * RUN;
  if (t_warp >= n) return;
  // the lane's loaded channels: head (within the group), parameter slots; its swapped channels: queries, RoPE
  const int hh = lane / LPH, head = hg * HEAD_GROUP + hh;
  u16 slot[E];
#pragma unroll
  for (int e = 0; e < E; ++e) slot[e] = key_group[hg * GD + lane * E + e];
  float qr[HPG][E];
#pragma unroll
  for (int j = 0; j < HPG; ++j) {
#pragma unroll
    for (int e = 0; e < E; ++e)
      qr[j][e] = to_float(q[((long long)b * HQ + head * HPG + j) * D + swapped_channel(lane, e) % D]);
  }
  float cs[HALF], sn[HALF], step_c[HALF], step_s[HALF];  // at the lane's frequencies f = swapped channel mod D / 2
#pragma unroll
  for (int e = 0; e < HALF; ++e) {
    const int f = swapped_channel(lane, e) % (D / 2);
    step_c[e] = step[2 * f];
    step_s[e] = step[2 * f + 1];
  }
  const u8* code_rows = kc + (((long long)b * HKV + head) * cap) * (D * K_BITS / 8);
  const u32* skip_row = skip ? skip + ((long long)b * HKV + head) * ((cap + 31) / 32) : nullptr;
  float* out_rows = out + ((long long)b * HQ + head * HPG) * cap;

  const int warp_end = min(t_warp + RUNS * RUN, n);
  u32 next[CODE_WORDS], after[CODE_WORDS];  // the codes of tokens t + 1 and t + 2, loaded ahead
  load_codes(next, code_rows + (long long)t_warp * (D * K_BITS / 8), lane);
  if (t_warp + 1 < warp_end) load_codes(after, code_rows + (long long)(t_warp + 1) * (D * K_BITS / 8), lane);
  for (int t = t_warp; t < warp_end; ++t) {
    if (t % RUN == 0) {  // a run's first position: its anchor
#pragma unroll
      for (int e = 0; e < HALF; ++e) {
        const long long at = ((long long)(t / RUN) * (D / 2) + swapped_channel(lane, e) % (D / 2)) * 2;
        cs[e] = anchors[at];
        sn[e] = anchors[at + 1];
      }
    }
    u32 w[CODE_WORDS];
#pragma unroll
    for (int i = 0; i < CODE_WORDS; ++i) {
      w[i] = next[i];
      next[i] = after[i];
    }
    if (t + 2 < warp_end) load_codes(after, code_rows + (long long)(t + 2) * (D * K_BITS / 8), lane);
    // x = (code - zero) * scale of each channel's group: code * scale + (-zero * scale)
    const float2* par = par_s + (t - t_block) * NGA;
    float y[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const u32 code = (w[e * K_BITS / 32] >> (e * K_BITS % 32)) & ((1u << K_BITS) - 1u);
      const float2 sz = par[slot[e]];
      y[e] = fmaf(__uint_as_float(0x4B000000u | code) - MAGIC, sz.x, sz.y);
    }
    // y = H_g x (unnormalized): e's bits, then the lane bits inside the head (swaps), then the head bits
#pragma unroll
    for (int h = 1; h < E; h *= 2) {
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (!(e & h)) { const float a = y[e], c = y[e + h]; y[e] = a + c; y[e + h] = a - c; }
    }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const bool upper = (lane >> k) & 1;  // this lane keeps e's upper half, its partner the lower
      const float sign = upper ? -1.f : 1.f;
#pragma unroll
      for (int i = 0; i < HALF; ++i) {
        const float mine = upper ? y[HALF + i] : y[i];
        const float theirs = __shfl_xor_sync(FULL_MASK, upper ? y[i] : y[HALF + i], 1 << k);
        y[i] = mine + theirs;                  // the pair's sum: lane bit k of the channel 0
        y[HALF + i] = sign * (mine - theirs);  // its difference (lower minus upper): lane bit k 1
      }
    }
#pragma unroll
    for (int m = LPH; m < 32; m *= 2) {
      const float sign = (lane & m) ? -1.f : 1.f;
#pragma unroll
      for (int e = 0; e < E; ++e) y[e] = fmaf(sign, y[e], __shfl_xor_sync(FULL_MASK, y[e], m));
    }
    // RoPE at position t on each (i, i + D/2) pair, then the logits of the head's queries
    float part[HPG];
#pragma unroll
    for (int j = 0; j < HPG; ++j) part[j] = 0.f;
#pragma unroll
    for (int e = 0; e < HALF; ++e) {
      const float lo = y[e], hi = y[HALF + e];
      const float k_lo = fmaf(lo, cs[e], -hi * sn[e]), k_hi = fmaf(hi, cs[e], lo * sn[e]);
#pragma unroll
      for (int j = 0; j < HPG; ++j) part[j] = fmaf(k_hi, qr[j][HALF + e], fmaf(k_lo, qr[j][e], part[j]));
      const float c2 = fmaf(cs[e], step_c[e], -sn[e] * step_s[e]), s2 = fmaf(sn[e], step_c[e], cs[e] * step_s[e]);
      cs[e] = c2;  // the next position's
      sn[e] = s2;
    }
#pragma unroll
    for (int j = 0; j < HPG; ++j) {
#pragma unroll
      for (int m = 1; m < LPH; m *= 2) part[j] += __shfl_xor_sync(FULL_MASK, part[j], m);
    }
    if (lane % LPH == 0) {
      const bool skipped = skip_row && ((skip_row[t / 32] >> (t % 32)) & 1u);
#pragma unroll
      for (int j = 0; j < HPG; ++j) out_rows[(long long)j * cap + t] = skipped ? __uint_as_float(0xff800000u)
                                                                                : part[j] * scale;
    }
  }
}
