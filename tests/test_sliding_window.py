"""Sliding-window layers (Gemma 3): the quantized cache stores every token and the model's own
sliding-window mask hides the old ones, so attention sees what transformers' own cache keeps."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from oscar import build_method
from oscar.attention import attach, record_attention
from oscar.cache import QuantizedKVCache
from oscar.lm import KVModel
from tests.conftest import build_tiny

WINDOW = 16  # conf/model/tiny-gemma3.yaml: layers 0, 1 sliding, layer 2 global


@pytest.fixture(scope="module")
def tiny_gemma3():
    return build_tiny("tiny-gemma3")


@pytest.fixture(scope="module")
def tokenizer():
    from oscar.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@torch.no_grad()
def test_fp16_through_our_cache_generates_what_gemma3s_own_cache_does(tiny_gemma3):
    model = copy.deepcopy(tiny_gemma3)
    ids = torch.randint(3, 1000, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    ref = model.generate(input_ids=ids, cache=DynamicCache(config=model.config), max_new_tokens=20, do_sample=False,
                         pad_token_id=0)
    method = build_method("fp16")
    attach(model, method)
    cache = QuantizedKVCache.for_model(model, method)
    ours = model.generate(input_ids=ids, cache=cache, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, ref)
    counts = cache.token_counts(0)
    assert counts["keys_packed"] + counts["keys_residual"] == 3 * WINDOW + 19  # every token stored, old ones masked
    assert len(set(ours[0, 3 * WINDOW:].tolist())) > 1  # not a degenerate continuation


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """One query position: q [H_q, D], k/v [S, D] (one KV head) -> [H_q, D]."""
    return torch.softmax(q @ k.T * scaling, dim=-1) @ v


@torch.no_grad()
@pytest.mark.parametrize("name", ["kivi", "quarot"])
def test_a_quantized_method_on_a_sliding_layer_attends_only_the_last_window(name, tiny_gemma3, tokenizer):
    """Decode step after a prompt 3x the window: the sliding layer's output is attention over the last
    WINDOW stored (dequantized) tokens, the global layer's over all of them."""
    lm = KVModel(copy.deepcopy(tiny_gemma3), tokenizer, build_method(name, group_size=16, residual_length=16))
    cache = lm.new_cache()
    ids = torch.randint(3, 1000, (1, 3 * WINDOW + 5), generator=torch.Generator().manual_seed(1))
    lm.model(ids, cache=cache)
    assert cache.token_counts(0)["keys_packed"] > WINDOW  # quantized tokens beyond the window are stored
    with record_attention(lm.model) as records:
        lm.model(torch.tensor([[9]]), cache=cache)
    scaling = lm.model.config.query_pre_attn_scalar ** -0.5
    for layer, windowed in ((0, True), (1, True), (2, False)):
        call = records[layer][0]
        q, k, v = call["query"][0, :, -1], call["key"][0, 0], call["value"][0, 0]  # [H_q, D], [S, D], [S, D]
        assert k.shape[0] == 3 * WINDOW + 6
        out = call["output"][0, -1]  # [H_q, D]
        last = _attend(q, k[-WINDOW:], v[-WINDOW:], scaling)
        full = _attend(q, k, v, scaling)
        assert torch.allclose(out, last if windowed else full, atol=1e-5)
        assert not torch.allclose(out, full if windowed else last, atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("name", ["rotatekv", "spectral"])
def test_calibrated_methods_at_16_bits_leave_gemma3s_logits(name, tiny_gemma3, tokenizer, data_file, tmp_path):
    """RotateKV undoes and re-applies RoPE, which on Gemma 3 differs per layer type (theta 10K sliding, 1M
    global); OSCAR rotates Q/K and folds its V rotation (4 query heads on 1 KV head). At 16 bits both
    must give the unquantized logits on every layer, prefill and decode past the window."""
    from scripts.calibrate_rotatekv import squad_text

    calibrate = __import__(f"scripts.calibrate_{name}", fromlist=["calibrate"]).calibrate
    calib = calibrate(copy.deepcopy(tiny_gemma3), tokenizer, squad_text(data_file("qa/ruler_squad_v2_dev.json")),
                      windows=1, seq_len=64)
    torch.save(calib, tmp_path / "calibration.pt")
    method = build_method(name, k_bits=16, v_bits=16, residual_length=16, calibration=str(tmp_path / "calibration.pt"))
    lm = KVModel(copy.deepcopy(tiny_gemma3), tokenizer, method)
    ids = torch.randint(3, 1000, (1, 50), generator=torch.Generator().manual_seed(2))
    ref_cache, cache = DynamicCache(config=tiny_gemma3.config), lm.new_cache(quantize_prefill=True)
    assert torch.allclose(lm.model(ids, cache=cache).logits, tiny_gemma3(ids, cache=ref_cache).logits, atol=1e-4)
    for t in range(3):
        ours = lm.model(torch.tensor([[5 + t]]), cache=cache).logits
        ref = tiny_gemma3(torch.tensor([[5 + t]]), cache=ref_cache).logits
        assert torch.allclose(ours, ref, atol=1e-4), (t, (ours - ref).abs().max())


@pytest.mark.slow
@torch.no_grad()
def test_fp16_through_our_cache_equals_gemma3_270ms_own_cache_token_for_token(data_file):
    """The real Gemma 3 270M (sliding window 512) on a 700-token essay prompt, 24 greedy tokens."""
    from oscar.models import load_model

    model, tokenizer = load_model("gemma3-270m", device="cpu", dtype="float32")
    text = " ".join(p.read_text() for p in sorted(data_file("pg_essays").glob("*.txt"))[:5])
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :700]
    ref = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=24, do_sample=False)
    lm = KVModel(model, tokenizer, build_method("fp16"))
    ours = model.generate(ids, cache=lm.new_cache(), max_new_tokens=24, do_sample=False)
    assert torch.equal(ours, ref)


def _window_mask(lengths: list[int], t: int, window: int) -> torch.Tensor:
    """[B, 1, T, T] bool: causal, within ``window`` of the query, left-padded rows hide their pads (and a pad
    query sees no key: a fully masked row)."""
    q, k = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    rows = []
    for n in lengths:
        real = torch.arange(t) >= t - n
        rows.append((k <= q) & (q - k < window) & real.view(1, -1) & real.view(-1, 1))
    return torch.stack(rows).unsqueeze(1)


@torch.no_grad()
@pytest.mark.parametrize("window", [300, 100_000])  # a sliding layer, a causal (global) layer
def test_masked_blocks_attention_equals_sdpa_and_skips_hidden_keys(window, monkeypatch):
    """On a CPU a long prefill's queries go in blocks over the keys their mask rows allow: the output equals
    plain SDPA's (fp32, up to the order of the sums) and no block reads the keys its mask hides."""
    import oscar.attention as attention

    t, g = 2 * attention.QUERY_BLOCK + 300, torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, t, 64, generator=g)
    k, v = torch.randn(2, 1, t, 64, generator=g), torch.randn(2, 1, t, 64, generator=g)
    mask = _window_mask([t, t - 700], t, window)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 4, True, False
    plain = attention.sdpa_attention_forward
    want, _ = plain(module, q, k, v, mask, scaling=0.125)
    spans = []

    def spy(module, query, key, value, mask, **kwargs):
        spans.append(key.shape[2])
        return plain(module, query, key, value, mask, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    got, _ = attention.masked_blocks_attention(module, q, k, v, mask, scaling=0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(spans) == 3
    assert spans[0] == t  # the first block holds the padded row's pad queries (no allowed key): plain SDPA
    if window < t:
        assert spans[1] == attention.QUERY_BLOCK + window - 1 and spans[2] == 300 + window - 1
    else:
        assert spans[1:] == [2 * attention.QUERY_BLOCK, t]
