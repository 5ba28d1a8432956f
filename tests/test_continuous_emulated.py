"""Continuous batching on backend=cupy's cache (kernels.cupy_layer: rows released and adopted through the per-row
counts, the packed storage, the exact slots and the method's state) on the CPU emulator of the kernels: a tiny
bf16 model's greedy tokens through a slot of two rows, refilled while the other row decodes and parked past its
window, equal each sample's tokens alone. The GPU half (CUDA graphs) is tests/test_continuous_gpu.py."""

from __future__ import annotations

import pytest
import torch
from test_cupy_cache_emulated import model_options, tiny_model  # noqa: F401 (fixtures)
from test_method_kernels_emulated import emulated_ops, emulator_libraries  # noqa: F401 (fixtures)

from kernels.backend import CupyBackend, CupyKVCache
from kernels.cupy_layer import CupyKVLayer
from oscar import build_method
from oscar.attention import attach
from oscar.continuous import Request, serve
from oscar.engine import DecodeEngine

#: prompt tokens and new tokens: R = 32 (kernel stages of 16 or 32), so rows flush in the prompt and while decoding;
#: the second sample ends early and its row stays parked past its window while the others decode
LENGTHS = [(40, 28), (20, 4), (30, 12)]
#: prompts past two windows: the prefill packs their first stage, so every decode flush starts past OSCAR's sink prefix
LONG_PROMPTS = [(80, 40), (64, 6), (70, 20)]


def requests_of(lengths: list[tuple[int, int]], seed: int) -> list[Request]:
    """Random prompts of (prompt tokens, new tokens) ``lengths``, keyed 0, 1, ..."""
    gen = torch.Generator().manual_seed(seed)
    return [Request(i, tuple(torch.randint(3, 1000, (n,), generator=gen).tolist()), new)
            for i, (n, new) in enumerate(lengths)]


def alone_tokens(engine: DecodeEngine, requests: list[Request]) -> dict[int, list[int]]:
    """Each request's greedy tokens decoded as a batch of its own."""
    alone = {}
    for r in requests:
        ids = torch.tensor([r.input_ids])
        alone[r.key] = engine.generate(ids, torch.ones_like(ids), r.max_new_tokens, set())[0]
    return alone


def engine_for(name: str) -> DecodeEngine:
    model = tiny_model("tiny-llama", torch.bfloat16)
    method = build_method(name, **model_options(name, model))
    method.prepare_model(model)
    attach(model, method)
    return DecodeEngine(model, method, CupyBackend(), "eager")


@pytest.mark.parametrize("name", ["kivi", "oscar", "quarot", "turboquant", "ott", "rotatekv", "spectral"])
def test_cupy_rows_refilled_mid_run_decode_what_each_sample_decodes_alone(emulated_ops, name, monkeypatch):
    """After every step a parked row's counts are zero in every layer, on the host and where the kernels read them,
    with no copy of the host's counts for it: a step copies them only where a row flushed."""
    engine = engine_for(name)
    requests = requests_of(LENGTHS, 5)
    alone = alone_tokens(engine, requests)
    assert all(len(set(tokens)) >= 4 for tokens in alone.values())
    parked_steps, copies, stepping = [], [], []
    advance, sync_counts = CupyKVCache.advance, CupyKVLayer._sync_counts

    def counted(layer):  # the host's counts copied to the device: counted when a step's advance does it
        if stepping:
            copies[-1] += 1
        sync_counts(layer)

    def checked(cache):
        copies.append(0)
        stepping.append(True)
        advance(cache)
        stepping.pop()
        for layer in cache.layers:
            for row in cache.parked:
                assert layer.tokens[row] == layer.n_packed[row] == 0
                assert int(layer.n_res_dev[row]) == int(layer.n_packed_dev[row]) == int(cache.lengths[row]) == 0
        parked_steps.append(len(cache.parked))

    monkeypatch.setattr(CupyKVCache, "advance", checked)
    monkeypatch.setattr(CupyKVLayer, "_sync_counts", counted)
    got = {f.key: f.tokens for f in serve(engine, requests, 2, 128, set())}
    assert got == alone
    assert sum(parked_steps) >= 10
    assert sum(copies) > 0 and any(n and not c for n, c in zip(parked_steps, copies))


@pytest.mark.parametrize("name", ["ott", "kivi"])
def test_a_caches_layers_send_each_row_list_to_the_device_once(emulated_ops, name, monkeypatch):
    """oscar.transfer.shared_ints around the layers of a step's advance, a release, an adoption and a prefill: every
    layer indexes the same rows, and each distinct list is copied to the device once per call, not once per layer."""
    import oscar.transfer as transfer
    from oscar.row_slots import SlotCache

    engine = engine_for(name)
    assert len(engine.model.model.layers) > 1
    requests = requests_of(LENGTHS, 6)
    sends, calls = [], []
    send = transfer._send

    def counted_send(values, device, dtype):
        if calls:
            sends[-1].append((tuple(values), dtype))
        return send(values, device, dtype)

    done = set()

    def counted(operation):
        def run(cache, *args):
            calls.append(operation.__name__)
            done.add(operation.__name__)
            sends.append([])
            try:
                return operation(cache, *args)
            finally:
                calls.pop()
        return run

    monkeypatch.setattr(transfer, "_send", counted_send)
    for cls, operation in ((CupyKVCache, "advance"), (SlotCache, "release"), (SlotCache, "adopt"),
                           (DecodeEngine, "_prefill")):
        monkeypatch.setattr(cls, operation, counted(getattr(cls, operation)))
    list(serve(engine, requests, 2, 128, set()))
    assert len(sends) >= 10 and sum(map(len, sends)) > 0 and "_prefill" in done
    assert all(len(lists) == len(set(lists)) for lists in sends), [lists for lists in sends
                                                                   if len(lists) != len(set(lists))][:2]


def test_oscars_flushes_past_its_sink_prefix_stage_and_restore_nothing(emulated_ops, monkeypatch):
    """OSCAR keeps the first sink_tokens positions (16 here): the prefill's first key flush stages them in one launch,
    and no flush from the sink prefix on (kernels.variant.KernelVariant.kept_limit) launches a stage or a write of
    kept tokens, while each sample's tokens stay what it decodes alone. Prompts of 64 tokens and more: the prefill
    packs their first stage of 32 (R = 32), so every decode flush starts past the prefix."""
    from kernels import runtime

    engine = engine_for("spectral")
    requests = requests_of(LONG_PROMPTS, 8)
    alone = alone_tokens(engine, requests)
    launches = {"prefill": [], "advance": []}
    phase = []
    launch = runtime.launch

    def counted_launch(source, name, *args, **kwargs):
        if phase:
            launches[phase[-1]].append(name)
        return launch(source, name, *args, **kwargs)

    def within(key, operation):
        def run(*args):
            phase.append(key)
            try:
                return operation(*args)
            finally:
                phase.pop()
        return run

    monkeypatch.setattr(runtime, "launch", counted_launch)
    monkeypatch.setattr(DecodeEngine, "_prefill", within("prefill", DecodeEngine._prefill))
    monkeypatch.setattr(CupyKVCache, "advance", within("advance", CupyKVCache.advance))
    got = {f.key: f.tokens for f in serve(engine, requests, 2, 128, set())}
    assert got == alone
    assert "stage_kept" in launches["prefill"] and launches["advance"].count("quantize_spectral") >= 4
    assert not {"stage_kept", "write_kept"} & set(launches["advance"]), sorted(set(launches["advance"]))


def test_a_cpu_decode_step_computes_a_row_alike_at_every_batch_size():
    """oscar.engine.rows_apart: a bf16 product's row on a CPU is the same alone and beside other rows (oneDNN's,
    PyTorch's default for bf16 there, rounds a row with the batch size: most rows of a vocabulary-sized one)."""
    from oscar.engine import rows_apart

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(8192, 256, generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(3, 1, 256, generator=gen).to(torch.bfloat16)
    with rows_apart(torch.device("cpu")):
        alone, beside = torch.nn.functional.linear(x[:1], weight), torch.nn.functional.linear(x, weight)[:1]
    assert torch.equal(alone, beside)
    assert torch.backends.mkldnn.enabled == torch.backends.mkldnn.is_available()  # put back


@pytest.mark.parametrize("name", ["oscar", "quarot", "ott"])
def test_long_prompts_decode_beside_other_rows_what_they_decode_alone(emulated_ops, name):
    """Prompts past two key windows (80, 64 and 70 tokens, R = 32) through a slot of two rows: each sample's greedy
    tokens are its tokens alone, which needs the decode step's products to round a row alike at batch 1 and 2
    (oscar.engine.rows_apart; without it the first sample's tokens differ from step 8 on for OScaR, QuaRot and OTT,
    with no row released yet). OSCAR's run: test_oscars_flushes_past_its_sink_prefix_stage_and_restore_nothing."""
    engine = engine_for(name)
    requests = requests_of(LONG_PROMPTS, 8)
    alone = alone_tokens(engine, requests)
    assert {f.key: f.tokens for f in serve(engine, requests, 2, 128, set())} == alone
