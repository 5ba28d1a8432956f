"""KIVI, QuaRot and TurboQuant+ CuPy kernels against their torch references on the GPU.

Marked ``gpu`` (skipped without CUDA and CuPy); one call runs them all in a few minutes:

    pytest -m gpu tests/test_kernels_methods.py

Quantizers: packed bytes equal to the method's own torch quantizer on the same GPU (through the decode-layout
converters of kernels.ops; TurboQuant+: equal to kernels.reference.turboquant_quantize, which fixes the order of
the fp32 sums, and nearly every byte of the method's own, whose torch.norm may round a norm differently), random
and real-looking inputs, written into storage rows at token offsets with the rest untouched. Decode attention:
error against the fp64 reference of kernels.reference within 2x the plain torch path's error in the same dtype
plus a small tolerance, per sequence; bf16 and fp16, head_dim 64/128/256, 1-8 query heads per KV head, batch > 1
with per-sequence lengths, empty splits. Outputs are poisoned before every launch. The helpers here also build
the caches of the CPU-emulated tests (tests/test_method_kernels_emulated.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from test_kernels import ATTENTION_TOL, DTYPES, _rel, gpu, random_input, real_looking

from kernels import ops
from kernels.reference import DECODE_REFERENCES, turboquant_quantize
from oscar import build_method
from oscar.quant import hadamard, quantize_groups

#: hyperparameters of build_method per method name beyond bits / group / residual
METHOD_OPTIONS = dict(kivi={}, quarot={}, turboquant={})


def build(method: str, kb: int, vb: int, g: int, **options):
    return build_method(method, k_bits=kb, v_bits=vb, group_size=g, residual_length=max(g, 32), **options)


def _fill_unused(store: dict) -> None:
    for buf in store.values():  # unused slots: finite but wrong values
        buf.zero_() if buf.dtype == torch.uint8 else buf.fill_(1.0)


def kernel_layout(method: str, keys: dict, values: dict, kb: int, vb: int, g: int, inverse: bool = False):
    """Reference-layout storage -> the layouts decode_attention reads (or back with ``inverse``)."""
    if method in ("oscar", "kivi"):
        keys = ops.key_decode_layout(keys, kb, inverse)
    else:
        keys = ops.token_key_decode_layout(keys, kb, inverse)
    return keys, ops.value_decode_layout(values, vb, g, inverse)


def make_method_cache(method: str, lengths, residuals, hkv: int, d: int, kb: int, vb: int, g: int, rcap: int, dtype,
                      data_seed: int, device="cuda", **options):
    """Per-sequence packed storage of real-looking K/V quantized by the method's own torch quantizer.

    Returns (kernel storage (keys, values) in the decode layouts, reference storage (keys, values), key residual,
    value residual, (n_packed, n_residual) int32, kwargs of decode_attention and of the reference). Residual keys
    are rotated for the rotating methods (as the cupy cache appends them)."""
    m = build(method, kb, vb, g, **options)
    b, tok = len(lengths), ops.stage_tokens(method, g)
    cap = max(tok, 16, math.ceil(max(lengths) / tok) * tok)
    keys, values = ops.empty_storage(method, b, hkv, cap, d, k_bits=kb, v_bits=vb, group_size=g, dtype=dtype,
                                     device=device)
    _fill_unused(keys)
    _fill_unused(values)
    k_res = torch.zeros(b, hkv, rcap, d, dtype=dtype, device=device)
    v_res = torch.zeros_like(k_res)
    per_channel_keys = method in ("oscar", "kivi")
    for i, (n, r) in enumerate(zip(lengths, residuals)):
        k = real_looking(1, hkv, n + r, d, dtype, seed=data_seed + i, device=device)
        v = real_looking(1, hkv, n + r, d, dtype, seed=data_seed + 100 + i, device=device) * 0.5
        if n:
            for store, packed, per_channel in ((keys, m.quantize_keys(k[:, :, :n], 0), per_channel_keys),
                                               (values, m.quantize_values(v[:, :, :n], 0), False)):
                for name, buf in packed.buffers.items():
                    rows = n // g if per_channel and name in ("scale", "zero") else n
                    store[name][i, :, :rows] = buf[0]
        k_res[i, :, :r] = hadamard(k[0, :, n:]) if method in ("oscar", "quarot") else k[0, :, n:]
        v_res[i, :, :r] = v[0, :, n:]
    counts = (torch.tensor(lengths, dtype=torch.int32, device=device),
              torch.tensor(residuals, dtype=torch.int32, device=device))
    kwargs = dict(k_bits=kb, v_bits=vb, group_size=g, scaling=1 / math.sqrt(d))
    kernel_kwargs, ref_kwargs = dict(kwargs, method=method), dict(kwargs)
    if method == "turboquant":
        signs, levels = m.signs(d, device), m.codebook(2, d).tolist()
        kernel_kwargs.update(signs=signs, codebook=levels)
        ref_kwargs.update(signs=signs, codebook=levels)
    if "zero_point" in options:
        kernel_kwargs["zero_point"] = ref_kwargs["zero_point"] = options["zero_point"]
    return (kernel_layout(method, keys, values, kb, vb, g), (keys, values), k_res, v_res, counts, kernel_kwargs,
            ref_kwargs)


def reference_errors(method: str, q, ref_store, k_res, v_res, counts, ref_kwargs):
    """(fp64 reference, plain torch path in the model dtype), both [B, Hq, 1, D] float32."""
    fn = DECODE_REFERENCES[method]
    exact = fn(q, *ref_store, k_res, v_res, *counts, dtype=torch.float64, **ref_kwargs)
    torch_path = fn(q, *ref_store, k_res, v_res, *counts, dtype=q.dtype, **ref_kwargs)
    return exact, torch_path


def assert_close_to_reference(out, exact, torch_path):
    assert torch.isfinite(out).all()
    for i in range(out.shape[0]):  # every sequence, not only on average
        err_kernel, err_torch = _rel(out[i], exact[i]), _rel(torch_path[i], exact[i])
        assert err_kernel <= 2 * err_torch + ATTENTION_TOL, (i, err_kernel, err_torch)


# ----------------------------------------------------------------------------- GPU: decode attention

DECODE_CASES = [
    # method, lengths (packed, per sequence), residuals, hq, hkv, d, k_bits, v_bits, G, forced splits, options
    ("kivi", [32 * 37, 32 * 5, 0], [17, 1, 9], 32, 8, 128, 2, 2, 32, None, {}),
    ("kivi", [64 * 9, 64 * 3], [63, 5], 9, 3, 64, 2, 2, 32, (3, 64 * 4), {}),
    ("kivi", [32 * 12], [31], 16, 2, 256, 4, 4, 32, None, {}),
    ("kivi", [32 * 300, 32 * 7], [9, 100], 32, 8, 128, 2, 2, 32, (300, 32), {}),
    ("kivi", [64 * 10, 64], [3, 64], 8, 8, 128, 4, 2, 64, None, dict(zero_point="int")),
    ("quarot", [32 * 37, 32 * 5, 0], [17, 1, 9], 32, 8, 128, 2, 2, 32, None, {}),
    ("quarot", [32 * 9, 32 * 3], [63, 5], 6, 2, 64, 2, 2, 32, (3, 32 * 4), dict(clip_ratio=0.9)),
    ("quarot", [32 * 12], [31], 16, 2, 256, 4, 4, 64, None, {}),
    ("quarot", [32 * 300, 32 * 7], [9, 100], 32, 8, 128, 2, 2, 32, (300, 32), {}),
    ("quarot", [32 * 21, 32 * 3], [5, 70], 8, 8, 128, 4, 2, 128, None, dict(zero_point="float")),
    ("turboquant", [32 * 37, 32 * 5, 0], [17, 1, 9], 32, 8, 128, 2, 2, 32, None, {}),
    ("turboquant", [32 * 9, 32 * 3], [63, 5], 9, 3, 64, 2, 2, 32, (3, 32 * 4), {}),
    ("turboquant", [32 * 12], [31], 16, 2, 256, 2, 2, 32, None, {}),
    ("turboquant", [32 * 300, 32 * 7], [9, 100], 32, 8, 128, 2, 2, 32, (300, 32), {}),
    ("turboquant", [32 * 21, 32 * 3], [5, 70], 6, 2, 128, 2, 2, 64, None, dict(seed=3)),
]


def _case_id(case):
    method, lengths, _, hq, hkv, d, kb, vb, g, splits, options = case
    options = "".join(f"-{k}{v}" for k, v in options.items())
    return f"{method}-d{d}-h{hq}x{hkv}-k{kb}v{vb}-g{g}-n{len(lengths)}{options}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_decode_attention_matches_reference(case, dtype):
    method, lengths, residuals, hq, hkv, d, kb, vb, g, splits, options = case
    rcap = max(128, max(residuals))
    store, ref_store, k_res, v_res, counts, kernel_kwargs, ref_kwargs = make_method_cache(
        method, lengths, residuals, hkv, d, kb, vb, g, rcap, dtype, data_seed=len(lengths) * d + kb, **options)
    q = real_looking(len(lengths), hq, 1, d, dtype, seed=99) * 2.0
    out = ops.decode_attention(q, *store, k_res, v_res, *counts, splits=splits, out=torch.full_like(q, float("nan")),
                               poison=True, **kernel_kwargs)
    assert_close_to_reference(out, *reference_errors(method, q, ref_store, k_res, v_res, counts, ref_kwargs))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("min_blocks", [8, 12, 16])
@pytest.mark.parametrize("method", ["kivi", "quarot", "turboquant"])
def test_decode_attention_launch_bounds_keep_the_result(method, min_blocks):
    """The register bounds the benchmark sweeps (spills included) keep the result, bf16, 4 heads per KV head."""
    case = next(c for c in DECODE_CASES if c[0] == method)
    _, lengths, residuals, hq, hkv, d, kb, vb, g, splits, options = case
    store, ref_store, k_res, v_res, counts, kernel_kwargs, ref_kwargs = make_method_cache(
        method, lengths, residuals, hkv, d, kb, vb, g, 128, torch.bfloat16, data_seed=5)
    q = real_looking(len(lengths), hq, 1, d, torch.bfloat16, seed=98) * 2.0
    out = ops.decode_attention(q, *store, k_res, v_res, *counts, out=torch.full_like(q, float("nan")), poison=True,
                               min_blocks=min_blocks, **kernel_kwargs)
    assert_close_to_reference(out, *reference_errors(method, q, ref_store, k_res, v_res, counts, ref_kwargs))


# ----------------------------------------------------------------------------- GPU: quantizers

INPUTS = [random_input, real_looking]


def _poisoned(store: dict) -> dict:
    for buf in store.values():
        buf.fill_(0xA5) if buf.dtype == torch.uint8 else buf.fill_(float("nan"))
    return store


def _poison_kept(buf: Tensor) -> Tensor:
    return buf.eq(0xA5) if buf.dtype == torch.uint8 else buf.isnan()


def _assert_written(store: dict, want: dict, rows, offset: int, t: int, per_group: int = 1):
    """store[name][rows[i], :, offset .. offset + t] == want[name][i] for every buffer (per-channel parameters:
    offset / G ..), the tokens around them and the rows no sequence went to still poisoned."""
    for name, ref in want.items():
        step = per_group if name != "codes" else 1
        lo, hi = offset // step, (offset + t) // step
        for i, row in enumerate(rows):
            assert torch.equal(store[name][row, :, lo:hi], ref[i]), (name, i)
        kept = _poison_kept(store[name])
        for row in range(store[name].shape[0]):
            outside = torch.cat([kept[row, :, :lo].flatten(), kept[row, :, hi:].flatten()]) if row in rows \
                else kept[row].flatten()
            assert outside.all(), (name, row, "written outside the sequence's tokens")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("make", INPUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 8, 96, 128, 2, 32, "float"), (3, 3, 64, 64, 4, 32, "float"),
                                  (1, 2, 64, 256, 2, 64, "int"), (2, 8, 128, 128, 4, 64, "float")])
def test_kivi_keys_bytes_equal_reference(case, dtype, make):
    b, h, t, d, bits, g, zero_point = case
    k = make(b, h, t, d, dtype, seed=sum(case[:6]))
    want = quantize_groups(k, bits, g, "channel", zero_point).buffers
    got = ops.quantize_channel_keys(k, bits, g, zero_point, out=_poisoned(ops.empty_keys(b, h, t, d, bits, g, dtype,
                                                                                          "cuda", norm=False)))
    for name in want:
        assert torch.equal(got.buffers[name], want[name]), name
    storage = _poisoned(ops.empty_keys(b + 1, h, t + 2 * g, d, bits, g, dtype, "cuda", norm=False))
    rows = [(i + 1) % (b + 1) for i in range(b)]
    ops.quantize_channel_keys(k, bits, g, zero_point, out=storage, rows=rows, offsets=[g] * b, decode_layout=True)
    _assert_written(storage, ops.key_decode_layout(want, bits), rows, g, t, per_group=g)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("make", INPUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [
    # role, batch, heads, tokens, head_dim, bits, G, zero point, clip ratio
    ("quarot_keys", 2, 8, 37, 128, 2, 32, "int", 1.0), ("quarot_keys", 3, 3, 9, 64, 4, 16, "int", 0.9),
    ("quarot_keys", 1, 2, 21, 256, 2, 128, "float", 0.95), ("kivi_values", 2, 8, 33, 128, 2, 32, "float", 1.0),
    ("kivi_values", 3, 3, 5, 64, 4, 16, "float", 1.0), ("quarot_values", 2, 4, 40, 128, 2, 64, "int", 0.8),
])
def test_per_token_groups_bytes_equal_reference(case, dtype, make):
    """QuaRot's keys (Hadamard + per-token groups, per-token key layout), KIVI's values (float zero) and QuaRot's
    values (clip ratio) equal the methods' own quantizers byte for byte, straight and into storage at an odd
    token offset (one token at a time is how the kivi policy flushes values)."""
    role, b, h, t, d, bits, g, zero_point, clip = case
    x = make(b, h, t, d, dtype, seed=sum(case[1:7]))
    if role == "quarot_keys":
        method = build("quarot", bits, bits, g, clip_ratio=clip, zero_point=zero_point)
        want = method.quantize_keys(x, 0).buffers
        run = lambda **kw: ops.quantize_token_keys(  # noqa: E731
            x, bits, g, zero_point=zero_point, clip_ratio=clip, **kw)
        moved = ops.token_key_decode_layout(want, bits)
    else:
        name = role.split("_")[0]
        method = build(name, bits, bits, g, zero_point=zero_point, **({"clip_ratio": clip} if name == "quarot" else {}))
        want = method.quantize_values(x, 0).buffers
        run = lambda **kw: ops.quantize_values(x, bits, g, zero_point=zero_point, clip_ratio=clip, **kw)  # noqa: E731
        moved = None
    got = run(out=_poisoned(ops.empty_values(b, h, t, d, bits, g, dtype, "cuda"))).buffers
    for key in want:
        assert torch.equal(got[key], want[key]), key
    rows = [(i + 1) % (b + 1) for i in range(b)]
    cap = 16 * math.ceil((t + 3 + 7) / 16)
    storage = _poisoned(ops.empty_values(b + 1, h, cap, d, bits, g, dtype, "cuda"))
    if moved is not None:
        run(out=storage, rows=rows, offsets=[3] * b, decode_layout=True)
        _assert_written(storage, moved, rows, 3, t)
    else:  # value tiles: the decode layout of the reference bytes placed at the offset, other tokens untouched
        run(out=storage, rows=rows, offsets=[3] * b, decode_layout=True)
        back = ops.value_decode_layout(storage, bits, g, inverse=True)
        _assert_written(back, want, rows, 3, t)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("make", INPUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 8, 37, 128, 32, "keys"), (3, 3, 16, 64, 32, "values"), (1, 2, 21, 256, 64, None),
                                  (2, 4, 40, 128, 128, "values")])
def test_turboquant_bytes_equal_reference(case, dtype, make):
    """quantize_turboquant equals kernels.reference.turboquant_quantize byte for byte (straight and into storage at
    an odd token offset through the layout converters) and nearly every code and norm of the method's own
    quantizer (whose torch.norm sums in another order)."""
    b, h, t, d, g, layout = case
    x = make(b, h, t, d, dtype, seed=sum(case[:5]))
    method = build("turboquant", 2, 2, g, seed=t)
    signs, levels = method.signs(d, "cuda"), method.codebook(2, d).tolist()
    want = turboquant_quantize(x, g, signs, levels)
    got = ops.quantize_turboquant(x, g, signs, levels, out=_poisoned(ops.empty_turboquant(b, h, t, d, 2, g, "cuda")))
    for name in want:
        assert torch.equal(got.buffers[name], want[name]), name
    own = method.quantize_keys(x, 0).buffers
    assert (own["codes"] == want["codes"]).float().mean() > 0.999
    assert (own["norm"] == want["norm"]).float().mean() > 0.99
    torch.testing.assert_close(own["norm"].float(), want["norm"].float(), rtol=2e-3, atol=0)
    rows = [(i + 1) % (b + 1) for i in range(b)]
    storage = _poisoned(ops.empty_turboquant(b + 1, h, 16 * math.ceil((t + 3) / 16), d, 2, g, "cuda"))
    ops.quantize_turboquant(x, g, signs, levels, out=storage, rows=rows, offsets=[3] * b, decode_layout=layout)
    if layout == "keys":
        _assert_written(storage, ops.token_key_decode_layout(want, 2), rows, 3, t)
    else:
        _assert_written(ops.value_decode_layout(storage, 2, g, inverse=True) if layout else storage, want, rows, 3, t)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["kivi", "quarot", "turboquant"])
def test_kernel_quantizers_feed_decode_attention(method, dtype):
    """The cache's path: K/V quantized by the kernels into storage (decode layouts, two sequences of different
    lengths written in two chunks at token offsets), attended by decode_attention; against the reference of the
    method's own quantization."""
    quantize_then_decode(method, dtype, "cuda", lengths=[32 * 20, 32 * 7], residuals=[40, 3], hkv=4, hq=16)


def quantize_then_decode(method: str, dtype, device, lengths, residuals, hkv: int, hq: int, d: int = 128,
                         g: int = 32, bits: int = 2):
    """Quantize real-looking K/V with the kernels of kernels.ops into storage, attend with decode_attention, and
    compare with the reference of the method's own quantization."""
    b, tok = len(lengths), ops.stage_tokens(method, g)
    m = build(method, bits, bits, g)
    cap, rcap = tok * math.ceil(max(lengths) / tok) + tok, 64
    keys, values = ops.empty_storage(method, b, hkv, cap, d, k_bits=bits, v_bits=bits, group_size=g, dtype=dtype,
                                     device=device)
    ref_keys, ref_values = ops.empty_storage(method, b, hkv, cap, d, k_bits=bits, v_bits=bits, group_size=g,
                                             dtype=dtype, device=device)
    for store in (keys, values, ref_keys, ref_values):
        _fill_unused(store)
    k_res = torch.zeros(b, hkv, rcap, d, dtype=dtype, device=device)
    v_res = torch.zeros_like(k_res)
    extra = {}
    if method == "turboquant":
        extra = dict(signs=m.signs(d, device), codebook=m.codebook(2, d).tolist())
    for i, (n, r) in enumerate(zip(lengths, residuals)):
        k = real_looking(1, hkv, n + r, d, dtype, seed=10 + i, device=device)
        v = real_looking(1, hkv, n + r, d, dtype, seed=20 + i, device=device) * 0.5
        half = n // 2 // tok * tok
        for start, stop in ((0, half), (half, n)):  # two flushes
            kc, vc = k[:, :, start:stop], v[:, :, start:stop]
            where = dict(rows=[i], offsets=[start])
            if method == "kivi":
                ops.quantize_channel_keys(kc, bits, g, out=keys, decode_layout=True, **where)
                ops.quantize_values(vc, bits, g, out=values, decode_layout=True, zero_point="float", **where)
            elif method == "quarot":
                ops.quantize_token_keys(kc, bits, g, out=keys, decode_layout=True, **where)
                ops.quantize_values(vc, bits, g, out=values, decode_layout=True, **where)
            else:
                ops.quantize_turboquant(kc, g, extra["signs"], extra["codebook"], out=keys, decode_layout="keys",
                                        **where)
                ops.quantize_turboquant(vc, g, extra["signs"], extra["codebook"], out=values, decode_layout="values",
                                        **where)
        for store, packed, per_channel in ((ref_keys, m.quantize_keys(k[:, :, :n], 0), method == "kivi"),
                                           (ref_values, m.quantize_values(v[:, :, :n], 0), False)):
            for name, buf in packed.buffers.items():
                store[name][i, :, :n // g if per_channel and name in ("scale", "zero") else n] = buf[0]
        k_res[i, :, :r] = hadamard(k[0, :, n:]) if method == "quarot" else k[0, :, n:]
        v_res[i, :, :r] = v[0, :, n:]
    counts = (torch.tensor(lengths, dtype=torch.int32, device=device),
              torch.tensor(residuals, dtype=torch.int32, device=device))
    q = real_looking(b, hq, 1, d, dtype, seed=30, device=device) * 2.0
    kwargs = dict(k_bits=bits, v_bits=bits, group_size=g, scaling=1 / math.sqrt(d), **extra)
    out = ops.decode_attention(q, keys, values, k_res, v_res, *counts, method=method,
                               out=torch.full_like(q, float("nan")), poison=True, **kwargs)
    assert_close_to_reference(out, *reference_errors(method, q, (ref_keys, ref_values), k_res, v_res, counts, kwargs))
