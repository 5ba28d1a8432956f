"""The KIVI, QuaRot and TurboQuant+ kernels on the CPU emulator (tests/cuda_emu.h) against their references.

Quantizers: packed bytes equal to the reference (numpy mirrors of ``quantize_groups`` with CUDA torch's
arithmetic, ``kernels.reference.turboquant_quantize`` for TurboQuant+), in the reference layout and through the
decode-layout converters of ``kernels.ops``, written into storage rows at token offsets with the rest untouched.
Decode attention: error against the fp64 reference of ``kernels.reference`` within 2x the plain torch path's error
in the same dtype plus a small tolerance, per sequence. Outputs are poisoned before every launch; inputs are
random and real-looking (channel outliers, a low-norm first token). Not modelled here: what the emulator does not
model for the OScaR kernels either (see tests/test_decode_emulated.py); those are the GPU tests'
(tests/test_kernels_methods.py).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch
from test_kernels import _hadamard_np, _np_input, _ptr, _quantize_np, emulator_builder, real_looking
from test_kernels import _host_source as quantize_host_source
from test_kernels_methods import assert_close_to_reference, make_method_cache, quantize_then_decode, reference_errors

from kernels import ops, runtime
from kernels.reference import turboquant_quantize
from oscar import build_method


@pytest.fixture(scope="module")
def emulated_quant():
    """defines -> ctypes library of quantize.cu built for the CPU emulator (memoized per #define set)."""
    return emulator_builder(quantize_host_source())


def _as_torch(*arrays):
    return [torch.from_numpy(a.astype(np.int32)) for a in arrays]


# ----------------------------------------------------------------------------- KIVI keys


@pytest.mark.parametrize("case", [
    # head_dim, bits, G, bf16, heads, warps per head, batch, tokens, blocks, zero point, storage, decode layout,
    # lattice input (exact rounding ties)
    (128, 2, 32, 1, 8, 1, 2, 64, 3, "float", True, True, False),
    (64, 4, 32, 0, 3, 2, 1, 96, 2, "float", False, False, True),
    (128, 2, 64, 0, 2, 2, 2, 64, 1, "float", True, False, True),
    (256, 2, 32, 1, 2, 2, 1, 32, 1, "int", False, True, False),
])
def test_kivi_keys_emulated_bytes_equal_reference(emulated_quant, case):
    """OScaR's key kernel without rotation and norm (KEY_NORM=0) writes quantize_groups(k, "channel", zero_point)
    byte for byte: real-looking keys (outlier channels, a low-norm first token) and lattice keys (ties in
    (x - min) / scale); into storage rows/offsets with the rest untouched; scale/zero through key_decode_layout."""
    d, bits, g, bf16, h, wph, b, t, blocks, zero_point, storage, decode, lattice = case
    lib = emulated_quant(HEAD_DIM=d, BITS=bits, GROUP=g, IS_BF16=bf16, HEADS=h, WPH=wph, KEY_NORM=0,
                         ZERO_FLOAT=int(zero_point == "float"), DECODE_LAYOUT=int(decode))
    k = _np_input((b, h, t, d), bf16, seed=sum(case[:9]), lattice=lattice)
    rows, off, cap = (np.arange(1, b + 1, dtype=np.int32), g, t + 2 * g) if storage else (None, 0, t)
    n_rows = b + 1 if storage else b
    codes = np.full((n_rows, h, cap, d * bits // 8), 0xA5, np.uint8)
    scale, zero = (np.full((n_rows, h, cap // g, d), 0xFFFF, np.uint16) for _ in range(2))
    offs = np.full(b, off, np.int32)
    inv = lambda x: ctypes.c_float(np.float32(1) / np.float32(x))  # noqa: E731
    lib.emu_keys(_ptr(k), b, t, 0, inv(math.sqrt(d)), inv(2**bits - 1), _ptr(codes), _ptr(scale), _ptr(zero), None,
                 cap, _ptr(rows) if storage else None, _ptr(offs) if storage else None, blocks)
    want = _quantize_np(k, bits, g, "channel", bool(bf16), zero_point)
    if decode:
        params = dict(zip(("scale", "zero"), _as_torch(want[1], want[2])))
        moved = ops.key_decode_layout(params, bits)
        want = (want[0], moved["scale"].numpy().astype(np.uint16), moved["zero"].numpy().astype(np.uint16))
    sel = (slice(1, None) if storage else slice(None), slice(None), slice(off, off + t))
    psel = sel[:2] + (slice(off // g, (off + t) // g),)
    for name, got, ref, where in zip(("codes", "scale", "zero"), (codes, scale, zero), want, (sel, psel, psel)):
        assert np.array_equal(got[where], ref), name
        if storage:
            assert (got[0] == got.flat[0]).all() and (got[1:, :, :where[2].start] == got.flat[0]).all(), name


# ----------------------------------------------------------------------------- per-token groups


def _token_case_run(lib, x, bits, g, cap, rows, offs):
    b, h, t, d = x.shape
    n_rows = int(rows.max()) + 1
    codes = np.full((n_rows, h, cap, d * bits // 8), 0xA5, np.uint8)
    scale, zero = (np.full((n_rows, h, cap, d // g), 0xFFFF, np.uint16) for _ in range(2))
    lib.emu_values(_ptr(x), b, h, t, ctypes.c_float(np.float32(1) / np.float32(2**bits - 1)), _ptr(codes),
                   _ptr(scale), _ptr(zero), cap, _ptr(rows), _ptr(offs))
    return codes, scale, zero


@pytest.mark.parametrize("case", [
    # role, head_dim, bits, G, bf16, heads, batch, tokens, zero point, clip ratio, lattice input
    ("quarot_keys", 128, 2, 32, 1, 4, 2, 21, "int", 1.0, False),
    ("quarot_keys", 64, 4, 16, 0, 3, 2, 9, "int", 0.9, False),
    ("quarot_keys", 256, 2, 64, 1, 2, 1, 7, "float", 0.95, False),
    ("kivi_values", 128, 2, 32, 0, 4, 2, 40, "float", 1.0, True),
    ("kivi_values", 64, 4, 16, 1, 3, 2, 16, "float", 1.0, False),
    ("quarot_values", 128, 2, 64, 1, 2, 2, 48, "int", 0.8, False),
])
def test_per_token_groups_emulated_bytes_equal_reference(emulated_quant, case):
    """The per-token kernel: QuaRot's keys (Hadamard first, codes in the per-token key layout), KIVI's values
    (float zero) and QuaRot's values (clip ratio) in the value decode layout, into storage rows at a token offset,
    equal quantize_groups(.., "token", zero_point, clip_ratio) through the ops converters; the rest untouched."""
    role, d, bits, g, bf16, h, b, t, zero_point, clip, lattice = case
    keys = role == "quarot_keys"
    defines = dict(HEAD_DIM=d, BITS=bits, GROUP=g, IS_BF16=bf16, DECODE_LAYOUT=2 if keys else 1,
                   ZERO_FLOAT=int(zero_point == "float"), ROTATE_TOKENS=int(keys),
                   CLIP_BITS=int(np.float32(clip).view(np.uint32)))
    lib = emulated_quant(**defines)
    x = _np_input((b, h, t, d), bool(bf16), seed=sum(case[1:8]), lattice=lattice)
    off = 5 if keys else 3  # value tiles take any token offset (one token at a time under the kivi policy)
    cap = 16 * math.ceil((t + off + 7) / 16)
    rows, offs = np.arange(1, b + 1, dtype=np.int32), np.full(b, off, np.int32)
    codes, scale, zero = _token_case_run(lib, x, bits, g, cap, rows, offs)
    src = _hadamard_np(x, bool(bf16)) if keys else x
    want = dict(zip(("codes", "scale", "zero"), _as_torch(*_quantize_np(src, bits, g, "token", bool(bf16), zero_point,
                                                                         clip))))
    got = dict(zip(("codes", "scale", "zero"), _as_torch(codes, scale, zero)))
    if keys:
        window = {name: buf[1:, :, off:off + t] for name, buf in got.items()}
        moved = ops.token_key_decode_layout(want, bits)
        assert not torch.equal(moved["codes"], want["codes"]), "the layout must move codes"
        for name in want:
            assert torch.equal(window[name], moved[name]), name
        assert torch.equal(ops.token_key_decode_layout(window, bits, inverse=True)["codes"], want["codes"])
        untouched = [buf[:, :, :off] for buf in got.values()] + [buf[:, :, off + t:] for buf in got.values()]
    else:  # compare whole tiles: the reference bytes placed at the offset, then the tile permutation
        full = {name: torch.full_like(buf[1:], -1) for name, buf in got.items()}
        for name in full:
            full[name][:, :, off:off + t] = want[name]
        placed = ops.value_decode_layout(full, bits, g)
        for name in want:
            mask = placed[name] != -1
            assert torch.equal(got[name][1:][mask], placed[name][mask]), name
            assert (got[name][1:][~mask] == got[name].flatten()[0]).all(), f"{name}: slots of other tokens written"
        untouched = []
    assert all((u == u.flatten()[0]).all() for u in untouched), "slots outside the written tokens changed"
    assert all((buf[0] == buf.flatten()[0]).all() for buf in got.values()), "a row no sequence goes to changed"


# ----------------------------------------------------------------------------- TurboQuant+ quantizer

TURBO_WRAPPER = r"""
#ifdef TURBO
extern "C" void emu_turbo(const u16* x, const float* signs, int b, int H, int T, float isd, const float* lv, u8* codes,
                          u16* norm, int cap, const int* rows, const int* offs, int blocks) {
  const long long n = (long long)b * H * T;
  emu_launch({(unsigned)blocks, 1, 1}, {256, 1, 1}, 8 * D, [&] {
    quantize_turboquant(x, signs, H, T, n, isd, lv[0], lv[1], lv[2], lv[3], lv[4], lv[5], lv[6], codes, norm, cap,
                        rows, offs);
  });
}
#endif
"""


@pytest.fixture(scope="module")
def emulated_turbo():
    return emulator_builder(quantize_host_source() + TURBO_WRAPPER)


@pytest.mark.parametrize("case", [
    # head_dim, G (values per norm), bf16, heads, batch, tokens, layout (None / keys / values), blocks, real-looking
    (128, 32, 1, 2, 2, 19, "keys", 2, True), (64, 32, 0, 3, 1, 16, "values", 1, True),
    (256, 64, 1, 1, 2, 7, None, 1, False), (128, 128, 0, 2, 1, 12, "values", 3, False),
])
def test_turboquant_emulated_bytes_equal_reference(emulated_turbo, case):
    """quantize_turboquant (signs, fp32 Hadamard, unit norm, codebook, fp16 corrected norm per block) equals
    kernels.reference.turboquant_quantize byte for byte through the layout converters, into storage rows at a token
    offset with the rest untouched; fewer blocks than rows exercises the grid stride."""
    d, g, bf16, h, b, t, layout, blocks, real = case
    lib = emulated_turbo(HEAD_DIM=d, BITS=2, GROUP=g, IS_BF16=bf16, TURBO=1,
                         DECODE_LAYOUT={None: 0, "values": 1, "keys": 2}[layout])
    dtype = torch.bfloat16 if bf16 else torch.float16
    x = real_looking(b, h, t, d, dtype, seed=d + t, device="cpu") if real else \
        torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(d + t)).to(dtype)
    method = build_method("turboquant", group_size=g, seed=t)
    signs, levels = method.signs(d), method.codebook(2, d)
    mids = (levels[1:] + levels[:-1]) / 2
    params = torch.cat([levels, mids]).contiguous()
    off, cap = 3, 32 * math.ceil((t + 3) / 32)
    rows, offs = np.arange(1, b + 1, dtype=np.int32), np.full(b, off, np.int32)
    codes = torch.full((b + 1, h, cap, d // 4), 0xA5, dtype=torch.uint8)
    norm = torch.full((b + 1, h, cap, d // g), float("nan"), dtype=torch.float16)
    tp = lambda a: ctypes.c_void_p(a.data_ptr())  # noqa: E731
    lib.emu_turbo(tp(x), tp(signs), b, h, t, ctypes.c_float(float(runtime.inv(math.sqrt(d)))), tp(params), tp(codes),
                  tp(norm), cap, _ptr(rows), _ptr(offs), blocks)
    want = turboquant_quantize(x, g, signs, levels.tolist())
    got = dict(codes=codes, norm=norm)
    if layout == "values":  # back to the reference layout (whole tiles: unwritten tokens get their own bytes back)
        got = ops.value_decode_layout(got, 2, g, inverse=True)
    for name in want:
        poison = got[name].eq(0xA5) if name == "codes" else got[name].isnan()
        assert poison[0].all() and poison[1:, :, :off].all() and poison[1:, :, off + t:].all(), name
    if layout == "keys":  # codes permuted inside each token row
        got = ops.token_key_decode_layout(got, 2, inverse=True)
    for name in want:
        assert torch.equal(got[name][1:, :, off:off + t], want[name]), name
    same = (build_method("turboquant", group_size=g, seed=t).quantize_keys(x, 0).buffers["codes"] == want["codes"])
    assert same.float().mean() > 0.999, "the kernel's order of sums must leave the method's codes (nearly) as they are"


# ----------------------------------------------------------------------------- kernels.ops on the emulator

QUANT_LAUNCHERS = r"""
#if KEYS_OK
extern "C" void launch_quantize_keys(unsigned gx, unsigned bx, unsigned long long smem, const u16* k, int b, int T,
                                     int rotate, float isd, float il, u8* codes, u16* sc, u16* zr, float* nrm, int cap,
                                     const int* rows, const int* offs) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem,
             [&] { quantize_keys(k, b, T, rotate, isd, il, codes, sc, zr, nrm, cap, rows, offs); });
}
#endif
#if VALUES_OK
extern "C" void launch_quantize_values(unsigned gx, unsigned bx, unsigned long long smem, const u16* v, int H, int T,
                                       long long chunks, float il, u8* codes, u16* sc, u16* zr, int cap,
                                       const int* rows, const int* offs) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem,
             [&] { quantize_values(v, H, T, chunks, il, codes, sc, zr, cap, rows, offs); });
}
#endif
#ifdef TURBO
extern "C" void launch_quantize_turboquant(unsigned gx, unsigned bx, unsigned long long smem, const u16* x,
                                           const float* signs, int H, int T, long long rows, float isd, float l0,
                                           float l1, float l2, float l3, float m0, float m1, float m2, u8* codes,
                                           u16* norm, int cap, const int* orow, const int* ooff) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] {
    quantize_turboquant(x, signs, H, T, rows, isd, l0, l1, l2, l3, m0, m1, m2, codes, norm, cap, orow, ooff);
  });
}
#endif
"""
DECODE_LAUNCHERS = r"""
extern "C" void launch_decode_attention(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned long long smem,
                                        const u16* q, const u8* kc, const u16* ks, const u16* kz, const float* kn,
                                        const u8* vc, const u16* vs, const u16* vz, const u16* kr, const u16* vr,
                                        const int* n_packed, const int* n_res, float* o_part, float* ml_part, int HKV,
                                        int cap, int rcap, int splits, int tps, float scale_log2, int rotate_q,
                                        float isd
#if CODEBOOK
                                        , const float* signs, float cb_a, float cb_b, float cb_k
#endif
#if PARAM32
                                        , float param_a, float param_b
#endif
#if EXACT
                                        , const u16* ke, const u16* ve, const int* n_exact, int ecap, const u32* skip
#endif
                                        ) {
  emu_launch({gx, gy, gz}, {bx, 1, 1}, smem, [&] {
    decode_attention(q, kc, ks, kz, kn, vc, vs, vz, kr, vr, n_packed, n_res, o_part, ml_part, HKV, cap, rcap, splits,
                     tps, scale_log2, rotate_q, isd
#if CODEBOOK
                     , signs, cb_a, cb_b, cb_k
#endif
#if PARAM32
                     , param_a, param_b
#endif
#if EXACT
                     , ke, ve, n_exact, ecap, skip
#endif
                     );
  });
}
extern "C" void launch_combine(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned long long smem,
                               const float* o_part, const float* ml_part, u16* out, int parts) {
  emu_launch({gx, gy, gz}, {bx, 1, 1}, smem, [&] { combine(o_part, ml_part, out, parts); });
}
"""


ROTATEKV_LAUNCHER = r"""
extern "C" void launch_rotatekv_scores(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned long long smem,
                                       const u16* q, const u8* kc, const u16* ks, const u16* kz, const u16* key_group,
                                       const float* anchors, const float* offsets, const int* n_packed,
                                       const u32* skip, float* out, int cap, float scale, float isg) {
  emu_launch({gx, gy, gz}, {bx, 1, 1}, smem, [&] {
    rotatekv_scores(q, kc, ks, kz, key_group, anchors, offsets, n_packed, skip, out, cap, scale, isg);
  });
}
"""
SPECTRAL_LAUNCHER = r"""
extern "C" void launch_quantize_spectral(unsigned gx, unsigned bx, unsigned long long smem, const u16* x, int H, int T,
                                         long long rows, int rank, float il, u8* codes, float* sc, float* zr, int cap,
                                         const int* orow, const int* ooff) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem,
             [&] { quantize_spectral(x, H, T, rows, rank, il, codes, sc, zr, cap, orow, ooff); });
}
"""
DEQUANTIZE_LAUNCHER = r"""
#ifndef TURBO
extern "C" void launch_dequantize(unsigned gx, unsigned bx, unsigned long long smem, const u8* codes,
                                  const param_t* sc, const param_t* zr, const float* nrm, int H, int cap,
                                  const int* rows, int start, int n, long long total, u16* out, long long sb,
                                  long long sh, long long st, float l0, float l1, float l2, float l3) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem,
             [&] { dequantize(codes, sc, zr, nrm, H, cap, rows, start, n, total, out, sb, sh, st, l0, l1, l2, l3); });
}
#else
extern "C" void launch_dequantize_turboquant(unsigned gx, unsigned bx, unsigned long long smem, const u8* codes,
                                             const u16* nrm, const float* signs, int H, int cap, const int* rows,
                                             int start, int n, long long total_rows, float l0, float l1, float l2,
                                             float l3, float isd, u16* out, long long sb, long long sh,
                                             long long st) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] {
    dequantize_turboquant(codes, nrm, signs, H, cap, rows, start, n, total_rows, l0, l1, l2, l3, isd, out, sb, sh,
                          st);
  });
}
#endif
"""
KEPT_TOKENS_LAUNCHER = r"""
extern "C" void launch_write_kept(unsigned gx, unsigned bx, unsigned long long smem, const u16* slots,
                                  const int* slot_pos, int H, int S, const int* rows, long long start, int n, u16* out,
                                  long long sb, long long sh, long long st) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { write_kept(slots, slot_pos, H, S, rows, start, n, out, sb, sh, st); });
}
extern "C" void launch_stage_kept(unsigned gx, unsigned bx, unsigned long long smem, const u16* k, long long kb,
                                  long long kh, long long kt, const u16* v, long long vb, long long vh, long long vt,
                                  int H, const long long* rows, long long start, int n, const long long* positions,
                                  long long prow, int m, int K, u16* sk, u16* sv, int* sp, int S, int* skip, int W) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] {
    stage_kept(k, kb, kh, kt, v, vb, vh, vt, H, rows, start, n, positions, prow, m, K, sk, sv, sp, S, skip, W);
  });
}
"""
OTT_POOL_LAUNCHERS = r"""
extern "C" void launch_ott_candidates(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned long long smem,
                                      const u16* k, u16* filled, int H, int T, int m, int* cand) {
  emu_launch({gx, gy, gz}, {bx, 1, 1}, smem, [&] { ott_candidates(k, filled, H, T, m, cand); });
}
extern "C" void launch_ott_admit(unsigned gx, unsigned bx, unsigned long long smem, const u16* k, const u16* v,
                                 u16* filled, int H, int T, int m, const int* cand, const long long* rows,
                                 long long start, long long* pool, int PS, u16* sk, u16* sv, int* sp, int S,
                                 int* skip, int W) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] {
    ott_admit(k, v, filled, H, T, m, cand, rows, start, pool, PS, sk, sv, sp, S, skip, W);
  });
}
"""
ROTATEKV_KEYS_LAUNCHER = r"""
extern "C" void launch_rotatekv_dequantize(unsigned gx, unsigned bx, unsigned long long smem, const u8* codes,
                                           const u16* sc, const u16* zr, const short* zi, const float2* rope, int H,
                                           int cap, const int* rows, int start, int n, long long tasks, float isg,
                                           u16* out, long long sb, long long sh, long long st) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] {
    rotatekv_dequantize(codes, sc, zr, zi, rope, H, cap, rows, start, n, tasks, isg, out, sb, sh, st);
  });
}
extern "C" void launch_rotatekv_quantize(unsigned gx, unsigned bx, unsigned long long smem, const u16* k,
                                         const float2* rope, const short* zi, int T, long long tokens, float isg,
                                         float clip, float il, u8* codes, u16* sc, u16* zr, int cap, const int* orow,
                                         const int* ooff) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] {
    rotatekv_quantize(k, rope, zi, T, tokens, isg, clip, il, codes, sc, zr, cap, orow, ooff);
  });
}
"""
#: kernels launched over a 3-D grid (the others take grid.x only)
GRID_3D = ("decode_attention", "combine", "rotatekv_scores", "ott_candidates")


def kernel_host_source(name: str, launchers: str) -> str:
    """kernels/<name> as host C++ for tests/cuda_emu.h (as test_kernels._host_source does quantize.cu: common.cuh
    inlined with its tensor-core helper emulated, test_kernels.COMMON_HELPERS), with ``launchers`` appended."""
    from test_kernels import _ASM, KERNELS, common_host_source

    text = (KERNELS / name).read_text()
    text = text.replace('#include "common.cuh"', common_host_source())
    text = text.replace("extern __shared__ __align__(16) unsigned char smem[];", "unsigned char* smem = emu_smem();")
    text = _ASM.sub(lambda m: f"{m.group(2)} = emu_{m.group(1).replace('.', '_')}("
                              f"{', '.join(a for a in m.group(3, 4) if a)});", text)
    assert "asm(" not in text and "__shared__" not in text, "a PTX statement or shared array the emulator lacks"
    return '#include "cuda_emu.h"\n' + text + launchers


#: the CuPy cache's other launches (tests/test_cupy_cache_emulated.py): the window append, the step's in-step
#: flushes, the prefill's key rotation and OSCAR's decode-step rotation
CACHE_LAUNCHERS = r"""
extern "C" void launch_append_residual(unsigned gx, unsigned bx, unsigned long long smem, const u16* k, const u16* v,
                                       u16* kr, u16* vr, int* n_res, const int* live, int H, int rcap, int rotate,
                                       float isd) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { append_residual(k, v, kr, vr, n_res, live, H, rcap, rotate, isd); });
}
extern "C" void launch_finish_step(unsigned gx, unsigned bx, unsigned long long smem, u16* kw, const u16* kr,
                                   u16* vw, const u16* vr, int* counts, int B, int H, int rcap, int stage, int first,
                                   int R) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { finish_step(kw, kr, vw, vr, counts, B, H, rcap, stage, first, R); });
}
extern "C" void launch_hadamard_rows(unsigned gx, unsigned bx, unsigned long long smem, const u16* x, u16* y,
                                     long long rows, float isd) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { hadamard_rows(x, y, rows, isd); });
}
extern "C" void launch_rotate_rows(unsigned gx, unsigned bx, unsigned long long smem, const u16* x, const float* r,
                                   u16* y, long long rows) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { rotate_rows(x, r, y, rows); });
}
"""


@pytest.fixture(scope="module")
def emulator_libraries():
    """source file -> (defines -> ctypes library with a launch_<kernel> function per kernel)."""
    from test_decode_emulated import _host_source as decode_host_source

    return {"quantize.cu": emulator_builder(quantize_host_source() + QUANT_LAUNCHERS + CACHE_LAUNCHERS),
            "decode_attention.cu": emulator_builder(decode_host_source(wrapper=DECODE_LAUNCHERS)),
            "rotatekv.cu": emulator_builder(kernel_host_source("rotatekv.cu", ROTATEKV_LAUNCHER)),
            "spectral_quantize.cu": emulator_builder(kernel_host_source("spectral_quantize.cu", SPECTRAL_LAUNCHER)),
            "dequantize.cu": emulator_builder(kernel_host_source("dequantize.cu", DEQUANTIZE_LAUNCHER)),
            "rotatekv_keys.cu": emulator_builder(kernel_host_source("rotatekv_keys.cu", ROTATEKV_KEYS_LAUNCHER)),
            "ott_pool.cu": emulator_builder(kernel_host_source("ott_pool.cu", OTT_POOL_LAUNCHERS)),
            "kept_tokens.cu": emulator_builder(kernel_host_source("kept_tokens.cu", KEPT_TOKENS_LAUNCHER))}


def _c_arg(a):
    if isinstance(a, torch.Tensor):
        return ctypes.c_void_p(a.data_ptr())
    if isinstance(a, np.uint64):  # a null pointer (the launchers' "no rows / offsets")
        return ctypes.c_void_p(int(a) or None)
    return {np.int32: ctypes.c_int, np.int64: ctypes.c_longlong, np.float32: ctypes.c_float}[type(a)](a)


@pytest.fixture
def emulated_ops(emulator_libraries, monkeypatch):
    """kernels.ops with every launch run on the CPU emulator (CPU tensors, 4 multiprocessors): the launchers'
    argument lists, #defines, grids and shared-memory sizes are what the GPU runs."""
    def launch(source, name, defines, grid, block, args, device, smem=0):
        lib = emulator_libraries[source](**defines)
        grid = tuple(grid) + (1, 1)
        dims = grid[:3] if name in GRID_3D else grid[:1]
        getattr(lib, f"launch_{name}")(*map(ctypes.c_uint, dims), ctypes.c_uint(block[0]), ctypes.c_ulonglong(smem),
                                       *map(_c_arg, args))

    monkeypatch.setattr(runtime, "launch", launch)
    monkeypatch.setattr(runtime, "device_index", lambda device: 0)
    monkeypatch.setattr(runtime, "multiprocessors", lambda index: 4)
    check = runtime.check_input
    monkeypatch.setattr(runtime, "check_input", lambda x, name, dims=None: check(_OnDevice(x), name, dims))
    return ops


class _OnDevice:
    """A CPU tensor that passes kernels.runtime.check_input's device test (everything else is the tensor's)."""

    def __init__(self, x):
        self._x = x

    is_cuda = True

    def __getattr__(self, name):
        return getattr(self._x, name)


# ----------------------------------------------------------------------------- decode attention

DECODE_CASES = [
    # method, lengths (packed, per sequence), residuals, hq, hkv, d, k_bits, v_bits, G, (splits, tokens per split),
    # dtype, options
    # 4 query heads per KV head, an empty sequence and empty splits; bf16 and fp16
    ("kivi", [32 * 6, 32 * 3, 0], [17, 1, 9], 8, 2, 128, 2, 2, 32, (3, 64), torch.bfloat16, {}),
    ("kivi", [32 * 6, 32 * 3, 0], [17, 1, 9], 8, 2, 128, 2, 2, 32, (3, 64), torch.float16, {}),
    # head_dim 64 with 3 heads per KV head; head_dim 256, 4-bit, 8 heads, KIVI's int-zero switch
    ("kivi", [64 * 3, 32], [0, 40], 6, 2, 64, 2, 2, 32, (2, 128), torch.bfloat16, {}),
    ("kivi", [32 * 3], [31], 8, 1, 256, 4, 4, 32, (2, 64), torch.float16, dict(zero_point="int")),
    ("quarot", [32 * 6, 32 * 3, 0], [17, 1, 9], 8, 2, 128, 2, 2, 32, (3, 64), torch.bfloat16, dict(clip_ratio=0.9)),
    ("quarot", [32 * 5, 32], [3, 30], 6, 2, 64, 2, 4, 16, (2, 96), torch.float16, {}),
    ("quarot", [32 * 3], [31], 8, 1, 256, 4, 4, 64, (2, 64), torch.bfloat16, dict(zero_point="float")),
    ("turboquant", [32 * 6, 32 * 3, 0], [17, 1, 9], 8, 2, 128, 2, 2, 32, (3, 64), torch.bfloat16, {}),
    ("turboquant", [32 * 6, 32 * 3, 0], [17, 1, 9], 8, 2, 128, 2, 2, 32, (3, 64), torch.float16, {}),
    ("turboquant", [32 * 4], [5], 8, 1, 256, 2, 2, 64, (2, 64), torch.bfloat16, dict(seed=1)),
    ("turboquant", [32 * 3, 32], [40, 0], 3, 1, 64, 2, 2, 32, (2, 64), torch.float16, {}),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-d{c[5]}-hpg{c[3] // c[4]}-{str(c[10])[6:]}")
def test_decode_attention_emulated_matches_reference(emulated_ops, case):
    """ops.decode_attention (METHOD = kivi, quarot, turboquant) lane by lane against kernels.reference: error within
    2x the plain torch path's plus a small tolerance, per sequence; partials and output poisoned with NaN first."""
    method, lengths, residuals, hq, hkv, d, kb, vb, g, splits, dtype, options = case
    rcap = max(32, max(residuals))
    store, ref_store, k_res, v_res, counts, kernel_kwargs, ref_kwargs = make_method_cache(
        method, lengths, residuals, hkv, d, kb, vb, g, rcap, dtype, data_seed=sum(lengths) + d, device="cpu", **options)
    q = real_looking(len(lengths), hq, 1, d, dtype, seed=7, device="cpu") * 2.0
    out = emulated_ops.decode_attention(q, *store, k_res, v_res, *counts, splits=splits,
                                        out=torch.full_like(q, float("nan")), poison=True, **kernel_kwargs)
    assert_close_to_reference(out, *reference_errors(method, q, ref_store, k_res, v_res, counts, ref_kwargs))


def _wave_possible(stages: int, wave: int) -> bool:
    """Whether some split length gives between ``wave`` and MAX_SPLITS splits of ``stages`` stages (by search)."""
    return wave <= 1 or any(wave <= math.ceil(stages / p) <= ops.MAX_SPLITS for p in range(1, stages + 1))


@pytest.mark.parametrize("heads, head_dim, dtype", [(5, 64, torch.bfloat16), (20, 128, torch.float16)],
                         ids=["5-heads", "20-heads-strided-over-16-warps"])
def test_append_residual_writes_the_token_and_advances_live_counts_emulated(emulated_ops, heads, head_dim, dtype):
    """A decode token into the windows at each sequence's n_res (keys rotated as ops.hadamard, values copied, nothing
    else written: windows poisoned), and with ``live`` n_res advanced in the same launch: by 1, by 0 for a released
    row; without it left as it was."""
    b, rcap = 3, 16
    k = real_looking(b, heads, 1, head_dim, dtype, seed=head_dim, device="cpu")
    v = real_looking(b, heads, 1, head_dim, dtype, seed=7, device="cpu")
    for live in (torch.tensor([1, 0, 1], dtype=torch.int32), None):
        kr = torch.full((b, heads, rcap, head_dim), float("nan"), dtype=dtype)
        vr = torch.full_like(kr, float("nan"))
        n_res = torch.tensor([0, 7, 15], dtype=torch.int32)
        at = n_res.clone()
        emulated_ops.append_residual(k, v, kr, vr, n_res, live)
        for i, pos in enumerate(at.tolist()):
            assert torch.equal(kr[i, :, pos], emulated_ops.hadamard(k)[i, :, 0])
            assert torch.equal(vr[i, :, pos], v[i, :, 0])
        written = torch.zeros(b, rcap, dtype=torch.bool)
        written[torch.arange(b), at.long()] = True
        assert kr.isnan().all(-1).all(1).eq(~written).all() and vr.isnan().all(-1).all(1).eq(~written).all()
        assert torch.equal(n_res, at + (0 if live is None else live))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotate_rows_emulated_matches_torch(emulated_ops, d, dtype):
    """ops.rotate_rows (OSCAR's decode-step rotation: fp32 sums in channel order, one rounding) on 37 rows, not a
    multiple of a block's ROTATE_ROWS, of real-looking x [1, 37, 1, D] times a random orthogonal matrix: as close to
    the fp64 product as torch's (x.float() @ R).to(dtype) and nearly always equal to it
    (test_kernels.assert_rotation_close); ``out`` poisoned with NaN bits first."""
    from test_kernels import assert_rotation_close, random_rotation

    from kernels.quantizers import ROTATE_ROWS

    assert 37 % ROTATE_ROWS
    x = real_looking(1, 1, 37, d, dtype, seed=d, device="cpu").view(1, 37, 1, d)
    matrix = random_rotation(d, seed=d)
    out = torch.empty_like(x)
    out.view(torch.int16).fill_(-1)
    assert ops.rotate_rows(x, matrix, out=out) is out
    assert_rotation_close(out, x, matrix)


def test_spectral_decode_token_is_rotated_by_the_kernel_emulated(emulated_ops):
    """OSCAR's variant rotates a decode token [B, H, 1, D] by ops.rotate_rows where the kernels take it (here: the
    emulator's 16-bit tensors), and by the method's torch transform_key otherwise (fp32)."""
    from test_cupy_cache_emulated import prepared_method
    from test_kernels import assert_rotation_close

    from kernels.variant import KERNELS

    method, variant = prepared_method("spectral", {}, 2, 64, "cpu"), KERNELS["spectral"]
    assert variant.transforms
    for dtype in (torch.bfloat16, torch.float16):
        x = real_looking(1, 1, 12, 64, dtype, seed=11, device="cpu").view(3, 4, 1, 64)
        got = variant.transform_token(method, x, 0)
        assert torch.equal(got, ops.rotate_rows(x, method.key_rotation(0)))
        assert_rotation_close(got, x, method.key_rotation(0))
    x = torch.randn(3, 4, 1, 64)
    assert torch.equal(variant.transform_token(method, x, 0), method.transform_key(x, 0))


@pytest.mark.parametrize("sms", [4, 108, 132])
def test_split_plan_fills_a_wave_where_the_context_allows(sms):
    """kernels.plans.split_tokens on ``sms`` multiprocessors: whole stages per split, every split holding tokens of
    the longest row, at most MAX_SPLITS; a grid of at least one wave (MIN_BLOCKS one-warp blocks per multiprocessor)
    wherever some split length gives one, else the most splits there are; splits of MIN_GROUPS_PER_SPLIT stages or
    more wherever those fill the wave."""
    for stage in (16, 32):
        for rows in (1, 2, 8, 24, 64):  # batch x KV heads
            for tokens in (0, 1, 31, 33, 100, 1000, 4096, 8191, 32768, 32896, 131072):
                splits, tps = ops.split_tokens(tokens, rows, 1, stage, sms)
                n, what = max(tokens, 1), (stage, rows, tokens)
                assert tps % stage == 0 and 1 <= splits <= ops.MAX_SPLITS, what
                assert (splits - 1) * tps < n <= splits * tps, what
                stages, wave = math.ceil(n / stage), math.ceil(sms * ops.MIN_BLOCKS / rows)
                if _wave_possible(stages, wave):
                    assert splits * rows >= sms * ops.MIN_BLOCKS, what
                else:
                    assert splits == min(stages, math.ceil(stages / math.ceil(stages / ops.MAX_SPLITS))), what
                if math.ceil(stages / ops.MIN_GROUPS_PER_SPLIT) >= wave:
                    assert tps >= ops.MIN_GROUPS_PER_SPLIT * stage, what


def test_split_plan_of_the_measured_shapes():
    """On 132 multiprocessors (H100, H200), 8 KV heads, G = 32: batch 1 at 32K splits twice as finely as the 8-group
    floor did (2,048 one-warp blocks, not 1,024; a full wave needs more splits than the combine takes), a 4K context
    runs over 1,024 blocks (not 128); the shapes of the kernel question's tuning sweep (results/efficiency/kernel.csv)
    keep their plans."""
    assert ops.split_tokens(32768, 1, 8, 32) == (256, 128)
    assert ops.split_tokens(4096, 1, 8, 32) == (128, 32)
    assert ops.split_tokens(131072, 1, 8, 32) == (256, 512)
    assert ops.split_tokens(131072, 8, 8, 32) == (98, 1344)
    assert ops.split_tokens(32768, 4, 8, 32) == (128, 256)


def test_decode_attention_plan_equals_one_split_emulated(emulated_ops):
    """decode_attention with its own split plan (4 emulated multiprocessors: a wave of 64 blocks, one 32-token stage a
    split for rows of 8 stages) is as close to the fp64 reference as the same attention in one split per row (both
    within 2x the plain torch path's error: the splits' probabilities round to the dtype at their own maxima, so the
    two differ in the last bits), and within a few dtype ulps of it; partials poisoned, so a split that wrote
    nothing would show."""
    lengths, hkv, hq, d, g, dtype = [32 * 8, 32 * 5], 2, 4, 64, 32, torch.bfloat16
    store, ref_store, k_res, v_res, counts, kwargs, ref_kwargs = make_method_cache(
        "kivi", lengths, [9, 3], hkv, d, 2, 2, g, 32, dtype, data_seed=5, device="cpu")
    q = real_looking(len(lengths), hq, 1, d, dtype, seed=6, device="cpu") * 2.0
    assert ops.split_tokens(max(lengths), len(lengths), hkv, g, 4)[0] == 8
    planned = ops.decode_attention(q, *store, k_res, v_res, *counts, poison=True, **kwargs)
    single = ops.decode_attention(q, *store, k_res, v_res, *counts, splits=(1, max(lengths)), poison=True, **kwargs)
    references = reference_errors("kivi", q, ref_store, k_res, v_res, counts, ref_kwargs)
    assert_close_to_reference(planned, *references)
    assert_close_to_reference(single, *references)
    torch.testing.assert_close(planned, single, rtol=0, atol=4 * 2**-8 * float(single.abs().max()))


@pytest.mark.parametrize("method, dtype", [("kivi", torch.float16), ("quarot", torch.bfloat16),
                                           ("turboquant", torch.float16)])
def test_kernel_quantizers_feed_decode_attention_emulated(emulated_ops, method, dtype):
    """The cache's path through kernels.ops on the emulator: K/V quantized by the kernels into storage (decode
    layouts, two chunks per sequence at token offsets), attended by decode_attention."""
    quantize_then_decode(method, dtype, "cpu", lengths=[32 * 4, 32 * 3], residuals=[20, 3], hkv=2, hq=6)


@pytest.mark.parametrize("method", ["oscar", "kivi", "quarot", "turboquant"])
def test_kernel_question_cache_and_call(emulated_ops, method):
    """The kernel question's cache (benchmarks/kernel.py) and decode call run (on the emulator) and its byte floor counts
    the real stored bytes: codes, scales and zeros (or TurboQuant+'s fp16 norms), OScaR's fp32 token norms."""
    from benchmarks.kernel import decode_call, method_cache, stored_bytes

    b, t, hkv, d, g, bits = 2, 64, 2, 128, 32, 2
    cache = method_cache(method, bits, b, t, dtype=torch.bfloat16, device="cpu", hkv=hkv, d=d, g=g, residual=5)
    q = torch.randn(b, 4 * hkv, 1, d).to(torch.bfloat16)
    out = decode_call(cache, q)()
    assert out.shape == q.shape and torch.isfinite(out).all()
    params = 2 * (d // g) * 2 if method == "turboquant" else 2 * 2 * (d // g) * 2  # per token and head, K and V
    per_token = hkv * (2 * d * bits // 8 + params) + (4 if method == "oscar" else 0)
    assert stored_bytes(cache) == b * t * per_token


def test_launchers_refuse_what_the_kernels_do_not_implement(emulated_ops):
    """Clear errors before any launch: unknown method, TurboQuant+ without its constants or a non-symmetric codebook,
    storage not in whole stages, a clip ratio out of range, key groups that split a k-step."""
    q = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    keys, values = ops.empty_storage("quarot", 1, 1, 48, 128, k_bits=2, v_bits=2, group_size=32,
                                     dtype=torch.bfloat16, device="cpu")
    res = torch.zeros(1, 1, 16, 128, dtype=torch.bfloat16)
    counts = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    common = dict(k_bits=2, v_bits=2, group_size=32, scaling=0.1)
    with pytest.raises(ValueError, match="decode_attention has kernels for"):
        ops.decode_attention(q, keys, values, res, res, *counts, method="fp16", **common)
    with pytest.raises(ValueError, match="multiple of the 32-token stages"):
        ops.decode_attention(q, keys, values, res, res, *counts, method="quarot", **common)
    with pytest.raises(ValueError, match="needs signs and codebook"):
        ops.decode_attention(q, keys, values, res, res, *counts, method="turboquant", **common)
    with pytest.raises(ValueError, match="symmetric 4-level codebook"):
        ops.codebook_terms([-1.5, -0.4, 0.5, 1.5])
    x = torch.zeros(1, 1, 16, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="clip_ratio"):
        ops.quantize_values(x, 2, 32, clip_ratio=1.5)
    with pytest.raises(ValueError, match="whole 16-channel k-steps"):
        ops.quantize_token_keys(x, 4, 8, decode_layout=True)
    with pytest.raises(ValueError, match="zero_point"):
        ops.quantize_channel_keys(torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16), 2, 32, zero_point="min")
    rotation, token = torch.eye(128), q[:, :1]
    for x, matrix, out, message in (
            (token.float(), rotation, None, "bfloat16 or float16"),
            (token[..., :96], rotation[:96, :96], None, "head_dim 96"),
            (token, rotation[:64, :64], None, r"float32 \[128, 128\] tensor"),
            (token, rotation.double(), None, r"float32 \[128, 128\] tensor"),
            (token, rotation.to("meta"), None, "on cpu"),
            (token, rotation, torch.empty_like(token, dtype=torch.float16), "out must be a contiguous")):
        with pytest.raises(ValueError, match=message):
            ops.rotate_rows(x, matrix, out=out)
