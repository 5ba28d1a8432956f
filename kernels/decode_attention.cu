// Fused decode attention on a packed cache (flash-decoding with a final combine): OScaR, and with METHOD the
// baselines KIVI, QuaRot and TurboQuant+ (turbo2), which share everything but the operands of the two products.
//
// One query token per sequence; GQA with HPG query heads per KV head. Grid (splits + rsplits, H_kv, B),
// one warp per block: split s < splits streams G-token groups [s*tps, (s+1)*tps) of the packed part
// through a cp.async ring in shared memory; the rsplits residual splits attend the full-precision tokens (the
// exact ones, then the window) in equal slices of their capacity ecap + rcap, so a long window is spread over
// blocks as the packed tokens are (one block would be the launch's critical path: a kivi-policy window holds R+).
// Every split writes an unnormalized partial output and its (max, sum) in base 2; `combine` merges them.
//
// Packed keys (OScaR): x = hadamard(k) / n_t, per-channel groups of G tokens, integer zero point z_c:
//   score_t = n_t * scaling * sum_c q_c s_c (code_tc - z_c)          (q already rotated)
// with s and z in the decode layout of common.cuh (the channels one operand register pairs are adjacent).
// Packed values: per-token groups of G channels: v_tc = s_tg (code_tc - z_tg), stored in the decode layout
// of common.cuh (codes, scales and zeros permuted inside 16-token tiles so each lane loads ready operand words).
// Both products run on tensor cores (mma.m16n8k16 in the model dtype, fp32 accumulate).
//
// Codes become operands with one shift and one LOP3: the 4 bits of one half of a code byte are moved to the
// top 4 mantissa bits of a 16-bit element and OR-ed into the exponent of a power of two MAGIC_p, which makes the
// element exactly MAGIC_p + code (MAGIC_p = 16 or 4 by the code's place; the offset is kept small, so the
// products below cancel it with little fp32 accumulation error). The offsets and the zero points are never
// subtracted per code; they are products of their own, once per group:
//   keys    B = q s (per channel, one packed multiply), A = codes; the bias sum_c B_c (MAGIC_c + z_c) per
//           head is two m16n8k8 products per k-step with A = (MAGIC + z), from which each lane receives the
//           bias of its own output columns;
//   values  A = codes^T [16 channels x 16 tokens], B = p s (per token, one packed multiply); the sums
//           S2 = sum_t B_t z_t and S1 = sum_t B_t come from one product with A = [z ; 1] (rows 0-7 / 8-15),
//           and o_c = acc_c - MAGIC_c S1 - S2 once per split.
// All products use the same rounded operands, so the offsets cancel up to fp32 accumulation error.
// With HPG <= 4 the B columns 4..7 are padding: the lanes of those columns (r >= 4) build the upper half
// of the key B operand for head r - 4 and hand it over with one shuffle per register (SPLIT_B).
// The ring's next copy is issued before the group's math, so NSTAGE - 1 groups are in flight during it;
// the running output is rescaled only when some head's running max moved.
//
// The baselines (METHOD; every other line of the kernel is OScaR's):
//  1 KIVI: keys as OScaR's without rotation and norm and with a float zero point z_c (the group min), k = s code + z:
//      score_t = scaling * (sum_c B_c (MAGIC_c + code_tc) - sum_c B_c (MAGIC_c + C) + sum_c q_c RN(z_c + C s_c)),
//      B = q s, C = (2^bits - 1) / 2 the middle code (B's rounding then weighs code - C, as OScaR's integer zero
//      weighs code - z); the bias is one m16n8k16 product per k-step, A = (-(MAGIC + C) | RN(z + C s)), B = (q s ; q).
//      Values v = s code + z: o_c = acc_c - (MAGIC_c + C) S1 + sum_t p_t z_tg + C sum_t p_t s_tg, the last two sums
//      for 8 value groups per product (A = (z | s), rows = groups, B = p).
//  2 QuaRot: queries and keys rotated (H_D), keys per token in groups of G channels with an integer zero point,
//      stored in the per-token key layout of common.cuh (k-step ks = channels 16 ks .. 16 ks + 15, inside one group):
//      score_t = scaling * sum_g s_tg (P_tg - z_tg Q_g), P_tg = sum_(c in g) q_c code_tc from one accumulator per
//      group (B = q, loop-invariant; MAGIC's sum is its start value), Q_g = sum_(c in g) q_c. Values as OScaR's.
//  3 TurboQuant+ (turbo2): keys and values y = H_D (signs * x) per token, coded by the 4-level codebook L and one
//      fp16 norm n_b per block of G channels. L is additive in the two code bits, L(c) = a + b c + d c1 (c1 = the
//      high bit, which the symmetric codebook makes exact), so each product runs on the uniform operands of OScaR
//      plus a second one with only the high bits (MAGIC + 2 c1) against B scaled by k/2 = d / (2 b):
//        score_t = scaling * b * sum_b n_tb (a/b Q_b + sum q' c + 2 sum RN(k/2 q') c1),   q' = H_D (signs * q);
//        o' = a S1 + b (acc - MAGIC (S1 + S1')),   B = p n, S1 = sum_t B_t, S1' = sum_t RN(k/2 B_t);
//      every packed split turns its o' back (o = signs * H_D o', exact in fp32) before the combine; the residual
//      tokens stay as stored (raw queries, keys and values). The value product runs in fp16 for every model dtype
//      (B = p n with the fp16 norms is then one packed multiply; mma_f16, vmma8 and friends).
//  4 OSCAR (spectral): queries rotated by the layer's matrix before the kernel, keys and values per token in groups
//      of G channels with fp32 scale and zero, float zero point (x = s' code + z'); s' = pb s, z' = z + pa s turn the
//      stored (scale, zero) or Lloyd-Max (std, mean) into the affine code map (pa = 0, pb = 1 for the uniform
//      quantizer; the levels l0 + (l1 - l0) code of an equally spaced codebook otherwise). Keys as QuaRot's with
//      the float zero (s' P + z' Q, in fp32); values as KIVI's: B = RN(p s') from the fp32 product, the zero sums
//      sum_t p_t RN(z' + C s') by the product with A = RN(z' + C s') (rows r; the centred zero is small).
//  5 RotateKV: the packed tokens' base-2 logits come from kernels/rotatekv.cu (keys rebuilt there: dequantized,
//      the pre-RoPE transform undone, RoPE applied per position), passed as `kc` ([B, HQ, cap] fp32, skipped
//      tokens -inf); the ring streams them with the values (per token, integer zero: QuaRot's).
// KIVI's and QuaRot's ZERO_FLOAT switches their zero-point convention (compile-time, like the method's switch).
// EXACT (OTT, RotateKV, OSCAR): tokens kept in full precision. The residual split attends, before the window, each
// row's exact tokens ke/ve [B, HKV, ecap, D] (n_exact [B, HKV] of them, keys in the attention space like the
// window's); the packed splits skip the packed copies of those tokens: bit t % 32 of word t / 32 of
// skip [B, HKV, cap / 32] (uint32) set = packed token t scores -inf (the RotateKV logits come masked already).
// Per-token keys stream STAGE_TOKENS tokens per stage (per-channel keys: one group of GROUP tokens).
// Compile-time: HEAD_DIM, K_BITS, V_BITS, GROUP, HPG (query heads per KV head, <= 8), IS_BF16, NSTAGE
// (ring buffers, >= 2), MIN_BLOCKS (resident blocks per SM asked of the register allocator), METHOD (0 OScaR,
// 1 KIVI (and OTT), 2 QuaRot, 3 TurboQuant+, 4 OSCAR, 5 RotateKV), ZERO_FLOAT, STAGE_TOKENS, EXACT.

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
#define NSTAGE 3
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
// benchmark variants that leave stages out (timed against the full kernel to place the time):
// 0 = full kernel, 1 = stream the packed bytes only (no math), 2 = keys and softmax only (no value product)
#ifndef MODE
#define MODE 0
#endif
#ifndef METHOD
#define METHOD 0
#endif
#define KEY_TOKEN (METHOD == 2 || METHOD == 3 || METHOD == 4)  // per-token key groups (else per channel, G tokens)
#define KEY_SCORES (METHOD == 5)                 // RotateKV: the packed logits come ready (kernels/rotatekv.cu)
#define KEY_NORM (METHOD == 0)                   // OScaR's token norm multiplies the scores
#define CODEBOOK (METHOD == 3)                   // TurboQuant+'s codebook and block norms, keys and values
#define PARAM32 (METHOD == 4)                    // OSCAR's fp32 scales and zeros, keys and values
#ifndef ZERO_FLOAT
#define ZERO_FLOAT (METHOD == 1 || METHOD == 4)  // float zero point (the group min), keys and values
#endif
#ifndef EXACT
#define EXACT 0                                  // exact tokens beside the window, skipped in the packed part
#endif
#define SKIP_MASK (EXACT && !KEY_SCORES)
#ifndef STAGE_TOKENS
#define STAGE_TOKENS 32
#endif

#include "common.cuh"

#define G GROUP
#if KEY_TOKEN || KEY_SCORES
#define TOK STAGE_TOKENS         // tokens per stage of the ring
#else
#define TOK G
#endif
#define NTT (TOK / 16)           // 16-token tiles per stage
#define NGK (D / G)              // key groups per token (per-token keys)
#define CPB_K (8 / K_BITS)
#define CPB_V (8 / V_BITS)
#define BPT_K (D * K_BITS / 8)   // packed key bytes per token and head
#define BPT_V (D * V_BITS / 8)
#define BQ (BPT_K / 4)           // key bytes of one token held by one lane of a quad
#define NWK (BQ / 4)             // ... as 32-bit words
#define CPW (4 * CPB_K)          // key channels per word
#define NKS (D / 16)             // k-steps of the score product
#define NVG (D / G)              // value groups per token
#define MPG (G / 16)             // 16-row tiles per value group (and 16-token tiles per group)
#define NBG (G / (8 * CPB_V))    // value bytes per lane per value group
#define NMT (D / 16)             // 16-channel output tiles
#define VWL (BPT_V / 8)          // value code words per lane and 16-token tile (decode layout)
#if HPG <= 4 && NWK % 2 == 0 && METHOD == 0
#define SPLIT_B 1
#else
#define SPLIT_B 0
#endif
#define NWK_B (SPLIT_B ? NWK / 2 : NWK)  // key words per lane whose B operand this lane builds
#define NKS_B (NWK_B * CPB_K)
#if IS_BF16
#define ONES 0x3f803f80u         // bf16x2 (1, 1)
#define MANT_BITS 7
#define EXP_BIAS 127
#define VB_SCALE 1.f             // p * s is range-safe in bf16
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#define MMA8_OP "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 "
#define MUL2_OP "mul.rn.bf16x2 %0, %1, %2;"
#define ADD2_OP "add.rn.bf16x2 %0, %1, %2;"
#define FMA2_OP "fma.rn.bf16x2 %0, %1, %2, %3;"
#else
#define ONES 0x3c003c00u         // f16x2 (1, 1)
#define MANT_BITS 10
#define EXP_BIAS 15
#define VB_SCALE 256.f           // lifts small p * s out of the fp16 subnormals (undone on the output)
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#define MMA8_OP "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
#define MUL2_OP "mul.rn.f16x2 %0, %1, %2;"
#define ADD2_OP "add.rn.f16x2 %0, %1, %2;"
#define FMA2_OP "fma.rn.f16x2 %0, %1, %2, %3;"
#endif
#if CODEBOOK  // TurboQuant+'s value product runs in fp16 whatever the model dtype (see vmma8 below)
#undef VB_SCALE
#define VB_SCALE 16.f            // p * n with norms n up to 4096 stays finite in fp16
#endif
#define NEG_INF __uint_as_float(0xff800000u)

#if ((K_BITS != 2) && (K_BITS != 4)) || ((V_BITS != 2) && (V_BITS != 4))
#error "K_BITS and V_BITS must be 2 or 4"
#endif
#if (G % 16) || (G > D) || (NBG < 1) || (HPG > 8) || (HPG < 1)
#error "unsupported GROUP / HPG"
#endif
#if (TOK % 16) || (METHOD < 0) || (METHOD > 5) || (CODEBOOK && (K_BITS != 2 || V_BITS != 2))
#error "unsupported STAGE_TOKENS / METHOD (TurboQuant+ codes are 2-bit)"
#endif
#if PARAM32 && !ZERO_FLOAT
#error "OSCAR's fp32 parameters take the float zero point"
#endif
#if NSTAGE < 2
#error "NSTAGE must be at least 2"
#endif

// stage layout (bytes): key codes, key scale, key zero, norms, value codes, value scale, value zero
// (per-token keys: scale/zero [TOK][NGK]; TurboQuant+: key and value block norms in place of the scales, no zeros;
// RotateKV: the logits [HPG][TOK] fp32 in place of the key codes, no key parameters)
#define PB (PARAM32 ? 4 : 2)     // bytes of a scale or zero
#if KEY_SCORES
#define B_KC (HPG * TOK * 4)
#else
#define B_KC (TOK * BPT_K)
#endif
#if KEY_SCORES
#define B_KS 0
#elif KEY_TOKEN
#define B_KS (TOK * NGK * PB)
#else
#define B_KS (D * 2)
#endif
#define B_KN (KEY_NORM ? TOK * 4 : 0)
#define B_VC (TOK * BPT_V)
#define B_VS (TOK * NVG * PB)
#define PARAM_FIELDS (CODEBOOK ? 1 : 2)  // scale and zero, or the norm alone
#define S_KC 0
#define S_KS (S_KC + B_KC)
#define S_KZ (S_KS + B_KS)
#define S_KN (S_KS + PARAM_FIELDS * B_KS)
#define S_VC (S_KN + B_KN)
#define S_VS (S_VC + B_VC)
#define S_VZ (S_VS + B_VS)
#define STAGE_BYTES (S_VS + PARAM_FIELDS * B_VS)

__device__ __forceinline__ u32 mul2(u32 a, u32 b) {
  u32 r;
  asm(MUL2_OP : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 add2(u32 a, u32 b) {
  u32 r;
  asm(ADD2_OP : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#if ZERO_FLOAT
// a * b + c per half, rounded once
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
  u32 r;
  asm(FMA2_OP : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
// the middle code (2^bits - 1) / 2: float-zero products weigh code - CENTRE (|.| <= CENTRE) against the rounding of
// their B operands, as the integer zero point does for OScaR, instead of the code itself
#define CENTRE_K (0.5f * ((1 << K_BITS) - 1))
#define CENTRE_V (0.5f * ((1 << V_BITS) - 1))
#define NZF ((NVG + 7) / 8)  // products of the value zero-point sums per tile (8 groups each)
#endif
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

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void mma(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      MMA_OP "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// m16n8k8: A rows (r, r + 8) for k = (2*q4, 2*q4 + 1), B column r
__device__ __forceinline__ void mma8(float c[4], u32 a0, u32 a1, u32 b0) {
  asm volatile(MMA8_OP "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(b0));
}

// Code at position p of byte h (0 or 1) of each 16-bit half of a word -> operand element MAGIC_p + code:
// the byte's half holding position p goes to mantissa bits MANT_BITS-4 .. MANT_BITS-1, the code to bit
// code_bit(p) of the element, and MAGIC_p = 2^(MANT_BITS - code_bit(p)) makes one unit of the code worth 1.
__host__ __device__ constexpr int code_bit(int bits, int p) { return MANT_BITS - 4 + bits * (p % (4 / bits)); }
__host__ __device__ constexpr int code_rshift(int bits, int p, int h) {
  return 8 * h + 4 * (p / (4 / bits)) - (MANT_BITS - 4);
}
__host__ __device__ constexpr u32 code_mask(int bits, int p) {
  return (((1u << bits) - 1u) << code_bit(bits, p)) * 0x00010001u;
}
__host__ __device__ constexpr u32 code_magic(int bits, int p) {  // (MAGIC_p, MAGIC_p) in the model dtype
  return ((u32)(EXP_BIAS + MANT_BITS - code_bit(bits, p)) << MANT_BITS) * 0x00010001u;
}
__host__ __device__ constexpr float code_magic_f(int bits, int p) {
  return (float)(1 << (MANT_BITS - code_bit(bits, p)));
}
#if CODEBOOK
// the high bit alone of the 2-bit code at position p: operand element MAGIC_p + 2 c1 (see the top)
__host__ __device__ constexpr u32 code_hi_mask(int p) { return (2u << code_bit(2, p)) * 0x00010001u; }
#endif
// a left shift as a multiplication runs on the FMA pipe (IMAD), leaving the integer pipe to the LOP3s; the
// multiplier comes from a register the compiler cannot fold (it would turn the product back into a shift)
__device__ __forceinline__ u32 shift_right(u32 w, int n, u32 one) {
  return n >= 0 ? w >> n : w * (one << -n);
}
// (x & mask) | MAGIC_p written as one LOP3: left to itself the compiler splits it into an AND and an OR
__device__ __forceinline__ u32 code_op(u32 word, int bits, int p, int h, u32 one) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;"
      : "=r"(r)
      : "r"(shift_right(word, code_rshift(bits, p, h), one)), "r"(code_mask(bits, p)), "r"(code_magic(bits, p)));
  return r;
}

#if CODEBOOK
// code_op with only the code's high bit kept (TurboQuant+)
__device__ __forceinline__ u32 code_op_hi(u32 word, int p, int h, u32 one) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;"
      : "=r"(r)
      : "r"(shift_right(word, code_rshift(2, p, h), one)), "r"(code_hi_mask(p)), "r"(code_magic(2, p)));
  return r;
}
// TurboQuant+'s value product in fp16 for every model dtype: B = p n with its fp16 norms is one packed multiply.
// The operands as code_op / mma / mul2 / pack2 build them, in fp16 (10 mantissa bits, bias 15); 2-bit codes
// (common.cuh's mma_f16 and pack_half2 are the fp16 mma and pack2).
#define V_ONES 0x3c003c00u
__host__ __device__ constexpr int vcode_bit(int p) { return 6 + 2 * (p % 2); }
__host__ __device__ constexpr u32 vcode_magic(int p) { return ((u32)(15 + 10 - vcode_bit(p)) << 10) * 0x00010001u; }
__host__ __device__ constexpr float vcode_magic_f(int p) { return (float)(1 << (10 - vcode_bit(p))); }
__host__ __device__ constexpr u32 vcode_mask(int p, bool hi_only) {
  return ((hi_only ? 2u : 3u) << vcode_bit(p)) * 0x00010001u;
}
// code at position p of byte h of each half -> fp16 element MAGIC_p + code (hi_only: MAGIC_p + 2 c1)
__device__ __forceinline__ u32 vcode_op(u32 word, int p, int h, bool hi_only, u32 one) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;"
      : "=r"(r)
      : "r"(shift_right(word, 8 * h + 4 * (p / 2) - 6, one)), "r"(vcode_mask(p, hi_only)), "r"(vcode_magic(p)));
  return r;
}
__device__ __forceinline__ void vmma8(float c[4], u32 a0, u32 a1, u32 b0) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(b0));
}
__device__ __forceinline__ u32 vmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#endif
// the i-th 16-bit value of packed words w as float (in the model dtype, or fp16)
__device__ __forceinline__ float half_of(const u32* w, int i) { return to_float((u16)(w[i / 2] >> (16 * (i % 2)))); }

// N bytes (1, 2, 4, 8 or 16 * k; N-aligned) of shared memory as 32-bit words (narrow loads zero-extended)
template <int N>
__device__ __forceinline__ void load_words(const u8* p, u32 out[(N + 3) / 4]) {
  if constexpr (N == 1) {
    out[0] = *p;
  } else if constexpr (N == 2) {
    out[0] = *reinterpret_cast<const u16*>(p);
  } else if constexpr (N == 4) {
    out[0] = *reinterpret_cast<const u32*>(p);
  } else if constexpr (N == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    out[0] = w.x; out[1] = w.y;
  } else {
    static_assert(N % 16 == 0, "loads of 1, 2, 4, 8 or a multiple of 16 bytes");
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const uint4 w = reinterpret_cast<const uint4*>(p)[i];
      out[4 * i] = w.x; out[4 * i + 1] = w.y; out[4 * i + 2] = w.z; out[4 * i + 3] = w.w;
    }
  }
}

__device__ __forceinline__ void cp_async16_if(u32 dst, const void* src, bool pred) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p cp.async.cg.shared.global [%0], [%1], 16; }"
               ::"r"(dst), "l"(src), "r"((int)pred));
}

// The copies of one group, spread over the lanes in 16-byte chunks: a stage is the regions
// key codes | key scale + key zero | norms | value codes | value scale + value zero (pairs of equal-sized
// fields share a region), and lane l copies chunks l, l + 32, ... of every region.
#define CH_KC (B_KC / 16)
#define CH_KS (B_KS / 16)
#define CH_KN (B_KN / 16)
#define CH_VC (B_VC / 16)
#define CH_VS (B_VS / 16)

struct Sources {  // the split's first group of every field (the same for all lanes)
  const u8* kc; const u8* ks; const u8* kz; const u8* kn; const u8* vc; const u8* vs; const u8* vz;
  long long kc_head;  // RotateKV: bytes from one query head's logits to the next
};

// a region of CHUNKS 16-byte chunks: the first CHUNKS_A from field a, the rest from field b (BYTES per group)
template <int CHUNKS, int CHUNKS_A, int BYTES>
__device__ __forceinline__ void copy_region(u32 dst, const u8* a, const u8* b, long long gi, int lane) {
#pragma unroll
  for (int i = 0; i < (CHUNKS + 31) / 32; ++i) {
    const int c = 32 * i + lane;
    const u8* src = (CHUNKS_A == CHUNKS || c < CHUNKS_A) ? a + 16 * c : b + 16 * (c - CHUNKS_A);
    cp_async16_if(dst + 16 * c, src + gi * BYTES, CHUNKS % 32 == 0 || c < CHUNKS);
  }
}

#if SKIP_MASK
#define NSKW ((TOK + 31) / 32)  // skip words per stage
// the skip bits of the TOK packed tokens from token j0 (a multiple of TOK): bit t of w[t / 32] = token j0 + t
__device__ __forceinline__ void load_skip(u32 w[NSKW], const u32* __restrict__ row, int j0) {
#pragma unroll
  for (int i = 0; i < NSKW; ++i) w[i] = row[j0 / 32 + i];
  if (TOK < 32) w[0] >>= j0 % 32;
}
__device__ __forceinline__ bool skipped(const u32 w[NSKW], int t) { return (w[t / 32] >> (t % 32)) & 1u; }
#endif

#if KEY_SCORES
// the stage's logits of the HPG query heads: TOK fp32 values from each head's row
__device__ __forceinline__ void copy_scores(u32 dst, const u8* src, long long head_bytes, long long gi, int lane) {
  constexpr int PER_HEAD = TOK * 4 / 16;
#pragma unroll
  for (int i = 0; i < (HPG * PER_HEAD + 31) / 32; ++i) {
    const int c = 32 * i + lane, h = c / PER_HEAD;
    cp_async16_if(dst + 16 * c, src + h * head_bytes + gi * (TOK * 4) + 16 * (c % PER_HEAD),
                  (HPG * PER_HEAD) % 32 == 0 || c < HPG * PER_HEAD);
  }
}
#endif

// issue the copies of group gi (counted from the split's first) into the stage at shared address st
__device__ __forceinline__ void load_stage(u32 st, const Sources& S, int gi, int lane) {
#if KEY_SCORES
  copy_scores(st + S_KC, S.kc, S.kc_head, gi, lane);
#else
  copy_region<CH_KC, CH_KC, B_KC>(st + S_KC, S.kc, S.kc, gi, lane);
#endif
  copy_region<PARAM_FIELDS * CH_KS, CH_KS, B_KS>(st + S_KS, S.ks, S.kz, gi, lane);
  copy_region<CH_KN, CH_KN, B_KN>(st + S_KN, S.kn, S.kn, gi, lane);
  copy_region<CH_VC, CH_VC, B_VC>(st + S_VC, S.vc, S.vc, gi, lane);
  copy_region<PARAM_FIELDS * CH_VS, CH_VS, B_VS>(st + S_VS, S.vs, S.vz, gi, lane);
}

// the HPG query rows of one KV head, rotated (after the sign flips `signs`, if given) and rounded to the model
// dtype like the reference path -> q_s
// Every query row is loaded before any is transformed: the HPG loads are in flight together (a block's prologue
// is on the critical path of a one-wave launch; one row at a time waited HPG memory latencies).
__device__ __forceinline__ void load_queries(float* q_s, const u16* q_rows, int lane, int rotate_q, float inv_sqrt_d,
                                             const float* signs = nullptr) {
  float v[HPG][EPL];
#pragma unroll
  for (int h = 0; h < HPG; ++h) load_row(q_rows + h * D, lane, v[h]);
#pragma unroll
  for (int h = 0; h < HPG; ++h) {
    if (signs) {
#pragma unroll
      for (int i = 0; i < EPL; ++i) v[h][i] *= signs[lane * EPL + i];
    }
    if (rotate_q) warp_hadamard(v[h], lane, inv_sqrt_d);
#pragma unroll
    for (int i = 0; i < EPL; ++i) q_s[h * D + lane * EPL + i] = to_float(to_dtype(v[h][i]));
  }
  __syncwarp();
}

extern "C" __global__ void __launch_bounds__(32, MIN_BLOCKS) decode_attention(
    const u16* __restrict__ q,                                   // [B, HKV*HPG, D]
    const u8* __restrict__ kc, const u16* __restrict__ ks, const u16* __restrict__ kz, const float* __restrict__ kn,
    const u8* __restrict__ vc, const u16* __restrict__ vs, const u16* __restrict__ vz,
    const u16* __restrict__ kr, const u16* __restrict__ vr,      // residual [B, HKV, rcap, D] (keys rotated)
    const int* __restrict__ n_packed, const int* __restrict__ n_res,
    float* __restrict__ o_part, float* __restrict__ ml_part,     // [B, HQ, parts, D], [B, HQ, parts, 2]
    int HKV, int cap, int rcap, int splits, int tps, float scale_log2, int rotate_q, float inv_sqrt_d
#if CODEBOOK
    , const float* __restrict__ signs, float cb_alpha, float cb_beta, float cb_hkappa  // [D] +-1; codebook a, b, k/2
#endif
#if PARAM32
    , float param_a, float param_b  // OSCAR: s' = param_b s, z' = z + param_a s
#endif
#if EXACT
    , const u16* __restrict__ ke, const u16* __restrict__ ve,  // exact tokens [B, HKV, ecap, D] (keys as kr's)
    const int* __restrict__ n_exact, int ecap, const u32* __restrict__ skip  // [B, HKV]; [B, HKV, cap / 32]
#endif
    ) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* p_s = reinterpret_cast<float*>(smem);          // [8 heads][TOK] probabilities
  float* q_s = p_s + 8 * TOK;                           // [HPG][D] rotated queries
  u8* stages = reinterpret_cast<u8*>(q_s + HPG * D);    // [NSTAGE][STAGE_BYTES]
  const int lane = threadIdx.x, r = lane >> 2, q4 = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int HQ = HKV * HPG, parts = gridDim.x;  // the packed splits, then the residual ones
  const long long bh = (long long)b * HKV + kvh;
  const u16* q_rows = q + ((long long)b * HQ + kvh * HPG) * D;

  if (split >= splits) {  // ---------------- a slice of the full-precision tokens (the exact ones, then the window)
    load_queries(q_s, q_rows, lane, rotate_q, inv_sqrt_d);
#if EXACT
    const int ne = n_exact[bh], nr = ne + n_res[b];  // token t < ne: exact row t, else window row t - ne
    const int full_cap = ecap + rcap;
#define FULL_ROW(win, ex, t) ((t) < ne ? (ex) + (bh * ecap + (t)) * D : (win) + (bh * rcap + (t) - ne) * D)
#else
    const int nr = n_res[b], full_cap = rcap;
#define FULL_ROW(win, ex, t) ((win) + (bh * rcap + (t)) * D)
#endif
    const int per_split = (full_cap + parts - splits - 1) / (parts - splits);  // fixed by the capacities
    const int t_lo = (split - splits) * per_split, t_hi = min(nr, t_lo + per_split);
    float* s_s = reinterpret_cast<float*>(stages);  // [per_split][HPG] base-2 logits of tokens t_lo ..
    for (int t = t_lo + lane; t < t_hi; t += 32) {  // one token per lane, its row in 16-byte loads issued together
      const uint4* krow = reinterpret_cast<const uint4*>(FULL_ROW(kr, ke, t));
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
          for (int h = 0; h < HPG; ++h)
            acc[h] += q_s[h * D + c8 * 8 + 2 * i] * k0 + q_s[h * D + c8 * 8 + 2 * i + 1] * k1;
        }
      }
#pragma unroll
      for (int h = 0; h < HPG; ++h) s_s[(t - t_lo) * HPG + h] = acc[h] * scale_log2;
    }
    __syncwarp();
    float m[HPG], l[HPG], o[HPG][EPL];  // an empty slice writes (-inf, 0, 0): the combine gives it no weight
#pragma unroll
    for (int h = 0; h < HPG; ++h) {
      m[h] = NEG_INF;
      for (int t = t_lo; t < t_hi; ++t) m[h] = fmaxf(m[h], s_s[(t - t_lo) * HPG + h]);
      l[h] = 0.f;
#pragma unroll
      for (int i = 0; i < EPL; ++i) o[h][i] = 0.f;
    }
    for (int t0 = t_lo; t0 < t_hi; t0 += 8) {  // rows of 8 tokens loaded before they are used
      float v[8][EPL];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (t0 + u < t_hi) load_row(FULL_ROW(vr, ve, t0 + u), lane, v[u]);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (t0 + u >= t_hi) break;
#pragma unroll
        for (int h = 0; h < HPG; ++h) {
          const float p = fast_exp2(s_s[(t0 + u - t_lo) * HPG + h] - m[h]);
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
#undef FULL_ROW

  // ---------------- packed part: stages [g_begin, g_begin + ng) of this split (TOK tokens each)
  const int n = n_packed[b];
  const int t_begin = split * tps, t_end = min(t_begin + tps, n);
  const int g_begin = t_begin / TOK, ng = t_end > t_begin ? (t_end - t_begin) / TOK : 0;
  const long long gpr = cap / TOK;  // stages per storage row
  const long long kg = bh * gpr + g_begin;  // first stage of the split in the per-head fields
#if KEY_SCORES  // the logits [B, HQ, cap] of this KV head's query heads, from the split's first token
  const u8* kc_first = kc + (((long long)b * HQ + kvh * HPG) * cap + (long long)g_begin * TOK) * 4;
#else
  const u8* kc_first = kc + kg * B_KC;
#endif
  const Sources src{kc_first, reinterpret_cast<const u8*>(ks) + kg * B_KS,
                    reinterpret_cast<const u8*>(kz) + kg * B_KS,
                    reinterpret_cast<const u8*>(kn) + ((long long)b * gpr + g_begin) * B_KN, vc + kg * B_VC,
                    reinterpret_cast<const u8*>(vs) + kg * B_VS, reinterpret_cast<const u8*>(vz) + kg * B_VS,
                    (long long)cap * 4};
  const u32 stages_addr = smem_addr(stages);
  const u32 one = (u32)(splits >= 0);  // 1, opaque to the compiler (see shift_right)

  float acc[NMT][4];
#pragma unroll
  for (int i = 0; i < NMT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float zacc[NVG][4];  // per value group: rows r = sum_t B_t z_t, rows r + 8 = sum_t B_t (heads 2*q4, 2*q4+1)
#pragma unroll
  for (int g = 0; g < NVG; ++g) zacc[g][0] = zacc[g][1] = zacc[g][2] = zacc[g][3] = 0.f;
#if ZERO_FLOAT
  // per 8 value groups gr: sum_t p_t z_tg (rows r) and sum_t p_t s_tg (rows r + 8) of group 8 gr + r, columns heads
  // 2*q4, 2*q4+1
  float zf[NZF][4];
#pragma unroll
  for (int gr = 0; gr < NZF; ++gr) zf[gr][0] = zf[gr][1] = zf[gr][2] = zf[gr][3] = 0.f;
#endif
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
  const bool head_ok[2] = {2 * q4 < HPG, 2 * q4 + 1 < HPG};

  // the first groups' copies fly while the queries are loaded and rotated
#pragma unroll
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < ng) load_stage(stages_addr + s * STAGE_BYTES, src, s, lane);
    cp_async_commit();
  }
#if CODEBOOK
  load_queries(q_s, q_rows, lane, 1, inv_sqrt_d, signs);
#elif !KEY_SCORES
  load_queries(q_s, q_rows, lane, rotate_q, inv_sqrt_d);
#endif
#if SKIP_MASK  // the skip words of the next stage, loaded a stage ahead (bit t: the stage's token t)
  const u32* skip_row = skip + bh * ((cap + 31) / 32);
  u32 skip_next[NSKW];
  if (ng > 0) load_skip(skip_next, skip_row, g_begin * TOK);
#endif

#if KEY_SCORES  // (no key operands: the logits come ready)
#elif KEY_TOKEN
  // B operands of the score product: head r's query in the order of the per-token key layout, k-step ks = channels
  // 16 ks + (2 q4, 2 q4 + 1) and 16 ks + (2 q4 + 8, 2 q4 + 9); loop-invariant
  u32 qb[NKS][2];
#if CODEBOOK
  u32 qc[NKS][2];  // the same times k/2: B of the high-bit product
  const u32 hk2 = pack2(cb_hkappa, cb_hkappa), hk2v = pack_half2(cb_hkappa, cb_hkappa);  // (model dtype, fp16)
#endif
  // per key group and this lane's head columns (2 q4 + j): the accumulators' start (minus the MAGIC offsets; plus
  // a/b Q for TurboQuant+) and Q = sum of the group's query values (times the zero point)
  float kstart[NGK][2], ksum[NGK][2];
  {
    float part_q[NGK], part_m[NGK];  // this lane's share for head r: sum q, sum MAGIC q (+ the high-bit product's)
#pragma unroll
    for (int gk = 0; gk < NGK; ++gk) part_q[gk] = part_m[gk] = 0.f;
#pragma unroll
    for (int k = 0; k < NKS; ++k) {
      const int c0 = 16 * k + 2 * q4, gk = k / (G / 16);
      const float* qr = q_s + r * D;
      const float x0 = r < HPG ? qr[c0] : 0.f, x1 = r < HPG ? qr[c0 + 1] : 0.f;
      const float x8 = r < HPG ? qr[c0 + 8] : 0.f, x9 = r < HPG ? qr[c0 + 9] : 0.f;
      qb[k][0] = pack2(x0, x1);  // exact: q_s holds values of the model dtype
      qb[k][1] = pack2(x8, x9);
      const float sq = (x0 + x1) + (x8 + x9);
      part_q[gk] += sq;
      part_m[gk] += code_magic_f(K_BITS, k % CPB_K) * sq;
#if CODEBOOK
      qc[k][0] = mul2(qb[k][0], hk2);
      qc[k][1] = mul2(qb[k][1], hk2);
      part_m[gk] += code_magic_f(2, k % CPB_K) * ((half_of(qc[k], 0) + half_of(qc[k], 1)) +
                                                  (half_of(qc[k], 2) + half_of(qc[k], 3)));
#endif
    }
#if CODEBOOK
    const float a_over_b = cb_alpha / cb_beta;
#endif
#pragma unroll
    for (int gk = 0; gk < NGK; ++gk) {
      part_q[gk] += __shfl_xor_sync(FULL_MASK, part_q[gk], 1);
      part_q[gk] += __shfl_xor_sync(FULL_MASK, part_q[gk], 2);
      part_m[gk] += __shfl_xor_sync(FULL_MASK, part_m[gk], 1);
      part_m[gk] += __shfl_xor_sync(FULL_MASK, part_m[gk], 2);
#pragma unroll
      for (int j = 0; j < 2; ++j) {  // head 2 q4 + j's sums sit in lanes 4 (2 q4 + j) ..
        ksum[gk][j] = __shfl_sync(FULL_MASK, part_q[gk], 4 * (2 * q4 + j));
        const float mag = __shfl_sync(FULL_MASK, part_m[gk], 4 * (2 * q4 + j));
#if CODEBOOK
        kstart[gk][j] = a_over_b * ksum[gk][j] - mag;
#else
        kstart[gk][j] = -mag;
#endif
      }
    }
  }
#if CODEBOOK
  const float key_scale = scale_log2 * cb_beta;
#else
  const float key_scale = scale_log2;
#endif
#else
  // this lane's query values in B-fragment order as packed pairs: head hb, k-step (word, position), pair
  // (byte 0, byte 2) or (byte 1, byte 3) of the word; with SPLIT_B the lanes r >= 4 hold the words NWK_B..
  // of head r - 4
  const int hb = SPLIT_B ? (r & 3) : r;
  const int wo = SPLIT_B && r >= 4 ? NWK_B : 0;
  u32 qh[NKS_B][2];
#pragma unroll
  for (int wi = 0; wi < NWK_B; ++wi)
#pragma unroll
    for (int p = 0; p < CPB_K; ++p)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ch = (q4 * BQ + 4 * (wi + wo) + h) * CPB_K + p;  // bytes h and h + 2 of the word
        qh[wi * CPB_K + p][h] = hb < HPG ? pack2(q_s[hb * D + ch], q_s[hb * D + ch + 2 * CPB_K]) : 0u;
      }
#endif

  for (int it = 0; it < ng; ++it) {
    cp_async_wait<NSTAGE - 2>();
    __syncwarp();  // group it has landed for every lane; every lane is done with group it - 1's buffer
    const int nx = it + NSTAGE - 1;
    if (nx < ng) load_stage(stages_addr + (nx % NSTAGE) * STAGE_BYTES, src, nx, lane);
    cp_async_commit();
    const u8* st = stages + (it % NSTAGE) * STAGE_BYTES;
#if KEY_NORM
    const float* skn = reinterpret_cast<const float*>(st + S_KN);
#endif
#if SKIP_MASK
    u32 skip_w[NSKW];
#pragma unroll
    for (int i = 0; i < NSKW; ++i) skip_w[i] = skip_next[i];
    if (it + 1 < ng) load_skip(skip_next, skip_row, (g_begin + it + 1) * TOK);
#endif
#if MODE == 1
#if KEY_SCORES
    if (lane == 0)
      acc[0][0] += (float)(st[S_KC] ^ st[S_VC] ^ st[S_VS] ^ st[STAGE_BYTES - 1] ^ one);
#elif METHOD == 0
    if (lane == 0)  // touch every field (and the operands the full kernel builds) so nothing is optimized away
      acc[0][0] += (float)st[S_KC] + skn[0] +
                   (float)(st[S_VC] ^ st[S_VS] ^ st[S_VZ] ^ st[S_KS] ^ st[S_KZ] ^ qh[0][0] ^ one);
#elif KEY_TOKEN
    if (lane == 0)
      acc[0][0] += (float)(st[S_KC] ^ st[S_KS] ^ st[S_VC] ^ st[S_VS] ^ st[STAGE_BYTES - 1] ^ qb[0][0] ^ one) +
                   kstart[0][0] + ksum[0][1] + key_scale;
#else
    if (lane == 0)
      acc[0][0] += (float)(st[S_KC] ^ st[S_KS] ^ st[S_VC] ^ st[S_VS] ^ st[STAGE_BYTES - 1] ^ qh[0][0] ^ one);
#endif
#if SKIP_MASK
    if (lane == 0) acc[0][0] += (float)skip_w[0];
#endif
#else

#if KEY_SCORES
    // 1-3. the stage's logits, rows (token), columns (heads 2*q4, 2*q4+1)
    float sc[NTT][4];
    const float* sst = reinterpret_cast<const float*>(st + S_KC);  // [HPG][TOK]
#pragma unroll
    for (int mt = 0; mt < NTT; ++mt) {
      const int ta = mt * 16 + r, tb = ta + 8;
      sc[mt][0] = head_ok[0] ? sst[(2 * q4) * TOK + ta] : NEG_INF;
      sc[mt][1] = head_ok[1] ? sst[(2 * q4 + 1) * TOK + ta] : NEG_INF;
      sc[mt][2] = head_ok[0] ? sst[(2 * q4) * TOK + tb] : NEG_INF;
      sc[mt][3] = head_ok[1] ? sst[(2 * q4 + 1) * TOK + tb] : NEG_INF;
    }
#elif KEY_TOKEN
    // 1-3. scores of the stage's tokens, rows (token), columns (heads 2*q4, 2*q4+1): per key group one product per
    // k-step (two for TurboQuant+) into the group's accumulator, then scaled per token and group
    float sc[NTT][4];
#pragma unroll
    for (int mt = 0; mt < NTT; ++mt) {
      const int ta = mt * 16 + r, tb = ta + 8;
      u32 wa[NWK], wb[NWK], sa[(NGK * PB + 3) / 4], sb[(NGK * PB + 3) / 4];
      load_words<BQ>(st + S_KC + ta * BPT_K + q4 * BQ, wa);
      load_words<BQ>(st + S_KC + tb * BPT_K + q4 * BQ, wb);
      load_words<NGK * PB>(st + S_KS + ta * NGK * PB, sa);
      load_words<NGK * PB>(st + S_KS + tb * NGK * PB, sb);
#if !CODEBOOK
      u32 za[(NGK * PB + 3) / 4], zb[(NGK * PB + 3) / 4];
      load_words<NGK * PB>(st + S_KZ + ta * NGK * PB, za);
      load_words<NGK * PB>(st + S_KZ + tb * NGK * PB, zb);
#endif
      float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int gk = 0; gk < NGK; ++gk) {
        float u[4] = {kstart[gk][0], kstart[gk][1], kstart[gk][0], kstart[gk][1]};  // one accumulator per group
#pragma unroll
        for (int kk = 0; kk < G / 16; ++kk) {
          const int k = gk * (G / 16) + kk, wi = k / CPB_K, p = k % CPB_K;
          mma(u, code_op(wa[wi], K_BITS, p, 0, one), code_op(wb[wi], K_BITS, p, 0, one),
              code_op(wa[wi], K_BITS, p, 1, one), code_op(wb[wi], K_BITS, p, 1, one), qb[k][0], qb[k][1]);
#if CODEBOOK
          mma(u, code_op_hi(wa[wi], p, 0, one), code_op_hi(wb[wi], p, 0, one), code_op_hi(wa[wi], p, 1, one),
              code_op_hi(wb[wi], p, 1, one), qc[k][0], qc[k][1]);
#endif
        }
#if CODEBOOK  // the tokens' fp16 block norms
        const float na = f16_to_float((u16)(sa[gk / 2] >> (16 * (gk % 2))));
        const float nb = f16_to_float((u16)(sb[gk / 2] >> (16 * (gk % 2))));
#pragma unroll
        for (int i = 0; i < 4; ++i) s4[i] = fmaf(i < 2 ? na : nb, u[i], s4[i]);
#else  // the tokens' scale and zero point (rows ta: elements 0, 1; tb: 2, 3)
#if PARAM32  // s' = param_b s, z' = z + param_a s
        const float s_a = __uint_as_float(sa[gk]), s_b = __uint_as_float(sb[gk]);
        const float scale[2] = {param_b * s_a, param_b * s_b};
        const float zero[2] = {fmaf(param_a, s_a, __uint_as_float(za[gk])),
                               fmaf(param_a, s_b, __uint_as_float(zb[gk]))};
#else
        const float scale[2] = {half_of(sa, gk), half_of(sb, gk)}, zero[2] = {half_of(za, gk), half_of(zb, gk)};
#endif
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#if ZERO_FLOAT  // k = s code + z: s P + z Q
          s4[i] = fmaf(scale[i / 2], u[i], fmaf(zero[i / 2], ksum[gk][i % 2], s4[i]));
#else  // k = s (code - z): s (P - z Q)
          s4[i] = fmaf(scale[i / 2], fmaf(-zero[i / 2], ksum[gk][i % 2], u[i]), s4[i]);
#endif
        }
#endif
      }
      sc[mt][0] = head_ok[0] ? s4[0] * key_scale : NEG_INF;
      sc[mt][1] = head_ok[1] ? s4[1] * key_scale : NEG_INF;
      sc[mt][2] = head_ok[0] ? s4[2] * key_scale : NEG_INF;
      sc[mt][3] = head_ok[1] ? s4[3] * key_scale : NEG_INF;
    }
#else
#if ZERO_FLOAT
    // 1-2. key B operands q * s per channel pair and the bias -sum_c B_c (MAGIC_c + C) + sum_c q_c RN(z_c + C s_c)
    // (C = CENTRE_K): per k-step two m16n8k8 products with the constant A = -(MAGIC + C) (every row: the sum over
    // both halves of B) and two with A = RN(z + C s) of bytes 0/2, 1/3 in rows (r, r + 8) against the query halves
    // (read in rows r and r + 8, as OScaR's bias below)
    u32 bk[NKS][2];
    float bias_m[4] = {0.f, 0.f, 0.f, 0.f}, bias02[4] = {0.f, 0.f, 0.f, 0.f}, bias13[4] = {0.f, 0.f, 0.f, 0.f};
    const u32 centre2 = pack2(CENTRE_K, CENTRE_K);
#pragma unroll
    for (int wi = 0; wi < NWK; ++wi) {
      u32 sw[CPW / 2], zw[CPW / 2];
      load_words<CPW * 2>(st + S_KS + (q4 * BQ + 4 * wi) * CPB_K * 2, sw);
      load_words<CPW * 2>(st + S_KZ + (q4 * BQ + 4 * wi) * CPB_K * 2, zw);
#pragma unroll
      for (int p = 0; p < CPB_K; ++p) {
        const int k = wi * CPB_K + p;
        const u32 neg = pack2(-(code_magic_f(K_BITS, p) + CENTRE_K), -(code_magic_f(K_BITS, p) + CENTRE_K));
        bk[k][0] = mul2(qh[k][0], sw[2 * p]);
        bk[k][1] = mul2(qh[k][1], sw[2 * p + 1]);
        const u32 mid02 = fma2(sw[2 * p], centre2, zw[2 * p]), mid13 = fma2(sw[2 * p + 1], centre2, zw[2 * p + 1]);
        mma8(bias_m, neg, neg, bk[k][0]);
        mma8(bias_m, neg, neg, bk[k][1]);
        mma8(bias02, mid02, mid13, qh[k][0]);
        mma8(bias13, mid02, mid13, qh[k][1]);
      }
    }
    const float bias0 = -(bias_m[0] + bias02[0] + bias13[2]), bias1 = -(bias_m[1] + bias02[1] + bias13[3]);
#else
    // 1. key B operands: q * s per channel pair, one packed multiply each
    u32 bk[NKS][2];
#pragma unroll
    for (int wi = 0; wi < NWK_B; ++wi) {
      u32 sw[CPW / 2];  // scales of the word's CPW channels, pairs of neighbours
      load_words<CPW * 2>(st + S_KS + (q4 * BQ + 4 * (wi + wo)) * CPB_K * 2, sw);
#pragma unroll
      for (int p = 0; p < CPB_K; ++p)
#pragma unroll
        for (int h = 0; h < 2; ++h)  // pair 2p + h: the channels of bytes h and h + 2 (decode layout)
          bk[wi * CPB_K + p][h] = mul2(qh[wi * CPB_K + p][h], sw[2 * p + h]);
    }
#if SPLIT_B  // the other half of head hb's operand from lane r ^ 4 (lanes r >= 4 are padding columns)
#pragma unroll
    for (int k = 0; k < NKS_B; ++k) {
      bk[NKS_B + k][0] = __shfl_xor_sync(FULL_MASK, bk[k][0], 16);
      bk[NKS_B + k][1] = __shfl_xor_sync(FULL_MASK, bk[k][1], 16);
    }
#endif

    // 2. bias per head: sum_c B_c (MAGIC_c + z_c); A = (MAGIC + z of bytes 0/2, of bytes 1/3) in rows (r, r + 8):
    // the product with the byte-0/2 half of B is read in rows r, the one with the byte-1/3 half in rows r + 8
    float bias02[4] = {0.f, 0.f, 0.f, 0.f}, bias13[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int wi = 0; wi < NWK; ++wi) {
      u32 zw[CPW / 2];
      load_words<CPW * 2>(st + S_KZ + (q4 * BQ + 4 * wi) * CPB_K * 2, zw);
#pragma unroll
      for (int p = 0; p < CPB_K; ++p) {
        const u32 z02 = add2(zw[2 * p], code_magic(K_BITS, p)), z13 = add2(zw[2 * p + 1], code_magic(K_BITS, p));
        mma8(bias02, z02, z13, bk[wi * CPB_K + p][0]);
        mma8(bias13, z02, z13, bk[wi * CPB_K + p][1]);
      }
    }
    const float bias0 = bias02[0] + bias13[2], bias1 = bias02[1] + bias13[3];
#endif

    // 3. scores of the group's tokens: rows (token), columns (heads 2*q4, 2*q4+1); two accumulators per tile
    // halve the dependent chain of products
    float sc[NTT][4];
#pragma unroll
    for (int mt = 0; mt < NTT; ++mt) {
      const int ta = mt * 16 + r, tb = ta + 8;
      u32 wa[NWK], wb[NWK];
      load_words<BQ>(st + S_KC + ta * BPT_K + q4 * BQ, wa);
      load_words<BQ>(st + S_KC + tb * BPT_K + q4 * BQ, wb);
      float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int wi = 0; wi < NWK; ++wi)
#pragma unroll
        for (int p = 0; p < CPB_K; ++p)
          mma(c[(wi * CPB_K + p) & 1], code_op(wa[wi], K_BITS, p, 0, one), code_op(wb[wi], K_BITS, p, 0, one),
              code_op(wa[wi], K_BITS, p, 1, one), code_op(wb[wi], K_BITS, p, 1, one), bk[wi * CPB_K + p][0],
              bk[wi * CPB_K + p][1]);
#if KEY_NORM
      const float na = skn[ta] * scale_log2, nb = skn[tb] * scale_log2;
#else
      const float na = scale_log2, nb = scale_log2;
#endif
      sc[mt][0] = head_ok[0] ? (c[0][0] + c[1][0] - bias0) * na : NEG_INF;
      sc[mt][1] = head_ok[1] ? (c[0][1] + c[1][1] - bias1) * na : NEG_INF;
      sc[mt][2] = head_ok[0] ? (c[0][2] + c[1][2] - bias0) * nb : NEG_INF;
      sc[mt][3] = head_ok[1] ? (c[0][3] + c[1][3] - bias1) * nb : NEG_INF;
    }
#endif
#if SKIP_MASK  // the packed copies of exact tokens
#pragma unroll
    for (int mt = 0; mt < NTT; ++mt) {
      if (skipped(skip_w, mt * 16 + r)) sc[mt][0] = sc[mt][1] = NEG_INF;
      if (skipped(skip_w, mt * 16 + r + 8)) sc[mt][2] = sc[mt][3] = NEG_INF;
    }
#endif

    // 4. online softmax per head (heads 2*q4 + j), probabilities to shared memory [head][token]
    float alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mx = NEG_INF;
#pragma unroll
      for (int mt = 0; mt < NTT; ++mt) mx = fmaxf(mx, fmaxf(sc[mt][j], sc[mt][j + 2]));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 16));
      alpha[j] = 1.f;
      if (head_ok[j]) {
        const float m_new = fmaxf(m_run[j], mx);
#if EXACT  // every token so far skipped: 0 stands in for the -inf max (exp2(-inf - -inf) is NaN)
        const float m_ref = m_new == NEG_INF ? 0.f : m_new;
#else
        const float m_ref = m_new;
#endif
        alpha[j] = fast_exp2(m_run[j] - m_ref);
        m_run[j] = m_new;
        float ls = 0.f;
#pragma unroll
        for (int mt = 0; mt < NTT; ++mt) {
          const float pa = fast_exp2(sc[mt][j] - m_ref), pb = fast_exp2(sc[mt][j + 2] - m_ref);
          ls += pa + pb;
          p_s[(2 * q4 + j) * TOK + mt * 16 + r] = pa * VB_SCALE;
          p_s[(2 * q4 + j) * TOK + mt * 16 + r + 8] = pb * VB_SCALE;
        }
        l_run[j] = l_run[j] * alpha[j] + ls;
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
#if ZERO_FLOAT
#pragma unroll
      for (int gr = 0; gr < NZF; ++gr) {
        zf[gr][0] *= alpha[0]; zf[gr][1] *= alpha[1]; zf[gr][2] *= alpha[0]; zf[gr][3] *= alpha[1];
      }
#endif
    }
    __syncwarp();
#if MODE == 0
    // 5. values: per 16-token tile and value group, B = p s (head r), A = codes^T and A = [z ; 1]; the decode
    // layout (see the top) hands each lane its codes, scales and zeros as ready operand words
#pragma unroll
    for (int kt = 0; kt < NTT; ++kt) {
      const int t0 = kt * 16 + 2 * q4;
      u32 p01 = 0u, p89 = 0u;  // (p_t0, p_t1), (p_t8, p_t9) of head r
#if PARAM32
      float2 pf01 = {0.f, 0.f}, pf89 = {0.f, 0.f};  // the same in fp32
#endif
      if (r < HPG) {
        const float2 a = *reinterpret_cast<const float2*>(p_s + r * TOK + t0);
        const float2 c = *reinterpret_cast<const float2*>(p_s + r * TOK + t0 + 8);
#if CODEBOOK
        p01 = pack_half2(a.x, a.y);
        p89 = pack_half2(c.x, c.y);
#else
        p01 = pack2(a.x, a.y);
        p89 = pack2(c.x, c.y);
#endif
#if PARAM32
        pf01 = a;
        pf89 = c;
#endif
      }
      u32 cw[VWL];
      load_words<VWL * 4>(st + S_VC + kt * 16 * BPT_V + lane * VWL * 4, cw);
#if PARAM32
      // fp32 s, z of group g and tokens (t0, t1, t8, t9) at 4 g + (0, 1, 2, 3): s' = param_b s and the centred zero
      // z' + C s' (z' = z + param_a s)
      u32 s32[4 * NVG], z32[4 * NVG];
      load_words<NVG * 16>(st + S_VS + (kt * 16 * NVG + q4 * 4 * NVG) * 4, s32);
      load_words<NVG * 16>(st + S_VZ + (kt * 16 * NVG + q4 * 4 * NVG) * 4, z32);
      float sp[4 * NVG], zc[4 * NVG];
#pragma unroll
      for (int i = 0; i < 4 * NVG; ++i) {
        const float sv = __uint_as_float(s32[i]);
        sp[i] = param_b * sv;
        zc[i] = fmaf(CENTRE_V, sp[i], fmaf(param_a, sv, __uint_as_float(z32[i])));
      }
#pragma unroll
      for (int gr = 0; gr < NZF; ++gr) {  // sum_t p_t RN(z' + C s') of value group 8 gr + r (rows r; rows r + 8: 0)
        const int gg = 8 * gr + r;
        u32 z0 = 0u, z1 = 0u;
#pragma unroll
        for (int g = 0; g < NVG; ++g)
          if (g == gg) { z0 = pack2(zc[4 * g], zc[4 * g + 1]); z1 = pack2(zc[4 * g + 2], zc[4 * g + 3]); }
        mma(zf[gr], z0, 0u, z1, 0u, p01, p89);
      }
#pragma unroll
      for (int g = 0; g < NVG; ++g) {  // B = RN(p s') from the fp32 product; S1 (rows r + 8) against A = [0 ; 1]
        const u32 b0 = pack2(pf01.x * sp[4 * g], pf01.y * sp[4 * g + 1]);
        const u32 b1 = pack2(pf89.x * sp[4 * g + 2], pf89.y * sp[4 * g + 3]);
        mma(zacc[g], 0u, ONES, 0u, ONES, b0, b1);
#pragma unroll
        for (int jb = 0; jb < NBG; ++jb) {
          const u32 w = cw[g * NBG + jb];
#pragma unroll
          for (int pp = 0; pp < CPB_V; pp += 2)
            mma(acc[g * MPG + (jb * CPB_V + pp) / 2], code_op(w, V_BITS, pp, 0, one),
                code_op(w, V_BITS, pp + 1, 0, one), code_op(w, V_BITS, pp, 1, one), code_op(w, V_BITS, pp + 1, 1, one),
                b0, b1);
        }
      }
#else
      u32 sw[2 * NVG];  // (scale or norm of t0, t1), (of t8, t9) per group
      load_words<NVG * 8>(st + S_VS + (kt * 16 * NVG + q4 * 4 * NVG) * 2, sw);
#endif
#if PARAM32
#elif CODEBOOK
      // B = p n (fp16), B' = RN(k/2 B); S1 (rows r) and S1' (rows r + 8) as k8 products with constant A pairs;
      // the codes' uniform and high-bit products into the same accumulators
#pragma unroll
      for (int g = 0; g < NVG; ++g) {
        const u32 b0 = vmul2(p01, sw[2 * g]), b1 = vmul2(p89, sw[2 * g + 1]);
        const u32 b0c = vmul2(b0, hk2v), b1c = vmul2(b1, hk2v);
        vmma8(zacc[g], V_ONES, 0u, b0);
        vmma8(zacc[g], V_ONES, 0u, b1);
        vmma8(zacc[g], 0u, V_ONES, b0c);
        vmma8(zacc[g], 0u, V_ONES, b1c);
#pragma unroll
        for (int jb = 0; jb < NBG; ++jb) {
          const u32 w = cw[g * NBG + jb];
#pragma unroll
          for (int pp = 0; pp < CPB_V; pp += 2) {
            float* a = acc[g * MPG + (jb * CPB_V + pp) / 2];
            mma_f16(a, vcode_op(w, pp, 0, false, one), vcode_op(w, pp + 1, 0, false, one),
                    vcode_op(w, pp, 1, false, one), vcode_op(w, pp + 1, 1, false, one), b0, b1);
            mma_f16(a, vcode_op(w, pp, 0, true, one), vcode_op(w, pp + 1, 0, true, one),
                    vcode_op(w, pp, 1, true, one), vcode_op(w, pp + 1, 1, true, one), b0c, b1c);
          }
        }
      }
#else
      u32 zw[2 * NVG];
      load_words<NVG * 8>(st + S_VZ + (kt * 16 * NVG + q4 * 4 * NVG) * 2, zw);
#if ZERO_FLOAT
#pragma unroll
      for (int gr = 0; gr < NZF; ++gr) {  // sum_t p_t z_tg (rows r) and sum_t p_t s_tg (rows r + 8) of value group
                                           // 8 gr + r: A = (z | s) of tokens (t0, t1 | t8, t9)
        u32 zg[2] = {0u, 0u}, sg[2] = {0u, 0u};
        if (8 * gr + r < NVG) {
          load_words<8>(st + S_VZ + (kt * 16 * NVG + (q4 * NVG + 8 * gr + r) * 4) * 2, zg);
          load_words<8>(st + S_VS + (kt * 16 * NVG + (q4 * NVG + 8 * gr + r) * 4) * 2, sg);
        }
        mma(zf[gr], zg[0], sg[0], zg[1], sg[1], p01, p89);
      }
#endif
#pragma unroll
      for (int g = 0; g < NVG; ++g) {
        const u32 b0 = mul2(p01, sw[2 * g]), b1 = mul2(p89, sw[2 * g + 1]);
        mma(zacc[g], zw[2 * g], ONES, zw[2 * g + 1], ONES, b0, b1);
#pragma unroll
        for (int jb = 0; jb < NBG; ++jb) {  // code byte jb of the lane's NBG of group g, tokens (t0, t8, t1, t9)
          const u32 w = cw[g * NBG + jb];
#pragma unroll
          for (int pp = 0; pp < CPB_V; pp += 2)  // channel pp in row r, pp + 1 in row r + 8
            mma(acc[g * MPG + (jb * CPB_V + pp) / 2], code_op(w, V_BITS, pp, 0, one),
                code_op(w, V_BITS, pp + 1, 0, one), code_op(w, V_BITS, pp, 1, one), code_op(w, V_BITS, pp + 1, 1, one),
                b0, b1);
        }
      }
#endif
    }
#endif
#endif
  }
  cp_async_wait<0>();

  // ---------------- partial output of this split: o_c = acc_c - MAGIC_c S1 - S2
  // (float zero: acc_c - (MAGIC_c + C) S1 + sum_t p_t (z_t + C s_t); TurboQuant+: a S1 + b (acc_c - MAGIC_c
  // (S1 + S1')), then rotated back through shared memory)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l_run[j] += __shfl_xor_sync(FULL_MASK, l_run[j], 4);
    l_run[j] += __shfl_xor_sync(FULL_MASK, l_run[j], 8);
    l_run[j] += __shfl_xor_sync(FULL_MASK, l_run[j], 16);
  }
#if ZERO_FLOAT
  float s3[2][NVG];  // sum_t p_t (z_tg + C s_tg) of group g for head 2 q4 + j, from lane (g % 8, q4)
#pragma unroll
  for (int g = 0; g < NVG; ++g)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      s3[j][g] = __shfl_sync(FULL_MASK, zf[g / 8][j], 4 * (g % 8) + q4) +
                 CENTRE_V * __shfl_sync(FULL_MASK, zf[g / 8][j + 2], 4 * (g % 8) + q4);
#endif
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (!head_ok[j]) continue;
    const long long pi = ((long long)b * HQ + kvh * HPG + 2 * q4 + j) * parts + split;
#pragma unroll
    for (int g = 0; g < NVG; ++g) {
#if ZERO_FLOAT
      const float s1 = zacc[g][j + 2];
#else
      const float s2 = zacc[g][j], s1 = zacc[g][j + 2];
#endif
#pragma unroll
      for (int u = 0; u < MPG; ++u)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int pp = 2 * (u % (CPB_V / 2)) + half, jb = u / (CPB_V / 2);
          const int ch = g * G + (r * NBG + jb) * CPB_V + pp;
#if CODEBOOK  // s2 = S1 (rows r), s1 = S1' (rows r + 8)
          const float o =
              cb_alpha * s2 + cb_beta * (acc[g * MPG + u][j + 2 * half] - vcode_magic_f(pp) * (s2 + s1));
          q_s[(2 * q4 + j) * D + ch] = o * (1.f / VB_SCALE);
#else
#if ZERO_FLOAT
          const float o = acc[g * MPG + u][j + 2 * half] - (code_magic_f(V_BITS, pp) + CENTRE_V) * s1 + s3[j][g];
#else
          const float o = acc[g * MPG + u][j + 2 * half] - code_magic_f(V_BITS, pp) * s1 - s2;
#endif
          o_part[pi * D + ch] = o * (1.f / VB_SCALE);
#endif
        }
    }
    if (r == 0) { ml_part[pi * 2] = m_run[j]; ml_part[pi * 2 + 1] = l_run[j]; }
  }
#if CODEBOOK  // o = signs * H_D o' per head, in fp32
  __syncwarp();
  for (int h = 0; h < HPG; ++h) {
    float v[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) v[i] = q_s[h * D + lane * EPL + i];
    warp_hadamard(v, lane, inv_sqrt_d);
    const long long pi = ((long long)b * HQ + kvh * HPG + h) * parts + split;
#pragma unroll
    for (int i = 0; i < EPL; ++i) o_part[pi * D + lane * EPL + i] = v[i] * signs[lane * EPL + i];
  }
#endif
}

// out[b, h, :] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.
// Grid (B*HQ, D / COMBINE_DIMS), block COMBINE_THREADS (a multiple of COMBINE_DIMS): a block merges COMBINE_DIMS
// channels of one head, in COMBINE_THREADS / COMBINE_DIMS slices of the splits. One pass: each thread folds its
// slice's partials into a running (max, sum, output) as flash-decoding's splits do (its loads independent of one
// another, all in flight together), then the slices' triples are merged once. A block per head with the weights
// computed first (two passes over (m, l), two block reductions, then the outputs) put three dependent rounds of loads
// on every layer's path at batch 1 (results/efficiency/kernel_profile.log).
#ifndef COMBINE_THREADS
#define COMBINE_THREADS 512
#endif
#ifndef COMBINE_DIMS
#define COMBINE_DIMS 32
#endif
#define SLICES (COMBINE_THREADS / COMBINE_DIMS)

// (m, l, o) folded into the running (M, L, N) of base-2 logits; a partial of an empty split (m = -inf) weighs 0
__device__ __forceinline__ void fold_partial(float& M, float& L, float& N, float m, float l, float o) {
  const float mn = fmaxf(M, m);
  const float keep = M == NEG_INF ? 0.f : fast_exp2(M - mn), w = m == NEG_INF ? 0.f : fast_exp2(m - mn);
  L = L * keep + w * l;
  N = N * keep + w * o;
  M = mn;
}

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) combine(const float* __restrict__ o_part,
                                                                      const float* __restrict__ ml_part,
                                                                      u16* __restrict__ out, int parts) {
  __shared__ float slice_m[SLICES], slice_l[SLICES], slice_n[SLICES][COMBINE_DIMS];
  const long long bh = blockIdx.x;
  const int t = threadIdx.x, c = t % COMBINE_DIMS, slice = t / COMBINE_DIMS;
  const float* ml = ml_part + bh * parts * 2;
  const float* o_col = o_part + bh * parts * D + blockIdx.y * COMBINE_DIMS + c;
  float M = NEG_INF, L = 0.f, N = 0.f;
#pragma unroll 8
  for (int s = slice; s < parts; s += SLICES)
    fold_partial(M, L, N, ml[2 * s], ml[2 * s + 1], o_col[(long long)s * D]);
  slice_n[slice][c] = N;
  if (c == 0) { slice_m[slice] = M; slice_l[slice] = L; }
  __syncthreads();
  if (t < COMBINE_DIMS) {
    M = NEG_INF, L = 0.f, N = 0.f;
#pragma unroll
    for (int k = 0; k < SLICES; ++k) fold_partial(M, L, N, slice_m[k], slice_l[k], slice_n[k][t]);
    out[bh * D + blockIdx.y * COMBINE_DIMS + t] = to_dtype(N / L);
  }
}
