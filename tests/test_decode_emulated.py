"""kernels/decode_attention.cu on the CPU emulator (tests/cuda_emu.h) against the torch reference.

The decode-attention kernel and its combine run lane by lane on the CPU, with every warp shuffle, vote and
tensor-core product of the CUDA code emulated (mma.sync fragments gathered across the warp, exact products
summed in fp32), so the fast suite checks the kernel's logic (operand layouts, offsets, online softmax,
splits, residual tokens, the combine) without a GPU. The criterion is the GPU test's: error against an fp64
reference within 2x the plain torch path's error in the same dtype plus a small tolerance, per sequence;
outputs and partials are poisoned with NaN before the launch. Not modelled: the tensor cores' own rounding
inside a product (their accumulation is not plain fp32), cp.async timing, ex2.approx's error; those are
the GPU tests' (tests/test_kernels.py, `pytest -m gpu`).
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from test_kernels import (_ASM, ATTENTION_TOL, _make_cache, _reference, _rel, _replace_definition,
                          common_host_source, emulator_builder, real_looking)

from kernels import ops, runtime
from oscar.paths import REPO_ROOT

KERNELS = REPO_ROOT / "kernels"

#: host versions of the PTX helpers of decode_attention.cu, replacing their definitions in place
EMU_HELPERS = {
    # a 16-bit product or sum is exact in fp32 for the operands the kernel multiplies / adds, then rounded once
    "mul2": "inline u32 mul2(u32 a, u32 b) { return emu_pairwise(a, b, [](float x, float y) { return x * y; }); }",
    "add2": "inline u32 add2(u32 a, u32 b) { return emu_pairwise(a, b, [](float x, float y) { return x + y; }); }",
    "fma2": "inline u32 fma2(u32 a, u32 b, u32 c) {\n  u32 r = 0;\n  for (int i = 0; i < 2; ++i) {\n"
            "    const double x = EMU_VALUE((unsigned short)(a >> 16 * i));\n"
            "    const double y = EMU_VALUE((unsigned short)(b >> 16 * i));\n"
            "    r |= (u32)EMU_ROUND((float)(x * y + EMU_VALUE((unsigned short)(c >> 16 * i)))) << 16 * i;\n  }\n"
            "  return r;\n}",
    "fast_exp2": "inline float fast_exp2(float x) { return exp2f(x); }",
    "smem_addr": "inline u32 smem_addr(const void* p) { return (u32)((const unsigned char*)p - emu_smem()); }",
    "cp_async_commit": "inline void cp_async_commit() {}",
    "cp_async_wait": "template <int N> inline void cp_async_wait() {}",  # the copies below are synchronous
    "cp_async16_if": "inline void cp_async16_if(u32 dst, const void* src, bool pred) {\n"
                     "  if (pred) memcpy(emu_smem() + dst, src, 16);\n}",
    "mma": "inline void mma(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {\n"
           "  const u32 a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};\n  emu_mma(c, a, b, 16, EMU_VALUE);\n}",
    "mma8": "inline void mma8(float c[4], u32 a0, u32 a1, u32 b0) {\n"
            "  const u32 a[2] = {a0, a1}, b[1] = {b0};\n  emu_mma(c, a, b, 8, EMU_VALUE);\n}",
    "code_op": "inline u32 code_op(u32 word, int bits, int p, int h, u32 one) {\n"
               "  const u32 shifted = shift_right(word, code_rshift(bits, p, h), one);\n"
               "  return (shifted & code_mask(bits, p)) | code_magic(bits, p);\n}",
    "vcode_op": "inline u32 vcode_op(u32 word, int p, int h, bool hi_only, u32 one) {\n"
                "  const u32 shifted = shift_right(word, 8 * h + 4 * (p / 2) - 6, one);\n"
                "  return (shifted & vcode_mask(p, hi_only)) | vcode_magic(p);\n}",
    "vmma8": "inline void vmma8(float c[4], u32 a0, u32 a1, u32 b0) {\n"
             "  const u32 a[2] = {a0, a1}, b[1] = {b0};\n  emu_mma(c, a, b, 8, emu_f16);\n}",
    "vmul2": "inline u32 vmul2(u32 a, u32 b) {\n  u32 r = 0;\n  for (int i = 0; i < 2; ++i)\n"
             "    r |= (u32)emu_cvt_rn_f16_f32(emu_f16((unsigned short)(a >> 16 * i)) *\n"
             "                                 emu_f16((unsigned short)(b >> 16 * i))) << 16 * i;\n  return r;\n}",
    "code_op_hi": "inline u32 code_op_hi(u32 word, int p, int h, u32 one) {\n"
                  "  const u32 shifted = shift_right(word, code_rshift(2, p, h), one);\n"
                  "  return (shifted & code_hi_mask(p)) | code_magic(2, p);\n}",
}
EMU_PRELUDE = r"""
#if IS_BF16
#define EMU_VALUE emu_bf16
#define EMU_ROUND emu_cvt_rn_bf16_f32
#else
#define EMU_VALUE emu_f16
#define EMU_ROUND emu_cvt_rn_f16_f32
#endif
template <class F> inline u32 emu_pairwise(u32 a, u32 b, F f) {
  u32 r = 0;
  for (int i = 0; i < 2; ++i)
    r |= (u32)EMU_ROUND(f(EMU_VALUE((unsigned short)(a >> 16 * i)), EMU_VALUE((unsigned short)(b >> 16 * i))))
         << 16 * i;
  return r;
}
"""
EMU_WRAPPER = r"""
extern "C" void emu_decode(const u16* q, const u8* kc, const u16* ks, const u16* kz, const float* kn, const u8* vc,
                           const u16* vs, const u16* vz, const u16* kr, const u16* vr, const int* n_packed,
                           const int* n_res, float* o_part, float* ml_part, u16* out, int B, int HKV, int cap,
                           int rcap, int splits, int rsplits, int tps, float scale_log2, int rotate_q, float isd,
                           int smem) {
  emu_launch({(unsigned)(splits + rsplits), (unsigned)HKV, (unsigned)B}, {32, 1, 1}, smem, [&] {
    decode_attention(q, kc, ks, kz, kn, vc, vs, vz, kr, vr, n_packed, n_res, o_part, ml_part, HKV, cap, rcap, splits,
                     tps, scale_log2, rotate_q, isd);
  });
  emu_launch({(unsigned)(B * HKV * HPG), D / COMBINE_DIMS, 1}, {COMBINE_THREADS, 1, 1}, 0,
             [&] { combine(o_part, ml_part, out, splits + rsplits); });
}
"""


def _host_source(helpers: dict = EMU_HELPERS, wrapper: str = EMU_WRAPPER) -> str:
    """kernels/decode_attention.cu as host C++ for tests/cuda_emu.h: common.cuh inlined (common_host_source, its
    tensor-core helper emulated), the PTX helpers replaced by ``helpers``, the remaining asm statements (in
    common.cuh) by emu_ calls, shared memory from the emulator (static arrays for the combine's __shared__ ones:
    blocks run one after the other), ``wrapper`` appended."""
    text = (KERNELS / "decode_attention.cu").read_text()
    text = text.replace('#include "common.cuh"', common_host_source() + EMU_PRELUDE)
    for name, replacement in helpers.items():
        text = _replace_definition(text, name, replacement)
    text = text.replace("extern __shared__ __align__(16) unsigned char smem[];", "unsigned char* smem = emu_smem();")
    text = text.replace("__shared__ float", "static float")
    text = _ASM.sub(lambda m: f"{m.group(2)} = emu_{m.group(1).replace('.', '_')}("
                              f"{', '.join(a for a in m.group(3, 4) if a)});", text)
    assert "asm" not in text and "__shared__" not in text, "a PTX statement or shared array the emulator lacks"
    return '#include "cuda_emu.h"\n' + text + wrapper


@pytest.fixture(scope="module")
def emulated_decode():
    """defines -> ctypes library of decode_attention.cu built for the CPU emulator (memoized per #define set)."""
    return emulator_builder(_host_source())


CASES = [
    # lengths (packed, per sequence), residuals, hq, hkv, d, k_bits, v_bits, G, (splits, tokens per split), dtype
    # 4 query heads per KV head (key operand split over the padded lanes), an empty sequence, empty splits
    ([32 * 6, 32 * 3, 0], [17, 1, 9], 8, 2, 128, 2, 2, 32, (3, 64), torch.bfloat16),
    ([32 * 6, 32 * 3, 0], [17, 1, 9], 8, 2, 128, 2, 2, 32, (3, 64), torch.float16),
    # head_dim 64 (one key word per lane: no split), 3 heads per KV head, no residual for one sequence
    ([64 * 3, 32], [0, 40], 6, 2, 64, 2, 2, 32, (2, 128), torch.bfloat16),
    # 4-bit keys, 2-bit values, G=64, one head per KV head
    ([64 * 3], [3], 2, 2, 128, 4, 2, 64, (2, 128), torch.float16),
    # head_dim 256, 4-bit keys and values, 8 heads per KV head
    ([32 * 3], [31], 8, 1, 256, 4, 4, 32, (2, 64), torch.bfloat16),
    # a kivi-policy window (R = 128 + a stage): its 160 slots over the residual splits, one sequence's tokens ending
    # inside the third slice, one's past the fourth, one short of the first (slices after it empty)
    ([32 * 4, 32 * 2, 32], [150, 70, 5], 8, 2, 128, 2, 2, 32, (2, 64), torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES)
def test_decode_attention_emulated_matches_reference(emulated_decode, case):
    lengths, residuals, hq, hkv, d, kb, vb, g, (splits, tps), dtype = case
    rcap = 160 if max(residuals) > 128 else max(g, max(residuals))
    keys, values, k_res, v_res, (n_p, n_r), ref = _make_cache(lengths, residuals, hkv, d, kb, vb, g, rcap, dtype,
                                                                seed=sum(lengths) + d, device="cpu")
    rsplits = ops.residual_splits(rcap)
    b, hpg, parts = len(lengths), hq // hkv, splits + rsplits
    lib = emulated_decode(HEAD_DIM=d, K_BITS=kb, V_BITS=vb, GROUP=g, HPG=hpg, IS_BF16=int(dtype == torch.bfloat16),
                          NSTAGE=ops.NSTAGE, COMBINE_THREADS=ops.COMBINE_THREADS, COMBINE_DIMS=ops.COMBINE_DIMS)
    q = real_looking(b, hq, 1, d, dtype, seed=7, device="cpu") * 2.0
    out = torch.full_like(q, float("nan"))
    o_part = torch.full((b, hq, parts, d), float("nan"))
    ml_part = torch.full((b, hq, parts, 2), float("nan"))
    scaling = 1 / math.sqrt(d)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    lib.emu_decode(*map(ptr, (q, keys["codes"], keys["scale"], keys["zero"], keys["norm"], values["codes"],
                              values["scale"], values["zero"], k_res, v_res, n_p, n_r, o_part, ml_part, out)),
                   b, hkv, keys["codes"].shape[2], rcap, splits, rsplits, tps,
                   ctypes.c_float(scaling * math.log2(math.e)), 1,
                   ctypes.c_float(float(runtime.inv(math.sqrt(d)))),
                   ops.decode_smem_bytes(d, kb, vb, g, hpg, ops.NSTAGE, rcap))
    exact, torch_path = _reference(q, ref, k_res, v_res, (n_p, n_r), kb, vb, g, scaling, dtype)
    assert torch.isfinite(out).all()
    for i in range(b):
        assert _rel(out[i], exact[i]) <= 2 * _rel(torch_path[i], exact[i]) + ATTENTION_TOL, i
