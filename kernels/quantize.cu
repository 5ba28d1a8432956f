// Quantization kernels: query/key Hadamard, fused key preprocessing, per-token group quantization.
//
// Each kernel mirrors one torch reference function bit for bit (see kernels/ops.py):
//   hadamard_rows  <-> oscar.quant.hadamard                      (fp32 butterflies, natural order)
//   hadamard_step  <-> the same, of a decode step's query and (in place) of each row's new key in a key cache
//   rotate_rows    <-> (x.float() @ R).to(dtype): OSCAR's query and key rotation by its layer's matrix (the same up to
//                      the order of the fp32 sums: c = 0 .. D - 1 here)
//   quantize_keys  <-> methods.oscar.OScaR.quantize_keys         (Hadamard, token norm, per-channel groups)
//                      with KEY_NORM=0: quantize_groups(k, axis="channel") (KIVI's keys; no rotation, no norm)
//   quantize_values<-> oscar.quant.quantize_groups(axis="token")  (per-token groups of G channels: every method's
//                      values, QuaRot's keys with ROTATE_TOKENS=1, i.e. quantize_groups(hadamard(k), ...))
// Compile-time: HEAD_DIM, BITS, GROUP, IS_BF16 (model dtype bf16, else fp16); quantize_keys also HEADS (KV
// heads), WPH (warps per head) and KMINB (resident blocks per SM asked of the register allocator); both
// ZERO_FLOAT (0: integer zero point, 1: float zero = the group min, KIVI's) and quantize_values CLIP_BITS (the fp32
// bits of quantize_groups' clip_ratio: min and max are multiplied by it first). Storage dtype values travel as
// raw 16-bit words, two channels per 32-bit word where they are packed.
//
// The quantizers stream: every thread keeps its data in registers from one round of 16-byte loads to its
// stores, and the exact reference arithmetic is kept without per-element divisions:
//  - x / n (keys, fp32 as torch divides) is a*RN(1/n) refined by two Markstein steps, which is RN(a / n);
//  - codes: rint(fl(x / s)) + z >= j holds exactly when x >= thr_j, the smallest dtype value above
//    s * (the fp32 rounding midpoint next to j - z - 1/2): x and s have at most 11 significant bits, so x / s
//    never equals such a 25-bit midpoint and the comparison is exact. 2-bit codes are three packed compares
//    (code bit 0 = parity of the three masks, bit 1 = the second mask); 4-bit codes divide as above;
//  - with a float zero, codes are rint(fl(x - z) / s) with the division as above (exact, per element).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BITS
#define BITS 2
#endif
#ifndef GROUP
#define GROUP 32
#endif
#ifndef IS_BF16
#define IS_BF16 1
#endif
#ifndef HEADS
#define HEADS 8
#endif
#ifndef WPH
#define WPH 1
#endif
// quantize_keys benchmark variants that stop early (timed against the full kernel to place the time):
// 0 = full kernel, 1 = rotate + token norms only, 2 = ... + division by the norm, group min/max, scale/zero
// and code parameters (no codes)
#ifndef MODE
#define MODE 0
#endif
// 1 = write the decode layouts of common.cuh (what decode_attention reads), 0 = the reference's; quantize_values
// also 2 = the per-token key layout of common.cuh (QuaRot's keys)
#ifndef DECODE_LAYOUT
#define DECODE_LAYOUT 0
#endif
// quantize_keys: 1 = OScaR's token norm (keys divided by it, the norm stored), 0 = plain per-channel groups
#ifndef KEY_NORM
#define KEY_NORM 1
#endif
// 0 = integer zero point (OScaR, QuaRot), 1 = float zero point (the group min in the dtype; KIVI)
#ifndef ZERO_FLOAT
#define ZERO_FLOAT 0
#endif
// quantize_values: the fp32 bits of the clip ratio (0x3f800000 = 1.0: no clipping)
#ifndef CLIP_BITS
#define CLIP_BITS 0x3f800000
#endif
// quantize_values: 1 = Hadamard of every row first, as oscar.quant.hadamard (QuaRot's keys)
#ifndef ROTATE_TOKENS
#define ROTATE_TOKENS 0
#endif

#include "common.cuh"

#define G GROUP
#define LEVELS ((1 << BITS) - 1)
#define BPT (D * BITS / 8)       // packed bytes per row

#if (BITS != 2) && (BITS != 4)
#error "BITS must be 2 or 4"
#endif
#define THRESHOLD_CODES (BITS == 2 && !ZERO_FLOAT)  // codes by three compares (else by an exact division)

// ----------------------------------------------------------------------------- packed pairs of the dtype

__device__ __forceinline__ float lo_of(u32 w) { return to_float((u16)(w & 0xffffu)); }
__device__ __forceinline__ float hi_of(u32 w) { return to_float((u16)(w >> 16)); }

__device__ __forceinline__ u32 min2(u32 a, u32 b) {
  u32 r;
#if IS_BF16
  asm("min.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
  asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#endif
  return r;
}

__device__ __forceinline__ u32 max2(u32 a, u32 b) {
  u32 r;
#if IS_BF16
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#endif
  return r;
}

// 0xffff in each half where a >= b
__device__ __forceinline__ u32 ge2(u32 a, u32 b) {
  u32 r;
#if IS_BF16
  asm("set.ge.u32.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
  asm("set.ge.u32.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#endif
  return r;
}

__device__ __forceinline__ u32 word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// ----------------------------------------------------------------------------- exact arithmetic

// RN(a / n) from r = RN(1/n): a * r is within 1.5 ulp, one Markstein step makes it faithful, the second
// correctly rounded (normal operands)
__device__ __forceinline__ float div_rn(float a, float n, float r) {
  float y = a * r;
  y = fmaf(fmaf(-n, y, a), r, y);
  return fmaf(fmaf(-n, y, a), r, y);
}

// The smallest dtype value x with rint(fl(x / s)) + z >= j (s > 0, z integer valued), as raw bits.
// With m = j - z and h = m - 1/2: rint(fl(x/s)) >= m <=> fl(x/s) >= h for even m (a tie at h rounds to m),
// fl(x/s) > h for odd m, i.e. x/s above the fp32 rounding midpoint below / above h. That bound times s is
// exact in fp64 and never a dtype value, so rounding it up gives the threshold.
__device__ __forceinline__ u16 code_threshold(float s, float z, int j) {
  const float m = (float)j - z;
  const float h = m - 0.5f;
  const bool even = !((int)m & 1);
  const u32 hb = __float_as_uint(h);
  const u32 nb = ((h > 0.f) == even) ? hb - 1u : hb + 1u;  // the fp32 neighbour below (even) / above (odd)
  const double bound = (double)s * (((double)h + (double)__uint_as_float(nb)) * 0.5);
  float t;
  asm("cvt.rp.f32.f64 %0, %1;" : "=f"(t) : "d"(bound));
#if IS_BF16
  u32 bits = __float_as_uint(t);
  if ((bits & 0xffffu) && t > 0.f) bits = (bits | 0xffffu) + 1u;  // round up; a negative t truncates up
  return (u16)(bits >> 16);
#else
  u16 r;
  asm("cvt.rp.f16.f32 %0, %1;" : "=h"(r) : "f"(t));
  return r;
#endif
}

// clamp(rint(fl(x / s)) + z, 0, LEVELS) with rs = RN(1/s)
__device__ __forceinline__ u32 code_of(float x, float s, float rs, float z) {
  const float q = rintf(div_rn(x, s, rs)) + z;
  return (u32)fminf(fmaxf(q, 0.f), (float)LEVELS);
}

// scale and zero of one group as quantize_groups(zero_point="float") computes them: the zero is the min
__device__ __forceinline__ void group_params_float(float lo, float hi, float inv_levels, float& scale, float& zero) {
  const float span = hi - lo;
  const float s = (span == 0.f) ? ((lo == 0.f) ? 1.f : fabsf(lo)) : span * inv_levels;
  scale = round_dtype(s);
  zero = round_dtype(lo);
}

// clamp(rint(fl(x - z) / s), 0, LEVELS) with rs = RN(1/s): the float-zero code
__device__ __forceinline__ u32 code_of_float(float x, float s, float rs, float z) {
  const float q = rintf(div_rn(x - z, s, rs));
  return (u32)fminf(fmaxf(q, 0.f), (float)LEVELS);
}

// the code of x with the group's (scale, zero, 1/scale), either zero-point convention
__device__ __forceinline__ u32 code_with(float x, float s, float rs, float z) {
#if ZERO_FLOAT
  return code_of_float(x, s, rs, z);
#else
  return code_of(x, s, rs, z);
#endif
}

// scale and zero of a group from its min and max, either convention
__device__ __forceinline__ void params_with(float lo, float hi, float inv_levels, float& scale, float& zero) {
#if ZERO_FLOAT
  group_params_float(lo, hi, inv_levels, scale, zero);
#else
  group_params(lo, hi, inv_levels, scale, zero);
#endif
}

// 2-bit codes of the pair x (lo, hi) from the threshold pairs t1 <= t2 <= t3, OR-ed into acc at bit
// `shift` of each half
__device__ __forceinline__ u32 codes2_pair(u32 x, u32 t1, u32 t2, u32 t3, int shift) {
  const u32 m1 = ge2(x, t1), m2 = ge2(x, t2), m3 = ge2(x, t3);
  const u32 bit0 = 0x00010001u << shift;
  return ((m1 ^ m2 ^ m3) & bit0) | (m2 & (bit0 << 1));
}

// Reduce-scatter of packed min/max words over the lanes that differ in lane bits M, M/2, .., LAST: at each
// bit the lanes with it set keep the upper half of the words (min/max-ed with the partner's), so N / (2M/LAST)
// words are left in mn/mx[0 ..], the lane's share starting at word `off` of the original N.
template <int N, int M, int LAST, int K>
__device__ __forceinline__ void minmax_scatter(u32 (&mn)[K], u32 (&mx)[K], int lane, int& off) {
  if constexpr (M >= LAST && M >= 1) {
    const bool up = lane & M;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const u32 send_mn = up ? mn[i] : mn[i + N / 2], keep_mn = up ? mn[i + N / 2] : mn[i];
      const u32 send_mx = up ? mx[i] : mx[i + N / 2], keep_mx = up ? mx[i + N / 2] : mx[i];
      mn[i] = min2(keep_mn, __shfl_xor_sync(FULL_MASK, send_mn, M));
      mx[i] = max2(keep_mx, __shfl_xor_sync(FULL_MASK, send_mx, M));
    }
    off += up ? N / 2 : 0;
    minmax_scatter<N / 2, M / 2, LAST>(mn, mx, lane, off);
  }
}

// ----------------------------------------------------------------------------- Hadamard

// lane holds elements lane*EPL .. lane*EPL+EPL-1 of one row (8-byte or 16-byte loads)
__device__ __forceinline__ void load_row_vec(const u16* row, int lane, float v[EPL]) {
  const u16* p = row + lane * EPL;
#if EPL == 2
  const u32 w = *reinterpret_cast<const u32*>(p);
  v[0] = lo_of(w); v[1] = hi_of(w);
#elif EPL == 4
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  v[0] = lo_of(w.x); v[1] = hi_of(w.x); v[2] = lo_of(w.y); v[3] = hi_of(w.y);
#else
  const uint4 w = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) { v[2 * i] = lo_of(word_of(w, i)); v[2 * i + 1] = hi_of(word_of(w, i)); }
#endif
}

__device__ __forceinline__ void store_row_vec(u16* row, int lane, const float v[EPL]) {
  u16* p = row + lane * EPL;
#if EPL == 2
  *reinterpret_cast<u32*>(p) = pack2(v[0], v[1]);
#elif EPL == 4
  *reinterpret_cast<uint2*>(p) = uint2{pack2(v[0], v[1]), pack2(v[2], v[3])};
#else
  *reinterpret_cast<uint4*>(p) = uint4{pack2(v[0], v[1]), pack2(v[2], v[3]), pack2(v[4], v[5]), pack2(v[6], v[7])};
#endif
}

// y[r] = hadamard(x[r]) in the model dtype for `rows` rows of D (one warp per row, grid-stride).
extern "C" __global__ void hadamard_rows(const u16* __restrict__ x, u16* __restrict__ y, long long rows,
                                         float inv_sqrt_d) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long r = warp; r < rows; r += nwarps) {
    float v[EPL];
    load_row_vec(x + r * D, lane, v);
    warp_hadamard(v, lane, inv_sqrt_d);
    store_row_vec(y + r * D, lane, v);
  }
}

// The decode step of a method whose query and key transform is the plain Hadamard, in one launch (the torch backend's
// static cache): y = hadamard(q) for q_rows rows of D, and, in place in the token-major key cache [B, capacity, H, D],
// the H rows of token lengths[b] (the step's new key) of every batch row b. One warp per row, grid-stride.
extern "C" __global__ void hadamard_step(const u16* __restrict__ q, u16* __restrict__ y, long long q_rows,
                                         u16* __restrict__ keys, const long long* __restrict__ lengths, int batch,
                                         int heads, long long capacity, float inv_sqrt_d) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  const long long rows = q_rows + (long long)batch * heads;
  for (long long r = warp; r < rows; r += nwarps) {
    const long long k = r - q_rows, b = k / heads;
    const u16* from = r < q_rows ? q + r * D : keys + ((b * capacity + lengths[b]) * heads + k % heads) * D;
    u16* to = r < q_rows ? y + r * D : keys + ((b * capacity + lengths[b]) * heads + k % heads) * D;
    float v[EPL];
    load_row_vec(from, lane, v);
    warp_hadamard(v, lane, inv_sqrt_d);
    store_row_vec(to, lane, v);
  }
}

// Rows times a matrix, y[n] = x[n] R, for a decode step's query [B, Hq, 1, D] and new key [B, Hkv, 1, D] (OSCAR's
// rotation by its layer's matrix): x, y [rows, D] in the model dtype, R [D, D] fp32 row-major. y[n, j] = sum over c
// of float(x[n, c]) * R[c, j], fused multiply-adds in fp32 in the order c = 0 .. D - 1, rounded once to the dtype:
// torch's (x.float() @ R).to(dtype) up to the order of its fp32 sums, in one launch where torch runs a cast, a GEMM
// and a cast. A block of D threads takes ROTATE_ROWS rows, thread j output column j: the rows staged in shared memory
// as fp32 (dynamic, ROTATE_ROWS * D floats), R read row by row (each c: R[c, 0 .. D - 1], one coalesced load), one
// fp32 accumulator per row in registers. Grid: ceil(rows / ROTATE_ROWS) blocks.
#define ROTATE_ROWS 8
extern "C" __global__ void __launch_bounds__(D) rotate_rows(const u16* __restrict__ x, const float* __restrict__ r,
                                                            u16* __restrict__ y, long long rows) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* xs = reinterpret_cast<float*>(smem);  // [ROTATE_ROWS][D]
  const int j = threadIdx.x;
  const long long first = (long long)blockIdx.x * ROTATE_ROWS;
  const int n = (int)min((long long)ROTATE_ROWS, rows - first);
#pragma unroll
  for (int i = 0; i < ROTATE_ROWS; ++i) xs[i * D + j] = i < n ? to_float(x[(first + i) * D + j]) : 0.f;
  __syncthreads();
  float acc[ROTATE_ROWS];
#pragma unroll
  for (int i = 0; i < ROTATE_ROWS; ++i) acc[i] = 0.f;
#pragma unroll 4
  for (int c = 0; c < D; ++c) {
    const float w = r[c * D + j];
#pragma unroll
    for (int i = 0; i < ROTATE_ROWS; ++i) acc[i] = fmaf(xs[i * D + c], w, acc[i]);
  }
#pragma unroll
  for (int i = 0; i < ROTATE_ROWS; ++i)
    if (i < n) y[(first + i) * D + j] = to_dtype(acc[i]);
}

__device__ __forceinline__ void butterfly(float& a, float& b) {
  const float x = a;
  a = x + b;
  b = x - b;
}

// Butterfly stages h = FROM, 2 FROM, .. < TO over the values a lane holds: pairs (v[i], v[i + h]) for i without h
template <int FROM, int TO, int N>
__device__ __forceinline__ void lane_butterflies(float (&v)[N]) {
#pragma unroll
  for (int h = FROM; h < TO; h *= 2) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (!(i & h)) butterfly(v[i], v[i + h]);
  }
}

// Butterfly stages across the LANES lanes of a row (lane bit m = stage m): the lane with the bit set holds b,
// so its result a - b is -v + o
template <int LANES, int N>
__device__ __forceinline__ void cross_lane_butterflies(float (&v)[N], int lane) {
#pragma unroll
  for (int m = 1; m < LANES; m *= 2) {
    const float sign = (lane & m) ? -1.f : 1.f;
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = fmaf(sign, v[i], __shfl_xor_sync(FULL_MASK, v[i], m));
  }
}

// Normalized Walsh-Hadamard transform of one row of D spread over KLPR lanes with 32 values each:
// v[8 i + e] is channel 8 (q + KLPR i) + e (q = lane % KLPR), so channel bits 0-2 are e, the next
// log2(KLPR) bits the lane and the top two bits i. Stages run in torch's order h = 1, 2, 4, ... with
// (a, b) -> (a + b, a - b) in fp32, then * (1/sqrt(D)).
#define KLPR (D / 32)
__device__ __forceinline__ void hadamard_lanes(float (&v)[32], int lane, float inv_sqrt_d) {
  lane_butterflies<1, 8>(v);
  cross_lane_butterflies<KLPR>(v, lane);
  lane_butterflies<8, 32>(v);
#pragma unroll
  for (int i = 0; i < 32; ++i) v[i] *= inv_sqrt_d;
}

// ----------------------------------------------------------------------------- keys

#define KRPW (32 / KLPR)           // rows a warp covers per round of loads
#define TPW (G / WPH)              // tokens per warp (its share of the group)
#define NJ (TPW / KRPW)            // row slots per lane
#define NWO (16 / KRPW)            // channel pairs whose group parameters a lane computes
#define NWARP (HEADS * WPH)
#ifndef KMINB
#define KMINB 1                    // resident blocks per SM asked of the register allocator
#endif
#define THR_WORDS ((THRESHOLD_CODES ? 3 : 4) * 16 * KLPR)  // per head: code thresholds / (scale, zero, 1/scale)
// the launcher checks these before compiling; other #define sets leave quantize_keys out
#define KEYS_OK (G % WPH == 0 && TPW % KRPW == 0 && NJ >= 1 && NWARP <= 32)

#if KEYS_OK
// one group's loads of a lane: chunk i of row slot j is channels 8 (q + KLPR i) .. + 7 of token
// t0 + tw + j*KRPW + r of head h (for each i the warp reads KLPR consecutive 16-byte chunks of KRPW rows)
__device__ __forceinline__ void load_group(uint4 (&raw)[NJ][4], const u16* __restrict__ k, long long item, int T,
                                           int h, int tw, int r, int q) {
  const int ngroups = T / G;
  const long long b = item / ngroups;
  const u16* src = k + ((b * HEADS + h) * T + (item - b * ngroups) * G + tw + r) * D + 8 * q;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      raw[j][i] = *reinterpret_cast<const uint4*>(src + (long long)j * KRPW * D + 8 * KLPR * i);
}

// Fused key preprocessing, one group of G tokens of one sequence at a time (items = T/G * batch; block i takes
// items i, i + gridDim.x, ..., prefetching the next while it finishes one; HEADS * WPH warps, warp (h, s)
// takes tokens s*TPW .. of head h):
//   kh = hadamard(k) per head (if rotate; else k is already rotated), n_t = ||kh_t|| over all heads and
//   channels (fp32, 0 -> 1), x = (kh / n_t) in the model dtype, per-channel groups of G tokens with an
//   integer zero point, packed along D (KEY_NORM=0: x = kh, no norm; ZERO_FLOAT: float zero point, KIVI's).
//   Input k: [b, HEADS, T, D] contiguous. Outputs are written into
//   storage of capacity `cap` tokens at batch row out_row[i] and token offset out_off[i] (a multiple of G;
//   null pointers: row i, offset 0): codes [*, H, cap, D*BITS/8] u8, scale/zero [*, H, cap/G, D], norm [*, cap].
// Lane (r, q) = (lane / KLPR, lane % KLPR) holds rows r, r + KRPW, ... of its warp's tokens, 32 channels each
// (see hadamard_lanes), as packed pairs p = (chunk 2(p/8), e) | (chunk 2(p/8)+1, e), e = p % 8.
// Dynamic shared memory (bytes): G*HEADS*4 (partial sums of squares) + HEADS*THR_WORDS*4 (code parameters)
// (+ NWARP*2*16*KLPR*4 for the group min/max exchange when WPH > 1).
extern "C" __global__ void __launch_bounds__(NWARP * 32, KMINB) quantize_keys(
    const u16* __restrict__ k, int batch, int T, int rotate, float inv_sqrt_d, float inv_levels,
    u8* __restrict__ codes, u16* __restrict__ scale_out, u16* __restrict__ zero_out, float* __restrict__ norm_out,
    int cap, const int* __restrict__ out_row, const int* __restrict__ out_off) {
  extern __shared__ __align__(16) unsigned char smem[];
#if KEY_NORM
  float* part = reinterpret_cast<float*>(smem);                        // [G][HEADS]
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = warp / WPH, sw = warp % WPH, q = lane % KLPR, r = lane / KLPR, tw = sw * TPW;
  const long long items = (long long)(T / G) * batch;  // (sequence, group) pairs, gridDim.x blocks stride over

  // 1. every load of the lane first; the next item's loads are issued once this item's are consumed
  uint4 raw[NJ][4];
  if (blockIdx.x < items) load_group(raw, k, blockIdx.x, T, h, tw, r, q);
  for (long long item = blockIdx.x; item < items; item += gridDim.x) {
    const int b = (int)(item / (T / G)), t0 = (int)(item % (T / G)) * G;
    const int orow = out_row ? out_row[b] : b;
    const int off = (out_off ? out_off[b] : 0) + t0;

    // 2. rotate, round to the model dtype (packed pairs), sums of squares of the rounded values
#if MODE != 1
    u32 tile[NJ][16];
#endif
#if KEY_NORM
    float ss[NJ];
#endif
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      float v[32];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          v[8 * i + 2 * w] = lo_of(word_of(raw[j][i], w));
          v[8 * i + 2 * w + 1] = hi_of(word_of(raw[j][i], w));
        }
      if (rotate) hadamard_lanes(v, lane, inv_sqrt_d);
#if KEY_NORM
      float s = 0.f;
#endif
#pragma unroll
      for (int p = 0; p < 16; ++p) {
        const u32 x = pack2(v[16 * (p / 8) + p % 8], v[16 * (p / 8) + 8 + p % 8]);
#if MODE != 1
        tile[j][p] = x;
#endif
#if KEY_NORM
        const float a = lo_of(x), c = hi_of(x);
        s = fmaf(a, a, s);
        s = fmaf(c, c, s);
#endif
      }
#if KEY_NORM
#pragma unroll
      for (int m = 1; m < KLPR; m *= 2) s += __shfl_xor_sync(FULL_MASK, s, m);
      ss[j] = s;
#endif
    }
#if KEY_NORM
    if (q == 0) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) part[(tw + j * KRPW + r) * HEADS + h] = ss[j];
    }
    __syncthreads();
#endif
    if (item + gridDim.x < items) load_group(raw, k, item + gridDim.x, T, h, tw, r, q);

#if KEY_NORM
    // 3. token norms: lane l of each warp sums the heads of its warp's token l (, l + 32), then hands the
    //    norm and its reciprocal to the lanes that hold the token
    constexpr int NTL = (TPW + 31) / 32;
    float nl[NTL];
#if MODE != 1
    float rl[NTL];
#endif
#pragma unroll
    for (int u = 0; u < NTL; ++u) {
      const int tt = u * 32 + lane;
      float sum = 0.f;
      if (tt < TPW) {
#pragma unroll
        for (int hh = 0; hh < HEADS; ++hh) sum += part[(tw + tt) * HEADS + hh];
      }
      const float n = sqrtf(sum);
      nl[u] = (n == 0.f) ? 1.f : n;
#if MODE != 1
      rl[u] = __frcp_rn(nl[u]);
#endif
      if (h == 0 && tt < TPW) norm_out[(long long)orow * cap + off + tw + tt] = nl[u];
    }
#endif
#if MODE != 1
    u32* thr = reinterpret_cast<u32*>(smem + G * HEADS * 4) + h * THR_WORDS;  // the head's code parameters
    // 4. x = kh / n in the model dtype, in place; per-channel min/max over the lane's rows
    u32 mn[16], mx[16];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#if KEY_NORM
      const int src_lane = (j * KRPW + r) & 31;
      const float n = __shfl_sync(FULL_MASK, nl[(j * KRPW) / 32], src_lane);
      const float rn = __shfl_sync(FULL_MASK, rl[(j * KRPW) / 32], src_lane);
#endif
#pragma unroll
      for (int p = 0; p < 16; ++p) {
#if KEY_NORM
        const u32 w = tile[j][p];
        const u32 x = pack2(div_rn(lo_of(w), n, rn), div_rn(hi_of(w), n, rn));
        tile[j][p] = x;
#else
        const u32 x = tile[j][p];
#endif
        mn[p] = j ? min2(mn[p], x) : x;
        mx[p] = j ? max2(mx[p], x) : x;
      }
    }
    // reduce-scatter over the KRPW lanes of equal q: lane keeps pairs wo .. wo + NWO - 1 in mn/mx[0 .. NWO-1]
    int wo = 0;
    minmax_scatter<16, 16, KLPR>(mn, mx, lane, wo);
#if WPH > 1
    // the other warps of the head hold the rest of the group's tokens
    u32* mm = reinterpret_cast<u32*>(smem + G * HEADS * 4) + HEADS * THR_WORDS;  // [NWARP][2][16][KLPR]
#pragma unroll
    for (int w = 0; w < NWO; ++w) {
      mm[((warp * 2) * 16 + wo + w) * KLPR + q] = mn[w];
      mm[((warp * 2 + 1) * 16 + wo + w) * KLPR + q] = mx[w];
    }
    __syncthreads();
#pragma unroll
    for (int s2 = 0; s2 < WPH; ++s2) {
      if (s2 == sw) continue;
      const int other = h * WPH + s2;
#pragma unroll
      for (int w = 0; w < NWO; ++w) {
        mn[w] = min2(mn[w], mm[((other * 2) * 16 + wo + w) * KLPR + q]);
        mx[w] = max2(mx[w], mm[((other * 2 + 1) * 16 + wo + w) * KLPR + q]);
      }
    }
#endif

    // 5. scale/zero and code parameters of the lane's 2 * NWO channels, shared out over the WPH warps of the
    //    head (channel u by warp u % WPH); the head's parameters go to shared memory for every warp of it
    const long long pbase = (((long long)orow * HEADS + h) * (cap / G) + off / G) * D;
    u16* par16 = reinterpret_cast<u16*>(thr);
#pragma unroll
    for (int u = 0; u < 2 * NWO; ++u) {
      if (u % WPH != sw) continue;
      const int w = u / 2, half = u % 2, p = wo + w;
      const int c = 8 * (q + KLPR * (2 * (p / 8) + half)) + p % 8;
      float s, z;
      params_with(half ? hi_of(mn[w]) : lo_of(mn[w]), half ? hi_of(mx[w]) : lo_of(mx[w]), inv_levels, s, z);
#if DECODE_LAYOUT
      const int pc = decode_key_param_offset(c, BITS);
#else
      const int pc = c;
#endif
      scale_out[pbase + pc] = to_dtype(s);
      zero_out[pbase + pc] = to_dtype(z);
      // word (k, p, q) of the table holds channel pair p of lane block q: u16 halves, or one float per half
#if THRESHOLD_CODES
#pragma unroll
      for (int jj = 0; jj < 3; ++jj) par16[2 * ((jj * 16 + p) * KLPR + q) + half] = code_threshold(s, z, jj + 1);
#else
      par16[2 * ((0 * 16 + p) * KLPR + q) + half] = to_dtype(s);
      par16[2 * ((1 * 16 + p) * KLPR + q) + half] = to_dtype(z);
      reinterpret_cast<float*>(thr)[((2 + half) * 16 + p) * KLPR + q] = __frcp_rn(s);
#endif
    }
#if MODE != 2
#if WPH > 1
    __syncthreads();
#else
    __syncwarp();
#endif

    // 6. codes, packed along D: chunk i of a row is 8 channels = one 16-bit (2-bit codes) or 32-bit word
    u8* dst = codes + (((long long)orow * HEADS + h) * cap + off + tw + r) * BPT;
#if BITS == 2
    u32 cw[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j) cw[j][0] = cw[j][1] = 0u;
#pragma unroll
    for (int p = 0; p < 16; ++p) {
#if THRESHOLD_CODES
      const u32 t1 = thr[(0 * 16 + p) * KLPR + q], t2 = thr[(1 * 16 + p) * KLPR + q],
                t3 = thr[(2 * 16 + p) * KLPR + q];
#pragma unroll
      for (int j = 0; j < NJ; ++j) cw[j][p / 8] |= codes2_pair(tile[j][p], t1, t2, t3, 2 * (p % 8));
#else  // float zero: the codes of the pair's halves at bit 2 (p % 8) of each half, as codes2_pair places them
      const u32 sp = thr[(0 * 16 + p) * KLPR + q], zp = thr[(1 * 16 + p) * KLPR + q];
      const float rs_lo = __uint_as_float(thr[(2 * 16 + p) * KLPR + q]);
      const float rs_hi = __uint_as_float(thr[(3 * 16 + p) * KLPR + q]);
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const u32 x = tile[j][p];
        cw[j][p / 8] |= (code_with(lo_of(x), lo_of(sp), rs_lo, lo_of(zp)) << (2 * (p % 8))) |
                        (code_with(hi_of(x), hi_of(sp), rs_hi, hi_of(zp)) << (16 + 2 * (p % 8)));
      }
#endif
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        *reinterpret_cast<u16*>(dst + (long long)j * KRPW * BPT + 2 * (q + KLPR * i)) =
            (u16)((i & 1) ? cw[j][i / 2] >> 16 : cw[j][i / 2] & 0xffffu);
#else
    u32 cw[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; ++j) cw[j][0] = cw[j][1] = cw[j][2] = cw[j][3] = 0u;
#pragma unroll
    for (int p = 0; p < 16; ++p) {
      const u32 sp = thr[(0 * 16 + p) * KLPR + q], zp = thr[(1 * 16 + p) * KLPR + q];
      const float rs_lo = __uint_as_float(thr[(2 * 16 + p) * KLPR + q]);
      const float rs_hi = __uint_as_float(thr[(3 * 16 + p) * KLPR + q]);
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const u32 x = tile[j][p];
        cw[j][2 * (p / 8)] |= code_with(lo_of(x), lo_of(sp), rs_lo, lo_of(zp)) << (4 * (p % 8));
        cw[j][2 * (p / 8) + 1] |= code_with(hi_of(x), hi_of(sp), rs_hi, hi_of(zp)) << (4 * (p % 8));
      }
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        *reinterpret_cast<u32*>(dst + (long long)j * KRPW * BPT + 4 * (q + KLPR * i)) = cw[j][i];
#endif
#endif  // MODE != 2
#endif  // MODE != 1
    __syncthreads();  // the shared tables are rewritten by the next item
  }
}
#endif  // KEYS_OK

// ----------------------------------------------------------------------------- values

#define VLPG (G / 8)                    // lanes per value group (a lane holds 8 consecutive channels)
#define VNR (VLPG > 4 ? VLPG : 4)       // 16-byte chunks per lane (row slots)
#define VNO (VNR / VLPG)                // slots whose group parameters a lane computes
#define CPR (D / 8)                     // chunks per row
#define VALUES_OK (G % 8 == 0 && D % G == 0 && VLPG <= 16)

#if VALUES_OK
#if ROTATE_TOKENS
// The rows of a slot, CPR chunks each in consecutive lanes, Hadamard-transformed as oscar.quant.hadamard does it:
// fp32 butterflies in torch's order (channel bits 0-2 in the chunk, the higher ones across the lanes), times
// fp32(1/sqrt(D)), rounded to the model dtype
__device__ __forceinline__ uint4 rotate_chunk(const uint4& w, int lane) {
  float v[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) { v[2 * i] = lo_of(word_of(w, i)); v[2 * i + 1] = hi_of(word_of(w, i)); }
  lane_butterflies<1, 8>(v);
  cross_lane_butterflies<CPR>(v, lane);
  const float inv = 1.f / sqrtf((float)D);  // what torch multiplies by for `/ math.sqrt(d)` on CUDA
  return uint4{pack2(v[0] * inv, v[1] * inv), pack2(v[2] * inv, v[3] * inv), pack2(v[4] * inv, v[5] * inv),
               pack2(v[6] * inv, v[7] * inv)};
}
#endif

// Per-token group quantization (every method's values; QuaRot's keys): per token and head, groups of G
// consecutive channels, integer (or, ZERO_FLOAT, float) zero point, min/max times the clip ratio (CLIP_BITS),
// each row Hadamard-transformed first with ROTATE_TOKENS.
// Input v: [b, H, T, D] contiguous, read as 16-byte chunks: warp w, slot j, lane l takes chunk
// (w * VNR + j) * 32 + l of the whole tensor (VLPG lanes per group). Outputs into storage of capacity `cap`
// at row out_row[i], token offset out_off[i] (null pointers and cap == T: the input's own layout):
// codes [*, H, cap, D*BITS/8], scale/zero [*, H, cap, D/G], in the decode layout of common.cuh when DECODE_LAYOUT
// is 1 (value tiles: cap a multiple of 16) or the codes in the per-token key layout when it is 2.
extern "C" __global__ void __launch_bounds__(256) quantize_values(
    const u16* __restrict__ v, int H, int T, long long chunks, float inv_levels, u8* __restrict__ codes,
    u16* __restrict__ scale_out, u16* __restrict__ zero_out, int cap, const int* __restrict__ out_row,
    const int* __restrict__ out_off) {
  const int lane = threadIdx.x & 31;
  const long long base = (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * (VNR * 32) + lane;
  const bool direct = !out_row && !out_off && cap == T;
  uint4 raw[VNR];
#pragma unroll
  for (int j = 0; j < VNR; ++j) {
    const long long c = base + j * 32;
    raw[j] = c < chunks ? *reinterpret_cast<const uint4*>(v + c * 8) : uint4{0u, 0u, 0u, 0u};
  }
#if ROTATE_TOKENS
#pragma unroll
  for (int j = 0; j < VNR; ++j) raw[j] = rotate_chunk(raw[j], lane);
#endif
  // group min/max of every slot (both halves), then reduce-scatter over the group's lanes: the lane keeps
  // slots vo .. vo + VNO - 1, which lane (l / VLPG) * VLPG + j / VNO of the group holds for slot j
  u32 mn[VNR], mx[VNR];
#pragma unroll
  for (int j = 0; j < VNR; ++j) {
    u32 a = min2(min2(raw[j].x, raw[j].y), min2(raw[j].z, raw[j].w));
    u32 c = max2(max2(raw[j].x, raw[j].y), max2(raw[j].z, raw[j].w));
    mn[j] = min2(a, __byte_perm(a, 0, 0x1032));
    mx[j] = max2(c, __byte_perm(c, 0, 0x1032));
  }
  int vo = 0;
  minmax_scatter<VNR, VLPG / 2, 1>(mn, mx, lane, vo);
  // output row of chunk c's token
  auto out_token = [&](long long c) -> long long {
    const long long row = c / CPR;
    if (direct) return row;
    const long long ht = (long long)H * T;
    const int i = (int)(row / ht), h = (int)((row % ht) / T), t = (int)(row % T);
    return ((long long)(out_row ? out_row[i] : i) * H + h) * cap + (out_off ? out_off[i] : 0) + t;
  };
  u32 par[VNO][3];
#pragma unroll
  for (int w = 0; w < VNO; ++w) {
    float s, z;
#if CLIP_BITS != 0x3f800000
    // __fmul_rn: rounded products as torch's `amin * clip_ratio` (ptxas would otherwise fuse max * clip - min
    // into one FMA, one fp32 ulp off: a stored scale one dtype ulp off now and then)
    const float clip = __uint_as_float(CLIP_BITS);
    params_with(__fmul_rn(lo_of(mn[w]), clip), __fmul_rn(lo_of(mx[w]), clip), inv_levels, s, z);
#else
    params_with(lo_of(mn[w]), lo_of(mx[w]), inv_levels, s, z);
#endif
    const long long c = base + (vo + w) * 32;
    if (c < chunks) {
      const long long tok = out_token(c);
      const int g = (c % CPR) / VLPG;
#if DECODE_LAYOUT == 1
      const long long pidx = (tok - tok % 16) * (D / G) + decode_param_offset((int)(tok % 16), g, D / G);
#else
      const long long pidx = tok * (D / G) + g;
#endif
      scale_out[pidx] = to_dtype(s);
      zero_out[pidx] = to_dtype(z);
    }
#if THRESHOLD_CODES
#pragma unroll
    for (int jj = 0; jj < 3; ++jj) par[w][jj] = (u32)code_threshold(s, z, jj + 1) * 0x00010001u;
#else
    par[w][0] = __float_as_uint(s);
    par[w][1] = __float_as_uint(z);
    par[w][2] = __float_as_uint(__frcp_rn(s));
#endif
  }
  const int group_lane0 = lane & ~(VLPG - 1);
#pragma unroll
  for (int j = 0; j < VNR; ++j) {
    u32 p3[3];
#pragma unroll
    for (int jj = 0; jj < 3; ++jj) p3[jj] = __shfl_sync(FULL_MASK, par[j % VNO][jj], group_lane0 + j / VNO);
    const long long c = base + j * 32;
#if DECODE_LAYOUT != 2  // (the key layout's exchange below needs every lane)
    if (c >= chunks) continue;
    const long long tok = out_token(c);
    const int cb = (c % CPR) * BITS;  // first code byte of the chunk in its token row
#endif
#if THRESHOLD_CODES
    // word w is channels 2w (lower half) and 2w + 1 (upper half): codes at bits 4w and 16 + 4w, the upper
    // ones fold down to 4w + 2
    u32 cw = 0u;
#pragma unroll
    for (int w = 0; w < 4; ++w) cw |= codes2_pair(word_of(raw[j], w), p3[0], p3[1], p3[2], 4 * w);
    const u32 out = (cw & 0x3333u) | ((cw >> 14) & 0xccccu);
#else  // channel e of the chunk at bits BITS * e
    const float s = __uint_as_float(p3[0]), z = __uint_as_float(p3[1]), rs = __uint_as_float(p3[2]);
    u32 cw = 0u;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const u32 x = word_of(raw[j], w);
      cw |= code_with(lo_of(x), s, rs, z) << (2 * BITS * w);
      cw |= code_with(hi_of(x), s, rs, z) << (2 * BITS * w + BITS);
    }
    const u32 out = cw;
#endif
#if DECODE_LAYOUT == 2
    // The per-token key layout (common.cuh): chunk ci of a row holds k-step ks = ci / 2, k = 8 (ci % 2) + e for its
    // channels e, whose codes go to code position ks % CPB of the bytes token_key_code_byte gives: byte e of an
    // 8-byte set shared with the lanes of the other positions (chunks ci + 2 (p' - p)), which OR them together;
    // each of those CPB lanes then stores 8 / CPB of the bytes.
    {
      constexpr int CPB = 8 / BITS;
      const int ci = (int)(c % CPR), ks = ci >> 1, p = ks % CPB;
      u32 set[2] = {0u, 0u};
#pragma unroll
      for (int e = 0; e < 8; ++e) set[e / 4] |= ((out >> (BITS * e)) & LEVELS) << (8 * (e % 4) + BITS * p);
#pragma unroll
      for (int m = 2; m < 2 * CPB; m *= 2) {
        set[0] |= __shfl_xor_sync(FULL_MASK, set[0], m);
        set[1] |= __shfl_xor_sync(FULL_MASK, set[1], m);
      }
      if (c < chunks) {
        u8* row = codes + out_token(c) * BPT;
#pragma unroll
        for (int i = 0; i < 8 / CPB; ++i) {
          const int e = p * (8 / CPB) + i;
          row[token_key_code_byte(16 * ks + 8 * (ci & 1) + e, BPT, BITS)] = (u8)(set[e / 4] >> (8 * (e % 4)));
        }
      }
    }
#elif DECODE_LAYOUT == 1
    u8* tile = codes + (tok - tok % 16) * BPT;
#pragma unroll
    for (int i = 0; i < BITS; ++i)
      tile[decode_code_offset((int)(tok % 16), cb + i, BPT, G * BITS / 8)] = (u8)(out >> 8 * i);
#elif BITS == 2
    *reinterpret_cast<u16*>(codes + tok * BPT + cb) = (u16)out;
#else
    *reinterpret_cast<u32*>(codes + tok * BPT + cb) = out;
#endif
  }
}
#endif  // VALUES_OK

// ----------------------------------------------------------------------------- TurboQuant+

#ifdef TURBO
// fp32 -> fp16 bits (TurboQuant+'s corrected norms are fp16 whatever the model dtype)
__device__ __forceinline__ u16 to_f16(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// TurboQuant+ (turbo2) quantization, methods.turboquant.TurboQuant._quantize with the fp32 sums in a fixed order
// (kernels.reference.turboquant_quantize): per row (token and head) of x [b, H, T, D], one warp, lane l holding
// channels l * EPL ..:
//   y = hadamard(signs * x) in fp32 (as hadamard_rows, not rounded); ||y||^2 and the block sums of G channels as
//   sequential sums of the lane's squares then butterflies over the lanes (block sums first); u = y / ||y||
//   (0 -> 1); code = #{midpoints < u} (bucketize); corrected norm per block = ||y_b|| / ||L[code]_b|| in fp16.
// Codes are 2-bit (BITS must be 2), staged per row in shared memory and stored in the reference layout
// (DECODE_LAYOUT 0), the value tiles (1) or the per-token key layout (2) of common.cuh; norms [*, H, cap, D/G] fp16
// (in the value tiles' parameter layout with 1). Outputs go to storage row out_row[i] at token out_off[i] + t.
// Block of 8 warps; dynamic shared memory 8 * D bytes.
#if BITS != 2 || EPL > G || D % G
#error "TurboQuant+ codes are 2-bit, blocks of G >= D / 32 channels"
#endif
#define TLANES (G / EPL)  // lanes per block of G channels
extern "C" __global__ void __launch_bounds__(256) quantize_turboquant(
    const u16* __restrict__ x, const float* __restrict__ signs, int H, int T, long long rows, float inv_sqrt_d,
    float l0, float l1, float l2, float l3, float m0, float m1, float m2, u8* __restrict__ codes,
    u16* __restrict__ norm_out, int cap, const int* __restrict__ out_row, const int* __restrict__ out_off) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  u8* row_codes = smem + (threadIdx.x >> 5) * D;  // the warp's codes of one row, one byte per channel
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  float sg[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) sg[i] = signs[lane * EPL + i];
  for (long long row = warp; row < rows; row += nwarps) {
    float y[EPL];
    load_row_vec(x + row * D, lane, y);
#pragma unroll
    for (int i = 0; i < EPL; ++i) y[i] *= sg[i];
    warp_hadamard(y, lane, inv_sqrt_d);
    // sums of squares: the lane's in order, then butterflies (the block's first)
    float ss = __fmul_rn(y[0], y[0]);
#pragma unroll
    for (int i = 1; i < EPL; ++i) ss = __fadd_rn(ss, __fmul_rn(y[i], y[i]));
#pragma unroll
    for (int m = 1; m < TLANES; m *= 2) ss = __fadd_rn(ss, __shfl_xor_sync(FULL_MASK, ss, m));
    const float block_ss = ss;
#pragma unroll
    for (int m = TLANES; m < 32; m *= 2) ss = __fadd_rn(ss, __shfl_xor_sync(FULL_MASK, ss, m));
    float norm = sqrtf(ss);
    norm = (norm == 0.f) ? 1.f : norm;
    float cs = 0.f;  // squares of the chosen levels, the same order
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const float u = __fdiv_rn(y[i], norm);
      const int c = (u > m0) + (u > m1) + (u > m2);
      const float level = c == 0 ? l0 : c == 1 ? l1 : c == 2 ? l2 : l3;
      cs = i ? __fadd_rn(cs, __fmul_rn(level, level)) : __fmul_rn(level, level);
      row_codes[lane * EPL + i] = (u8)c;
    }
#pragma unroll
    for (int m = 1; m < TLANES; m *= 2) cs = __fadd_rn(cs, __shfl_xor_sync(FULL_MASK, cs, m));
    __syncwarp();
    const long long ht = (long long)H * T;
    const int i = (int)(row / ht), h = (int)((row % ht) / T), t = (int)(row % T);
    const long long tok = ((long long)(out_row ? out_row[i] : i) * H + h) * cap + (out_off ? out_off[i] : 0) + t;
    if (lane % TLANES == 0) {
      const int blk = lane / TLANES;
      const u16 n = to_f16(__fdiv_rn(sqrtf(block_ss), sqrtf(cs)));
#if DECODE_LAYOUT == 1
      norm_out[(tok - tok % 16) * (D / G) + decode_param_offset((int)(tok % 16), blk, D / G)] = n;
#else
      norm_out[tok * (D / G) + blk] = n;
#endif
    }
    for (int bb = lane; bb < BPT; bb += 32) {  // output byte bb of the row
      u32 byte = 0u;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
#if DECODE_LAYOUT == 2
        byte |= (u32)row_codes[token_key_channel(bb, p, BPT, 2)] << (2 * p);
#else
        byte |= (u32)row_codes[4 * bb + p] << (2 * p);
#endif
      }
#if DECODE_LAYOUT == 1
      codes[(tok - tok % 16) * BPT + decode_code_offset((int)(tok % 16), bb, BPT, G * 2 / 8)] = (u8)byte;
#else
      codes[tok * BPT + bb] = (u8)byte;
#endif
    }
    __syncwarp();  // the row's codes are read before the next row writes them
  }
}
#endif  // TURBO

// One new token per sequence into the residual windows at position n_res[b]: the key row rotated (as
// hadamard_rows) when `rotate`, the value row copied; with `live` (not null) the window's count then advances,
// n_res[b] += live[b] (0 for a released row: kernels.cupy_layer). k, v: [B, H, D]; kr, vr: [B, H, rcap, D]. One block
// per sequence, a warp per head (heads strided over the block's warps): every warp reads n_res[b] before the block's
// first thread advances it.
extern "C" __global__ void append_residual(const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ kr,
                                           u16* __restrict__ vr, int* __restrict__ n_res, const int* __restrict__ live,
                                           int H, int rcap, int rotate, float inv_sqrt_d) {
  const int lane = threadIdx.x & 31, b = blockIdx.x;
  const int at = n_res[b];
  for (int h = threadIdx.x >> 5; h < H; h += blockDim.x >> 5) {
    const long long row = (long long)b * H + h;
    const long long dst = (row * rcap + at) * D;
    float x[EPL];
    load_row_vec(k + row * D, lane, x);
    if (rotate) warp_hadamard(x, lane, inv_sqrt_d);
    store_row_vec(kr + dst, lane, x);
#pragma unroll
    for (int i = 0; i < EPL; ++i) vr[dst + lane * EPL + i] = v[row * D + lane * EPL + i];
  }
  if (live) {
    __syncthreads();  // every warp has read n_res[b]
    if (threadIdx.x == 0) n_res[b] = at + live[b];
  }
}

// The decode step's in-step flushes (kernels.cupy_layer.CupyKVLayer.finish_step), every stream in one launch: for
// stream s (0: keys, 1: values; streams first .. first + gridDim.x / B - 1) of row b, when the window holds more than
// R of its unpacked tokens (n_packed + n_res - packed > R) its oldest one, window index at = packed - n_packed, is
// replaced by restored[b, :, at] (its dequantization, computed a stage ahead) and the stream's packed count advances.
// windows: [B, H, rcap, D] (keys, values); restored: [B, H, stage, D]; counts: [4, B] int32 rows n_packed, n_res,
// keys packed, values packed. One block per (stream, row); 16-byte copies.
extern "C" __global__ void finish_step(u16* __restrict__ key_window, const u16* __restrict__ key_restored,
                                       u16* __restrict__ value_window, const u16* __restrict__ value_restored,
                                       int* __restrict__ counts, int B, int H, int rcap, int stage, int first, int R) {
  const int b = blockIdx.x % B, stream = first + blockIdx.x / B;
  int* packed = counts + (2 + stream) * B + b;
  const int p = *packed, n_packed = counts[b];
  if (n_packed + counts[B + b] - p <= R) return;  // the same for the whole block
  const int at = p - n_packed;
  u16* window = stream ? value_window : key_window;
  const u16* restored = stream ? value_restored : key_restored;
  constexpr int VECS = D / 8;  // 16-byte vectors per token row
  for (int i = threadIdx.x; i < H * VECS; i += blockDim.x) {
    const long long head = (long long)b * H + i / VECS;
    reinterpret_cast<uint4*>(window + (head * rcap + at) * D)[i % VECS] =
        reinterpret_cast<const uint4*>(restored + (head * stage + at) * D)[i % VECS];
  }
  __syncthreads();  // every thread has read *packed
  if (threadIdx.x == 0) *packed = p + 1;
}
