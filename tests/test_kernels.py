"""CuPy kernels against their torch references.

CPU (always, unless nvcc is missing): every kernels/*.cu compiles with nvcc for sm_90 under the #define
sets the launchers use, so a syntax error cannot land (the default run: every set to PTX, the front end, and the
first set to an object; ``-m slow``: every set to an object, ptxas and the host compiler included). GPU (marked
``gpu``, skipped without CUDA and CuPy; run with ``pytest -m gpu tests/test_kernels.py``): each kernel on fresh random and real-looking
inputs (channel outliers, a low-norm first token), outputs poisoned before launch, several shapes with
odd lengths and batch > 1: Hadamard and packed bytes equal to the reference's; attention error against
an fp32 reference within 2x the plain torch path's error (same dtype) plus a small tolerance.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

import pytest
import torch

from kernels import ops
from kernels.reference import oscar_decode
from methods.oscar import token_norm
from oscar import build_method
from oscar.paths import REPO_ROOT
from oscar.quant import PackedTensor, dequantize_groups, hadamard, quantize_groups

KERNELS = REPO_ROOT / "kernels"
#: relative error the kernel may add on top of 2x the torch path's (bf16 operands inside the kernel)
ATTENTION_TOL = 2e-3


def _compile_sets(source: str) -> list[dict]:
    if source == "quantize.cu":
        return [dict(HEAD_DIM=d, BITS=b, GROUP=g, IS_BF16=bf, HEADS=h, WPH=w, KMINB=mb, MODE=m, DECODE_LAYOUT=dl)
                for d, b, g, bf, h, w, mb, m, dl in [
                    (64, 2, 32, 1, 8, 1, 1, 0, 0), (128, 4, 32, 0, 8, 1, 2, 0, 1), (256, 2, 32, 0, 4, 2, 1, 1, 0),
                    (128, 2, 32, 1, 8, 1, 1, 2, 1), (128, 2, 64, 1, 2, 2, 1, 0, 1), (64, 4, 8, 0, 8, 1, 1, 0, 0)]] + [
            # KIVI's keys and values (float zero), QuaRot's keys (rotation, clip, per-token key layout)
            dict(HEAD_DIM=128, BITS=2, GROUP=32, IS_BF16=1, HEADS=8, WPH=1, KEY_NORM=0, ZERO_FLOAT=1, DECODE_LAYOUT=1),
            dict(HEAD_DIM=64, BITS=4, GROUP=16, IS_BF16=0, ROTATE_TOKENS=1, DECODE_LAYOUT=2, CLIP_BITS=1064514355),
            # TurboQuant+'s quantizer (with the value kernel's default #defines)
            dict(HEAD_DIM=256, BITS=2, GROUP=32, IS_BF16=1, TURBO=1, DECODE_LAYOUT=2)]
    if source == "decode_attention.cu":
        return [dict(HEAD_DIM=d, K_BITS=kb, V_BITS=vb, GROUP=g, HPG=hpg, IS_BF16=bf)
                for d, kb, vb, g, hpg, bf in [(128, 2, 2, 32, 4, 1), (64, 2, 2, 32, 3, 1), (256, 4, 4, 32, 8, 0),
                                              (128, 4, 2, 64, 1, 0)]] + [dict(MODE=1), dict(MODE=2)] + [
            dict(NSTAGE=2, MIN_BLOCKS=24), dict(NSTAGE=3, MIN_BLOCKS=16, HPG=2)] + [
            # the baselines' variants (kernels.ops.METHODS): KIVI, QuaRot (float-zero switch), TurboQuant+
            dict(METHOD=1, HEAD_DIM=128, HPG=4, IS_BF16=1), dict(METHOD=1, HEAD_DIM=256, K_BITS=4, V_BITS=4, GROUP=16),
            dict(METHOD=2, HEAD_DIM=64, HPG=3, IS_BF16=0), dict(METHOD=2, ZERO_FLOAT=1, MODE=2),
            dict(METHOD=3, HEAD_DIM=256, HPG=8, IS_BF16=1), dict(METHOD=3, IS_BF16=0, MODE=1)] + [
            # OTT (KIVI + exact tokens), OSCAR (fp32 parameters, exact tokens), RotateKV (ready logits)
            dict(METHOD=1, EXACT=1, GROUP=64, K_BITS=4, MODE=1), dict(METHOD=4, EXACT=1, GROUP=128, HPG=4),
            dict(METHOD=4, EXACT=1, HEAD_DIM=256, GROUP=128, K_BITS=4, V_BITS=4, HPG=8, IS_BF16=0, MODE=2),
            dict(METHOD=5, EXACT=1, HEAD_DIM=64, HPG=3, IS_BF16=0, MODE=1)]
    if source == "spectral_quantize.cu":
        return [dict(HEAD_DIM=128, BITS=2, GROUP=128, IS_BF16=1, DECODE_LAYOUT=2),
                dict(HEAD_DIM=256, BITS=4, GROUP=128, IS_BF16=0, DECODE_LAYOUT=1)]
    if source == "dequantize.cu":  # OScaR's keys, KIVI's (float zero), value tiles, QuaRot's keys, TurboQuant+
        return [dict(HEAD_DIM=128, BITS=2, GROUP=32, IS_BF16=1, LAYOUT=0, KEY_NORM=1),
                dict(HEAD_DIM=256, BITS=4, GROUP=64, IS_BF16=0, LAYOUT=0, ZERO_FLOAT=1),
                dict(HEAD_DIM=64, BITS=2, GROUP=16, IS_BF16=1, LAYOUT=1, ZERO_FLOAT=1),
                dict(HEAD_DIM=128, BITS=4, GROUP=128, IS_BF16=0, LAYOUT=2),
                dict(HEAD_DIM=256, BITS=2, GROUP=32, IS_BF16=1, LAYOUT=2, TURBO=1),  # TurboQuant+'s keys
                dict(HEAD_DIM=64, BITS=2, GROUP=32, IS_BF16=0, LAYOUT=1, TURBO=1),  # ... and values
                # OSCAR's fp32 parameters: its keys, its Lloyd-Max values
                dict(HEAD_DIM=128, BITS=4, GROUP=128, IS_BF16=1, LAYOUT=2, ZERO_FLOAT=1, PARAM32=1),
                dict(HEAD_DIM=64, BITS=2, GROUP=64, IS_BF16=0, LAYOUT=1, ZERO_FLOAT=1, PARAM32=1, LEVEL_TABLE=1)]
    if source == "rotatekv_keys.cu":
        return [dict(HEAD_DIM=d, BITS=b, GROUP=g, HEAD_GROUP=hg, HKV=h, IS_BF16=bf)
                for d, b, g, hg, h, bf in [(128, 2, 32, 4, 8, 1), (64, 4, 16, 1, 3, 0), (256, 2, 64, 8, 8, 0),
                                           (128, 2, 32, 2, 32, 1)]]
    if source == "rotatekv.cu":
        return [dict(HEAD_DIM=d, K_BITS=kb, GROUP=g, HEAD_GROUP=hg, HKV=h, HPG=hpg, IS_BF16=bf)
                for d, kb, g, hg, h, hpg, bf in [(128, 2, 32, 4, 8, 4, 1), (256, 4, 64, 2, 2, 8, 0)]]
    return [{}]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("whole", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ptx", "objects"])
@pytest.mark.parametrize("source", sorted(p.name for p in KERNELS.glob("*.cu")))
def test_cu_compiles_with_nvcc(source, whole, tmp_path):
    """Every #define set compiles without a warning: to PTX (the CUDA front end: every syntax and type error), the
    first set (and with ``whole`` every set) to an object file (ptxas, the host code)."""
    for i, defines in enumerate(_compile_sets(source)):
        flags = [f"-D{k}={v}" for k, v in defines.items()]
        stage = ["-c", "-o", str(tmp_path / "k.o")] if whole or i == 0 else ["-ptx", "-o", str(tmp_path / "k.ptx")]
        cmd = ["nvcc", "-arch=sm_90", "-std=c++17", f"-I{KERNELS}", *stage, str(KERNELS / source), *flags]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
        assert "warning" not in result.stderr.lower(), result.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_clip_products_are_rounded_before_the_span(tmp_path):
    """QuaRot's clipped min and max are rounded products as torch's ``amin * clip_ratio``: emitted as mul.rn, which
    ptxas never fuses. A plain mul let ptxas compute max * clip - min * clip as one FMA, and a stored value scale
    came out one dtype ulp from the torch path's now and then (QuaRot, clip 0.9, head_dim 256, on the H200)."""
    clip_bits = int(np.float32(0.9).view(np.uint32))
    ptx = tmp_path / "quantize.ptx"
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "-O3", f"-I{KERNELS}", "-ptx", str(KERNELS / "quantize.cu"), "-o",
           str(ptx), "-DHEAD_DIM=256", "-DBITS=2", "-DGROUP=32", "-DIS_BF16=0", "-DDECODE_LAYOUT=1",
           f"-DCLIP_BITS={clip_bits}"]
    subprocess.run(cmd, check=True, capture_output=True)
    body = ptx.read_text().split(".entry quantize_values", 1)[1].split("\n}", 1)[0]
    register = re.search(r"mov\.f32\s+(%f\d+), 0f3F666666;", body)
    constant = register.group(1) if register else "0f3F666666"
    uses = [line.split()[0] for line in body.splitlines() if re.search(rf"{re.escape(constant)}\b", line)
            and not line.lstrip().startswith("mov")]
    assert uses == ["mul.rn.f32", "mul.rn.f32"], uses


def test_cupy_backend_refuses_what_the_kernels_do_not_implement():
    """Checked before any model is loaded (runner and KVModel call it): the configurations the kernels implement
    pass (OScaR, KIVI, QuaRot, TurboQuant+ at 2 or 4 bits, both zero points, any clip ratio, both flush policies for
    the baselines; OTT, RotateKV and OSCAR with their exact tokens, every flush policy they take, OSCAR's uniform and
    released Lloyd-Max codebooks); the others are refused naming what is missing."""
    from kernels.backend import check_method

    for name, options in (("oscar", dict(k_bits=2, v_bits=2, group_size=32, residual_length=128)),
                          ("oscar", dict(k_bits=4, v_bits=4, group_size=64, residual_length=128)),
                          ("kivi", {}),
                          ("kivi", dict(zero_point="int", flush="block", k_bits=4, v_bits=4, group_size=16)),
                          ("quarot", dict(clip_ratio=0.9, zero_point="float", residual_length=0, flush="block")),
                          ("quarot", dict(k_bits=4, v_bits=4, group_size=16)),
                          ("turboquant", dict(group_size=64, residual_length=96)),
                          ("ott", {}), ("ott", dict(scope="token", keep_values=False, flush="block")),
                          ("rotatekv", dict(reorder=False)), ("rotatekv", dict(reorder=False, flush="window")),
                          ("spectral", {}), ("spectral", dict(codebook="lloyd_max", flush="kivi"))):
        check_method(build_method(name, **options))
    for method, reason in ((build_method("spectral", residual_length=16), "residual_length=16"),
                           (build_method("rotatekv", reorder_first=True), "reorder_first=true"),
                           (build_method("rotatekv", residual_length=16), "residual_length=16 with flush=kivi"),
                           (build_method("spectral", codebook="lloyd_max", lloyd_max_levels="exact"),
                            "lloyd_max_levels=exact"),
                           (build_method("quarot", flush="window"), "flush=window"),
                           (build_method("oscar", group_size=256, residual_length=256), "group_size=256"),
                           (build_method("oscar", group_size=16, v_bits=2), "group_size=16"),
                           (build_method("oscar", flush="kivi"), "flush=kivi"),
                           (build_method("oscar", rotate=False), "ablation"),
                           (build_method("kivi", k_bits=3), r"k_bits=3, v_bits=2 \(the kernels pack 2 or 4 bits\)"),
                           (build_method("kivi", v_bits=8), "v_bits=8"),
                           (build_method("kivi", group_size=48, residual_length=96), "group_size=48"),
                           (build_method("quarot", group_size=8), "group_size=8"),
                           (build_method("quarot", k_bits=16), "k_bits=16"),
                           (build_method("turboquant", k_bits=4, v_bits=4), r"the kernels pack 2 bits"),
                           (build_method("turboquant", group_size=16), "group_size=16"),
                           (build_method("quarot", residual_length=0), r"residual_length=0 with flush=kivi \(the "
                                                                       r"kernel path needs R >= 32\)"),
                           (build_method("turboquant", residual_length=16), "residual_length=16 with flush=kivi")):
        with pytest.raises(ValueError, match=reason):
            check_method(method)


# ----------------------------------------------------------------------------- CPU emulation

EMU_WRAPPERS = r"""
#if KEYS_OK
extern "C" void emu_keys(const u16* k, int b, int T, int rotate, float isd, float il, u8* codes, u16* sc, u16* zr,
                         float* nrm, int cap, const int* rows, const int* offs, int blocks) {
  const size_t smem = G * HEADS * 4 + HEADS * THR_WORDS * 4 + (WPH > 1 ? NWARP * 2 * 16 * KLPR * 4 : 0);
  emu_launch({(unsigned)blocks, 1, 1}, {NWARP * 32, 1, 1}, smem,
             [&] { quantize_keys(k, b, T, rotate, isd, il, codes, sc, zr, nrm, cap, rows, offs); });
}
#endif
extern "C" void emu_values(const u16* v, int b, int H, int T, float il, u8* codes, u16* sc, u16* zr, int cap,
                           const int* rows, const int* offs) {
  const long long chunks = (long long)b * H * T * D / 8, warps = (chunks + 32 * VNR - 1) / (32 * VNR);
  emu_launch({(unsigned)((warps + 7) / 8), 1, 1}, {256, 1, 1}, 0,
             [&] { quantize_values(v, H, T, chunks, il, codes, sc, zr, cap, rows, offs); });
}
extern "C" void emu_hadamard(const u16* x, u16* y, long long rows, float isd) {
  emu_launch({(unsigned)((rows + 7) / 8), 1, 1}, {256, 1, 1}, 0, [&] { hadamard_rows(x, y, rows, isd); });
}
extern "C" void emu_hadamard_step(const u16* q, u16* y, long long q_rows, u16* keys, const long long* lengths,
                                  int b, int h, long long cap, float isd) {
  emu_launch({(unsigned)((q_rows + b * h + 7) / 8), 1, 1}, {256, 1, 1}, 0,
             [&] { hadamard_step(q, y, q_rows, keys, lengths, b, h, cap, isd); });
}
"""
_ASM = re.compile(r'asm(?: volatile)?\("([a-z0-9.]+) %0, %1(?:, %2)?;"\s*:\s*"=\w"\(([^)]*)\)\s*:\s*"\w"\(([^)]*)\)'
                  r'(?:,\s*"\w"\(([^)]*)\))?\);')
#: host versions of common.cuh's helpers whose asm _ASM does not translate (the tensor-core product: several
#: in-out operands; the fp16 fma: three inputs), replacing their definitions wherever common.cuh is inlined; its other asm statements (pack2,
#: pack_half2, to_dtype, ...) become emu_ calls through _ASM
COMMON_HELPERS = {
    "mma_f16": "inline void mma_f16(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {\n"
               "  const u32 a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};\n  emu_mma(c, a, b, 16, emu_f16);\n}",
    # the fp16 product is exact in double, the sum rounded there once before fp16's (a tie may land 1 ulp off)
    "fma_half2": "inline u32 fma_half2(u32 a, u32 b, u32 c) {\n  u32 r = 0;\n  for (int i = 0; i < 2; ++i) {\n"
                 "    const auto half = [&](u32 x) { return (double)emu_f16((unsigned short)(x >> 16 * i)); };\n"
                 "    r |= (u32)emu_cvt_rn_f16_f32((float)(half(a) * half(b) + half(c))) << 16 * i;\n  }\n"
                 "  return r;\n}"}


def _replace_definition(text: str, name: str, replacement: str) -> str:
    """The definition of device function `name` (through its matching closing brace) -> replacement."""
    match = re.search(rf"^(?:template <[^>]*>\n)?__device__ __forceinline__ [^\n(]*\b{name}\(", text, re.M)
    assert match, f"{name} is not defined in the source"
    depth, i = 0, text.index("{", match.end())
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            break
        i += 1
    return text[:match.start()] + replacement + text[i + 1:]


def common_host_source() -> str:
    """kernels/common.cuh for inlining into a host source: ``#pragma once`` dropped, COMMON_HELPERS replaced."""
    text = (KERNELS / "common.cuh").read_text().replace("#pragma once", "")
    for name, replacement in COMMON_HELPERS.items():
        text = _replace_definition(text, name, replacement)
    return text


def _host_source() -> str:
    """kernels/quantize.cu as host C++ for tests/cuda_emu.h: common.cuh inlined (common_host_source), every asm
    statement a call of the emu_ function named after its opcode, dynamic shared memory from the emulator."""
    text = (KERNELS / "quantize.cu").read_text()
    text = text.replace('#include "common.cuh"', common_host_source())
    text = text.replace("extern __shared__ __align__(16) unsigned char smem[];", "unsigned char* smem = emu_smem();")
    text = _ASM.sub(lambda m: f"{m.group(2)} = emu_{m.group(1).replace('.', '_')}("
                              f"{', '.join(a for a in m.group(3, 4) if a)});", text)
    assert "asm(" not in text, "a PTX statement the emulator does not know"
    return '#include "cuda_emu.h"\n' + text + EMU_WRAPPERS


#: the emulator's compiled libraries, named by a hash of what builds them (host source, tests/cuda_emu.h, flags,
#: #defines, the compiler's version): each is built once per machine and shared by every module that needs it
EMULATOR_CACHE = Path(os.environ.get("OSCAR_EMULATOR_CACHE",
                                     Path(tempfile.gettempdir()) / f"oscar-kv-emulator-{os.getuid()}"))
EMULATOR_FLAGS = ("-O1", "-std=c++20", "-frounding-math", "-ffp-contract=off", "-fPIC", "-shared", "-w")
_EMULATOR_LIBRARIES: dict[str, ctypes.CDLL] = {}


def emulator_builder(host_source: str):
    """defines -> ctypes library of host_source (host C++ for tests/cuda_emu.h) built with g++ (memoized per #define
    set in :data:`EMULATOR_CACHE`); skips without g++."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    tests = Path(__file__).parent
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    base = "\0".join([compiler, (tests / "cuda_emu.h").read_text(), host_source, *EMULATOR_FLAGS])

    def build(**defines):
        flags = [f"-D{k}={v}" for k, v in sorted(defines.items())]
        digest = hashlib.sha256("\0".join([base, *flags]).encode()).hexdigest()[:32]
        if digest not in _EMULATOR_LIBRARIES:
            lib = EMULATOR_CACHE / f"{digest}.so"
            if not lib.exists():
                EMULATOR_CACHE.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=EMULATOR_CACHE) as work:
                    source, built = Path(work) / "host.cpp", Path(work) / "lib.so"
                    source.write_text(host_source)
                    cmd = ["g++", *EMULATOR_FLAGS, f"-I{tests}", str(source), "-o", str(built), *flags]
                    result = subprocess.run(cmd, capture_output=True, text=True)
                    assert result.returncode == 0, result.stderr
                    os.replace(built, lib)  # whole or not at all: another run may be building it too
            _EMULATOR_LIBRARIES[digest] = ctypes.CDLL(str(lib))
        return _EMULATOR_LIBRARIES[digest]
    return build


@pytest.fixture(scope="module")
def emulated():
    """defines -> ctypes library of quantize.cu built for the CPU emulator (memoized per #define set)."""
    return emulator_builder(_host_source())


def _bits16(x: np.ndarray, bf16: bool) -> np.ndarray:
    """float32 -> raw bf16/fp16 bits, round to nearest even."""
    if not bf16:
        return x.astype(np.float16).view(np.uint16)
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _float(bits: np.ndarray, bf16: bool) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32) if bf16 else bits.view(np.float16).astype(np.float32)


def _hadamard_np(x: np.ndarray, bf16: bool) -> np.ndarray:
    """oscar.quant.hadamard as CUDA torch computes it: fp32 butterflies, times fp32(1/sqrt(d)), rounded."""
    d = x.shape[-1]
    y = _float(x, bf16).reshape(-1, d)
    h = 1
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        y = np.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), axis=2)
        h *= 2
    return _bits16(y.reshape(x.shape) * (np.float32(1) / np.float32(math.sqrt(d))), bf16)


def _quantize_np(x: np.ndarray, bits: int, g: int, axis: str, bf16: bool, zero_point: str = "int",
                 clip: float = 1.0):
    """oscar.quant.quantize_groups in numpy float32 (CUDA torch semantics: a division by a Python number is a
    product with its fp32 reciprocal): codes, scale, zero."""
    b, h, t, d = x.shape
    f = _float(x, bf16)
    if axis == "channel":
        grouped = f.reshape(b, h, t // g, g, d).transpose(0, 1, 2, 4, 3)
    else:
        grouped = f.reshape(b, h, t, d // g, g)
    levels = 2**bits - 1
    lo, hi = grouped.min(-1, keepdims=True), grouped.max(-1, keepdims=True)
    if clip != 1.0:
        lo, hi = lo * np.float32(clip), hi * np.float32(clip)
    span = hi - lo
    inv_levels = np.float32(1) / np.float32(levels)
    scale = np.where(span == 0, np.where(lo == 0, np.float32(1), np.abs(lo)), span * inv_levels)
    scale = _float(_bits16(scale, bf16), bf16)
    if zero_point == "float":
        zero = _float(_bits16(lo, bf16), bf16)
        q = np.clip(np.rint((grouped - zero) / scale), 0, levels).astype(np.uint8)
    else:
        zero = _float(_bits16(np.rint(-lo / scale), bf16), bf16)
        q = np.clip(np.rint(grouped / scale) + zero, 0, levels).astype(np.uint8)
    q = q.transpose(0, 1, 2, 4, 3).reshape(b, h, t, d) if axis == "channel" else q.reshape(b, h, t, d)
    per = 8 // bits
    packed = np.zeros((b, h, t, d // per), np.uint8)
    for i in range(per):
        packed |= q[..., i::per] << (i * bits)
    return packed, _bits16(scale[..., 0], bf16), _bits16(zero[..., 0], bf16)


def _np_input(shape, bf16: bool, seed: int, lattice: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if lattice:  # multiples of 1/8: many exact rounding ties in x / scale
        return _bits16(rng.integers(-12, 13, size=shape).astype(np.float32) / 8, bf16)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., rng.permutation(shape[-1])[:4]] *= 12
    x[:, :, 0] *= 0.05
    return _bits16(x, bf16)


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("case", [
    # head_dim, bits, G, bf16, heads, warps per head, batch, tokens, blocks (fewer than groups: persistent), rotate,
    # into storage rows/offsets, decode layout
    (128, 2, 32, 1, 8, 2, 2, 96, 4, 1, False, False), (64, 4, 32, 0, 3, 1, 2, 64, 4, 0, True, True),
    (256, 2, 32, 1, 4, 4, 1, 64, 2, 1, False, True), (128, 4, 64, 0, 2, 4, 2, 128, 1, 1, True, False)])
def test_quantize_keys_emulated_bytes_equal_reference(emulated, case):
    """quantize_keys on the CPU emulator (every lane, shuffle and barrier of the CUDA code) against the numpy
    reference of OScaR.quantize_keys fed the kernel's norms (scale/zero through ops.key_decode_layout for the
    decode layout), outputs poisoned first; with storage, sequence i goes to row i + 1 at token G and row 0
    and the tokens before stay untouched."""
    d, bits, g, bf16, h, wph, b, t, blocks, rotate, storage, decode = case
    lib = emulated(HEAD_DIM=d, BITS=bits, GROUP=g, IS_BF16=bf16, HEADS=h, WPH=wph, DECODE_LAYOUT=int(decode))
    k = _np_input((b, h, t, d), bf16, seed=sum(case), lattice=not rotate)
    rows, off, cap = (np.arange(1, b + 1, dtype=np.int32), g, t + 2 * g) if storage else (None, 0, t)
    n_rows = b + 1 if storage else b
    codes = np.full((n_rows, h, cap, d * bits // 8), 0xA5, np.uint8)
    scale, zero = (np.full((n_rows, h, cap // g, d), 0xFFFF, np.uint16) for _ in range(2))
    norm = np.full((n_rows, cap), np.nan, np.float32)
    inv = lambda x: ctypes.c_float(np.float32(1) / np.float32(x))  # noqa: E731
    offs = np.full(b, off, np.int32)
    lib.emu_keys(_ptr(k), b, t, rotate, inv(math.sqrt(d)), inv(2**bits - 1), _ptr(codes), _ptr(scale), _ptr(zero),
                 _ptr(norm), cap, _ptr(rows) if storage else None, _ptr(offs) if storage else None, blocks)
    sel = (slice(1, None) if storage else slice(None), slice(None), slice(off, off + t))
    kh = _hadamard_np(k, bf16) if rotate else k
    ref_norm = np.sqrt((_float(kh, bf16).astype(np.float64) ** 2).sum(axis=(1, 3)))
    got_norm = norm[sel[0], off:off + t]
    np.testing.assert_allclose(got_norm, np.where(ref_norm == 0, 1, ref_norm), rtol=2e-6, atol=0)
    x = _bits16(_float(kh, bf16) / got_norm[:, None, :, None], bf16)
    want = _quantize_np(x, bits, g, "channel", bf16)
    if decode:
        params = dict(scale=torch.from_numpy(want[1].astype(np.int32)), zero=torch.from_numpy(want[2].astype(np.int32)))
        moved = ops.key_decode_layout(params, bits)
        assert not torch.equal(moved["scale"], params["scale"]), "the layout must move entries"
        want = (want[0], moved["scale"].numpy().astype(np.uint16), moved["zero"].numpy().astype(np.uint16))
    psel = sel[:2] + (slice(off // g, (off + t) // g),)
    for name, got, want, where in zip(("codes", "scale", "zero"), (codes, scale, zero), want, (sel, psel, psel)):
        assert np.array_equal(got[where], want), name
        if storage:
            assert (got[0] == got.flat[0]).all() and (got[1:, :, :where[2].start] == got.flat[0]).all(), name


@pytest.mark.parametrize("case", [(128, 2, 32, 1, 4, 2, 37, False), (64, 4, 8, 0, 3, 2, 9, True),
                                  (256, 2, 128, 1, 2, 1, 5, True)])
def test_quantize_values_emulated_into_storage(emulated, case):
    """quantize_values on the CPU emulator into storage rows/offsets equals the reference; the rest stays."""
    d, bits, g, bf16, h, b, t, lattice = case
    lib = emulated(HEAD_DIM=d, BITS=bits, GROUP=g, IS_BF16=bf16)
    v = _np_input((b, h, t, d), bf16, seed=sum(case[:-1]), lattice=lattice)
    cap, rows, offs = t + 5, np.arange(1, b + 1, dtype=np.int32), np.full(b, 3, np.int32)
    codes = np.full((b + 1, h, cap, d * bits // 8), 0xA5, np.uint8)
    scale, zero = (np.full((b + 1, h, cap, d // g), 0xFFFF, np.uint16) for _ in range(2))
    lib.emu_values(_ptr(v), b, h, t, ctypes.c_float(np.float32(1) / np.float32(2**bits - 1)), _ptr(codes),
                   _ptr(scale), _ptr(zero), cap, _ptr(rows), _ptr(offs))
    want = _quantize_np(v, bits, g, "token", bf16)
    for name, got, want in zip(("codes", "scale", "zero"), (codes, scale, zero), want):
        assert np.array_equal(got[1:, :, 3:3 + t], want), name
        assert (got[0] == got.flat[0]).all() and (got[1:, :, :3] == got.flat[0]).all(), f"{name} outside was written"


@pytest.mark.parametrize("case", [(128, 2, 32, 1, 4, 2, 48), (64, 4, 16, 0, 3, 2, 32), (256, 2, 128, 1, 2, 1, 16)])
def test_quantize_values_emulated_decode_layout(emulated, case):
    """With DECODE_LAYOUT the kernel writes exactly ops.value_decode_layout of the reference bytes (into storage
    at a 16-token offset); value_decode_layout(inverse=True) gives the reference back."""
    d, bits, g, bf16, h, b, t = case
    lib = emulated(HEAD_DIM=d, BITS=bits, GROUP=g, IS_BF16=bf16, DECODE_LAYOUT=1)
    v = _np_input((b, h, t, d), bf16, seed=sum(case))
    cap, rows, offs = t + 32, np.arange(1, b + 1, dtype=np.int32), np.full(b, 16, np.int32)
    codes = np.full((b + 1, h, cap, d * bits // 8), 0xA5, np.uint8)
    scale, zero = (np.full((b + 1, h, cap, d // g), 0xFFFF, np.uint16) for _ in range(2))
    lib.emu_values(_ptr(v), b, h, t, ctypes.c_float(np.float32(1) / np.float32(2**bits - 1)), _ptr(codes),
                   _ptr(scale), _ptr(zero), cap, _ptr(rows), _ptr(offs))
    ref = dict(zip(("codes", "scale", "zero"), (torch.from_numpy(x.astype(np.int32))
                                                 for x in _quantize_np(v, bits, g, "token", bf16))))
    want = ops.value_decode_layout(ref, bits, g)
    got = {name: torch.from_numpy(x[1:, :, 16:16 + t].astype(np.int32))
           for name, x in (("codes", codes), ("scale", scale), ("zero", zero))}
    for name in want:
        assert torch.equal(got[name], want[name]), name
        assert not torch.equal(want[name], ref[name]), f"{name}: the layout must move bytes"
        assert torch.equal(ops.value_decode_layout(got, bits, g, inverse=True)[name], ref[name]), name
    assert (codes[0] == 0xA5).all() and (codes[1:, :, :16] == 0xA5).all() and (codes[1:, :, 16 + t:] == 0xA5).all()
    meta = dict(bits=bits, group_size=g, axis="token", zero_point="int", layout="decode")
    with pytest.raises(ValueError, match="decode layout"):
        dequantize_groups(PackedTensor(got, (b, h, t, d), torch.bfloat16, meta))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_emulated_equals_reference(emulated, d):
    lib = emulated(HEAD_DIM=d, IS_BF16=1)
    x = _np_input((1, 1, 37, d), True, seed=d)[0, 0]
    y = np.zeros_like(x)
    lib.emu_hadamard(_ptr(x), _ptr(y), 37, ctypes.c_float(np.float32(1) / np.float32(math.sqrt(d))))
    assert np.array_equal(y, _hadamard_np(x, True))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_step_emulated_rotates_the_query_and_each_rows_new_key(emulated, d):
    """hadamard_step: the query rows as hadamard_rows gives them, and in a token-major key cache [B, cap, H, D] the
    H rows at each batch row's length rotated in place, every other entry untouched."""
    lib = emulated(HEAD_DIM=d, IS_BF16=1)
    b, hq, h, cap = 3, 6, 2, 9
    q = _np_input((1, 1, b * hq, d), True, seed=d)[0, 0]
    keys = _np_input((b, cap, h, d), True, seed=d + 1)
    before = keys.copy()
    lengths = np.array([0, 5, 8], dtype=np.int64)
    y = np.zeros_like(q)
    lib.emu_hadamard_step(_ptr(q), _ptr(y), b * hq, _ptr(keys), _ptr(lengths), b, h, cap,
                          ctypes.c_float(np.float32(1) / np.float32(math.sqrt(d))))
    assert np.array_equal(y, _hadamard_np(q, True))
    for row, n in enumerate(lengths):
        assert np.array_equal(keys[row, n], _hadamard_np(before[row, n], True))
        keys[row, n] = before[row, n]
    assert np.array_equal(keys, before)


# ----------------------------------------------------------------------------- GPU


def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and CuPy")
DTYPES = [torch.bfloat16, torch.float16]


def real_looking(b: int, h: int, t: int, d: int, dtype, seed: int, device="cuda") -> torch.Tensor:
    """Keys/values with a few large channels and a low-norm first token (an attention sink)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, h, t, d, device=device, generator=g)
    outliers = torch.randperm(d, generator=torch.Generator().manual_seed(seed))[:4].to(device)
    x[..., outliers] *= 12.0
    x[:, :, 0] *= 0.05
    return x.to(dtype)


def random_input(b, h, t, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(b, h, t, d, device="cuda", generator=g).to(dtype)


INPUTS = [random_input, real_looking]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 7, 128), (2, 3, 256), (33, 1, 128)])
def test_hadamard_equals_reference(shape, dtype):
    x = real_looking(*shape[:2], 1, shape[2], dtype, seed=sum(shape))[:, :, 0]
    assert torch.equal(ops.hadamard(x), hadamard(x))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hadamard_step_equals_reference(head_dim, dtype):
    b, hq, h, cap = 3, 32, 8, 40
    q = real_looking(b, hq, 1, head_dim, dtype, seed=head_dim)
    keys = real_looking(b, h, cap, head_dim, dtype, seed=head_dim + 1).transpose(1, 2).contiguous().transpose(1, 2)
    before = keys.clone()
    lengths = torch.tensor([0, 17, 39], device="cuda")
    assert torch.equal(ops.hadamard_step(q, keys, lengths), hadamard(q))
    for row, n in enumerate(lengths.tolist()):
        assert torch.equal(keys[row, :, n], hadamard(before[row, :, n]))
        keys[row, :, n] = before[row, :, n]
    assert torch.equal(keys, before)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_append_residual_writes_rotated_rows(head_dim, dtype):
    b, h, rcap = 3, 5, 16
    kr = torch.full((b, h, rcap, head_dim), float("nan"), dtype=dtype, device="cuda")
    vr = torch.full_like(kr, float("nan"))
    n_res = torch.tensor([0, 7, 15], dtype=torch.int32, device="cuda")
    at, live = n_res.clone(), torch.tensor([1, 0, 1], dtype=torch.int32, device="cuda")
    k, v = real_looking(b, h, 1, head_dim, dtype, seed=head_dim), random_input(b, h, 1, head_dim, dtype, seed=5)
    ops.append_residual(k, v, kr, vr, n_res, live)
    assert torch.equal(n_res, at + live)  # advanced in the launch (a released row by 0)
    n_res = at
    for i, pos in enumerate(n_res.tolist()):
        assert torch.equal(kr[i, :, pos], hadamard(k)[i, :, 0])
        assert torch.equal(vr[i, :, pos], v[i, :, 0])
    written = torch.zeros(b, rcap, dtype=torch.bool)
    written[torch.arange(b), n_res.cpu().long()] = True
    assert kr.isnan().all(-1).all(1).cpu().eq(~written).all(), "only the n_res slots may change"


def random_rotation(d: int, seed: int, device="cpu") -> torch.Tensor:
    """A random orthogonal [d, d] float32 matrix (QR of a seeded normal one), as OSCAR's layer rotations are."""
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float().to(device)


#: the least fraction of ops.rotate_rows' elements equal to torch's ``(x.float() @ R).to(dtype)``: the two sum in fp32
#: in other orders, so an element rounds one dtype ulp apart now and then, about 8x as often in fp16 (3 more mantissa
#: bits) as in bf16. Torch's own batched and row-by-row products of 1000 rows agree on 99.97-99.98% of the bf16 and
#: 99.81-99.89% of the fp16 elements (CPU, D 128 and 256, real-looking and normal rows).
ROTATION_EQUAL = {torch.bfloat16: 0.999, torch.float16: 0.995}


def assert_rotation_close(got: torch.Tensor, x: torch.Tensor, matrix: torch.Tensor) -> None:
    """ops.rotate_rows' result ``got`` against x @ matrix in fp64: its largest error within 1.5x that of torch's
    ``(x.float() @ matrix).to(dtype)`` (plus 1e-6 of the largest output); equal to torch's result on at least
    :data:`ROTATION_EQUAL` of the elements, every other one within a dtype ulp of it plus fp32's summation-order bound
    ``D * eps32 * (|x| @ |matrix|)`` (a sum that cancels to near zero may round several of its own ulps apart)."""
    assert got.shape == x.shape and got.dtype == x.dtype
    exact = x.double() @ matrix.double()
    plain = (x.float() @ matrix).to(x.dtype)
    error, plain_error = ((y.double() - exact).abs().max().item() for y in (got, plain))
    assert error <= 1.5 * plain_error + 1e-6 * exact.abs().max().item(), (error, plain_error)
    same = (got == plain).double().mean().item()
    assert same >= ROTATION_EQUAL[x.dtype], same
    info = torch.finfo(x.dtype)
    ulp = info.eps * torch.maximum(got.abs(), plain.abs()).double() + info.smallest_normal
    order = x.shape[-1] * torch.finfo(torch.float32).eps * (x.double().abs() @ matrix.double().abs())
    assert ((got.double() - plain.double()).abs() <= ulp + order).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 64), (37, 128), (3, 37, 256), (8, 32, 1, 128), (8, 8, 1, 128)],
                         ids=["37x64", "37x128", "3x37x256", "llama-8b-query", "llama-8b-key"])
def test_rotate_rows_matches_torch(shape, dtype):
    """OSCAR's decode-step rotation in one launch: rows of real-looking x (Llama-3.1-8B's query [B, 32, 1, 128] and
    key [B, 8, 1, 128] among them) times a random orthogonal matrix, as close to the fp64 product as torch's cast,
    GEMM and cast, and nearly always equal to it (:func:`assert_rotation_close`); ``out`` poisoned with NaN bits."""
    d = shape[-1]
    x = real_looking(1, 1, math.prod(shape[:-1]), d, dtype, seed=sum(shape)).view(shape)
    matrix = random_rotation(d, seed=d, device="cuda")
    out = torch.empty_like(x)
    out.view(torch.int16).fill_(-1)
    assert ops.rotate_rows(x, matrix, out=out) is out
    assert_rotation_close(out, x, matrix)
    assert torch.equal(ops.rotate_rows(x, matrix), out)


def _poisoned_keys(b, h, cap, d, bits, g, dtype):
    out = ops.empty_keys(b, h, cap, d, bits, g, dtype, "cuda")
    out["codes"].fill_(0xA5)
    for name in ("scale", "zero", "norm"):
        out[name].fill_(float("nan"))
    return out


KEY_CASES = [(1, 8, 96, 128, 2, 32), (3, 3, 64, 64, 2, 32), (2, 2, 32, 256, 4, 32), (2, 8, 128, 128, 4, 64),
             (1, 1, 160, 64, 4, 32)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("make", INPUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", KEY_CASES)
def test_quantize_keys_bytes_equal_reference(case, dtype, make):
    b, h, t, d, bits, g = case
    k = make(b, h, t, d, dtype, seed=hash(case) % 1000)
    out = ops.quantize_keys(k, bits, g, out=_poisoned_keys(b, h, t, d, bits, g, dtype))
    kh = hadamard(k)
    ref_norm = token_norm(kh, "token")
    torch.testing.assert_close(out.buffers["norm"], ref_norm, rtol=2e-6, atol=0)
    # bytes: the reference quantizer fed the kernel's norm (fp32 sums in another order differ by an ulp)
    ref = quantize_groups((kh.float() / out.buffers["norm"]).to(dtype), bits, g, "channel", "int")
    for name in ("codes", "scale", "zero"):
        assert torch.equal(out.buffers[name], ref.buffers[name]), name
    # and the method's own path end to end: nearly every byte, the same layout
    method = build_method("oscar", k_bits=bits, group_size=g, residual_length=g)
    full = method.quantize_keys(k, 0)
    assert full.buffers.keys() == out.buffers.keys()
    for name, buf in full.buffers.items():
        assert buf.shape == out.buffers[name].shape and buf.dtype == out.buffers[name].dtype, name
    same = (full.buffers["codes"] == out.buffers["codes"]).float().mean().item()
    assert same > 0.999, same


@pytest.mark.gpu
@gpu
def test_quantize_keys_into_storage_rows_and_offsets():
    b, h, d, bits, g = 3, 4, 128, 2, 32
    storage = _poisoned_keys(b, h, 5 * g, d, bits, g, torch.bfloat16)
    first = real_looking(b, h, 2 * g, d, torch.bfloat16, seed=1)
    second = real_looking(2, h, 3 * g, d, torch.bfloat16, seed=2)
    rotated_second = hadamard(second)
    ops.quantize_keys(first, bits, g, out=storage)
    ops.quantize_keys(rotated_second, bits, g, rotate=False, out=storage, rows=[2, 0], offsets=[2 * g, 2 * g])
    method = build_method("oscar", k_bits=bits, group_size=g, residual_length=g)
    for row, src in ((2, 0), (0, 1)):
        ref = method.quantize_keys(torch.cat([first[row:row + 1], second[src:src + 1]], dim=2), 0)
        torch.testing.assert_close(storage["norm"][row:row + 1], ref.buffers["norm"], rtol=2e-6, atol=0)
        for name in ("scale", "zero"):
            assert torch.equal(storage[name][row:row + 1], ref.buffers[name]), name
        same = (storage["codes"][row:row + 1] == ref.buffers["codes"]).float().mean().item()
        assert same > 0.999
    assert storage["codes"][1, :, 2 * g:].eq(0xA5).all(), "row 1 beyond its tokens must stay untouched"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("make", INPUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(1, 8, 37, 128, 2, 32), (3, 3, 5, 64, 2, 32), (2, 2, 17, 256, 4, 32),
                                  (2, 8, 33, 128, 4, 64), (1, 4, 9, 64, 4, 64)])
def test_quantize_values_bytes_equal_reference(case, dtype, make):
    b, h, t, d, bits, g = case
    v = make(b, h, t, d, dtype, seed=hash(case) % 1000 + 7)
    out = ops.empty_values(b, h, t, d, bits, g, dtype, "cuda")
    out["codes"].fill_(0xA5)
    out["scale"].fill_(float("nan"))
    out["zero"].fill_(float("nan"))
    got = ops.quantize_values(v, bits, g, out=out)
    ref = quantize_groups(v, bits, g, "token", "int")
    for name in ("codes", "scale", "zero"):
        assert torch.equal(got.buffers[name], ref.buffers[name]), name


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 8, 64, 128, 2, 32), (3, 2, 48, 64, 4, 16), (1, 4, 256, 256, 2, 128)])
def test_quantizers_write_the_decode_layouts(case, dtype):
    """decode_layout=True writes ops.key_decode_layout / value_decode_layout of the reference bytes (values also
    into storage rows at a 16-token offset)."""
    b, h, t, d, bits, g = case
    k = real_looking(b, h, t, d, dtype, seed=sum(case) + 1)
    got_k = ops.quantize_keys(k, bits, g, decode_layout=True).buffers
    want_k = ops.key_decode_layout(ops.quantize_keys(k, bits, g).buffers, bits)
    for name in want_k:
        assert torch.equal(got_k[name], want_k[name]), name
    v = real_looking(b, h, t, d, dtype, seed=sum(case))
    want = ops.value_decode_layout(quantize_groups(v, bits, g, "token", "int").buffers, bits, g)
    got = ops.quantize_values(v, bits, g, decode_layout=True)
    storage = ops.empty_values(b, h, t + 32, d, bits, g, dtype, "cuda")
    storage["codes"].fill_(0xA5)
    ops.quantize_values(v, bits, g, out=storage, rows=list(range(b)), offsets=[16] * b, decode_layout=True)
    for name in want:
        assert torch.equal(got.buffers[name], want[name]), name
        assert torch.equal(storage[name][:, :, 16:16 + t], want[name]), name
    assert storage["codes"][:, :, :16].eq(0xA5).all() and storage["codes"][:, :, 16 + t:].eq(0xA5).all()


def lattice_input(b, h, t, d, dtype, seed):
    """Multiples of 1/8 in [-1.5, 1.5]: groups whose x / scale often lands exactly on a half-integer (the
    rounding ties of the code thresholds)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randint(-12, 13, (b, h, t, d), device="cuda", generator=g).float() / 8).to(dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 8, 64, 128, 2, 32), (1, 4, 64, 64, 4, 32), (2, 2, 32, 256, 2, 32)])
def test_quantize_keys_launch_knobs_and_ties(case, dtype):
    """Warps per head and the register bound change the schedule, never the bytes; lattice inputs (ties in
    x / scale after rotate=False) go through the exact code thresholds."""
    b, h, t, d, bits, g = case
    k = real_looking(b, h, t, d, dtype, seed=3)
    ref = ops.quantize_keys(k, bits, g)
    rows_per_step = 1024 // d
    for knobs in [dict(warps_per_head=w) for w in (1, 2, 4) if (g // w) % rows_per_step == 0 and h * w <= 32] + [
            dict(warps_per_head=1, min_blocks=2)]:
        got = ops.quantize_keys(k, bits, g, out=_poisoned_keys(b, h, t, d, bits, g, dtype), **knobs)
        for name in ref.buffers:
            assert torch.equal(got.buffers[name], ref.buffers[name]), (knobs, name)
    flat = lattice_input(b, h, t, d, dtype, seed=4)
    got = ops.quantize_keys(flat, bits, g, rotate=False, out=_poisoned_keys(b, h, t, d, bits, g, dtype))
    norm = token_norm(flat, "token")
    torch.testing.assert_close(got.buffers["norm"], norm, rtol=2e-6, atol=0)
    want = quantize_groups((flat.float() / got.buffers["norm"]).to(dtype), bits, g, "channel", "int")
    for name in ("codes", "scale", "zero"):
        assert torch.equal(got.buffers[name], want.buffers[name]), name


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 4, 33, 128, 2, 32), (3, 2, 9, 64, 4, 8), (1, 3, 21, 256, 2, 128),
                                  (2, 8, 40, 128, 4, 16)])
def test_quantize_values_ties_and_storage(case, dtype):
    """Lattice inputs (exact rounding ties) equal the reference byte for byte, written straight and into
    storage rows/offsets; slots outside the written tokens stay untouched."""
    b, h, t, d, bits, g = case
    v = lattice_input(b, h, t, d, dtype, seed=sum(case))
    ref = quantize_groups(v, bits, g, "token", "int")
    got = ops.quantize_values(v, bits, g)
    for name in ("codes", "scale", "zero"):
        assert torch.equal(got.buffers[name], ref.buffers[name]), name
    storage = ops.empty_values(b + 1, h, t + 5, d, bits, g, dtype, "cuda")
    storage["codes"].fill_(0xA5)
    storage["scale"].fill_(float("nan"))
    storage["zero"].fill_(float("nan"))
    rows = [(i + 1) % (b + 1) for i in range(b)]
    ops.quantize_values(v, bits, g, out=storage, rows=rows, offsets=[3] * b)
    for i, row in enumerate(rows):
        for name in ("codes", "scale", "zero"):
            assert torch.equal(storage[name][row, :, 3:3 + t], ref.buffers[name][i]), (i, name)
    assert storage["codes"][rows[0], :, :3].eq(0xA5).all(), "tokens before the offset must stay untouched"
    assert storage["codes"][0].eq(0xA5).all(), "a row no sequence goes to must stay untouched"


# ----------------------------------------------------------------------------- attention


def _make_cache(lengths, residuals, hkv, d, kb, vb, g, rcap, dtype, seed, device="cuda"):
    """Packed storage of real-looking K/V quantized by the torch reference, per sequence lengths: in the decode
    layouts, then the same in the reference layout (keys, values) for kernels.reference.oscar_decode."""
    b = len(lengths)
    cap = max(max(lengths), g)
    keys = ops.empty_keys(b, hkv, cap, d, kb, g, dtype, device)
    values = ops.empty_values(b, hkv, cap, d, vb, g, dtype, device)
    for buf in list(keys.values()) + list(values.values()):
        buf.zero_() if buf.dtype == torch.uint8 else buf.fill_(1.0)  # unused slots: finite but wrong values
    method = build_method("oscar", k_bits=kb, v_bits=vb, group_size=g, residual_length=g)
    k_res = torch.zeros(b, hkv, rcap, d, dtype=dtype, device=device)
    v_res = torch.zeros_like(k_res)
    for i, (n, r) in enumerate(zip(lengths, residuals)):
        k = real_looking(1, hkv, n + r, d, dtype, seed=seed + i, device=device)
        v = real_looking(1, hkv, n + r, d, dtype, seed=seed + 100 + i, device=device) * 0.5
        kp, vp = method.quantize_keys(k[:, :, :n], 0), method.quantize_values(v[:, :, :n], 0)
        keys["codes"][i, :, :n] = kp.buffers["codes"][0]
        keys["scale"][i, :, :n // g] = kp.buffers["scale"][0]
        keys["zero"][i, :, :n // g] = kp.buffers["zero"][0]
        keys["norm"][i, :, :n] = kp.buffers["norm"][0]
        values["codes"][i, :, :n] = vp.buffers["codes"][0]
        values["scale"][i, :, :n] = vp.buffers["scale"][0]
        values["zero"][i, :, :n] = vp.buffers["zero"][0]
        k_res[i, :, :r] = hadamard(k[0, :, n:])
        v_res[i, :, :r] = v[0, :, n:]
    counts = (torch.tensor(lengths, dtype=torch.int32, device=device),
              torch.tensor(residuals, dtype=torch.int32, device=device))
    return (ops.key_decode_layout(keys, kb), ops.value_decode_layout(values, vb, g), k_res, v_res, counts,
            (keys, values))


def _reference(q, reference_store, k_res, v_res, counts, kb, vb, g, scaling, dtype):
    """(fp64 reference, plain torch path in the model dtype) of kernels.reference.oscar_decode: [B, Hq, 1, D]."""
    kwargs = dict(k_bits=kb, v_bits=vb, group_size=g, scaling=scaling)
    return (oscar_decode(q, *reference_store, k_res, v_res, *counts, dtype=torch.float64, **kwargs),
            oscar_decode(q, *reference_store, k_res, v_res, *counts, dtype=dtype, **kwargs))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


ATTENTION_CASES = [
    # lengths (packed, per sequence), residuals, hq, hkv, d, k_bits, v_bits, G, forced splits
    ([32 * 37, 32 * 5, 0], [17, 1, 9], 32, 8, 128, 2, 2, 32, None),
    ([32 * 40, 32 * 40], [0, 127], 32, 8, 128, 2, 2, 32, (7, 32 * 6)),
    ([64 * 9, 64 * 3], [63, 5], 9, 3, 64, 2, 2, 32, (3, 64 * 4)),
    ([32 * 12], [31], 16, 2, 256, 4, 4, 32, None),
    ([64 * 10, 64], [3, 64], 8, 8, 128, 4, 2, 64, None),
    ([32 * 300, 32 * 111, 32 * 2], [100, 0, 128], 32, 8, 128, 2, 2, 32, None),
    # 3 and 2 heads per KV head with the key operand split over the padded lanes (heads 3 and 2..3 absent)
    ([32 * 21, 32 * 3], [5, 70], 6, 2, 128, 2, 2, 32, None),
    ([32 * 9], [33], 4, 2, 256, 2, 4, 32, None),
    # one split per group: 301 partials per head to combine, most of them empty for the short sequence
    ([32 * 300, 32 * 7], [9, 100], 32, 8, 128, 2, 2, 32, (300, 32)),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_attention_matches_reference(case, dtype):
    _check_decode_attention(case, dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("min_blocks", [1, 16, 20, 24])
@pytest.mark.parametrize("nstage", [2, 3, 4])
def test_decode_attention_tuning_knobs_keep_the_result(nstage, min_blocks):
    """Every ring depth and launch bound of the tuning sweep (register spills included) stays within the
    tolerance: 4 heads per KV head (key operand split over the padded lanes) and 8 heads (no split)."""
    _check_decode_attention(ATTENTION_CASES[0], torch.bfloat16, nstage=nstage, min_blocks=min_blocks)
    _check_decode_attention(ATTENTION_CASES[3], torch.float16, nstage=nstage, min_blocks=min_blocks)


def _check_decode_attention(case, dtype, **knobs):
    lengths, residuals, hq, hkv, d, kb, vb, g, splits = case
    rcap = max(128, max(residuals))
    keys, values, k_res, v_res, (n_p, n_r), ref = _make_cache(lengths, residuals, hkv, d, kb, vb, g, rcap, dtype,
                                                                seed=len(lengths) * d + kb)
    b = len(lengths)
    q = real_looking(b, hq, 1, d, dtype, seed=99) * 2.0
    scaling = 1 / math.sqrt(d)
    out = ops.decode_attention(q, keys, values, k_res, v_res, n_p, n_r, k_bits=kb, v_bits=vb, group_size=g,
                               scaling=scaling, splits=splits, out=torch.full_like(q, float("nan")),
                               poison=True, **knobs)
    exact, torch_path = _reference(q, ref, k_res, v_res, (n_p, n_r), kb, vb, g, scaling, dtype)
    assert torch.isfinite(out).all()
    err_kernel, err_torch = _rel(out, exact), _rel(torch_path, exact)
    assert err_kernel <= 2 * err_torch + ATTENTION_TOL, (err_kernel, err_torch)
    for i in range(b):  # every sequence, not only on average
        assert _rel(out[i], exact[i]) <= 2 * _rel(torch_path[i], exact[i]) + ATTENTION_TOL, i


# ----------------------------------------------------------------------------- end to end


def _tiny_llama(head_dim: int, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=4 * head_dim, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096)
    return LlamaForCausalLM(config).to("cuda", dtype).eval()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cupy_cache_decodes_like_the_torch_path(head_dim):
    """Same model, same prompts (left-padded batch): per-step logits of backend=cupy stay as close to the
    fp32-cache reference as the torch path's, and the stored bytes are equal."""
    from kernels.backend import CupyBackend
    from oscar.attention import attach
    from oscar.cache import QuantizedKVCache

    dtype = torch.bfloat16
    method = build_method("oscar", k_bits=2, v_bits=2, group_size=32, residual_length=64)
    ids = torch.randint(0, 512, (2, 150), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    steps = 80  # crosses window flushes at different steps for the two rows

    def run(model, cache):
        logits, x, m = [], ids, mask
        pos = (m.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            for _ in range(steps):
                out = model(input_ids=x, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1].float())
                x = teacher[:, len(logits) - 1:len(logits)]  # teacher forcing: the same inputs for every path
                m = torch.cat([m, torch.ones_like(x)], dim=1)
                pos = pos[:, -1:] + 1
        return torch.stack(logits, 1)

    teacher = torch.randint(0, 512, (2, steps), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    model = _tiny_llama(head_dim, dtype)
    method.prepare_model(model)  # the value Hadamard folded: a cache refuses a model not prepared for its method
    attach(model, method)
    torch_cache = QuantizedKVCache.for_model(model, method, mask)
    ref = run(model, torch_cache)
    cupy_cache = CupyBackend().new_cache(model, method, mask)  # bound to the model: its attention reads it
    got = run(model, cupy_cache)
    assert cupy_cache.nbytes == torch_cache.nbytes
    assert cupy_cache.token_counts(0) == torch_cache.token_counts(0)
    model32 = _tiny_llama(head_dim, torch.float32)
    method.prepare_model(model32)
    attach(model32, method)
    exact = run(model32, QuantizedKVCache.for_model(model32, method, mask))
    err_cupy, err_torch = _rel(got, exact), _rel(ref, exact)
    assert err_cupy <= 2 * err_torch + 1e-2, (err_cupy, err_torch)


@pytest.mark.gpu
@gpu
def test_generate_runs_on_the_packed_cache():
    from kernels.backend import CupyBackend
    from oscar.attention import attach

    model = _tiny_llama(128, torch.bfloat16)
    method = build_method("oscar", residual_length=32)
    method.prepare_model(model)
    attach(model, method)
    ids = torch.randint(0, 512, (3, 70), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    cache = CupyBackend().new_cache(model, method, torch.ones_like(ids))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=40, do_sample=False)
    assert out.shape == (3, 110)
    counts = cache.token_counts(0)
    assert counts["keys_packed"] + counts["keys_residual"] == 3 * 109  # the last token is never stored
    assert counts["keys_packed"] == 3 * 96
