// The decode step's small layers, one launch each (launched by kernels/layers.py; kernels/fused_layers.py swaps
// them into a model): RMSNorm (alone, or after the residual add), RoPE of the query and the key together,
// SiLU(gate) * up. Each computes what transformers' module computes, in its order of operations and with its
// roundings to the model dtype (see each kernel); products and sums are written as __fmul_rn / __fadd_rn so that no
// fused multiply-add changes a rounding. DTYPE: 0 float32, 1 bfloat16, 2 float16. One kernel per #define set:
// NORM_SIZE (rms_norm, add_rms_norm), ROPE_DIM (rotary), SILU_MUL (silu_mul), ROTATE_DIM (rotate_rows: a method's
// float32 rotation of a decode token's heads, OSCAR's).
#if DTYPE == 0
typedef float elem_t;
__device__ __forceinline__ float to_float(elem_t x) { return x; }
__device__ __forceinline__ elem_t to_dtype(float f) { return f; }
#else
typedef unsigned short elem_t;
__device__ __forceinline__ float to_float(elem_t x) {
#if DTYPE == 1
  return __uint_as_float(((unsigned)x) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#endif
}
__device__ __forceinline__ elem_t to_dtype(float f) {
  elem_t h;
#if DTYPE == 1
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}
#endif
// f rounded to the model dtype, as a float: what a torch op in that dtype hands the next one
__device__ __forceinline__ float rounded(float f) { return to_float(to_dtype(f)); }

#ifdef NORM_SIZE
// RMSNorm of rows of NORM_SIZE channels, as LlamaRMSNorm / Qwen3RMSNorm compute it: in float32 the mean of the
// squares (each square rounded, summed, times inv_size = fp32(1 / NORM_SIZE)), x * rsqrt(mean + eps) rounded to the
// dtype, times the weight, rounded. ROW_THREADS threads per row (a multiple of 32), ROW_ELEMS = ceil(NORM_SIZE /
// ROW_THREADS) channels per thread (c = lane + i * ROW_THREADS), ROWS_PER_BLOCK rows per block. Row r of ``rows`` is
// (outer, inner) = (r / inner_rows, r % inner_rows): x + outer * x_outer + inner * x_inner, likewise out (strides in
// elements, channels contiguous). Dynamic shared memory: ROWS_PER_BLOCK * ROW_THREADS / 32 floats.
// With ``residual`` (add_rms_norm: a decoder layer's residual add before its norm), the row normalized is
// residual + x as torch adds them in the dtype (the float32 sum, rounded), and that sum is written to ``sum_out``
// (laid out as out).
#define ROW_WARPS (ROW_THREADS / 32)
__device__ __forceinline__ void norm_rows(const elem_t* __restrict__ x, long long x_outer, long long x_inner,
                                          const elem_t* __restrict__ residual, long long r_outer, long long r_inner,
                                          elem_t* __restrict__ sum_out, const elem_t* __restrict__ weight,
                                          elem_t* __restrict__ out, long long out_outer, long long out_inner,
                                          int inner_rows, long long rows, float eps, float inv_size) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* partial = (float*)smem;
  const int slot = threadIdx.x / ROW_THREADS, lane = threadIdx.x % ROW_THREADS;
  const long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + slot;
  const bool live = row < rows;
  const long long outer = live ? row / inner_rows : 0, inner = live ? row % inner_rows : 0;
  const elem_t* src = x + outer * x_outer + inner * x_inner;
  const elem_t* res = residual ? residual + outer * r_outer + inner * r_inner : nullptr;
  elem_t* dst = out + outer * out_outer + inner * out_inner;
  float v[ROW_ELEMS];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < ROW_ELEMS; ++i) {
    const int c = lane + i * ROW_THREADS;
    const bool here = live && c < NORM_SIZE;
    v[i] = here ? to_float(src[c]) : 0.f;
    if (res && here) {
      v[i] = rounded(__fadd_rn(to_float(res[c]), v[i]));
      sum_out[dst - out + c] = to_dtype(v[i]);
    }
    sum = __fadd_rn(sum, __fmul_rn(v[i], v[i]));
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, m));
  if (ROW_WARPS > 1) {
    if ((lane & 31) == 0) partial[slot * ROW_WARPS + lane / 32] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < ROW_WARPS; ++w) sum = __fadd_rn(sum, partial[slot * ROW_WARPS + w]);
  }
  if (!live) return;
  const float scale = rsqrtf(__fadd_rn(__fmul_rn(sum, inv_size), eps));
#pragma unroll
  for (int i = 0; i < ROW_ELEMS; ++i) {
    const int c = lane + i * ROW_THREADS;
    if (c < NORM_SIZE) dst[c] = to_dtype(__fmul_rn(to_float(weight[c]), rounded(__fmul_rn(v[i], scale))));
  }
}

extern "C" __global__ void rms_norm(const elem_t* __restrict__ x, long long x_outer, long long x_inner,
                                    const elem_t* __restrict__ weight, elem_t* __restrict__ out, long long out_outer,
                                    long long out_inner, int inner_rows, long long rows, float eps, float inv_size) {
  norm_rows(x, x_outer, x_inner, nullptr, 0, 0, nullptr, weight, out, out_outer, out_inner, inner_rows, rows, eps,
            inv_size);
}

extern "C" __global__ void add_rms_norm(const elem_t* __restrict__ x, long long x_outer, long long x_inner,
                                        const elem_t* __restrict__ residual, long long r_outer, long long r_inner,
                                        elem_t* __restrict__ sum_out, const elem_t* __restrict__ weight,
                                        elem_t* __restrict__ out, long long out_outer, long long out_inner,
                                        int inner_rows, long long rows, float eps, float inv_size) {
  norm_rows(x, x_outer, x_inner, residual, r_outer, r_inner, sum_out, weight, out, out_outer, out_inner, inner_rows,
            rows, eps, inv_size);
}
#endif

#ifdef ROPE_DIM
// RoPE of a query and a key in the rotate-half convention, as transformers' apply_rotary_pos_emb computes it in the
// dtype: out = x * cos + rotate_half(x) * sin, each product rounded, then the sum rounded; rotate_half(x) is
// (-x[HALF:], x[:HALF]). One thread per channel pair (c, c + HALF) of one (sequence, head, token) row, the query's
// heads_q heads then the key's heads_k; ``pairs`` = batch * tokens * (heads_q + heads_k) * HALF. Strides in elements
// per (sequence, head, token) of q, k, q_out and k_out, per (sequence, token) of cos and sin ([B, T, ROPE_DIM],
// shared by the heads; a sequence stride of 0 broadcasts one table over the batch); channels contiguous.
#define HALF (ROPE_DIM / 2)
extern "C" __global__ void rotary(const elem_t* __restrict__ q, long long qb, long long qh, long long qt,
                                  const elem_t* __restrict__ k, long long kb, long long kh, long long kt,
                                  const elem_t* __restrict__ cos, const elem_t* __restrict__ sin, long long cb,
                                  long long ct, elem_t* __restrict__ q_out, long long qob, long long qoh,
                                  long long qot, elem_t* __restrict__ k_out, long long kob, long long koh,
                                  long long kot, int heads_q, int heads_k, int tokens, long long pairs) {
  const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= pairs) return;
  const int c = (int)(g % HALF);
  const long long r = g / HALF;
  int h = (int)(r % (heads_q + heads_k));
  const long long bt = r / (heads_q + heads_k);
  const long long t = bt % tokens, b = bt / tokens;
  const elem_t* src;
  elem_t* dst;
  if (h < heads_q) {
    src = q + b * qb + h * qh + t * qt;
    dst = q_out + b * qob + h * qoh + t * qot;
  } else {
    h -= heads_q;
    src = k + b * kb + h * kh + t * kt;
    dst = k_out + b * kob + h * koh + t * kot;
  }
  const elem_t* cs = cos + b * cb + t * ct;
  const elem_t* sn = sin + b * cb + t * ct;
  const float x1 = to_float(src[c]), x2 = to_float(src[c + HALF]);
  dst[c] = to_dtype(__fadd_rn(rounded(__fmul_rn(x1, to_float(cs[c]))), rounded(__fmul_rn(-x2, to_float(sn[c])))));
  dst[c + HALF] = to_dtype(__fadd_rn(rounded(__fmul_rn(x2, to_float(cs[c + HALF]))),
                                     rounded(__fmul_rn(x1, to_float(sn[c + HALF])))));
}
#endif

#ifdef SILU_MUL
// act_fn(gate) * up of a SiLU MLP, as torch computes it in the dtype: silu(g) = g / (1 + exp(-g)) in float32,
// rounded, times up, rounded. One thread per element of ``total`` = rows * width; row strides in elements (gate and
// up may be the two halves of one merged projection's rows), channels contiguous.
extern "C" __global__ void silu_mul(const elem_t* __restrict__ gate, long long gate_row,
                                    const elem_t* __restrict__ up, long long up_row, elem_t* __restrict__ out,
                                    long long out_row, int width, long long total) {
  const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= total) return;
  const long long row = g / width;
  const int c = (int)(g % width);
  const float a = to_float(gate[row * gate_row + c]);
  const float act = rounded(__fdiv_rn(a, __fadd_rn(1.f, expf(-a))));
  out[row * out_row + c] = to_dtype(__fmul_rn(act, to_float(up[row * up_row + c])));
}
#endif

#ifdef ROTATE_DIM
// Rows of ROTATE_DIM channels times a float32 matrix [ROTATE_DIM, ROTATE_DIM], as (x.float() @ matrix).to(dtype):
// float32 sums of products over the channels in order (fused multiply-adds, as a float32 GEMM runs them; cuBLAS's
// order differs, so the float32 results may differ in their last bits), rounded to the dtype. One thread per output
// channel; ROTATE_ROWS rows per block share each load of the matrix (a decode token's heads: the matrix is read
// once per block, from L2). Rows [rows, ROTATE_DIM] contiguous. Dynamic shared memory: the block's rows in float32,
// ROTATE_ROWS * ROTATE_DIM * 4 bytes.
extern "C" __global__ void __launch_bounds__(ROTATE_DIM) rotate_rows(const elem_t* __restrict__ x,
                                                                     const float* __restrict__ matrix,
                                                                     elem_t* __restrict__ out, long long rows) {
  extern __shared__ __align__(16) unsigned char smem[];
  float(*xs)[ROTATE_DIM] = (float(*)[ROTATE_DIM])smem;
  const long long first = (long long)blockIdx.x * ROTATE_ROWS;
  const int j = threadIdx.x;
#pragma unroll
  for (int r = 0; r < ROTATE_ROWS; ++r) xs[r][j] = first + r < rows ? to_float(x[(first + r) * ROTATE_DIM + j]) : 0.f;
  __syncthreads();
  float acc[ROTATE_ROWS];
#pragma unroll
  for (int r = 0; r < ROTATE_ROWS; ++r) acc[r] = 0.f;
#pragma unroll 4
  for (int c = 0; c < ROTATE_DIM; ++c) {
    const float m = matrix[c * ROTATE_DIM + j];
#pragma unroll
    for (int r = 0; r < ROTATE_ROWS; ++r) acc[r] = fmaf(xs[r][c], m, acc[r]);
  }
#pragma unroll
  for (int r = 0; r < ROTATE_ROWS; ++r)
    if (first + r < rows) out[(first + r) * ROTATE_DIM + j] = to_dtype(acc[r]);
}
#endif
