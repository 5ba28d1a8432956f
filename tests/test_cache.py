"""The quantized cache: flush policies, what attention sees, generation, padding, exactness."""

import copy

import pytest
import torch
from transformers import DynamicCache

from oscar import build_method
from oscar.attention import attach
from oscar.cache import QuantizedKVCache, QuantizedKVLayer, left_pad_lengths
from tests.test_quant import kv_like

R, G = 64, 32


def expected_counts(policy: str, t: int) -> dict:
    k_packed = t - t % R
    v_packed = max(0, t - R) if policy == "kivi" else k_packed
    return dict(keys_packed=k_packed, keys_residual=t - k_packed, values_packed=v_packed, values_residual=t - v_packed)


@pytest.mark.parametrize("policy", ["kivi", "block"])
@pytest.mark.parametrize("prefill", [1, R - 1, R, R + 1, 3 * R + 5])
def test_prefill_flush_boundaries(policy, prefill):
    layer = QuantizedKVLayer(build_method("kivi", group_size=G, residual_length=R, flush=policy), 0)
    x = kv_like(b=1, h=2, t=prefill, d=64)
    k, v = layer.update(x, x + 1)
    assert k.shape == x.shape and v.shape == x.shape
    assert layer.token_counts() == expected_counts(policy, prefill)
    assert layer.get_seq_length() == prefill


@pytest.mark.parametrize("policy", ["kivi", "block"])
def test_decode_across_flush_boundaries(policy):
    layer = QuantizedKVLayer(build_method("oscar", group_size=G, residual_length=R, flush=policy), 0)
    x = kv_like(b=1, h=2, t=3 * R + 3, d=64)
    start = R - 2
    layer.update(x[:, :, :start], x[:, :, :start])
    for t in range(start + 1, x.shape[2] + 1):
        k, _ = layer.update(x[:, :, t - 1:t], x[:, :, t - 1:t])
        assert k.shape[2] == t
        assert layer.token_counts() == expected_counts(policy, t), t


def test_decode_tokens_really_get_quantized_and_are_never_requantized():
    method = build_method("kivi", group_size=G, residual_length=R)
    layer = QuantizedKVLayer(method, 0)
    x = kv_like(b=1, h=2, t=3 * R, d=64)
    layer.update(x[:, :, :1], x[:, :, :1])
    first_chunk = None
    for t in range(1, 3 * R):
        k, _ = layer.update(x[:, :, t:t + 1], x[:, :, t:t + 1])
        if t == R and first_chunk is None:
            first_chunk = {n: b.clone() for n, b in layer.groups[0].keys.packed.buffers.items()}
    packed = layer.groups[0].keys.packed
    for name, buf in first_chunk.items():  # the first flushed chunk is stored unchanged
        assert torch.equal(packed.buffers[name][:, :, :buf.shape[2]], buf)
    k, _ = layer.update(x[:, :, :1], x[:, :, :1])
    decoded = k[:, :, R:2 * R]  # tokens that arrived one at a time during decoding
    assert not torch.equal(decoded, x[:, :, R:2 * R])  # they are stored quantized, as one block of R
    assert torch.equal(decoded, method.dequantize(method.quantize_keys(x[:, :, R:2 * R], 0)))


@pytest.mark.parametrize("quantize_prefill", [False, True])
def test_prefill_attention_sees_full_precision_unless_asked(quantize_prefill):
    method = build_method("oscar", group_size=G, residual_length=R)
    layer = QuantizedKVLayer(method, 0, quantize_prefill=quantize_prefill)
    x = kv_like(b=1, h=2, t=2 * R + 5, d=64)
    k, v = layer.update(x, x)
    rotated = method.transform_key(x, 0)
    assert torch.allclose(k[:, :, -5:], rotated[:, :, -5:], atol=1e-5)  # residual tokens: exact
    assert torch.allclose(k, rotated, atol=1e-5) != quantize_prefill
    assert torch.equal(v, x) != quantize_prefill


def test_left_pad_lengths():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert left_pad_lengths(mask) == [2, 0]
    with pytest.raises(ValueError, match="left padding"):
        left_pad_lengths(torch.tensor([[1, 1, 0, 0]]))


def _generate(model, method, ids, mask=None, steps=24):
    attach(model, method)
    cache = QuantizedKVCache.for_model(model, method, mask)
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=steps, do_sample=False,
                         pad_token_id=0)
    return out[:, ids.shape[1]:], cache


def test_fp16_method_generates_exactly_what_dynamic_cache_does(tiny_llama):
    ids = torch.randint(3, 1000, (1, 77), generator=torch.Generator().manual_seed(0))
    ref = tiny_llama.generate(input_ids=ids, cache=DynamicCache(), max_new_tokens=24, do_sample=False, pad_token_id=0)
    ours, cache = _generate(tiny_llama, build_method("fp16"), ids)
    assert torch.equal(ours, ref[:, ids.shape[1]:])
    assert cache.get_seq_length() == 77 + 24 - 1


@pytest.mark.parametrize("name", ["kivi", "oscar"])
def test_sample_alone_equals_sample_in_left_padded_batch(name):
    from tests.conftest import build_tiny

    model = build_tiny("tiny-llama")
    method = build_method(name, group_size=16, residual_length=32)
    method.prepare_model(model)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 1000, (1, 70), generator=g), torch.randint(3, 1000, (1, 45), generator=g)
    alone = [_generate(model, method, x)[0] for x in (a, b)]
    ids = torch.cat([a, torch.cat([torch.zeros(1, 25, dtype=torch.long), b], dim=1)])
    mask = (torch.arange(70)[None] >= torch.tensor([[0], [25]])).long()
    batch, cache = _generate(model, method, ids, mask)
    assert torch.equal(batch[0:1], alone[0]) and torch.equal(batch[1:2], alone[1])
    counts = cache.token_counts(0)  # pad tokens are never stored
    assert counts["keys_packed"] + counts["keys_residual"] == (70 + 23) + (45 + 23)


@torch.no_grad()
def test_oscar_at_16_bits_gives_the_logits_of_the_unquantized_model(tiny_llama):
    """Rotation of Q/K and the folded V rotation change nothing in exact arithmetic (16-bit keys: stored unscaled)."""
    model = copy.deepcopy(tiny_llama)
    method = build_method("oscar", k_bits=16, v_bits=16, group_size=16, residual_length=32)
    method.prepare_model(model)
    attach(model, method)
    ids = torch.randint(3, 1000, (1, 100), generator=torch.Generator().manual_seed(2))
    ref_cache, cache = DynamicCache(), QuantizedKVCache.for_model(model, method, quantize_prefill=True)
    ref = tiny_llama(input_ids=ids[:, :80], cache=ref_cache).logits
    ours = model(input_ids=ids[:, :80], cache=cache).logits
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    for t in range(80, 100):  # decoding across the flush at 96 tokens
        ref = tiny_llama(input_ids=ids[:, t:t + 1], cache=ref_cache).logits
        ours = model(input_ids=ids[:, t:t + 1], cache=cache).logits
        assert torch.allclose(ours, ref, atol=1e-4), (t, (ours - ref).abs().max())
    assert cache.token_counts(0)["keys_packed"] == 96


def test_cache_rejects_batch_size_mismatch_and_beam_search(tiny_llama):
    method = build_method("kivi")
    cache = QuantizedKVCache(method, num_layers=2, pad_lengths=[0, 3])
    with pytest.raises(ValueError, match="made for a batch of 2 rows and the forward sends 1 row: make one cache per batch"):
        cache.update(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), 0)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.layers[1].reorder_cache(torch.tensor([0]))
