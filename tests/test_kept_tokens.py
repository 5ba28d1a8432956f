"""kernels.kept_tokens: the bookkeeping of the tokens a CuPy cache layer keeps exactly, on the CPU (no kernel).

Staged tokens take their (row, head)'s next slot in stream order with their key and value; the skip words equal
kernels.method_layouts.skip_words of the staged positions; the kernel's counts are the slots below each row's P;
restoring a range gives the oscar.exact buffers whose restore_exact puts the kept tokens back where they were (the
reference of KeptTokens.write's kernel: tests/test_exact_slots_emulated.py);
re-staging a position (or one before the last staged) changes nothing; the bytes follow the stated rule. And the
methods' rows (kernels.backend.KERNELS) name the tokens each method keeps.
"""

from __future__ import annotations

import pytest
import torch

from kernels.backend import KERNELS
from kernels.kept_tokens import KeptTokens, skip_word
from kernels.method_layouts import skip_mask, skip_words
from oscar import build_method
from oscar.exact import restore_exact

B, H, D, CAP = 2, 3, 8, 96


def _chunk(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)


def test_skip_word_is_skip_words_of_the_positions():
    positions = [0, 5, 31, 32, 63, 64, 95]
    mask = torch.zeros(CAP, dtype=torch.bool)
    mask[positions] = True
    assert [skip_word(positions, w) for w in range(3)] == skip_words(mask).tolist()


def test_staging_fills_slots_in_stream_order_with_skip_bits_and_counts():
    kept = KeptTokens(B, H, 4, D, CAP, torch.float32, "cpu")
    keys, values = _chunk(0, 40)
    mask = torch.zeros(B, H, 40, dtype=torch.bool)
    mask[0, 0, [1, 33]] = True
    mask[0, 2, 39] = True
    mask[1, :, 0] = True  # every head of row 1
    kept.stage(torch.tensor([0, 1]), 0, mask, keys, values)
    assert kept.staged() == [[[1, 33], [], [39]], [[0], [0], [0]]]
    assert kept.slot_positions[0].tolist() == [[1, 33, -1, -1], [-1] * 4, [39, -1, -1, -1]]
    assert torch.equal(kept.buffers["keys"][0, 0, :2], keys[0, 0, [1, 33]])
    assert torch.equal(kept.buffers["values"][0, 2, 0], values[0, 2, 39])
    assert torch.equal(kept.buffers["keys"][1, :, 0], keys[1, :, 0])
    assert torch.equal(skip_mask(kept.buffers["skip"], CAP)[:, :, :40], mask)
    # a later chunk of row 1 at stream position 40 (not a word boundary), through rows given in another order, one
    # mask for every head; its bit in the word that holds position 39 too
    keys2, values2 = _chunk(1, 16)
    later = torch.zeros(B, 1, 16, dtype=torch.bool)
    later[0, 0, 3] = True  # row 1 (first in the list), position 43
    kept.stage(torch.tensor([1, 0]), 40, later, keys2, values2)
    assert kept.staged()[1] == [[0, 43]] * H and torch.equal(kept.buffers["keys"][1, :, 1], keys2[0, :, 3])
    assert skip_mask(kept.buffers["skip"], CAP)[1, 1].nonzero().flatten().tolist() == [0, 43]
    assert skip_mask(kept.buffers["skip"], CAP)[0, 2].nonzero().flatten().tolist() == [39]
    # the kernel reads the slots below each row's P
    kept.sync_counts([32, 64])
    assert kept.buffers["count"].tolist() == [[1, 0, 0], [2, 2, 2]]
    # staging a position again (a chunk quantized again after a stage quantized ahead) changes nothing, nor does a
    # position before the last staged one
    before = {name: kept.buffers[name].clone() for name in ("keys", "values", "skip")}
    again = mask.clone()
    again[0, 0, 20] = True
    kept.stage(torch.tensor([0, 1]), 0, again, keys2[:, :, :1].expand(B, H, 40, D), values)
    assert kept.staged() == [[[1, 33], [], [39]], [[0, 43]] * H]
    assert all(torch.equal(kept.buffers[name], x) for name, x in before.items())


def test_staging_maps_the_staged_values_and_fills_every_slot():
    """``value_map`` (OTT's keep_values=false: the values' dequantization) sees the staged values; a chunk with more
    kept tokens than free slots of a (row, head) fills them in stream order (the methods never keep more)."""
    kept = KeptTokens(1, 1, 3, D, CAP, torch.float32, "cpu")
    keys, values = _chunk(6, 40)
    first = torch.zeros(1, 1, 40, dtype=torch.bool)
    first[0, 0, 5] = True
    kept.stage(torch.tensor([0]), 0, first, keys[:1, :1], values[:1, :1], value_map=lambda v: -v)
    mask = torch.zeros(1, 1, 40, dtype=torch.bool)
    mask[0, 0, [7, 9, 30]] = True
    kept.stage(torch.tensor([0]), 0, mask, keys[:1, :1], values[:1, :1], value_map=lambda v: 2 * v)
    assert kept.staged() == [[[5, 7, 9]]]
    assert torch.equal(kept.buffers["values"][0, 0], torch.stack([-values[0, 0, 5], 2 * values[0, 0, 7],
                                                                  2 * values[0, 0, 9]]))
    assert torch.equal(kept.buffers["keys"][0, 0], keys[0, 0, [5, 7, 9]])


def test_restore_puts_the_kept_tokens_back_in_a_range():
    kept = KeptTokens(B, H, 4, D, CAP, torch.float32, "cpu")
    keys, values = _chunk(2, 64)
    mask = torch.rand(B, H, 64, generator=torch.Generator().manual_seed(3)) < 0.05
    mask[0, 1, 40] = True
    keys_kept = mask & (mask.cumsum(-1) <= 4)  # at most the slots
    kept.stage(torch.tensor([0, 1]), 0, keys_kept, keys, values)
    start, n = 32, 24
    for stream, x in (("keys", keys), ("values", values)):
        buffers = kept.restore(stream, [1, 0], start, n)  # rows in another order
        base = torch.zeros(B, H, n, D)
        got = restore_exact(base, buffers, start)
        want_mask = keys_kept[[1, 0], :, start:start + n]
        want = torch.where(want_mask.unsqueeze(-1), x[[1, 0], :, start:start + n], base)
        assert torch.equal(got, want), stream
        assert int((buffers["exact_pos"] >= 0).sum()) == int(want_mask.sum())
    empty = kept.restore("keys", [0], 90, 4)
    assert empty["exact"].shape == (1, H, 4, D) and (empty["exact_pos"] == -1).all() and not empty["exact"].any()


def test_reset_grow_assume_first_and_bytes():
    kept = KeptTokens(B, H, 40, D, CAP, torch.bfloat16, "cpu")
    kept.assume_first(33)
    assert kept.staged() == [[list(range(33))] * H] * B
    assert torch.equal(kept.slot_positions[..., :34], torch.tensor([*range(33), -1]).expand(B, H, 34).int())
    assert skip_mask(kept.buffers["skip"], CAP)[..., :40].sum(-1).tolist() == [[33] * H] * B
    kept.grow(200)
    assert kept.buffers["skip"].shape == (B, H, 7)
    assert skip_mask(kept.buffers["skip"], 200).sum().item() == 33 * B * H
    # keys of the kept tokens below keys_packed, values below values_packed; count and P's skip words per head
    per_slot = D * 2
    assert int(kept.nbytes([32, 64], [16, 0], [0, 64])) == (H * (32 + 16) + H * (33 + 0)) * per_slot \
        + H * 4 * 2 + H * 4 * 2
    kept.reset()
    assert kept.staged() == [[[]] * H] * B and not kept.buffers["skip"].any() and not kept.buffers["count"].any()
    assert (kept.slot_positions == -1).all()


def test_the_rows_name_the_tokens_each_method_keeps():
    """OTT's pool and RotateKV's sinks from the state, OSCAR's first sink_tokens by its rule (on the host); the
    benchmarks' state keeps each row's first tokens, as many as the slots."""
    rows = torch.tensor([1, 0])
    ott = build_method("ott", pool_size=3)
    state = ott.new_state(2, H, "cpu")
    state["pool"][1, 2, :2] = torch.tensor([4, 40])
    mask = KERNELS["ott"].kept(ott, state, rows, 32, 16)
    assert mask.shape == (2, H, 16) and mask.nonzero().tolist() == [[0, 2, 8]]
    rotatekv = build_method("rotatekv", reorder=False, num_sinks=2)
    sinks = rotatekv.new_state(2, H, "cpu")
    sinks["sinks"][0, 0] = torch.tensor([0, 17])
    assert KERNELS["rotatekv"].kept(rotatekv, sinks, rows, 16, 4).nonzero().tolist() == [[1, 0, 1]]
    spectral = build_method("spectral", sink_tokens=10)
    prefix = KERNELS["spectral"].kept(spectral, {}, rows, 8, 4)
    assert prefix.shape == (2, 1, 4) and prefix.device.type == "cpu" and prefix[:, 0].tolist() == [[1, 1, 0, 0]] * 2
    assert KERNELS["ott"].assume_kept(ott, state, 100) == 3 and state["pool"][0, 0].tolist() == [0, 1, 2]
    assert KERNELS["rotatekv"].assume_kept(rotatekv, sinks, 1) == 1 and sinks["sinks"][1, 0].tolist() == [0, -1]
    assert KERNELS["spectral"].assume_kept(spectral, {}, 100) == 10
    assert [KERNELS[n].slots(m) for n, m in (("ott", ott), ("rotatekv", rotatekv), ("spectral", spectral))] == \
        [3, 2, 10]
    assert not KERNELS["kivi"].exact and KERNELS["ott"].kept_by_keys and not KERNELS["spectral"].kept_by_keys


@pytest.mark.parametrize("name, options", [("ott", dict(pool_size=5)), ("rotatekv", dict(reorder=False, num_sinks=2, group_size=8)),
                                           ("spectral", dict(sink_tokens=3))])
def test_a_span_kept_elsewhere_leaves_the_kept_tokens_out_and_the_rest_as_it_was(name, options):
    """TokenSpan.kept_elsewhere (the CuPy cache stores the kept tokens itself): the quantizer's codes and its state
    (OTT's pool) are those of the plain call, and no exact/exact_pos buffers come back (no host read of their count)."""
    from oscar.method import TokenSpan

    m = build_method(name, **options)
    x = torch.randn(2, H, 64, D, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 2, 64).view(-1, 1)
    if name == "spectral":
        m._k_rotation = torch.eye(D).unsqueeze(0)
    if name == "rotatekv":
        from test_kernels_exact_methods import rotary

        m._rotary, m._group, m._num_kv_heads = rotary(D), 1, H
    results = []
    for elsewhere in (False, True):
        state = m.new_state(2, H, "cpu")
        if "sinks" in state:
            state["sinks"][:, :, 0] = 7
        span = TokenSpan(torch.arange(2), 0, state, kept_elsewhere=elsewhere)
        packed = m.quantize_keys(x, 0, span)
        results.append((packed, {k: v.clone() for k, v in state.items()}))
    (plain, plain_state), (bare, bare_state) = results
    assert "exact" in plain.buffers and not {"exact", "exact_pos"} & set(bare.buffers)
    assert int((plain.buffers["exact_pos"] >= 0).sum()) > 0, "no token kept: the case tests nothing"
    assert all(torch.equal(bare.buffers[k], v) for k, v in plain.buffers.items() if k not in ("exact", "exact_pos"))
    assert all(torch.equal(bare_state[k], v) for k, v in plain_state.items())
