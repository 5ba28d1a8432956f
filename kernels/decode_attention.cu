// Fused decode attention on the packed OScaR cache (flash-decoding with a final combine).
//
// One query token per sequence; GQA with HPG query heads per KV head. Grid (splits + 1, H_kv, B),
// one warp per block: split s < splits streams G-token groups [s*tps, (s+1)*tps) of the packed part
// through a cp.async ring in shared memory; the last split attends the full-precision residual tokens.
// Every split writes an unnormalized partial output and its (max, sum) in base 2; `combine` merges them.
//
// Packed keys (OScaR): x = hadamard(k) / n_t, per-channel groups of G tokens, integer zero point:
//   score_t = n_t * scaling * sum_c q_c s_c (code_tc - z_c)          (q already rotated)
// Packed values: per-token groups of G channels: v_tc = (code_tc - z_tg) s_tg.
// Both products run on tensor cores (mma.m16n8k16 in the model dtype, fp32 accumulate). Codes become
// operands with one LOP3 and one packed subtraction: (code << shift) | MAGIC is the number MAGIC + code *
// 2^shift exactly (MAGIC = 128 in bf16, 1024 in fp16), minus MAGIC gives code * 2^shift; the 2^-shift goes
// into the other operand (keys) or the output row (values).
// Keys: A = codes [16 tokens x 16 channels], B = q*s [16 channels x 8 heads]; per head the zero-point
// term sum_c q_c s_c z_c is subtracted in fp32. Values: A = codes^T [16 channels x 16 tokens] per value
// group, B = p*s [16 tokens x 8 heads]; one more product with A = the zero points gives sum_t p s z.
// With HPG <= 4 the B columns 4..7 are padding: the lanes of those columns (r >= 4) build the upper half
// of the key B operand for head r - 4 and the two halves are swapped with one shuffle (SPLIT_B).
// The ring's next copy is issued before the group's math, so NSTAGE - 1 groups are in flight during it;
// the running output is rescaled only when some head's running max moved.
// Compile-time: HEAD_DIM, K_BITS, V_BITS, GROUP, HPG (query heads per KV head, <= 8), IS_BF16, NSTAGE
// (ring buffers, >= 2), MIN_BLOCKS (resident blocks per SM asked of the register allocator).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef K_BITS
#define K_BITS 2
#endif
#ifndef V_BITS
#define V_BITS 2
#endif
#ifndef GROUP
#define GROUP 32
#endif
#ifndef HPG
#define HPG 4
#endif
#ifndef IS_BF16
#define IS_BF16 1
#endif
#ifndef NSTAGE
#define NSTAGE 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
// benchmark variants that leave stages out (timed against the full kernel to place the time):
// 0 = full kernel, 1 = stream the packed bytes only (no math), 2 = keys and softmax only (no value product)
#ifndef MODE
#define MODE 0
#endif

#define D HEAD_DIM
#define G GROUP
#define EPL (D / 32)
#define CPB_K (8 / K_BITS)
#define CPB_V (8 / V_BITS)
#define BPT_K (D * K_BITS / 8)   // packed key bytes per token and head
#define BPT_V (D * V_BITS / 8)
#define BQ (BPT_K / 4)           // key bytes of one token held by one lane of a quad
#define NWK (BQ / 4)             // ... as 32-bit words
#define NKS (D / 16)             // k-steps of the score product
#define NVG (D / G)              // value groups per token
#define MPG (G / 16)             // 16-row tiles per value group (and 16-token tiles per group)
#define NBG (G / (8 * CPB_V))    // value bytes per lane per value group
#define NMT (D / 16)             // 16-channel output tiles
#if HPG <= 4 && NWK % 2 == 0
#define SPLIT_B 1
#else
#define SPLIT_B 0
#endif
#define NWK_B (SPLIT_B ? NWK / 2 : NWK)  // key words per lane whose B operand this lane builds
#define NKS_B (NWK_B * CPB_K)
#define FULL_MASK 0xffffffffu
#if IS_BF16
#define MAGIC 0x43004300u        // bf16x2 (128, 128)
#define MANT_BITS 7
#define VB_SCALE 1.f             // p * s is range-safe in bf16
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#define SUB_OP "sub.rn.bf16x2 %0, %1, %2;"
#else
#define MAGIC 0x64006400u        // f16x2 (1024, 1024)
#define MANT_BITS 10
#define VB_SCALE 256.f           // lifts small p * s out of the fp16 subnormals (undone on the output)
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#define SUB_OP "sub.rn.f16x2 %0, %1, %2;"
#endif
#define NEG_INF __uint_as_float(0xff800000u)

#if (D != 64) && (D != 128) && (D != 256)
#error "HEAD_DIM must be 64, 128 or 256"
#endif
#if ((K_BITS != 2) && (K_BITS != 4)) || ((V_BITS != 2) && (V_BITS != 4))
#error "K_BITS and V_BITS must be 2 or 4"
#endif
#if (G % 16) || (G > D) || (NBG < 1) || (HPG > 8) || (HPG < 1)
#error "unsupported GROUP / HPG"
#endif
#if NSTAGE < 2
#error "NSTAGE must be at least 2"
#endif

// stage layout (bytes): key codes, key scale, key zero, norms, value codes, value scale, value zero
#define S_KC 0
#define S_KS (S_KC + G * BPT_K)
#define S_KZ (S_KS + D * 2)
#define S_KN (S_KZ + D * 2)
#define S_VC (S_KN + G * 4)
#define S_VS (S_VC + G * BPT_V)
#define S_VZ (S_VS + G * NVG * 2)
#define STAGE_BYTES (S_VZ + G * NVG * 2)

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

// two floats -> one packed MMA operand (lo, hi) in the model dtype, rounded to nearest
__device__ __forceinline__ u32 pack_op(float lo, float hi) {
  u32 r;
#if IS_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
__device__ __forceinline__ float op_lo(u32 x) { return to_float((u16)(x & 0xffffu)); }
__device__ __forceinline__ float op_hi(u32 x) { return to_float((u16)(x >> 16)); }

// packed codes (already masked and OR-ed with MAGIC) -> the exact code values
__device__ __forceinline__ u32 code_op(u32 word, int shift, u32 mask) {
  u32 r, x = ((word >> shift) & mask) | MAGIC;
  asm(SUB_OP : "=r"(r) : "r"(x), "r"(MAGIC));
  return r;
}

// N consecutive 16-bit values from shared memory (N * 2 bytes aligned)
template <int N>
__device__ __forceinline__ void load_u16s(const u16* p, u16 out[N]) {
  if constexpr (N == 1) {
    out[0] = p[0];
  } else if constexpr (N == 2) {
    u32 w = *reinterpret_cast<const u32*>(p);
    out[0] = (u16)w; out[1] = (u16)(w >> 16);
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      uint2 w = *reinterpret_cast<const uint2*>(p + i);
      out[i] = (u16)w.x; out[i + 1] = (u16)(w.x >> 16); out[i + 2] = (u16)w.y; out[i + 3] = (u16)(w.y >> 16);
    }
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void mma(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      MMA_OP "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// code position p inside its byte -> right shift before masking, and the code's multiplier in the
// operand (bits above the mantissa would reach the exponent, so those positions are shifted down)
__host__ __device__ constexpr int pos_shift(int bits, int p) { return bits * (p + 1) <= MANT_BITS ? 0 : bits * p; }
__host__ __device__ constexpr u32 pos_mask(int bits, int p) {
  return (((1u << bits) - 1u) << (bits * p - pos_shift(bits, p))) * 0x00010001u;
}
__host__ __device__ constexpr float pos_inv_mult(int bits, int p) {
  return 1.f / (float)(1 << (bits * p - pos_shift(bits, p)));
}
__host__ __device__ constexpr float pos_mult(int bits, int p) { return (float)(1 << (bits * p - pos_shift(bits, p))); }

// lane holds elements lane*EPL .. of one row of D in the model dtype
__device__ __forceinline__ void load_row(const u16* row, int lane, float v[EPL]) {
#pragma unroll
  for (int i = 0; i < EPL; ++i) v[i] = to_float(row[lane * EPL + i]);
}

// torch-order normalized Walsh-Hadamard transform of one row held by the warp (see quantize.cu)
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

struct Packed {
  const u8* kc; const u16* ks; const u16* kz; const float* kn;
  const u8* vc; const u16* vs; const u16* vz;
};

// issue the copies of group gi (one KV head of one sequence) into a stage
__device__ __forceinline__ void load_stage(u8* st, const Packed& P, long long bh, int b, int cap, int gi, int lane) {
  constexpr int C_KC = G * BPT_K / 16, C_KS = D * 2 / 16, C_KN = G * 4 / 16, C_VC = G * BPT_V / 16,
                C_VS = G * NVG * 2 / 16;
  constexpr int TOTAL = C_KC + 2 * C_KS + C_KN + C_VC + 2 * C_VS;
  const long long tok = bh * cap + (long long)gi * G;
  const u8* src_kc = P.kc + tok * BPT_K;
  const u8* src_ks = reinterpret_cast<const u8*>(P.ks + (bh * (cap / G) + gi) * D);
  const u8* src_kz = reinterpret_cast<const u8*>(P.kz + (bh * (cap / G) + gi) * D);
  const u8* src_kn = reinterpret_cast<const u8*>(P.kn + (long long)b * cap + (long long)gi * G);
  const u8* src_vc = P.vc + tok * BPT_V;
  const u8* src_vs = reinterpret_cast<const u8*>(P.vs + tok * NVG);
  const u8* src_vz = reinterpret_cast<const u8*>(P.vz + tok * NVG);
  for (int c = lane; c < TOTAL; c += 32) {
    int i = c;
    const u8* src; int dst;
    if (i < C_KC) { src = src_kc + 16 * i; dst = S_KC + 16 * i; }
    else if ((i -= C_KC) < C_KS) { src = src_ks + 16 * i; dst = S_KS + 16 * i; }
    else if ((i -= C_KS) < C_KS) { src = src_kz + 16 * i; dst = S_KZ + 16 * i; }
    else if ((i -= C_KS) < C_KN) { src = src_kn + 16 * i; dst = S_KN + 16 * i; }
    else if ((i -= C_KN) < C_VC) { src = src_vc + 16 * i; dst = S_VC + 16 * i; }
    else if ((i -= C_VC) < C_VS) { src = src_vs + 16 * i; dst = S_VS + 16 * i; }
    else { i -= C_VS; src = src_vz + 16 * i; dst = S_VZ + 16 * i; }
    cp_async16(st + dst, src);
  }
}

extern "C" __global__ void __launch_bounds__(32, MIN_BLOCKS) decode_attention(
    const u16* __restrict__ q,                                   // [B, HKV*HPG, D]
    const u8* __restrict__ kc, const u16* __restrict__ ks, const u16* __restrict__ kz, const float* __restrict__ kn,
    const u8* __restrict__ vc, const u16* __restrict__ vs, const u16* __restrict__ vz,
    const u16* __restrict__ kr, const u16* __restrict__ vr,      // residual [B, HKV, rcap, D] (keys rotated)
    const int* __restrict__ n_packed, const int* __restrict__ n_res,
    float* __restrict__ o_part, float* __restrict__ ml_part,     // [B, HQ, splits+1, D], [B, HQ, splits+1, 2]
    int HKV, int cap, int rcap, int splits, int tps, float scale_log2, int rotate_q, float inv_sqrt_d) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* p_s = reinterpret_cast<float*>(smem);          // [G][8]
  u8* stages = reinterpret_cast<u8*>(p_s + G * 8);      // [NSTAGE][STAGE_BYTES]
  float* q_s = reinterpret_cast<float*>(stages);        // [HPG][D], until the first copy into the ring
  const int lane = threadIdx.x, r = lane >> 2, q4 = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int HQ = HKV * HPG, parts = splits + 1;
  const long long bh = (long long)b * HKV + kvh;

  // query heads of this KV head, rotated and rounded to the model dtype like the reference path
  for (int h = 0; h < HPG; ++h) {
    float v[EPL];
    load_row(q + ((long long)b * HQ + kvh * HPG + h) * D, lane, v);
    if (rotate_q) warp_hadamard(v, lane, inv_sqrt_d);
#pragma unroll
    for (int i = 0; i < EPL; ++i) q_s[h * D + lane * EPL + i] = to_float(to_dtype(v[i]));
  }
  __syncwarp();

  if (split == splits) {  // ---------------- full-precision residual tokens
    const int nr = n_res[b];
    float* s_s = q_s + HPG * D;  // [rcap][HPG] base-2 logits
    for (int t = lane; t < nr; t += 32) {  // one token per lane, its row in 16-byte loads issued together
      const uint4* krow = reinterpret_cast<const uint4*>(kr + (bh * rcap + t) * D);
      float acc[HPG];
#pragma unroll
      for (int h = 0; h < HPG; ++h) acc[h] = 0.f;
#pragma unroll
      for (int c8 = 0; c8 < D / 8; ++c8) {
        const uint4 w = krow[c8];
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float k0 = to_float((u16)(ws[i] & 0xffffu)), k1 = to_float((u16)(ws[i] >> 16));
#pragma unroll
          for (int h = 0; h < HPG; ++h) acc[h] += q_s[h * D + c8 * 8 + 2 * i] * k0 + q_s[h * D + c8 * 8 + 2 * i + 1] * k1;
        }
      }
#pragma unroll
      for (int h = 0; h < HPG; ++h) s_s[t * HPG + h] = acc[h] * scale_log2;
    }
    __syncwarp();
    float m[HPG], l[HPG], o[HPG][EPL];
#pragma unroll
    for (int h = 0; h < HPG; ++h) {
      m[h] = NEG_INF;
      for (int t = 0; t < nr; ++t) m[h] = fmaxf(m[h], s_s[t * HPG + h]);
      l[h] = 0.f;
#pragma unroll
      for (int i = 0; i < EPL; ++i) o[h][i] = 0.f;
    }
    for (int t0 = 0; t0 < nr; t0 += 8) {  // rows of 8 tokens loaded before they are used
      float v[8][EPL];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (t0 + u < nr) load_row(vr + (bh * rcap + t0 + u) * D, lane, v[u]);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (t0 + u >= nr) break;
#pragma unroll
        for (int h = 0; h < HPG; ++h) {
          const float p = fast_exp2(s_s[(t0 + u) * HPG + h] - m[h]);
          l[h] += p;
#pragma unroll
          for (int i = 0; i < EPL; ++i) o[h][i] += p * v[u][i];
        }
      }
    }
#pragma unroll
    for (int h = 0; h < HPG; ++h) {
      const long long pi = ((long long)b * HQ + kvh * HPG + h) * parts + split;
#pragma unroll
      for (int i = 0; i < EPL; ++i) o_part[pi * D + lane * EPL + i] = o[h][i];
      if (lane == 0) { ml_part[pi * 2] = m[h]; ml_part[pi * 2 + 1] = l[h]; }
    }
    return;
  }

  // ---------------- packed part: groups [g_begin, g_end) of this split
  const int n = n_packed[b];
  const int t_begin = split * tps, t_end = min(t_begin + tps, n);
  const int g_begin = t_begin / G, ng = t_end > t_begin ? (t_end - t_begin) / G : 0;
  const Packed P{kc, ks, kz, kn, vc, vs, vz};

  // this lane's query values in B-fragment order: head hb, channel of (k-step, slot); with SPLIT_B the lanes
  // r >= 4 hold the key words NWK_B.. of head r - 4
  const int hb = SPLIT_B ? (r & 3) : r;
  const int wo = SPLIT_B && r >= 4 ? NWK_B : 0;
  float qreg[NKS_B][4];
#pragma unroll
  for (int wi = 0; wi < NWK_B; ++wi)
#pragma unroll
    for (int p = 0; p < CPB_K; ++p)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int ch = (q4 * BQ + 4 * (wi + wo) + j) * CPB_K + p;
        qreg[wi * CPB_K + p][j] = hb < HPG ? q_s[hb * D + ch] * pos_inv_mult(K_BITS, p) : 0.f;
      }
  __syncwarp();  // q_s is read: the ring may overwrite it

  float acc[NMT][4];
#pragma unroll
  for (int i = 0; i < NMT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float zacc[NVG][4];  // per value group: row 0 of the product with A = zero points, sum_t z_t * B_t
#pragma unroll
  for (int g = 0; g < NVG; ++g) zacc[g][0] = zacc[g][1] = zacc[g][2] = zacc[g][3] = 0.f;
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
  const bool head_ok[2] = {2 * q4 < HPG, 2 * q4 + 1 < HPG};

#pragma unroll
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < ng) load_stage(stages + s * STAGE_BYTES, P, bh, b, cap, g_begin + s, lane);
    cp_async_commit();
  }
  for (int it = 0; it < ng; ++it) {
    cp_async_wait<NSTAGE - 2>();
    __syncwarp();  // group it has landed for every lane; every lane is done with group it - 1's buffer
    const int nx = it + NSTAGE - 1;
    if (nx < ng) load_stage(stages + (nx % NSTAGE) * STAGE_BYTES, P, bh, b, cap, g_begin + nx, lane);
    cp_async_commit();
    const u8* st = stages + (it % NSTAGE) * STAGE_BYTES;
    const u16* sks = reinterpret_cast<const u16*>(st + S_KS);
    const u16* skz = reinterpret_cast<const u16*>(st + S_KZ);
    const float* skn = reinterpret_cast<const float*>(st + S_KN);
#if MODE != 2  // the variant without the value product still loads the value bytes but never reads them
    const u8* svc = st + S_VC;
    const u16* svs = reinterpret_cast<const u16*>(st + S_VS);
    const u16* svz = reinterpret_cast<const u16*>(st + S_VZ);
#endif
#if MODE == 1
    if (lane == 0)
      acc[0][0] += (float)st[S_KC] + skn[0] + (float)svc[0] + to_float(sks[0] ^ skz[0] ^ svs[0] ^ svz[0]) + qreg[0][0];
#else

    // 1. key B fragments (q * s / mult in the model dtype) and the per-head zero-point term sum(B * z * mult)
    u32 bk[NKS][2];
    float bias = 0.f;
#pragma unroll
    for (int wi = 0; wi < NWK_B; ++wi) {
      float bv[CPB_K][4], zm[CPB_K][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int base = (q4 * BQ + 4 * (wi + wo) + j) * CPB_K;  // channels base .. base + CPB_K - 1 share a byte
        u16 sr[CPB_K], zr[CPB_K];
        load_u16s<CPB_K>(sks + base, sr);
        load_u16s<CPB_K>(skz + base, zr);
#pragma unroll
        for (int p = 0; p < CPB_K; ++p) {
          bv[p][j] = qreg[wi * CPB_K + p][j] * to_float(sr[p]);
          zm[p][j] = to_float(zr[p]) * pos_mult(K_BITS, p);
        }
      }
#pragma unroll
      for (int p = 0; p < CPB_K; ++p) {
        const u32 b0 = pack_op(bv[p][0], bv[p][2]), b1 = pack_op(bv[p][1], bv[p][3]);
        bk[wi * CPB_K + p][0] = b0;
        bk[wi * CPB_K + p][1] = b1;
        bias += op_lo(b0) * zm[p][0] + op_hi(b0) * zm[p][2] + op_lo(b1) * zm[p][1] + op_hi(b1) * zm[p][3];
      }
    }
#if SPLIT_B  // the other half of head hb's operand (and its zero-point sum) from lane r ^ 4
#pragma unroll
    for (int k = 0; k < NKS_B; ++k) {
      bk[NKS_B + k][0] = __shfl_xor_sync(FULL_MASK, bk[k][0], 16);
      bk[NKS_B + k][1] = __shfl_xor_sync(FULL_MASK, bk[k][1], 16);
    }
    bias += __shfl_xor_sync(FULL_MASK, bias, 16);
#endif
    bias += __shfl_xor_sync(0xffffffffu, bias, 1);
    bias += __shfl_xor_sync(0xffffffffu, bias, 2);
    const float hb0 = __shfl_sync(0xffffffffu, bias, 4 * (2 * q4) & 31);
    const float hb1 = __shfl_sync(0xffffffffu, bias, 4 * (2 * q4 + 1) & 31);

    // 2. scores of the group's tokens: rows (token), columns (heads 2*q4, 2*q4+1)
    float sc[MPG][4];
#pragma unroll
    for (int mt = 0; mt < MPG; ++mt) {
      const int ta = mt * 16 + r, tb = ta + 8;
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int wi = 0; wi < NWK; ++wi) {
        const u32 wa = *reinterpret_cast<const u32*>(st + S_KC + ta * BPT_K + q4 * BQ + 4 * wi);
        const u32 wb = *reinterpret_cast<const u32*>(st + S_KC + tb * BPT_K + q4 * BQ + 4 * wi);
#pragma unroll
        for (int p = 0; p < CPB_K; ++p) {
          const int sh = pos_shift(K_BITS, p);
          const u32 mk = pos_mask(K_BITS, p);
          mma(c, code_op(wa, sh, mk), code_op(wb, sh, mk), code_op(wa, sh + 8, mk), code_op(wb, sh + 8, mk),
              bk[wi * CPB_K + p][0], bk[wi * CPB_K + p][1]);
        }
      }
      const float na = skn[ta] * scale_log2, nb = skn[tb] * scale_log2;
      sc[mt][0] = head_ok[0] ? (c[0] - hb0) * na : NEG_INF;
      sc[mt][1] = head_ok[1] ? (c[1] - hb1) * na : NEG_INF;
      sc[mt][2] = head_ok[0] ? (c[2] - hb0) * nb : NEG_INF;
      sc[mt][3] = head_ok[1] ? (c[3] - hb1) * nb : NEG_INF;
    }

    // 3. online softmax per head (heads 2*q4 + j), probabilities to shared memory [token][head]
    float alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mx = NEG_INF;
#pragma unroll
      for (int mt = 0; mt < MPG; ++mt) mx = fmaxf(mx, fmaxf(sc[mt][j], sc[mt][j + 2]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      if (head_ok[j]) {
        const float m_new = fmaxf(m_run[j], mx);
        alpha[j] = fast_exp2(m_run[j] - m_new);
        m_run[j] = m_new;
        float ls = 0.f;
#pragma unroll
        for (int mt = 0; mt < MPG; ++mt) {
          const float pa = fast_exp2(sc[mt][j] - m_new), pb = fast_exp2(sc[mt][j + 2] - m_new);
          ls += pa + pb;
          p_s[(mt * 16 + r) * 8 + 2 * q4 + j] = pa;
          p_s[(mt * 16 + r + 8) * 8 + 2 * q4 + j] = pb;
        }
        l_run[j] = l_run[j] * alpha[j] + ls;
      } else {
        alpha[j] = 1.f;
#pragma unroll
        for (int mt = 0; mt < MPG; ++mt) {
          p_s[(mt * 16 + r) * 8 + 2 * q4 + j] = 0.f;
          p_s[(mt * 16 + r + 8) * 8 + 2 * q4 + j] = 0.f;
        }
      }
    }
    if (__any_sync(FULL_MASK, alpha[0] != 1.f || alpha[1] != 1.f)) {  // some running max moved
#pragma unroll
      for (int i = 0; i < NMT; ++i) {
        acc[i][0] *= alpha[0]; acc[i][1] *= alpha[1]; acc[i][2] *= alpha[0]; acc[i][3] *= alpha[1];
      }
#pragma unroll
      for (int g = 0; g < NVG; ++g) {
        zacc[g][0] *= alpha[0]; zacc[g][1] *= alpha[1]; zacc[g][2] *= alpha[0]; zacc[g][3] *= alpha[1];
      }
    }
    __syncwarp();
#if MODE == 0
    // 4. values: per 16-token tile and value group, B = p * s for head r, A = codes^T and A = zero points
#pragma unroll
    for (int kt = 0; kt < MPG; ++kt) {
      const int t0 = kt * 16 + 2 * q4;
      const int tk[4] = {t0, t0 + 1, t0 + 8, t0 + 9};
      float pv[4];
      u16 sr[4][NVG], zr[4][NVG];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pv[j] = r < HPG ? p_s[tk[j] * 8 + r] * VB_SCALE : 0.f;
        load_u16s<NVG>(svs + tk[j] * NVG, sr[j]);
        load_u16s<NVG>(svz + tk[j] * NVG, zr[j]);
      }
#pragma unroll
      for (int g = 0; g < NVG; ++g) {
        const u32 b0 = pack_op(pv[0] * to_float(sr[0][g]), pv[1] * to_float(sr[1][g]));
        const u32 b1 = pack_op(pv[2] * to_float(sr[2][g]), pv[3] * to_float(sr[3][g]));
        const u32 z01 = r == 0 ? ((u32)zr[0][g] | ((u32)zr[1][g] << 16)) : 0u;
        const u32 z89 = r == 0 ? ((u32)zr[2][g] | ((u32)zr[3][g] << 16)) : 0u;
        mma(zacc[g], z01, 0u, z89, 0u, b0, b1);
        const int byte0 = g * (G / CPB_V) + r * NBG;
#pragma unroll
        for (int jb = 0; jb < NBG; ++jb) {
          const u32 x01 = (u32)svc[tk[0] * BPT_V + byte0 + jb] | ((u32)svc[tk[1] * BPT_V + byte0 + jb] << 16);
          const u32 x89 = (u32)svc[tk[2] * BPT_V + byte0 + jb] | ((u32)svc[tk[3] * BPT_V + byte0 + jb] << 16);
#pragma unroll
          for (int pp = 0; pp < CPB_V; pp += 2) {  // channel i = jb*CPB_V + pp (row r), + 1 (row r + 8)
            const int u = (jb * CPB_V + pp) / 2;
            const int sh0 = pos_shift(V_BITS, pp), sh1 = pos_shift(V_BITS, pp + 1);
            const u32 mk0 = pos_mask(V_BITS, pp), mk1 = pos_mask(V_BITS, pp + 1);
            mma(acc[g * MPG + u], code_op(x01, sh0, mk0), code_op(x01, sh1, mk1), code_op(x89, sh0, mk0),
                code_op(x89, sh1, mk1), b0, b1);
          }
        }
      }
    }
#endif
#endif
  }
  cp_async_wait<0>();

  // ---------------- partial output of this split
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l_run[j] += __shfl_xor_sync(0xffffffffu, l_run[j], 4);
    l_run[j] += __shfl_xor_sync(0xffffffffu, l_run[j], 8);
    l_run[j] += __shfl_xor_sync(0xffffffffu, l_run[j], 16);
  }
#pragma unroll
  for (int g = 0; g < NVG; ++g) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float szj = __shfl_sync(0xffffffffu, zacc[g][j], q4);  // row 0 of the zero-point product
      if (!head_ok[j]) continue;
      const long long pi = ((long long)b * HQ + kvh * HPG + 2 * q4 + j) * parts + split;
#pragma unroll
      for (int u = 0; u < MPG; ++u)
#pragma unroll
        for (int par = 0; par < 2; ++par) {
          const int i = 2 * u + par;                   // channel index within this lane's block
          const int ch = g * G + r * (G / 8) + i;
          const float o = acc[g * MPG + u][j + 2 * par] * pos_inv_mult(V_BITS, i % CPB_V) - szj;
          o_part[pi * D + ch] = o * (1.f / VB_SCALE);
        }
      if (r == 0) { ml_part[pi * 2] = m_run[j]; ml_part[pi * 2 + 1] = l_run[j]; }
    }
  }
}

// out[b, h, :] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s  (grid B*HQ, block D threads)
extern "C" __global__ void combine(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                                   u16* __restrict__ out, int parts) {
  const long long bh = blockIdx.x;
  const int c = threadIdx.x;
  float mx = NEG_INF;
#pragma unroll 8
  for (int s = 0; s < parts; ++s) mx = fmaxf(mx, ml_part[(bh * parts + s) * 2]);
  float num = 0.f, den = 0.f;
#pragma unroll 8  // independent loads in flight; the sums keep their order
  for (int s = 0; s < parts; ++s) {
    const float w = fast_exp2(ml_part[(bh * parts + s) * 2] - mx);
    den += w * ml_part[(bh * parts + s) * 2 + 1];
    num += w * o_part[(bh * parts + s) * D + c];
  }
  out[bh * D + c] = to_dtype(num / den);
}
