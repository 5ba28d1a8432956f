"""The OTT, RotateKV and OSCAR (spectral) kernels on the CPU emulator (tests/cuda_emu.h) against their references.

First the pieces in plain torch: the skip words, RotateKV's key layout, key groups and RoPE tables, OSCAR's affine
code map, and each reference of kernels.reference against the method's own torch path (its ``dequantize``, the
exact tokens restored in place, then attention). Then the kernels lane by lane: RotateKV's logits kernel
(kernels/rotatekv.cu) against the logits of the method's dequantized keys, and ops.decode_attention for the three
methods (exact tokens attended beside the window, their packed copies skipped, RotateKV's logits streamed) against
the fp64 reference within 2x the plain torch path's error plus a small tolerance, per sequence, outputs and
partials poisoned. Not modelled here: what the emulator does not model for the other kernels either (see
tests/test_decode_emulated.py); those are the GPU tests' (tests/test_kernels_exact_methods.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_kernels import real_looking
from test_kernels_exact_methods import (check_exact_tokens_count_once, check_rotatekv_key_kernels, cuda_hadamard,
                                        exact_method, make_exact_cache, rotary, run_exact_case)
from test_method_kernels_emulated import emulated_ops, emulator_libraries  # noqa: F401 (fixtures)

from kernels import ops
from kernels.kept_tokens import KeptTokens
from kernels.method_layouts import (empty_exact, rotatekv_key_groups, rotatekv_key_layout, rotatekv_rope,
                                    rotatekv_tables, skip_mask, skip_words)
from methods.spectral import RELEASED_LLOYD_MAX_LEVELS
from oscar import build_method
from oscar.exact import keep_exact
from oscar.method import TokenSpan
from oscar.quant import PackedTensor, dequantize_groups, pack_bits, unpack_bits
from oscar.rope import apply_rope, rope_tables

# ----------------------------------------------------------------------------- the pieces, in torch


def test_skip_words_round_trip_every_bit():
    mask = torch.rand(3, 2, 70, generator=torch.Generator().manual_seed(0)) < 0.3
    mask[0, 0, 31] = mask[1, 1, 63] = True  # the sign bits of the int32 words
    words = skip_words(mask)
    assert words.shape == (3, 2, 3) and words.dtype == torch.int32
    assert torch.equal(skip_mask(words, 70), mask)
    assert words[0, 0, 0] < 0 and int(words[0, 0, 0]) & 0xFFFFFFFF == sum(1 << t for t in range(32) if mask[0, 0, t])


def test_rotatekv_key_layout_puts_each_channel_before_the_permutation():
    h, d, bits, t, g = 3, 64, 2, 5, 32
    order = torch.randperm(h * d, generator=torch.Generator().manual_seed(1))
    codes = torch.randint(0, 4, (2, h, t, d), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    keys = dict(codes=pack_bits(codes, bits), scale=torch.rand(2, h, t, d // g))
    moved = rotatekv_key_layout(keys, bits, order)
    x = unpack_bits(moved["codes"], bits, d).transpose(1, 2).reshape(2, t, h * d)
    z = codes.transpose(1, 2).reshape(2, t, h * d)
    assert torch.equal(x[..., order], z), "z_j = x_order[j]"
    assert torch.equal(moved["scale"], keys["scale"])
    assert torch.equal(rotatekv_key_layout(moved, bits, order, inverse=True)["codes"], keys["codes"])
    groups = rotatekv_key_groups(order, g)
    assert groups.dtype == torch.int16 and torch.equal(groups[order].long(), torch.arange(h * d) // g)


def test_rotatekv_channel_index_is_made_once_per_order_and_dropped_with_it():
    """rotatekv_key_layout's index on the codes' device: one per (order, direction), not a host copy per flush; an
    identity order (reorder=false) is one shared tensor; a freed order's entries go with it."""
    import gc

    from kernels.method_layouts import _CHANNEL_INDEX, _channel_index

    order = torch.randperm(12, generator=torch.Generator().manual_seed(7))
    forward = _channel_index(order, False, "cpu")
    assert forward is _channel_index(order, False, "cpu") and torch.equal(forward, torch.argsort(order))
    assert torch.equal(_channel_index(order, True, "cpu"), order)
    held = len(_CHANNEL_INDEX)
    del order
    gc.collect()
    assert len(_CHANNEL_INDEX) == held - 2
    m = build_method("rotatekv", reorder=False)
    assert m.channel_order(0, 256) is m.channel_order(3, 256)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotatekv_rope_tables_advance_to_the_models_table(head_dim):
    """Anchors every ROPE_RUN positions rotated by the offsets 0 .. ROPE_RUN - 1 (the kernel's one complex product, in
    fp32) give the model's own cos/sin at every position within a few fp32 ulps of the angle (Llama 3.1's RoPE,
    positions to 4K, and a scaled table: the anchors carry the attention scaling, the offsets do not)."""
    rope = rotary(head_dim)
    positions = torch.arange(4096)
    for scaling in (1.0, 1.25):
        anchors = [t * scaling for t in rope_tables(rope, positions[::ops.ROPE_RUN], head_dim)]
        first = [t * scaling for t in rope_tables(rope, positions[:ops.ROPE_RUN], head_dim)]
        tables = rotatekv_rope(*anchors, *first)
        assert tables["offsets"].shape == (ops.ROPE_RUN, head_dim // 2, 2)
        cos, sin = tables["anchors"][:, None, :, 0], tables["anchors"][:, None, :, 1]  # [n, 1, D/2]
        off_cos, off_sin = tables["offsets"][None, :, :, 0], tables["offsets"][None, :, :, 1]  # [1, R, D/2]
        got = torch.stack([cos * off_cos - sin * off_sin, sin * off_cos + cos * off_sin], -1).flatten(0, 1)
        want_cos, want_sin = rope_tables(rope, positions, head_dim)
        want = torch.stack([want_cos[:, :head_dim // 2], want_sin[:, :head_dim // 2]], -1) * scaling
        assert float((got - want).abs().max()) < 2e-3 * scaling  # fp32(t theta) is off by up to half an ulp of it


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_cuda_hadamard_is_the_methods_up_to_cpu_torchs_division(d):
    """kernels.reference._hadamard_fp32 (what tests/test_kernels_exact_methods.cuda_hadamard swaps into RotateKV on
    the CPU) is oscar.quant.hadamard but for its last step, the product with fp32(1 / sqrt(d)) where CPU torch divides
    by sqrt(d): equal where that reciprocal is exact (d = 64, 256), within one fp32 ulp otherwise (bit for bit as
    CUDA torch on the GPU: tests/test_kernels_exact_methods.py)."""
    from kernels.reference import _hadamard_fp32
    from oscar.quant import hadamard

    x = torch.randn(40, d, generator=torch.Generator().manual_seed(d))
    got, want = _hadamard_fp32(x), hadamard(x)
    if math.sqrt(d).is_integer() and math.log2(math.sqrt(d)).is_integer():
        assert torch.equal(got, want)
    else:
        ulp = torch.finfo(torch.float32).eps * want.abs()
        assert ((got - want).abs() <= ulp).all() and not torch.equal(got, want)


def test_affine_levels_take_equally_spaced_levels_only():
    a, b = ops.affine_levels(RELEASED_LLOYD_MAX_LEVELS)
    assert [a + b * c for c in range(4)] == pytest.approx(RELEASED_LLOYD_MAX_LEVELS, rel=1e-12)
    assert ops.affine_levels([0.0, 1.0, 2.0, 3.0]) == (0.0, 1.0)
    with pytest.raises(ValueError, match="equally spaced"):
        ops.affine_levels([-1.51, -0.45, 0.45, 1.51])


@pytest.mark.parametrize("name, g, shift, options", [("ott", 32, 8, {}), ("spectral", 64, 8, {}),
                                                     ("spectral", 64, 0, dict(codebook="lloyd_max")),
                                                     ("rotatekv", 32, 8, dict(head_group=2))])
def test_store_and_load_a_methods_own_chunks(emulated_ops, name, g, shift, options):
    """store_packed writes the method's own chunks (two per row; values ``shift`` tokens later: across 16-token
    tiles, or whole tiles) into the decode-layout storage, leaving every other token as it was; load_packed reads
    them back as the method's buffers (without the kept tokens), which its dequantize turns into the chunk's values
    bit for bit (the kept tokens aside); the variant's dequantize kernel (emulated) reads the same values straight
    from the storage into a NaN-poisoned buffer (OSCAR's fp32 parameters and Lloyd-Max levels, RotateKV's keys)."""
    from kernels.method_layouts import load_packed, store_packed
    from kernels.variant import KERNELS

    hkv, d, dtype = 2, 64, torch.bfloat16
    m = exact_method(name, hkv, d, 2, 2, g, "cpu", **options)
    order = m._orders[0] if name == "rotatekv" else None
    keys, values = ops.empty_storage(name, 3, hkv, 128, d, k_bits=2, v_bits=2, group_size=g, dtype=dtype,
                                     device="cpu")
    for store in (keys, values):
        for buf in store.values():
            buf.fill_(0xA5) if buf.dtype == torch.uint8 else buf.fill_(7.0)
    before = dict(kcodes=keys["codes"].clone(), vcodes=values["codes"].clone())
    state = m.new_state(2, hkv, "cpu")
    chunks = []
    for start, t in ((0, 32), (32, 64)):  # rows 2 and 0 of the storage, the values at start + shift
        x = real_looking(2, hkv, t, d, dtype, seed=start, device="cpu")
        if name == "rotatekv":
            cos, sin = rope_tables(m._rotary, torch.arange(start, start + t), d)
            x = apply_rope(x.float(), cos, sin).to(dtype)
        span = TokenSpan(torch.arange(2), start, state)
        pk, pv = m.quantize_keys(x, 0, span), m.quantize_values(x, 0, span)
        store_packed(name, "keys", pk, keys, [2, 0], [start, start], order)
        store_packed(name, "values", pv, values, [2, 0], [start + shift, start + shift], order)
        chunks.append((start, t, pk, pv))
    for start, t, pk, pv in chunks:
        got_k = load_packed(name, "keys", keys, [2, 0], start, t, pk, order)
        got_v = load_packed(name, "values", values, [2, 0], start + shift, t, pv, order)
        for got, own in ((got_k, pk), (got_v, pv)):
            for key, buf in got.buffers.items():
                if key not in ("exact", "exact_pos"):
                    assert torch.equal(buf, own.buffers[key]), key
            bare = own.with_buffers(**{k: v for k, v in got.buffers.items() if k in ("exact", "exact_pos")})
            bare.start = start
            assert torch.equal(m.dequantize(got), m.dequantize(bare))
        for stream, store, offset, got in (("keys", keys, start, got_k), ("values", values, start + shift, got_v)):
            out = torch.full((2, hkv, t, d), float("nan"), dtype=dtype)
            KERNELS[name].dequantize(m, stream, store, torch.tensor([2, 0], dtype=torch.int32), offset, t, out, 0)
            with cuda_hadamard("cpu"):  # the method's Hadamard as CUDA torch computes it (RotateKV's keys)
                assert torch.equal(out, m.dequantize(got)), (stream, start)
    assert torch.equal(keys["codes"][1], before["kcodes"][1]) and torch.equal(values["codes"][1], before["vcodes"][1])
    back = ops.value_decode_layout(values, 2, g, inverse=True)  # the tiles' other tokens must stay as they were
    for key, poison in (("codes", 0xA5), ("scale", 7.0), ("zero", 7.0)):
        assert (back[key][0, :, :shift] == poison).all() and (back[key][0, :, shift + 96:] == poison).all(), key


CASES = [
    # method, lengths (packed), residuals, hq, hkv, d, k_bits, v_bits, G, options
    ("ott", [32 * 4, 32 * 2], [5, 0], 4, 2, 64, 2, 2, 32, dict(pool_size=3)),
    ("ott", [64 * 2], [9], 2, 2, 128, 4, 2, 64, dict(scope="token", keep_values=False)),
    ("spectral", [32 * 4, 32], [3, 20], 6, 2, 64, 2, 2, 128, dict(sink_tokens=40)),
    ("spectral", [32 * 3], [7], 4, 1, 128, 2, 2, 128, dict(codebook="lloyd_max", sink_tokens=4)),
    ("rotatekv", [32 * 3, 32], [4, 11], 4, 2, 64, 2, 2, 32, dict(head_group=2)),
    ("rotatekv", [32 * 2], [6], 3, 3, 64, 2, 4, 16, dict(order=None, num_sinks=2)),
]


def _case_id(case):
    return f"{case[0]}-d{case[5]}-h{case[3]}x{case[4]}-k{case[6]}v{case[7]}-g{case[8]}-" + \
        "-".join(f"{k}{v}" for k, v in case[9].items())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_is_the_methods_own_torch_path(case):
    """kernels.reference (exact tokens beside the packed ones, their packed copies masked) equals attention over the
    method's own dequantize (the exact tokens restored in place) and the window, in fp32 after the same rounding to
    the model dtype: the reference models the method, kept tokens included."""
    name, lengths, residuals, hq, hkv, d, kb, vb, g, options = case
    dtype = torch.bfloat16
    cache = make_exact_cache(name, lengths, residuals, hkv, d, kb, vb, g, 32, dtype, data_seed=11, device="cpu",
                             **options)
    assert int(cache["exact"]["count"].sum()) > 0, "the case must keep some tokens exactly"
    m = cache["method"]
    q = cache["query"](real_looking(len(lengths), hq, 1, d, dtype, seed=4, device="cpu"))
    got = ops_reference(name, q, cache, torch.float32)
    for i, (n, r) in enumerate(zip(lengths, residuals)):
        k = real_looking(1, hkv, n + r, d, dtype, seed=11 + i, device="cpu")
        v = real_looking(1, hkv, n + r, d, dtype, seed=111 + i, device="cpu") * 0.5
        state = m.new_state(1, hkv, "cpu")
        if name == "rotatekv":
            cos, sin = rope_tables(m._rotary, torch.arange(n + r), d)
            k = apply_rope(k.float(), cos, sin).to(dtype)
            state["sinks"].copy_(_sinks_of(cache, i, n))
        span = TokenSpan(torch.arange(1), 0, state)
        keys, values = [m.transform_key(k[:, :, n:], 0)], [v[:, :, n:]]
        if n:
            keys.insert(0, m.dequantize(m.quantize_keys(k[:, :, :n], 0, span)))
            values.insert(0, m.dequantize(m.quantize_values(v[:, :, :n], 0, span)))
        kk, vv = torch.cat(keys, 2).float(), torch.cat(values, 2).float()
        rep = hq // hkv
        want = F.scaled_dot_product_attention(q[i:i + 1].float(), kk.repeat_interleave(rep, 1),
                                              vv.repeat_interleave(rep, 1), scale=1 / math.sqrt(d))
        torch.testing.assert_close(got[i:i + 1], want, rtol=2e-5, atol=2e-5)


def ops_reference(name, q, cache, dtype):
    from kernels.reference import DECODE_REFERENCES

    return DECODE_REFERENCES[name](q, *cache["ref"], cache["k_res"], cache["v_res"], *cache["counts"], dtype=dtype,
                                   **cache["reference"])


def _sinks_of(cache, i, n):
    """RotateKV's sink positions of row i as its state holds them [1, 1, num_sinks] (-1 = none)."""
    mask = skip_mask(cache["exact"]["skip"][i, 0], n)
    found = torch.nonzero(mask).flatten()
    sinks = torch.full((1, 1, cache["method"].num_sinks), -1, dtype=torch.long)
    sinks[0, 0, :len(found)] = found
    return sinks


# ----------------------------------------------------------------------------- the kernels, emulated


@pytest.mark.parametrize("case", [(96, 4, 2, 64, 2, 32, dict(head_group=2), torch.float16),
                                  (80, 3, 3, 64, 4, 16, dict(order=None), torch.float16),
                                  (32, 4, 4, 64, 2, 32, dict(head_group=4), torch.bfloat16),
                                  (150, 8, 2, 128, 2, 32, dict(head_group=2), torch.bfloat16)],
                         ids=["g2-hpg2", "g1-3heads-4bit", "g4-mha-bf16", "d128-hpg4-bf16"])
def test_rotatekv_logits_emulated_match_the_methods_keys(emulated_ops, case):
    """rotatekv.cu's logits (keys rebuilt from the permuted codes on tensor cores: dequantized, grouped-head Hadamard,
    RoPE at each position from its anchor and offset) equal scale * q . k of the method's dequantized keys (its own
    arithmetic in fp32) within 3x the error of those keys rounded to the model dtype (what the torch path attends);
    the sinks' logits are -inf; tokens past n_packed untouched (a last tile cut short, two blocks)."""
    n, hq, hkv, d, kb, g, options, dtype = case
    cache = make_exact_cache("rotatekv", [n], [0], hkv, d, kb, 64 // g, g, 16, dtype, data_seed=3, device="cpu",
                             sinks=(1, 7), **options)  # (values of G * bits = 64: what their tiles take)
    n_packed = torch.tensor([n], dtype=torch.int32)
    q = real_looking(1, hq, 1, d, dtype, seed=5, device="cpu")
    logits = ops.rotatekv_logits(q, cache["store"][0], n_packed, cache["exact"]["skip"], cache["kernel"]["rope"], kb,
                                 g, 1 / math.sqrt(d), n, poison=True)
    m = cache["method"]
    buffers = {name: x[:1, :, :n] for name, x in cache["ref"][0].items()}
    z = dequantize_groups(PackedTensor(buffers, (1, hkv, n, d), dtype, dict(bits=kb, group_size=g, axis="token",
                                                                            zero_point="int")), torch.float32)
    k = apply_rope(m.from_rotated(z, 0), *rope_tables(m._rotary, torch.arange(n), d))  # the method's, in fp32
    rep = hq // hkv
    want = (q.float() @ k.float().repeat_interleave(rep, 1).transpose(-1, -2))[0, :, 0] * (math.log2(math.e)
                                                                                          / math.sqrt(d))
    skipped = skip_mask(cache["exact"]["skip"][0], n).repeat_interleave(rep, 0)  # [Hq, n]
    got = logits[0, :, :n]
    assert skipped[:, 1].all() and skipped[:, 7].all() and int(skipped.sum()) == 2 * hq
    assert torch.isneginf(got[skipped]).all()
    # the torch path attends these keys rounded to the model dtype: the kernel's fp16 operands (rotatekv.cu's stated
    # choice) may err a small multiple of that rounding (the fast-hadamard-transform way of testing a fast path)
    rounded = (q.float() @ k.to(dtype).float().repeat_interleave(rep, 1).transpose(-1, -2))[0, :, 0] * (
        math.log2(math.e) / math.sqrt(d))
    kernel_err = float((got[~skipped] - want[~skipped]).abs().max())
    torch_err = float((rounded[~skipped] - want[~skipped]).abs().max())
    assert kernel_err <= 3 * torch_err
    assert logits[0, :, n:].isnan().all(), "tokens past n_packed must stay untouched"


def test_profile_scripts_rotatekv_call_writes_every_logit(emulated_ops):
    """scripts/profile_decode_kernel.py's rotatekv_logits call (what it profiles: Llama-3.1-8B's attention shape,
    head groups of 4) passes ops' checks and writes a finite logit for every query head and token; the kernel's
    other knobs (RoPE per tile instead of per k-step, one block an SM) give the same logits up to fp32 rounding."""
    from scripts.profile_decode_kernel import rotatekv_logits_call

    q = real_looking(1, 32, 1, 128, torch.bfloat16, seed=4, device="cpu")
    torch.manual_seed(0)  # the cache's random codes and parameters
    logits = rotatekv_logits_call(1, 48, q, poison=True)()
    assert logits.shape == (1, 32, 48) and torch.isfinite(logits).all()
    torch.manual_seed(0)
    variant = rotatekv_logits_call(1, 48, q, poison=True, min_blocks=1, rope_per_tile=True)()
    torch.testing.assert_close(variant, logits, rtol=1e-5, atol=1e-5 * float(logits.abs().max()))


@pytest.mark.parametrize("case", [
    # head_dim, bits, G, head group, KV heads, dtype, channel order
    (64, 2, 32, 2, 2, torch.bfloat16, True), (64, 4, 16, 1, 3, torch.float16, False),
    (128, 2, 32, 4, 4, torch.bfloat16, True),
    (256, 2, 64, 8, 8, torch.float16, True)],
    ids=lambda c: f"d{c[0]}-k{c[1]}-g{c[2]}-hg{c[3]}-h{c[4]}-{str(c[5])[6:]}")
def test_rotatekv_key_kernels_emulated_equal_the_reference(emulated_ops, case):
    """kernels/rotatekv_keys.cu's flush and prefix read equal kernels.reference's CUDA-torch arithmetic of the method
    bit for bit (storage and outputs poisoned around what they write), every head group, 2 and 4 bits."""
    d, bits, g, head_group, hkv, dtype, order = case
    check_rotatekv_key_kernels("cpu", d, bits, g, head_group, hkv, dtype, order=order, seed=sum(case[:5]))


@pytest.mark.parametrize("case", [
    # head_dim, bits, G, bf16, heads, batch, tokens, clip ratio, layout
    (128, 2, 128, 1, 2, 2, 19, 0.96, "keys"), (64, 2, 64, 0, 3, 1, 16, 0.92, "values"),
    (256, 4, 128, 1, 1, 2, 7, 0.0, None), (128, 4, 64, 0, 2, 1, 12, 1.0, "values")])
def test_spectral_quantizer_emulated_bytes_equal_reference(emulated_ops, case):
    """quantize_spectral (quantile clip by counting, group min/max, fp32 scale/zero, exact division) equals
    kernels.reference.spectral_quantize byte for byte through the layout converters, into storage rows at a token
    offset with the rest untouched; real-looking rows (outlier channels: the clip bites) and lattice rows (ties at
    the threshold and in the codes); for the real-looking rows nearly every byte of the method's own CPU quantizer
    (which divides the span by the levels exactly, CUDA torch by a reciprocal)."""
    from kernels.reference import spectral_quantize

    d, bits, g, bf16, h, b, t, clip, layout = case
    dtype = torch.bfloat16 if bf16 else torch.float16
    x = real_looking(b, h, t, d, dtype, seed=d + t, device="cpu")
    if layout == "values":  # multiples of 1/8: equal magnitudes at the clip rank, exact ties in the codes
        x = (torch.randint(-12, 13, (b, h, t, d), generator=torch.Generator().manual_seed(t)) / 8).to(dtype)
    off, cap = 3, 16 * math.ceil((t + 3) / 16)
    keys, _ = ops.empty_storage("spectral", b + 1, h, cap, d, k_bits=bits, v_bits=bits, group_size=g, dtype=dtype,
                                device="cpu")
    for buf in keys.values():
        buf.fill_(0xA5) if buf.dtype == torch.uint8 else buf.fill_(float("nan"))
    ops.quantize_spectral(x, bits, g, clip, out=keys, rows=list(range(1, b + 1)), offsets=[off] * b,
                          decode_layout=layout)
    want = spectral_quantize(x, bits, g, clip)
    got = ops.value_decode_layout(keys, bits, g, inverse=True) if layout == "values" else keys
    for name in want:
        poison = got[name].eq(0xA5) if name == "codes" else got[name].isnan()
        assert poison[0].all() and poison[1:, :, :off].all() and poison[1:, :, off + t:].all(), name
    if layout == "keys":
        got = ops.token_key_decode_layout(got, bits, inverse=True)
    for name in want:
        assert torch.equal(got[name][1:, :, off:off + t], want[name]), name
    if layout != "values":  # (the lattice rows' ties make the two divisions differ more often)
        own = exact_method("spectral", h, d, bits, bits, g, "cpu")._quantize(x, bits, clip, None).buffers
        assert (own["codes"] == want["codes"]).float().mean() > 0.99


#: (case index, dtype): every case in bf16, and three in fp16
VARIANTS = [(i, torch.bfloat16) for i in range(len(CASES))] + [(i, torch.float16) for i in (0, 3, 4)]
EMULATED = [pytest.param(CASES[i], dtype, id=f"{_case_id(CASES[i])}-{str(dtype)[6:]}") for i, dtype in VARIANTS]


@pytest.mark.parametrize("case, dtype", EMULATED)
def test_decode_attention_emulated_matches_reference(emulated_ops, case, dtype):
    name, lengths, residuals, hq, hkv, d, kb, vb, g, options = case
    cache, _, _ = run_exact_case(name, lengths, residuals, hq, hkv, d, kb, vb, g, (2, 64), dtype, "cpu", rcap=32,
                                 data_seed=sum(lengths) + d, **options)
    assert int(cache["exact"]["count"].sum()) > 0


@pytest.mark.parametrize("name, g, options", [("ott", 32, dict(pool_size=3)), ("spectral", 64, dict(sink_tokens=40)),
                                              ("rotatekv", 32, dict(head_group=2))])
def test_exact_tokens_are_attended_exactly_once_emulated(emulated_ops, name, g, options):
    check_exact_tokens_count_once(name, "cpu", [32 * 4, 32 * 2], [5, 9], 4, 2, 64, g, splits=(2, 64), **options)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=lambda c: c[0])
def test_backend_rows_drive_the_kernels_emulated(emulated_ops, case):
    """kernels.backend.KERNELS for OTT, RotateKV and OSCAR: the rows' quantizer hooks (OTT's key flush by its pool
    kernel and KIVI's key kernel, RotateKV's and OSCAR's by their kernels, the values by the value kernel or
    OSCAR's; two chunks per row) and attention keywords
    (RotateKV's tables from the model's RoPE and the layer's channel order) attended by decode_attention match the
    reference of the method's quantization (the exact tokens placed from what the keys' hook and the method name)."""
    from kernels.backend import KERNELS
    from test_kernels_exact_methods import _place_exact
    from test_kernels_methods import assert_close_to_reference

    name, lengths, residuals, hq, hkv, d, kb, vb, g, options = case
    dtype, row = torch.bfloat16, KERNELS[name]
    cache = make_exact_cache(name, lengths, residuals, hkv, d, kb, vb, g, 32, dtype, data_seed=17, device="cpu",
                             **options)
    m, (ref_keys, ref_values) = cache["method"], cache["ref"]
    gq, cap = cache["kernel"]["group_size"], ref_keys["codes"].shape[2]
    keys, values = ops.empty_storage(name, len(lengths), hkv, cap, d, k_bits=kb, v_bits=vb, group_size=gq,
                                     dtype=dtype, device="cpu")
    exact = empty_exact(len(lengths), hkv, cache["exact"]["keys"].shape[2], d, cap, dtype, "cpu")
    flushed = KeptTokens(len(lengths), hkv, row.slots(m), d, cap, dtype, "cpu")  # OTT's flush stages here
    for i, (n, r) in enumerate(zip(lengths, residuals)):  # the cache's K/V (make_exact_cache's seeds)
        k = real_looking(1, hkv, n + r, d, dtype, seed=17 + i, device="cpu")[:, :, :n]
        v = real_looking(1, hkv, n + r, d, dtype, seed=117 + i, device="cpu")[:, :, :n] * 0.5
        state = m.new_state(1, hkv, "cpu")
        if name == "rotatekv":
            k = apply_rope(k.float(), *rope_tables(m._rotary, torch.arange(n), d)).to(dtype)
            state["sinks"].copy_(_sinks_of(cache, i, n))
        k = m.transform_key(k, 0)  # as the window holds them
        parts = []
        for start, stop in ((0, n // 2 // 32 * 32), (n // 2 // 32 * 32, n)):
            span = TokenSpan(torch.arange(1), start, state)
            where = dict(out=keys, rows=[i], offsets=[start])
            if name == "ott":
                pk = row.flush_keys(m, k[:, :, start:stop], v[:, :, start:stop], 0, span, flushed, **where)
            else:
                pk = row.quantize_keys(m, k[:, :, start:stop], 0, span, **where)
            row.quantize_values(m, v[:, :, start:stop], 0, span, out=values, rows=[i], offsets=[start])
            if name == "spectral":  # the kernels' (no kept tokens): the method's own names them
                pk = m.quantize_rotated_keys(k[:, :, start:stop], span)
            elif name == "rotatekv":
                pk = m.quantize_keys(k[:, :, start:stop], 0, span)
            else:  # the hook leaves its kept tokens to the cache (TokenSpan.kept_elsewhere): those kept() names
                assert "exact" not in pk.buffers
                mask = row.kept(m, state, torch.arange(1), start, stop - start)
                pk = pk.with_buffers(**keep_exact(k[:, :, start:stop], mask, start))
            parts.append((pk, m.quantize_values(v[:, :, start:stop], 0, span)))  # the method's: its kept values
        joined = [PackedTensor.cat([p[j] for p in parts]) for j in (0, 1)]
        _place_exact(exact, i, m, *joined, n)
    assert torch.equal(exact["skip"], cache["exact"]["skip"]) and torch.equal(exact["count"], cache["exact"]["count"])
    kwargs = row.attention(m, d, "cpu", layer_idx=0, capacity=cap, heads=hkv)
    q = cache["query"](real_looking(len(lengths), hq, 1, d, dtype, seed=7, device="cpu") * 2.0)
    out = ops.decode_attention(q, keys, values, cache["k_res"], cache["v_res"], *cache["counts"], k_bits=kb,
                               v_bits=vb, group_size=gq, scaling=1 / math.sqrt(d), exact=exact, splits=(2, 64),
                               out=torch.full_like(q, float("nan")), poison=True, **kwargs)
    from test_kernels_exact_methods import exact_reference_errors
    assert_close_to_reference(out, *exact_reference_errors(name, q, cache))


def test_launchers_refuse_the_exact_methods_without_their_inputs(emulated_ops):
    """Clear errors before any launch: no exact tokens, exact buffers of the wrong shape, RotateKV without its
    tables, OSCAR's parameters not in fp32, an integer zero for OSCAR."""
    q = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    res = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    counts = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    common = dict(k_bits=2, v_bits=2, group_size=32, scaling=0.1)
    keys, values = ops.empty_storage("ott", 1, 1, 64, 64, k_bits=2, v_bits=2, group_size=32, dtype=torch.bfloat16,
                                     device="cpu")
    with pytest.raises(ValueError, match="needs `exact`"):
        ops.decode_attention(q, keys, values, res, res, *counts, method="ott", **common)
    with pytest.raises(ValueError, match="exact skip must be"):
        ops.decode_attention(q, keys, values, res, res, *counts, method="ott",
                             exact=empty_exact(1, 1, 4, 64, 32, torch.bfloat16, "cpu"), **common)
    exact = empty_exact(1, 1, 4, 64, 64, torch.bfloat16, "cpu")
    keys, values = ops.empty_storage("rotatekv", 1, 1, 64, 64, k_bits=2, v_bits=2, group_size=32,
                                     dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="needs `rope`"):
        ops.decode_attention(q, keys, values, res, res, *counts, method="rotatekv", exact=exact, **common)
    keys16, values16 = ops.empty_storage("quarot", 1, 1, 64, 64, k_bits=2, v_bits=2, group_size=32,
                                         dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="fp32"):
        ops.decode_attention(q, keys16, values16, res, res, *counts, method="spectral", exact=exact, **common)
    with pytest.raises(ValueError, match="float zero point"):
        ops.decode_attention(q, keys16, values16, res, res, *counts, method="spectral", exact=exact,
                             zero_point="int", **common)
    rope = rotatekv_tables(torch.arange(64), 32, 1, rotatekv_rope(*rope_tables(rotary(64), torch.arange(2), 64),
                                                                 *rope_tables(rotary(64), torch.arange(16), 64)))
    with pytest.raises(ValueError, match="RoPE anchors"):
        ops.decode_attention(q, keys, values, res, res, *counts, method="rotatekv", exact=exact, rope=rope, **common)
