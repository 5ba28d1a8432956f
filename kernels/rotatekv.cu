// RotateKV's packed keys as base-2 logits for decode_attention.cu (METHOD 5), one new query token per sequence.
//
// RotateKV stores z = P H_g k_pre per token (k_pre the key before RoPE, H_g the Walsh-Hadamard transform over the
// g * D channels of HEAD_GROUP consecutive KV heads, P a calibrated permutation of all HKV * D channels) in
// per-token groups of G channels with an integer zero point, and attends k = RoPE_t(H_g P^T z_hat) (methods/
// rotatekv.py). RoPE's rotation depends on the token's position t, so the keys are rebuilt token by token:
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
// Packed token t has stream position t (pad tokens are never stored). Grid (ceil(n / TPB), HKV / HEAD_GROUP, B),
// blocks of WARPS warps; warp w takes tokens [t0 + RUN w, t0 + RUN w + RUN) of the block's TPB, one token at a time,
// lane l holding the head group's channels E l .. E l + E - 1 (E = g D / 32). Writes out [B, HKV * HPG, cap] for the
// tokens t < n_packed[b]. Dynamic shared memory: the block's (scale, zero) pairs [TPB][HKV * D / G] u32, the
// queries [HPG][E][32] fp32, the step [D / 2] float2 (rotatekv_smem_bytes in kernels/ops.py).
// Compile-time: HEAD_DIM, K_BITS (2 or 4), GROUP, HEAD_GROUP (1, 2, 4, 8), HKV, HPG, IS_BF16.

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
#define PARTNER (LPH / 2)          // lane distance of a RoPE pair (i, i + D/2)
#define NG (D / GROUP)             // groups per head row
#define NGA (HKV * NG)             // groups per token over all heads
#define RUN 16                     // positions per warp run (one anchor each)
#define WARPS 4
#define TPB (RUN * WARPS)          // tokens per block
#define CODE_BITS (E * K_BITS)     // code bits per lane and token
#define CODE_WORDS ((CODE_BITS + 31) / 32)

#if (K_BITS != 2) && (K_BITS != 4)
#error "K_BITS must be 2 or 4"
#endif
#if (HEAD_GROUP != 1) && (HEAD_GROUP != 2) && (HEAD_GROUP != 4) && (HEAD_GROUP != 8)
#error "HEAD_GROUP must be 1, 2, 4 or 8"
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
  u32* par_s = reinterpret_cast<u32*>(smem);                    // [TPB][NGA] scale | zero << 16
  float* q_s = reinterpret_cast<float*>(par_s + TPB * NGA);     // [HPG][E][32]
  float2* step_s = reinterpret_cast<float2*>(q_s + HPG * E * 32);  // [D / 2]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t_block = blockIdx.x * TPB, hg = blockIdx.y, b = blockIdx.z;
  const int n = n_packed[b];
  if (t_block >= n) return;
  const int HQ = HKV * HPG;

  // the block's parameters of every group, the queries of the head group, the step rotation
  for (int i = threadIdx.x; i < HKV * TPB * NG; i += 32 * WARPS) {
    const int h = i / (TPB * NG), t = (i / NG) % TPB, g = i % NG;
    u32 pair = 0u;
    if (t_block + t < cap) {
      const long long at = (((long long)b * HKV + h) * cap + t_block + t) * NG + g;
      pair = (u32)ks[at] | ((u32)kz[at] << 16);
    }
    par_s[t * NGA + h * NG + g] = pair;
  }
  for (int i = threadIdx.x; i < HPG * GD; i += 32 * WARPS) {
    const int j = i / GD, c = i % GD, l = c / E, e = c % E;  // x channel c of the group, lane l, element e
    const int head = hg * HEAD_GROUP + c / D;
    q_s[(j * E + e) * 32 + l] = to_float(q[((long long)b * HQ + head * HPG + j) * D + c % D]);
  }
  for (int f = threadIdx.x; f < D / 2; f += 32 * WARPS) step_s[f] = float2{step[2 * f], step[2 * f + 1]};
  __syncthreads();

  // this lane's channels: the head (within the group), RoPE frequencies, parameter slots
  const int hh = lane / LPH, head = hg * HEAD_GROUP + hh;
  const int i0 = (lane % LPH) * E;           // first channel of the lane within its head
  const float sign = (lane & PARTNER) ? 1.f : -1.f;  // second half of the head: + y_(i-D/2) sin, first: - y_(i+D/2) sin
  u16 slot[E];
#pragma unroll
  for (int e = 0; e < E; ++e) slot[e] = key_group[hg * GD + lane * E + e];
  const u8* code_rows = kc + (((long long)b * HKV + head) * cap) * (D * K_BITS / 8);
  const u32* skip_row = skip ? skip + ((long long)b * HKV + head) * ((cap + 31) / 32) : nullptr;
  float* out_rows = out + ((long long)b * HQ + head * HPG) * cap;

  const int t_run = t_block + warp * RUN;
  if (t_run >= n) return;
  float cs[E], sn[E];  // cos, sin of the lane's frequencies at the current position
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int f = (i0 + e) % (D / 2);
    cs[e] = anchors[((long long)(t_run / RUN) * (D / 2) + f) * 2];
    sn[e] = anchors[((long long)(t_run / RUN) * (D / 2) + f) * 2 + 1];
  }
  u32 next[CODE_WORDS];
  load_codes(next, code_rows + (long long)t_run * (D * K_BITS / 8), lane);
  const int run_end = min(t_run + RUN, n);
  for (int t = t_run; t < run_end; ++t) {
    u32 w[CODE_WORDS];
#pragma unroll
    for (int i = 0; i < CODE_WORDS; ++i) w[i] = next[i];
    if (t + 1 < run_end) load_codes(next, code_rows + (long long)(t + 1) * (D * K_BITS / 8), lane);
    // x = (code - zero) * scale of each channel's group
    const u32* par = par_s + (t - t_block) * NGA;
    float y[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const u32 code = (w[e * K_BITS / 32] >> (e * K_BITS % 32)) & ((1u << K_BITS) - 1u);
      const u32 pz = par[slot[e]];
      y[e] = ((float)code - to_float((u16)(pz >> 16))) * to_float((u16)(pz & 0xffffu));
    }
    // y = H_g x (unnormalized): the lane's channel bits first, then the lane bits
#pragma unroll
    for (int h = 1; h < E; h *= 2) {
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (!(e & h)) { const float a = y[e], c = y[e + h]; y[e] = a + c; y[e + h] = a - c; }
    }
#pragma unroll
    for (int m = 1; m < 32; m *= 2) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float o = __shfl_xor_sync(FULL_MASK, y[e], m);
        y[e] = (lane & m) ? (o - y[e]) : (y[e] + o);
      }
    }
    // RoPE at position t, then the logits of the head's queries
    float part[HPG];
#pragma unroll
    for (int j = 0; j < HPG; ++j) part[j] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float pair = __shfl_xor_sync(FULL_MASK, y[e], PARTNER);
      const float k = fmaf(sign * pair, sn[e], y[e] * cs[e]);
#pragma unroll
      for (int j = 0; j < HPG; ++j) part[j] = fmaf(k, q_s[(j * E + e) * 32 + lane], part[j]);
      const float2 st = step_s[(i0 + e) % (D / 2)];  // the next position's cos, sin
      const float c2 = fmaf(cs[e], st.x, -sn[e] * st.y), s2 = fmaf(sn[e], st.x, cs[e] * st.y);
      cs[e] = c2;
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
