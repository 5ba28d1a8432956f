// RotateKV's packed keys as base-2 logits for decode_attention.cu (METHOD 5), one new query token per sequence.
//
// RotateKV stores z = P H_g k_pre per token (k_pre the key before RoPE, H_g the Walsh-Hadamard transform over the
// g * D channels of HEAD_GROUP consecutive KV heads, P a calibrated permutation of all HKV * D channels) in
// per-token groups of G channels with a zero point, and attends k = RoPE_t(H_g P^T z_hat) (methods/rotatekv.py).
// RoPE's rotation depends on the token's position t, so the keys are rebuilt token by token:
//   x = P^T z_hat   the codes are stored permuted (kernels.ops.rotatekv_key_layout): row h of the code storage
//                   holds x's channels h D .. h D + D - 1, and key_group[c] names the z group (scale, zero) of x's
//                   channel c among the token's HKV * D / G groups;
//   y = H_g x       the transform over the head group's g D channels (x scaled by 1 / sqrt(g D) as dequantized);
//   k = RoPE_t(y)   per head, rotate-half pairs (i, i + D/2): k_i = y_i cos_ti - y_(i+D/2) sin_ti, and
//                   k_(i+D/2) = y_(i+D/2) cos_ti + y_i sin_ti; cos/sin from the model's table at the multiple of
//                   RUN below t (`anchors`, attention scaling included) times the rotation by the rest of t
//                   (`offsets`), in fp32;
//   logit = scale * q . k for each of the HPG query heads of every head (q as the model made it), -inf for the
//   tokens whose skip bit is set (kept exactly: decode_attention attends them from its exact buffer).
// Why per key: the logit q . RoPE_t(H_g x) equals (H_g RoPE_t^-1 q) . x, and RoPE_t's position-dependent pair
// rotations (a frequency per pair) do not commute with H_g, which mixes every pair of the group's heads; so
// whichever side takes RoPE_t^-1 also takes a g D-channel Hadamard at every key position (no transform of the
// query once per step is exact). The paper's pre-RoPE rotation fixes that cost; quantizing post-RoPE keys instead
// would be another method (other codes), not a faster form of this one.
// On tensor cores. Write a channel of the head group c = h D + i (h its head, i = a + A b with a < A = D / 16 the low
// bits and b < 16 the high four): Sylvester's H_g is H_G (x) H_16 (x) H_A over (h, b, a), and RoPE_t and the dot are
// linear, so with y_h' = H_D x_h' (per head, no mixing)
//   logit_(h, j) = sum_h' H_G[h, h'] q_(h, j) . RoPE_t(y_h').
// A warp takes 16 tokens (the rows of every product) and, for each head h' of the group:
//   1. dequantizes x_h' straight into the operands of the H_16 product, in fp16 pairs (k = b, one k-step per a;
//      lane (g, q) = (lane / 4, lane % 4) holds tokens g, g + 8 and b = 2q, 2q + 1, 2q + 8, 2q + 9): an operand
//      register is (code - zero, code' - zero') exact in fp16 times the pair's scales;
//   2. runs H_16 over b (mma.m16n8k16, B = H_16, fp32 accumulate): the lane then holds its two tokens' b' = 2q,
//      2q + 1 (first n-tile) and 2q + 8, 2q + 9 (second) for every a;
//   3. runs H_A over a in its registers (fp32 butterflies);
//   4. applies RoPE at its tokens in fp32: the pair (i, i + D/2) is (b', b' + 8), the same register of the two
//      n-tiles; cos/sin at t0 + d are the anchor of the tile's first position t0 times the table of offsets d < 16
//      (one complex product: no recurrence);
//   5. adds its part of every logit of the group (its G HPG queries, columns n = h HPG + j) on tensor cores: the
//      accumulators of step 2 are the operands of a k-step over b' (one k-step per a'), and B = the queries with
//      H_G[h, h']'s sign (fp16, one XOR), accumulated over h' in fp32.
// Stated choice: both products take fp16 operands whatever the model dtype (x, the rotated keys, the queries), with
// fp32 accumulation, and x is scaled by 1 / sqrt(g D) as it is dequantized, so the keys keep their own magnitude in
// fp16. x is dequantized in fp16: (code - zero) exact (zeros within 1024 of the codes; farther ones err 2^-11
// relative), times scale / sqrt(g D) rounded to fp16, the product rounded to fp16 (where an fp32 x would be rounded
// once: 2^-11 relative). The keys are then rounded to fp16 once more than an fp32 transform would (below the model
// dtype's rounding of the keys the torch path attends); the queries are the model's, rounded to fp16.
// Packed token t has stream position t (pad tokens are never stored). Grid (ceil(n / TPB), HKV / HEAD_GROUP, B),
// blocks of WARPS warps; warp w takes the 16-token tiles w, w + WARPS, .. of the block's TPB tokens.
// A warp's steps (tile, h') run in order, and each step's codes are loaded during the step before.
// Dynamic shared memory (rotatekv_smem_bytes in kernels/plans.py): the block's (scale / sqrt(g D), -1024 - zero)
// [TPB][HKV * D / G + 1] as fp16 pairs (rows padded: a lane's two tokens are rows g and g + 8, so unpadded rows of a
// multiple of 128 bytes put 8 lanes on one bank), the RoPE offsets [RUN][ROPE_ROW] and the block's anchors
// [TPB / RUN][ROPE_ROW] (cos, sin; the row's quarters skewed, see QSTRIDE), the dot's B operands [A][NT][32 lanes]
// (2 fp16 pairs each), the group's key groups [g D] (int16). Compile-time: HEAD_DIM,
// K_BITS (2 or 4), GROUP, HEAD_GROUP (1, 2, 4, 8), HKV, HPG, IS_BF16, TPB (tokens per block: a multiple of 16 WARPS),
// ROPE_PER_TILE and MIN_BLOCKS (the knobs ops.rotatekv_logits passes on).

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

#define GD (HEAD_GROUP * D)         // channels of a head group
#define A (D / 16)                  // the low factor of a head's channels: i = a + A b
#define NG (D / GROUP)              // groups per head row
#define NGA (HKV * NG)              // groups per token over all heads
#define PAR_ROW (NGA + 1)           // a token's row of parameters in shared memory, padded: the lanes' 8 tokens
                                    // (rows g) then fall in different banks
#define QSTRIDE (2 * A + ((4 - 2 * A) % 16 + 16) % 16)  // a RoPE row's quarters (f / 2A = lane quad q) start
#define ROPE_ROW (4 * QSTRIDE + 1)  // QSTRIDE q apart and the rows 4 QSTRIDE + 1: with QSTRIDE = 4 and the row
                                    // = 1 (mod 16) float2, the 16 lanes (g, q) of a half-warp meet 16 bank pairs
#define COLS (HEAD_GROUP * HPG)     // the group's queries: the logits' columns
#define NT ((COLS + 7) / 8)         // their n-tiles
#ifndef TPB
#define TPB 128                     // tokens per block
#endif
#define RUN 16                      // positions per anchor: kernels.plans.ROPE_RUN, the tile's tokens
#define WARPS 4
#define RUN_BITS (2 * A * K_BITS)   // code bits of one lane's run of 2 A channels (b = 2q, 2q + 1)
#define RUN_WORDS ((RUN_BITS + 31) / 32)
#define HALF_MAGIC2 0x64006400u     // the fp16 pair (1024, 1024): 0x6400 | c is 1024 + c for c < 1024
#define HALF_ONE2 0x3C003C00u       // (1, 1)
#define HALF_ONE 0x3C00u            // fp16 1.0
#define HALF_SIGNS 0x80008000u      // the sign bits of an fp16 pair
// The knobs. Nsight Compute, H100, 1 x 128K, Llama 3.1 8B's shape (results/efficiency/kernel_profile.log): 226 us a
// launch at the defaults (128 registers, 4 blocks an SM) against 291 with the tile's cos/sin held over its heads at
// 1 block (184 registers): the latency of the shared-memory lookups wants the warps more than the registers (head
// groups of 8 spill 40 bytes, 72 with 4-bit keys, at 128 registers).
#ifndef ROPE_PER_TILE
#define ROPE_PER_TILE 0             // 1: a tile's cos/sin held over its heads (else made per k-step: fewer registers)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS (D <= 128 ? 4 : 1)  // resident blocks per SM asked of the register allocator
#endif

#if (K_BITS != 2) && (K_BITS != 4)
#error "K_BITS must be 2 or 4"
#endif
#if (HEAD_GROUP != 1) && (HEAD_GROUP != 2) && (HEAD_GROUP != 4) && (HEAD_GROUP != 8)
#error "HEAD_GROUP must be 1, 2, 4 or 8"
#endif
#if (TPB % (RUN * WARPS)) || (TPB < RUN * WARPS)
#error "TPB must be a multiple of RUN * WARPS"
#endif
#if (D % GROUP) || (HKV % HEAD_GROUP) || (HPG < 1) || (HPG > 8) || (NGA > 65535)
#error "unsupported GROUP / HKV / HPG"
#endif

__host__ __device__ constexpr int parity(int x) { return x == 0 ? 0 : (x & 1) ^ parity(x >> 1); }
// H_16[k][n] as an fp16 pair (k, k + 1)
__device__ __forceinline__ u32 hadamard_pair(int k, int n) {
  const u32 minus_one = 0x8000u | HALF_ONE;
  return (parity(k & n) ? minus_one : HALF_ONE) | ((parity((k + 1) & n) ? minus_one : HALF_ONE) << 16);
}

// The lane's two runs of codes of one token (channels 2q A .. 2q A + 2A - 1 and D/2 more), bits from bit 0 of w
__device__ __forceinline__ void load_runs(u32 w[2][RUN_WORDS], const u8* __restrict__ row, int q) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int bit0 = (4 * r + q) * RUN_BITS;
    const u32* words = reinterpret_cast<const u32*>(row);
    if (RUN_BITS >= 32) {
#pragma unroll
      for (int i = 0; i < RUN_WORDS; ++i) w[r][i] = words[bit0 / 32 + i];
    } else {
      w[r][0] = words[bit0 / 32] >> (bit0 % 32);
    }
  }
}
// the lane's two tokens' code runs of one head at tile t0 (rows past the cache's capacity read its last row)
__device__ __forceinline__ void load_tile(u32 w[2][2][RUN_WORDS], const u8* __restrict__ head_rows, int t0, int g,
                                          int quad, int cap) {
#pragma unroll
  for (int r = 0; r < 2; ++r) load_runs(w[r], head_rows + (long long)min(t0 + g + 8 * r, cap - 1) * (D * K_BITS / 8),
                                        quad);
}
// the code of channel offset k of a run
__device__ __forceinline__ u32 run_code(const u32 w[RUN_WORDS], int k) {
  return (w[k * K_BITS / 32] >> (k * K_BITS % 32)) & ((1u << K_BITS) - 1u);
}
// 1024 + the codes of channel offsets k and k + A of a run as an fp16 pair (lo: k)
__device__ __forceinline__ u32 code_pair(const u32 w[RUN_WORDS], int k) {
  const u32 bits = (A * K_BITS == 16 && RUN_WORDS == 1)  // both in one shift: k + A sits 16 bits above k
                       ? (w[0] >> (k * K_BITS)) & (((1u << K_BITS) - 1u) * 0x00010001u)
                       : run_code(w, k) | (run_code(w, k + A) << 16);
  return bits | HALF_MAGIC2;
}

// frequency f's place in a RoPE row of shared memory (see QSTRIDE)
__device__ __forceinline__ int rope_slot(int f) { return f % (2 * A) + QSTRIDE * (f / (2 * A)); }
// rows row0 .. row0 + rows - 1 of a cos/sin table [*, D / 2, 2] into shared-memory rows of ROPE_ROW (rope_slot's
// places); a row at or past `valid` is zeros
__device__ __forceinline__ void stage_rope_rows(float2* dst, const float* __restrict__ table, int row0, int rows,
                                                int valid) {
  for (int i = threadIdx.x; i < rows * (D / 2); i += 32 * WARPS) {
    const int row = i / (D / 2), f = i % (D / 2);
    const long long at = (long long)(row0 + row) * (D / 2) + f;
    dst[row * ROPE_ROW + rope_slot(f)] = row0 + row < valid ? float2{table[2 * at], table[2 * at + 1]}
                                                            : float2{0.f, 0.f};
  }
}
// cos, sin of the lane's frequencies f = ap + A (2q + e) at its two tokens t0 + g + 8 r ([r][e]): the tile's anchor
// (its row of anchor_s) times the offset (g + 8 r)
__device__ __forceinline__ void rope_at(float cs[2][2], float sn[2][2], const float2* anchor_s, const float2* off_s,
                                        int g, int quad, int ap) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int f = rope_slot(ap + A * (2 * quad + e));
    const float2 an = anchor_s[f];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 o = off_s[(g + 8 * r) * ROPE_ROW + f];
      cs[r][e] = fmaf(an.x, o.x, -an.y * o.y);
      sn[r][e] = fmaf(an.y, o.x, an.x * o.y);
    }
  }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) rotatekv_scores(
    const u16* __restrict__ q,                 // [B, HKV * HPG, D]
    const u8* __restrict__ kc,                 // [B, HKV, cap, D * K_BITS / 8], x's channels (see the top)
    const u16* __restrict__ ks, const u16* __restrict__ kz,  // [B, HKV, cap, D / G], z groups
    const u16* __restrict__ key_group,         // [HKV * D]: z group of each of x's channels
    const float* __restrict__ anchors,         // [ceil(cap / RUN), D / 2, 2]: cos, sin at positions RUN i
    const float* __restrict__ offsets,         // [RUN, D / 2, 2]: cos, sin of d positions (d < RUN)
    const int* __restrict__ n_packed, const u32* __restrict__ skip,  // [B]; [B, HKV, ceil(cap / 32)] or null
    float* __restrict__ out, int cap, float scale, float inv_sqrt_gd) {
  extern __shared__ __align__(16) unsigned char smem[];
  u32* par_s = reinterpret_cast<u32*>(smem);                         // [TPB][PAR_ROW]
  float2* off_s = reinterpret_cast<float2*>(par_s + TPB * PAR_ROW);   // [RUN][ROPE_ROW]
  float2* anchor_s = off_s + RUN * ROPE_ROW;                          // [TPB / RUN][ROPE_ROW]
  uint2* qb_s = reinterpret_cast<uint2*>(anchor_s + TPB / RUN * ROPE_ROW);  // [A][NT][32]
  u16* slot_s = reinterpret_cast<u16*>(qb_s + A * NT * 32);           // [GD]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, quad = lane & 3;
  const int t_block = blockIdx.x * TPB, hg = blockIdx.y, b = blockIdx.z;
  const int n = n_packed[b];
  if (t_block >= n) return;
  const int HQ = HKV * HPG;

  // the block's tables (fixed trip counts: the loads issue together)
#pragma unroll 8
  for (int r = 0; r < (HKV * TPB * NG + 32 * WARPS - 1) / (32 * WARPS); ++r) {
    const int i = r * 32 * WARPS + threadIdx.x;
    if (i >= HKV * TPB * NG) break;
    const int h = i / (TPB * NG), t = (i / NG) % TPB, gr = i % NG;
    u32 pair = 0u;
    if (t_block + t < cap) {
      const long long at = (((long long)b * HKV + h) * cap + t_block + t) * NG + gr;
      const float s = to_float(ks[at]) * inv_sqrt_gd;
      pair = pack_half2(s, -1024.f - to_float(kz[at]));
    }
    par_s[t * PAR_ROW + h * NG + gr] = pair;
  }
  stage_rope_rows(off_s, offsets, 0, RUN, RUN);
  stage_rope_rows(anchor_s, anchors, t_block / RUN, TPB / RUN, (cap + RUN - 1) / RUN);
  for (int i = threadIdx.x; i < GD; i += 32 * WARPS) slot_s[i] = key_group[hg * GD + i];
  for (int i = threadIdx.x; i < A * NT * 32; i += 32 * WARPS) {  // B[k = b'][n] = q_n[a' + A b'] (n = h HPG + j)
    const int ap = i / (NT * 32), nt = (i / 32) % NT, ln = i % 32, col = 8 * nt + (ln >> 2), k = 2 * (ln & 3);
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (col < COLS) {
      const u16* qrow = q + ((long long)b * HQ + hg * COLS + col) * D;
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = to_float(qrow[ap + A * (k + (e & 1) + 8 * (e >> 1))]);
    }
    qb_s[i] = uint2{pack_half2(v[0], v[1]), pack_half2(v[2], v[3])};
  }
  __syncthreads();

  u32 hb[2][2];  // B = H_16 of the two n-tiles: k = 2q, 2q + 1 | 2q + 8, 2q + 9, n = g | g + 8
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    hb[nt][0] = hadamard_pair(2 * quad, g + 8 * nt);
    hb[nt][1] = hadamard_pair(2 * quad + 8, g + 8 * nt);
  }
  const int heads0 = hg * HEAD_GROUP, t_end = min(n, t_block + TPB);
  const long long head_stride = (long long)cap * (D * K_BITS / 8);
  const u8* group_rows = kc + ((long long)b * HKV + heads0) * head_stride;  // the group's first head's code rows
  // the warp's steps are (tile, head h') in order; each step's codes load during the step before (w_next)
  u32 w_next[2][2][RUN_WORDS];
  if (t_block + warp * RUN < t_end) load_tile(w_next, group_rows, t_block + warp * RUN, g, quad, cap);
  for (int tile = warp; tile < TPB / RUN; tile += WARPS) {
    const int t0 = t_block + tile * RUN;
    if (t0 >= n) break;
    const int rows[2] = {t0 + g, t0 + g + 8};
    const float2* tile_anchor = anchor_s + tile * ROPE_ROW;
    float rc[ROPE_PER_TILE ? A : 1][2][2], rs[ROPE_PER_TILE ? A : 1][2][2];  // the tile's, [a'][r][e]
#pragma unroll
    for (int ap = 0; ap < (ROPE_PER_TILE ? A : 0); ++ap) rope_at(rc[ap], rs[ap], tile_anchor, off_s, g, quad, ap);
    float lg[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) lg[nt][0] = lg[nt][1] = lg[nt][2] = lg[nt][3] = 0.f;

#pragma unroll 1
    for (int hp = 0; hp < HEAD_GROUP; ++hp) {
      u32 w[2][2][RUN_WORDS];  // [token][run]
#pragma unroll
      for (int i = 0; i < 4 * RUN_WORDS; ++i) w[i / (2 * RUN_WORDS)][i / RUN_WORDS % 2][i % RUN_WORDS] =
          w_next[i / (2 * RUN_WORDS)][i / RUN_WORDS % 2][i % RUN_WORDS];
      const bool last_head = hp + 1 == HEAD_GROUP;
      const int next_t0 = last_head ? t0 + WARPS * RUN : t0;
      if (next_t0 < t_end)
        load_tile(w_next, group_rows + (last_head ? 0 : hp + 1) * head_stride, next_t0, g, quad, cap);
      // 1-2. y[a][nt][.] = H_16 over b of x's channels a + A b (rows g, g + 8; columns b' = 2q, 2q + 1 + 8 nt)
      float y[A][2][4];
#pragma unroll
      for (int a = 0; a < A; ++a) {
        u32 op[4];  // A operand: (row g | g + 8) x (b = 2q, 2q + 1 | 2q + 8, 2q + 9)
        int slot[2][2];  // [run][e]: the parameter slot of channel a + A (2q + e + 8 run), the same for both tokens
#pragma unroll
        for (int run = 0; run < 2; ++run) {
#pragma unroll
          for (int e = 0; e < 2; ++e) slot[run][e] = slot_s[hp * D + a + A * (2 * quad + e + 8 * run)];
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const u32* par = par_s + (rows[r] - t_block) * PAR_ROW;
#pragma unroll
          for (int run = 0; run < 2; ++run) {  // channels e = 0, 1: their (scale, -1024 - zero) regrouped
            const u32 p0 = par[slot[run][0]], p1 = par[slot[run][1]];
            const u32 centred = fma_half2(code_pair(w[r][run], a), HALF_ONE2, __byte_perm(p0, p1, 0x7632));
            op[r + 2 * run] = fma_half2(centred, __byte_perm(p0, p1, 0x5410), 0u);
          }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          y[a][nt][0] = y[a][nt][1] = y[a][nt][2] = y[a][nt][3] = 0.f;
          mma_f16(y[a][nt], op[0], op[1], op[2], op[3], hb[nt][0], hb[nt][1]);
        }
      }
      // 3. H_A over a
#pragma unroll
      for (int h = 1; h < A; h *= 2) {
#pragma unroll
        for (int a = 0; a < A; ++a) {
          if (a & h) continue;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const float u = y[a][nt][c], v = y[a + h][nt][c];
              y[a][nt][c] = u + v;
              y[a + h][nt][c] = u - v;
            }
          }
        }
      }
      // 4-5. RoPE on each (b', b' + 8) pair, then the k-step a' of the logits (B: the queries, H_G[h, hp]'s sign)
      u32 sign[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sign[nt] = parity(((8 * nt + g) / HPG) & hp) ? HALF_SIGNS : 0u;
#pragma unroll
      for (int ap = 0; ap < A; ++ap) {
        float cs[2][2], sn[2][2];
        if (ROPE_PER_TILE) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            cs[c >> 1][c & 1] = rc[ROPE_PER_TILE ? ap : 0][c >> 1][c & 1];
            sn[c >> 1][c & 1] = rs[ROPE_PER_TILE ? ap : 0][c >> 1][c & 1];
          }
        } else {
          rope_at(cs, sn, tile_anchor, off_s, g, quad, ap);
        }
        float k_lo[4], k_hi[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float lo = y[ap][0][c], hi = y[ap][1][c], co = cs[c >> 1][c & 1], si = sn[c >> 1][c & 1];
          k_lo[c] = fmaf(lo, co, -hi * si);
          k_hi[c] = fmaf(hi, co, lo * si);
        }
        const u32 a0 = pack_half2(k_lo[0], k_lo[1]), a1 = pack_half2(k_lo[2], k_lo[3]);
        const u32 a2 = pack_half2(k_hi[0], k_hi[1]), a3 = pack_half2(k_hi[2], k_hi[3]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint2 qb = qb_s[(ap * NT + nt) * 32 + lane];
          mma_f16(lg[nt], a0, a1, a2, a3, qb.x ^ sign[nt], qb.y ^ sign[nt]);
        }
      }
    }
    // the logits of the lane's tokens and columns 2q, 2q + 1 of each n-tile; -inf where the skip bit is set
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int t = rows[c >> 1], col = 8 * nt + 2 * quad + (c & 1);
        if (t >= n || col >= COLS) continue;
        const int head = heads0 + col / HPG;
        const long long word = ((long long)b * HKV + head) * ((cap + 31) / 32) + t / 32;
        const bool skipped = skip && ((skip[word] >> (t % 32)) & 1u);
        out[((long long)b * HQ + hg * COLS + col) * cap + t] = skipped ? __uint_as_float(0xff800000u)
                                                                       : lg[nt][c] * scale;
      }
    }
  }
}
