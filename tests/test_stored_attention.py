"""oscar.attention.stored_attention (the static caches' prefill attention) against attention computed row by row
in float64: left-padded chunks over each row's stored prefix, grouped-query heads, sliding windows, a row whose
whole chunk is padding. The FlashAttention path is the GPU test's (tests/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from oscar.attention import prefix_chunk_attention, stored_attention


class AttentionStub:
    """What SDPA's transformers wrapper reads of an attention module."""

    is_causal = True

    def __init__(self, groups: int):
        self.num_key_value_groups = groups


def row_by_row(query, keys, values, stored, new, scaling, window=None, block: int = 512):
    """[B, t, Hq, D] float64 on the inputs' device: each real query over its row's keys up to its position (within
    the window), one row and ``block`` queries at a time."""
    b, hq, t, d = query.shape
    hkv = keys.shape[1]
    out = torch.zeros(b, t, hq, d, dtype=torch.float64, device=query.device)
    for row in range(b):
        n = stored[row]
        k = keys[row, :, :n].double().repeat_interleave(hq // hkv, 0)  # [Hq, n, D]
        v = values[row, :, :n].double().repeat_interleave(hq // hkv, 0)
        j = torch.arange(n, device=query.device)
        for lo in range(t - new[row], t, block):
            i = torch.arange(lo, min(t, lo + block), device=query.device)
            position = (n - t + i).view(-1, 1)
            allowed = (j <= position) & (True if window is None else j > position - window)  # [q, n]
            scores = torch.einsum("hqd,hnd->hqn", query[row, :, i].double(), k) * scaling
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
            out[row, i] = torch.einsum("hqn,hnd->qhd", weights, v)
    return out


def case(stored, new, t, hkv=2, hq=6, d=16, capacity=None, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    capacity = capacity or max(stored) + 5
    b = len(stored)
    query = torch.randn(b, hq, t, d, generator=gen)
    # token-major storage [B, capacity, H, D] viewed head-major, as the static caches keep it
    keys = torch.randn(b, capacity, hkv, d, generator=gen).transpose(1, 2)
    values = torch.randn(b, capacity, hkv, d, generator=gen).transpose(1, 2)
    for row, n in enumerate(stored):  # past a row's tokens: stale values of another batch, never read
        keys[row, :, n:] = 1e4
        values[row, :, n:] = -1e4
    return [x.to(device, dtype) for x in (query, keys, values)]


@pytest.mark.parametrize("stored, new, t, window", [
    ([40, 40], [40, 40], 40, None),        # a whole prompt, no padding: causal
    ([40, 25], [40, 25], 40, None),        # a left-padded first chunk
    ([70, 55], [16, 16], 16, None),        # a later chunk over a stored prefix
    ([70, 9], [16, 0], 16, None),          # a row whose chunk is all padding
    ([70, 55], [16, 10], 16, 24),          # a sliding-window layer
    ([40, 40], [40, 40], 40, 24),          # a whole prompt longer than the window
])
def test_stored_attention_matches_row_by_row_attention(stored, new, t, window):
    query, keys, values = case(stored, new, t)
    got = stored_attention(AttentionStub(3), query, keys, values, stored, new, 0.25, window)
    want = row_by_row(query, keys, values, stored, new, 0.25, window)
    assert got.shape == (len(stored), t, 6, 16)
    for row, n in enumerate(new):
        torch.testing.assert_close(got[row, t - n:].double(), want[row, t - n:], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(got[row]).all()


def test_stored_attention_refuses_inconsistent_counts():
    query, keys, values = case([40], [40], 40)
    with pytest.raises(ValueError, match="stored tokens"):
        stored_attention(AttentionStub(3), query, keys, values, [30], [40], 0.25)


@pytest.mark.parametrize("prefix, t", [(0, 24), (50, 16), (1, 40)])
def test_prefix_chunk_attention_merges_the_two_softmaxes(prefix, t):
    """The chunk over its prefix and over itself, merged by log-sum-exp (the GPU path of an unpadded chunk over one
    prefix length), equals causal attention over prefix + chunk in float64 (here through PyTorch's CPU kernel)."""
    stored = [prefix + t] * 2
    query, keys, values = case(stored, [t, t], t)
    got = prefix_chunk_attention(query, keys[:, :, :prefix + t], values[:, :, :prefix + t], 0.25)
    want = row_by_row(query, keys, values, stored, [t, t], 0.25)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
