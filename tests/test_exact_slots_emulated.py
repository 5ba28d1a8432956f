"""The exact slots' kernels on the CPU emulator against their references, bit for bit.

kernels/ott_pool.cu: OTT.pool_outliers (the pool's admission and the filled chunk) followed by KeptTokens.stage of
the tokens it pooled (slots, their positions, the skip words), on fresh random keys, keys with a low-norm sink and
huge magnitudes, and SmolLM2's own post-RoPE keys; pools part full, nearly full and full, slots staged before (a
chunk quantized again), rows of the storage out of order. The chunk out of the kernel is NaN-poisoned first.
kernels/kept_tokens.cu: KeptTokens.write against restore_exact of KeptTokens.restore, over a chunk and a strided
window; KeptTokens.stage_positions against KeptTokens.stage of the positions' mask. Through the whole cache:
tests/test_cupy_cache_emulated.py and tests/test_continuous_emulated.py."""

from __future__ import annotations

import pytest
import torch
from test_kernels import real_looking
from test_method_kernels_emulated import emulated_ops, emulator_libraries  # noqa: F401 (fixtures)

from kernels.kept_tokens import KeptTokens
from kernels.ott_pool import pool_outliers
from oscar import build_method
from oscar.exact import positions_mask, restore_exact
from oscar.method import TokenSpan


def reference(m, k, values, pool, rows, start, kept):
    """The torch path: the method's pool_outliers on a span of ``rows``, then the stage of its mask."""
    span = TokenSpan(torch.tensor(rows, device=k.device), start, {"pool": pool})
    filled, mask = m.pool_outliers(k, span)
    kept.stage(span.rows, start, mask, k, values)
    return filled


def check(m, k, values, pool, rows, start, staged_before=()):
    """The kernel's filled chunk, pools and exact slots equal the reference's, from the same state (``pool``, and
    ``staged_before``: (row, position) pairs staged in every head first), on k's device (the GPU's test:
    tests/test_kernels_exact_methods.py). Returns the pools after."""
    b, h, t, d = k.shape
    states = []
    for _ in range(2):
        kept = KeptTokens(pool.shape[0], h, m.pool_size, d, start + t + 64, k.dtype, k.device)
        for row, position in staged_before:
            mask = torch.ones(1, 1, 1, dtype=torch.bool, device=k.device)
            token = torch.randn(1, h, 1, d, generator=torch.Generator().manual_seed(position)).to(k)
            kept.stage(torch.tensor([row], device=k.device), position, mask, token, token)
        states.append((pool.clone(), kept))
    (want_pool, want_kept), (got_pool, got_kept) = states
    want = reference(m, k, values, want_pool, rows, start, want_kept)
    out = torch.full_like(k, float("nan"))
    got = pool_outliers(k, values, got_pool, torch.tensor(rows, device=k.device), start, got_kept, m.group_size,
                        m.outliers_per_group, out=out)
    assert got is out and torch.equal(got, want)
    assert torch.equal(got_pool, want_pool)
    assert torch.equal(got_kept.slot_positions, want_kept.slot_positions)
    for name in ("keys", "values", "skip"):
        assert torch.equal(got_kept.buffers[name], want_kept.buffers[name]), name
    return want_pool


def ott(**options):
    return build_method("ott", **{"group_size": 32, "residual_length": 128, **options})


@pytest.mark.parametrize("scope, per_group, g, d, dtype", [("head", 1, 32, 64, torch.bfloat16),
                                                           ("head", 3, 64, 128, torch.float16),
                                                           ("token", 2, 32, 64, torch.bfloat16)])
def test_pool_and_stage_match_the_method_on_fresh_keys(emulated_ops, scope, per_group, g, d, dtype):
    """Two chunk rows into storage rows 2 and 0 (of 3), a pool part full, then the next chunk of the same rows: the
    pool fills up mid-chunk (later candidates refused) and the slots take what it admitted."""
    m = ott(scope=scope, outliers_per_group=per_group, group_size=g, pool_size=4)
    h = 2
    pool = m.new_state(3, h, "cpu")["pool"]
    pool[2, :, :2] = torch.tensor([3, 9])
    for start, seed in ((64, 0), (64 + 2 * g, 1)):
        k = real_looking(2, h, 2 * g, d, dtype, seed=seed, device="cpu")
        values = torch.randn(2, h, 2 * g, d, generator=torch.Generator().manual_seed(seed + 10)).to(dtype)
        pool = check(m, k, values, pool, [2, 0], start)
    assert (pool[[0, 2]] >= 0).all(), "the case must fill the pools"


def test_a_full_pool_admits_nothing_and_a_restaged_chunk_stages_nothing_again(emulated_ops):
    """A full pool leaves the chunk as it came (no slot, no skip bit); positions at or before a head's last staged
    one are not staged again (a chunk quantized again after a stage quantized ahead)."""
    m = ott(pool_size=4)
    k = real_looking(1, 2, 64, 64, torch.bfloat16, seed=3, device="cpu")
    full = torch.arange(4).repeat(1, 2, 1).long()
    check(m, k, k, full, [0], 32)
    pooled = check(m, k, k, m.new_state(1, 2, "cpu")["pool"], [0], 32)
    again = int(pooled[0, 0, 1])  # the second token head 0 pools: staged before, and the first with it
    check(m, k, k, m.new_state(1, 2, "cpu")["pool"], [0], 32, staged_before=[(0, again)])


def test_huge_and_tiny_keys_pool_the_same_tokens(emulated_ops):
    """At RMS 1e30 and 1e-30 the norms are taken scaled by a power of two, as the reference takes them."""
    m = ott(scope="head", pool_size=8)
    k = real_looking(1, 2, 64, 64, torch.float32, seed=5, device="cpu")
    for scale in (1e30, 1e-30):
        check(m, (k * scale).to(torch.bfloat16), k.to(torch.bfloat16), m.new_state(1, 2, "cpu")["pool"], [0], 0)


def test_on_smollm2_keys(emulated_ops):
    """SmolLM2-135M's post-RoPE keys of a real prompt (three KV heads of 64 channels), per head and per token."""
    from oscar.models import load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="bfloat16")
    text = "The history of the city goes back to Roman times, when a small fort was built on the river bank. " * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :96]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    keys, values = cache.layers[3].keys, cache.layers[3].values
    for scope in ("head", "token"):
        m = ott(scope=scope, pool_size=6)
        pool = m.new_state(1, keys.shape[1], "cpu")["pool"]
        check(m, keys[:, :, :96].contiguous(), values[:, :, :96].contiguous(), pool, [0], 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_puts_back_what_restore_gives(emulated_ops, dtype):
    check_write(dtype, "cpu")


def check_write(dtype, device):
    """Kept tokens of rows [2, 0] (of 3) over ranges that hold some, all or none of them, written over a random chunk
    and over a strided window slice: restore_exact of restore's buffers, every other element as it was."""
    h, d = 3, 64
    kept = KeptTokens(3, h, 4, d, 256, dtype, device)
    gen = torch.Generator().manual_seed(7)
    keys, values = (torch.randn(3, h, 128, d, generator=gen).to(device, dtype) for _ in range(2))
    mask = torch.zeros(3, h, 128, dtype=torch.bool, device=device)  # kept at both edges of [32, 80), inside and outside
    for row, head, positions in ((0, 0, [3, 32, 80]), (0, 1, [70, 79]), (2, 2, [33, 127]), (2, 0, [0, 31, 47]),
                                 (1, 1, [50])):
        mask[row, head, positions] = True
    kept.stage(torch.arange(3, device=device), 0, mask, keys, values)
    for stream in ("keys", "values"):
        for start, n in ((32, 48), (0, 128), (200, 16)):
            chunk = torch.randn(2, h, n, d, generator=gen).to(device, dtype)
            want = restore_exact(chunk.clone(), kept.restore(stream, [2, 0], start, n), start)
            assert torch.equal(kept.write(stream, [2, 0], start, n, chunk.clone()), want), (stream, start)
            window = torch.randn(2, h, n + 40, d, generator=gen).to(device, dtype)
            inside = window[:, :, 5:5 + n]
            expected = window.clone()
            expected[:, :, 5:5 + n] = restore_exact(inside.clone(), kept.restore(stream, [2, 0], start, n), start)
            kept.write(stream, [2, 0], start, n, inside)
            assert torch.equal(window, expected), (stream, start)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stage_positions_is_the_stage_of_their_mask(emulated_ops, dtype):
    check_stage_positions(dtype, "cpu")


def check_stage_positions(dtype, device):
    """KeptTokens.stage_positions (kernels/kept_tokens.cu) against KeptTokens.stage of positions_mask, bit for bit
    (slots, their positions, skip words): lists per head and one for every head, one list for every row, with -1
    entries, repeats, positions outside the chunk, before a (row, head)'s last staged one and more than its free
    slots; rows out of order, a chunk as a strided window slice, a value map; a prefill-sized chunk and a decode
    stage after it."""
    h, d, slots = 3, 64, 4
    gen = torch.Generator().manual_seed(11)
    per_head = torch.tensor([[[5, 5, 40, -1, 33], [70, 2, 3, 4, 6], [-1] * 5],
                             [[1, 9, 100, 36, 200], [0, -1, -1, -1, -1], [39, 38, 37, 35, 34]],
                             [[64, 65, 66, 67, 68], [31, 32, 33, 34, 35], [7, 80, 96, 97, 98]]], device=device)
    lists = [per_head, per_head[:, :1].contiguous(), per_head[1:2, 2:].contiguous(),
             torch.arange(6, device=device).view(1, 1, 6)]
    for positions in lists:
        for value_map in (None, lambda v: (2 * v.float()).to(v.dtype)):
            states = []
            for _ in range(2):
                kept = KeptTokens(3, h, slots, d, 256, dtype, device)
                token = torch.randn(1, h, 1, d, generator=torch.Generator().manual_seed(3)).to(device, dtype)
                kept.stage(torch.tensor([1], device=device), 34, torch.ones(1, 1, 1, dtype=torch.bool,
                                                                              device=device), token, token)
                states.append(kept)
            want, got = states
            for start, n in ((0, 40), (40, 32), (72, 160)):
                rows = torch.tensor([2, 1, 0], device=device)
                window = torch.randn(3, h, n + 9, d, generator=gen).to(device, dtype)
                keys, values = window[:, :, 4:4 + n], torch.randn(3, h, n, d, generator=gen).to(device, dtype)
                chosen = positions if positions.shape[0] > 1 else positions.expand(3, -1, -1)
                mask = positions_mask(chosen[rows], start, n)
                want.stage(rows, start, mask, keys, values, value_map)
                got.stage_positions(rows, start, positions, keys, values, value_map)
                assert torch.equal(got.slot_positions, want.slot_positions), (positions.shape, start)
                for name in ("keys", "values", "skip"):
                    assert torch.equal(got.buffers[name], want.buffers[name]), (name, positions.shape, start)
            assert (want.slot_positions >= 0).sum() > 12, "too few tokens staged: the case tests little"
            assert ((want.slot_positions >= 0).sum(-1) == slots).any(), "no (row, head) filled its slots"
