"""The four baselines (QuaRot, RotateKV, OTT, TurboQuant+): each one's defining property. What every method
shares (8 bits ~ fp16, padded batches, both prefill modes, ...) is in tests/test_conformance.py."""

from __future__ import annotations

import math

import pytest
import torch

from methods.rotatekv import effective_head_group, grouped_head_hadamard, permute_channels
from oscar import build_method
from oscar.attention import record_attention
from oscar.exact import keep_exact, restore_exact
from oscar.lm import KVModel
from oscar.method import SequenceState, TokenSpan
from oscar.quant import hadamard, hadamard_matrix, lloyd_max_gaussian
from oscar.rope import apply_rope, undo_rope
from tests.conftest import build_tiny
from tests.test_quant import kv_like


@pytest.fixture(scope="module")
def tokenizer():
    from oscar.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def tiny_calibration(tmp_path_factory, tokenizer, data_file) -> str:
    """RotateKV's channel order for tiny-llama, from the calibration script on a short text."""
    from scripts.calibrate_rotatekv import calibrate, squad_text

    result = calibrate(build_tiny("tiny-llama"), tokenizer, squad_text(data_file("qa/ruler_squad_v2_dev.json")),
                       windows=2, seq_len=64)
    path = tmp_path_factory.mktemp("calibration") / "rotatekv_tiny-llama.pt"
    torch.save(result, path)
    return str(path)


# ----------------------------------------------------------------------------- configs


def test_rotatekv_missing_calibration_names_the_command(tmp_path):
    method = build_method("rotatekv", calibration=str(tmp_path / "rotatekv_some-model.pt"))
    with pytest.raises(FileNotFoundError, match="scripts/calibrate_rotatekv.py --model some-model"):
        method.check_model(head_dim=64, num_kv_heads=4)
    build_method("rotatekv", reorder=False).check_model(head_dim=64, num_kv_heads=4)  # no file needed


# ----------------------------------------------------------------------------- QuaRot


def test_quarot_quantizes_each_token_alone_in_channel_groups_after_a_hadamard():
    method = build_method("quarot", k_bits=2, group_size=32)
    k = kv_like(t=16, d=64, seed=3)
    packed = method.quantize_keys(k, 0)
    assert packed.meta["axis"] == "token" and packed.buffers["scale"].shape == (*k.shape[:3], 64 // 32)
    changed = k.clone()
    changed[:, :, 5] *= 40  # per-token groups: no other token may move
    other = method.dequantize(method.quantize_keys(changed, 0))
    keep = torch.arange(16) != 5
    assert torch.equal(other[:, :, keep], method.dequantize(packed)[:, :, keep])
    q = kv_like(t=4, d=64, seed=4)
    exact = build_method("quarot", k_bits=16, v_bits=16)
    scores = exact.transform_query(q, 0) @ exact.dequantize(exact.quantize_keys(k, 0)).transpose(-1, -2)
    assert torch.allclose(scores, q @ k.transpose(-1, -2), atol=1e-4)
    assert torch.allclose(method.transform_key(k, 0), k @ hadamard_matrix(64), atol=1e-5)


def test_quarot_clip_ratio_shrinks_the_range():
    k = kv_like(t=8, d=64, seed=5)
    full = build_method("quarot").quantize_keys(k, 0).buffers["scale"]
    clipped = build_method("quarot", clip_ratio=0.8).quantize_keys(k, 0).buffers["scale"]
    assert torch.allclose(clipped, 0.8 * full, rtol=1e-5)


# ----------------------------------------------------------------------------- TurboQuant+


def test_turboquant_codebook_is_the_gaussian_lloyd_max_quantizer():
    levels = lloyd_max_gaussian(2)
    assert levels == pytest.approx([-1.5104, -0.4528, 0.4528, 1.5104], abs=1e-4)
    # centroid condition, checked by sampling: each level is the mean of N(0, 1) over its cell
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cells = torch.bucketize(x, torch.tensor([(a + b) / 2 for a, b in zip(levels, levels[1:])], dtype=torch.float64))
    for i, level in enumerate(levels):
        assert x[cells == i].mean().item() == pytest.approx(level, abs=5e-3)
    d = 128
    method = build_method("turboquant")
    assert method.codebook(2, d).tolist() == pytest.approx([lv / math.sqrt(d) for lv in levels], rel=1e-6)


def test_turboquant_stores_2_5_bits_per_value_and_exact_block_norms():
    method = build_method("turboquant", k_bits=2, group_size=32)
    k = kv_like(t=64, d=128, seed=6).half()
    packed = method.quantize_keys(k, 0)
    assert 8 * packed.nbytes / k.numel() == 2.5
    assert set(packed.buffers) == {"codes", "norm"} and packed.buffers["norm"].dtype == torch.float16
    k_hat = method.dequantize(packed).float()
    signs = method.signs(128)
    # in the rotated space every block of 32 keeps its norm (fp16 rounding aside)
    y, y_hat = hadamard(k.float() * signs), hadamard(k_hat * signs)
    block_norm = lambda t: t.view(*t.shape[:3], 4, 32).norm(dim=-1)  # noqa: E731
    assert torch.allclose(block_norm(y_hat), block_norm(y), rtol=2e-3)
    rel = ((k_hat - k.float()).norm() / k.float().norm()).item()
    assert 0.25 < rel < 0.40  # Lloyd-Max 2-bit Gaussian: relative MSE 0.1175 -> error ~0.34


def test_turboquant_bits_per_value_with_the_residual_window(tiny_llama, tokenizer):
    lm = KVModel(tiny_llama, tokenizer, build_method("turboquant", residual_length=32))
    ids = torch.randint(0, 1000, (1, 96), generator=torch.Generator().manual_seed(0))
    cache = lm.new_cache(quantize_prefill=True)
    with torch.no_grad():
        tiny_llama(ids, cache=cache)
    counts = cache.token_counts(0)
    h, d = 2, 64
    values_per_token = h * d
    expected_bits = 2.5 * (counts["keys_packed"] + counts["values_packed"]) + 32 * (
        counts["keys_residual"] + counts["values_residual"])  # the residual is float32 here
    layers = len(cache.layers)
    assert 8 * cache.nbytes == pytest.approx(layers * values_per_token * expected_bits)
    assert counts["keys_packed"] == 96 and counts["values_packed"] == 64  # kivi policy, R = 32


# ----------------------------------------------------------------------------- OTT


def test_ott_excluded_tokens_come_back_exactly_and_group_ranges_shrink():
    k = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    k[..., :4] += 8.0  # outlier channels ...
    k[:, :, 3] *= 0.02  # ... in which token 3 (group 0) and token 40 (group 1) are abnormally small
    k[:, :, 40] *= 0.02
    ott, kivi = build_method("ott", outliers_per_group=1), build_method("kivi")
    packed = ott.quantize_keys(k, 0)
    k_hat = ott.dequantize(packed)
    assert torch.equal(k_hat[:, :, 3], k[:, :, 3]) and torch.equal(k_hat[:, :, 40], k[:, :, 40])
    assert torch.equal(packed.buffers["exact_pos"].flatten(2).unique(), torch.tensor([3, 40], dtype=torch.int32))
    scale_ott, scale_kivi = packed.buffers["scale"], kivi.quantize_keys(k, 0).buffers["scale"]
    assert (scale_ott <= scale_kivi + 1e-6).all()
    assert (scale_ott[..., :4] < 0.7 * scale_kivi[..., :4]).all()  # the outlier channels' ranges shrink
    rest = torch.ones(64, dtype=torch.bool)
    rest[[3, 40]] = False
    err = lambda x: (x[:, :, rest, :4] - k[:, :, rest, :4]).norm()  # noqa: E731
    assert err(k_hat) < 0.6 * err(kivi.dequantize(kivi.quantize_keys(k, 0)))


def test_ott_pool_is_bounded_per_sequence_and_lives_in_the_state_the_cache_hands_over():
    ott = build_method("ott", pool_size=3, outliers_per_group=1, scope="token")
    rows = torch.tensor([0, 1])
    state = SequenceState(ott)
    state.allocate(2, 3, "cpu")
    pooled = []
    for start in (0, 64, 128):
        packed = ott.quantize_keys(kv_like(b=2, t=64, seed=start), 0, span=TokenSpan(rows, start, state.tensors))
        pos = packed.buffers["exact_pos"]
        assert pos.shape[1] == 1 and (pos[pos >= 0] >= start).all()
        pooled += [int(p) for p in pos[0].flatten() if p >= 0]
    assert len(pooled) == 3  # 2 groups per chunk, but the pool holds 3
    assert state.tensors["pool"][0, 0].tolist() == pooled  # the state holds them, in token order
    v = ott.quantize_values(kv_like(b=2, t=64, seed=9), 0, span=TokenSpan(rows, 0, state.tensors))
    assert int((v.buffers["exact_pos"][0] >= 0).sum()) == 2  # values of the first chunk's outliers
    alone = ott.quantize_values(kv_like(b=2, t=64, seed=9), 0)  # no state: nothing pooled
    assert alone.buffers["exact_pos"].shape[2] == 0
    state.reset()
    fresh = ott.quantize_keys(kv_like(b=2, t=64, seed=10), 0, span=TokenSpan(rows, 0, state.tensors))
    assert int((fresh.buffers["exact_pos"][0] >= 0).sum()) == 2  # a reset state: new sequences, an empty pool


def test_ott_without_kept_values_dequantizes_them_as_kivi():
    """keep_values=false: the values keep no token (the keys still pool theirs) and dequantize as KIVI's."""
    ott, kivi = build_method("ott", keep_values=False), build_method("kivi")
    v = kv_like(b=2, t=64, seed=12)
    packed = ott.quantize_values(v, 0)
    assert "exact" not in packed.buffers
    assert torch.equal(ott.dequantize(packed), kivi.dequantize(kivi.quantize_values(v, 0)))


def test_keep_and_restore_exact_over_concatenated_chunks():
    from oscar.quant import PackedTensor

    x = kv_like(b=2, h=3, t=20, seed=11)
    masks = [torch.zeros(2, 3, 10, dtype=torch.bool) for _ in range(2)]
    masks[0][0, 1, [2, 7]] = True
    masks[0][1, 2, 0] = True
    masks[1][1, 0, 9] = True
    parts = [PackedTensor(keep_exact(x[:, :, 10 * i:10 * (i + 1)], m, 10 * i), (2, 3, 10, 64), x.dtype)
             for i, m in enumerate(masks)]
    whole = PackedTensor.cat(parts)
    restored = restore_exact(torch.zeros_like(x), whole.buffers)
    mask = torch.cat(masks, dim=-1)
    assert torch.equal(restored[mask], x[mask]) and (restored[~mask] == 0).all()


# ----------------------------------------------------------------------------- RotateKV


def test_rotatekv_key_transform_is_invertible_and_mixes_grouped_heads(tiny_calibration, tiny_llama):
    method = build_method("rotatekv", calibration=tiny_calibration)
    method.prepare_model(tiny_llama)
    k = kv_like(h=2, t=16, d=64, seed=12)
    for reorder_first in (False, True):
        method.reorder_first = reorder_first
        z = method.to_rotated(k, 1)
        assert torch.allclose(method.from_rotated(z, 1), k, atol=1e-5)
        assert torch.allclose(z.norm(), k.norm(), rtol=1e-5)
    order = method._orders[1]
    assert sorted(order.tolist()) == list(range(2 * 64)) and not torch.equal(order, torch.arange(128))
    x = kv_like(h=4, t=4, d=64, seed=13)
    bumped = x.clone()
    bumped[:, 0] += 1.0
    moved = (grouped_head_hadamard(bumped, 4) - grouped_head_hadamard(x, 4)).abs().amax(dim=(0, 2, 3))
    assert (moved > 1e-3).all()  # a change in head 0 reaches all 4 heads of the group
    assert torch.allclose(grouped_head_hadamard(grouped_head_hadamard(x, 4), 4), x, atol=1e-5)
    assert torch.equal(permute_channels(permute_channels(x, torch.arange(256).flip(0)), torch.arange(256).flip(0)), x)
    assert [effective_head_group(4, h) for h in (8, 4, 2, 3, 6)] == [4, 4, 2, 1, 2]


def test_rope_inverse_is_exact():
    x = kv_like(h=2, t=8, d=64, seed=14)
    angles = torch.randn(8, 32)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    assert torch.allclose(undo_rope(apply_rope(x, cos, sin), cos, sin), x, atol=1e-5)
    assert torch.allclose(undo_rope(apply_rope(x, 2 * cos, 2 * sin), 2 * cos, 2 * sin), x, atol=1e-5)


def test_rotatekv_at_16_bits_leaves_the_logits_unchanged(tiny_calibration, tokenizer):
    ids = torch.randint(0, 1000, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = build_tiny("tiny-llama")(ids).logits
        model = build_tiny("tiny-llama")
        lm = KVModel(model, tokenizer, build_method("rotatekv", k_bits=16, v_bits=16, residual_length=0,
                                               calibration=tiny_calibration))
        out = model(ids, cache=lm.new_cache(quantize_prefill=True)).logits
    assert torch.allclose(out, ref, atol=1e-4)


def test_rotatekv_keeps_the_massive_activation_tokens_exactly(tiny_calibration, tokenizer):
    method = build_method("rotatekv", num_sinks=3, sink_select="tokens", calibration=tiny_calibration)
    hidden = torch.randn(2, 10, 16)
    hidden[0, 4, 7] = 500.0
    hidden[1, 9, 2] = -300.0
    real = torch.ones(2, 10, dtype=torch.bool)
    real[1, :3] = False  # left padding: stream index = position among real tokens
    sinks = method.select_sinks(hidden, real)[:, 0]
    assert 4 in sinks[0].tolist() and 6 in sinks[1].tolist() and (sinks >= 0).sum(-1).tolist() == [3, 3]
    assert sinks[0].tolist() == sorted(sinks[0].tolist())

    # end to end: prefill in full precision, then the stored sink tokens must equal what the model cached
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(2))
    model = build_tiny("tiny-llama")
    lm = KVModel(model, tokenizer, build_method("rotatekv", residual_length=0, calibration=tiny_calibration))
    cache = lm.new_cache(quantize_prefill=False)
    with torch.no_grad(), record_attention(model) as seen:
        model(ids, cache=cache)
    for layer in (0, 1):
        sinks = cache.sequence_state(layer).tensors["sinks"][0, 0]
        kept = sinks[sinks >= 0]
        others = torch.ones(64, dtype=torch.bool)
        others[kept] = False
        assert 1 <= len(kept) <= 20
        stored = cache.layers[layer].groups[0]
        for stream, name in ((stored.keys, "key"), (stored.values, "value")):
            x, x_hat = seen[layer][0][name], lm.method.dequantize(stream.packed)
            assert torch.equal(x_hat[:, :, kept], x[:, :, kept])
            assert not torch.equal(x_hat[:, :, others], x[:, :, others])  # the rest is quantized


@pytest.mark.parametrize("sink_select", ["elements", "tokens"])
def test_rotatekv_sinks_of_a_padded_batch_are_each_rows_own(tiny_calibration, sink_select):
    """The batched sink search (on the device, no host read) finds what a search row by row over the real tokens
    alone finds: the tokens of the top |h| entries (a token holding several of them once) or of the top max |h|,
    as stream indices, ascending, -1 after; a row with fewer real tokens than sinks keeps them all."""
    method = build_method("rotatekv", num_sinks=6, sink_select=sink_select, calibration=tiny_calibration)
    hidden = torch.randn(3, 12, 8, generator=torch.Generator().manual_seed(4))
    hidden[0, 5, :4] = 50.0 + torch.arange(4.0)  # one token with several of the top entries
    real = torch.ones(3, 12, dtype=torch.bool)
    real[1, :4] = False
    real[2, :9] = False  # 3 real tokens, fewer than the sinks
    hidden[1, :4] = 1e4  # padding with the largest values is never a sink
    got = method.select_sinks(hidden, real)[:, 0]
    for row in range(3):
        h = hidden[row, real[row]].abs()
        if sink_select == "elements":
            want = torch.unique(h.flatten().topk(min(6, h.numel())).indices // h.shape[1])
        else:
            want = torch.sort(h.amax(-1).topk(min(6, h.shape[0])).indices).values
        assert got[row].tolist() == want.tolist() + [-1] * (6 - len(want)), row
    assert got[2].tolist()[:3] == [0, 1, 2] and (got[0] == 5).sum() == 1


def test_rotatekv_sink_hooks_leave_another_methods_cache_alone(tokenizer):
    """A model RotateKV prepared (its sink hooks on every layer) then runs another method's cache (a benchmark timing
    several methods on one model prepares each directly, as benchmarks.harness prepares each method): the hooks find no sinks
    of theirs there and do nothing."""
    from oscar.attention import attach
    from oscar.cache import QuantizedKVCache

    model = build_tiny("tiny-llama")
    rotatekv = build_method("rotatekv", reorder=False)
    rotatekv.prepare_model(model)
    ott = build_method("ott", pool_size=4, residual_length=32)
    ott.prepare_model(model)
    attach(model, ott)
    cache = QuantizedKVCache.for_model(model, ott)
    ids = torch.randint(0, 1000, (1, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, cache=cache)
    assert set(cache.sequence_state(0).tensors) == {"pool"} and (cache.sequence_state(0).tensors["pool"] >= 0).any()


def test_rotatekv_refuses_positions_that_are_not_stream_indices(tiny_calibration, tokenizer):
    model = build_tiny("tiny-llama")
    lm = KVModel(model, tokenizer, build_method("rotatekv", calibration=tiny_calibration))
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :5] = 0
    with pytest.raises(ValueError, match="position_ids"), torch.no_grad():
        model(ids, attention_mask=mask, cache=lm.new_cache(mask))  # positions 0..39 include the pads
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions, cache=lm.new_cache(mask))
