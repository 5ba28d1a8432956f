"""Continuous batching (oscar.continuous, oscar.row_slots) and the task scheduler (evals.scheduler) on the CPU.

The contract: every sample's greedy tokens are the ones it gets alone, for every method, when rows of one slot finish
at different steps (prompts of different lengths, different max_new_tokens, an EOS that fires early in some rows) and
new samples join rows while the others decode; what each sample's row stored is what its cache stores alone. The
scheduler orders samples by length, never holds more than its budget (stored bytes counted at every step), and the
tasks write the same predictions with it as without. The CuPy cache's half runs on the CPU emulator here and on the
GPU in tests/test_continuous_gpu.py."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

from evals import build_task
from evals.longbench import LongBenchE
from evals.scheduler_replay import (column_minutes, draw_column, live_cache_bytes, longbench_e_counts, official_loop,
                                    replay, stratified)
from evals.niah import NeedleInAHaystack
from evals import scheduler
from evals.scheduler import (MEMORY_SHARE, Budget, Job, agreement_with_batch_one, free_memory, memory_budget,
                             plan_waves, scheduled_generate, token_budget)
from oscar import available_methods
from oscar.continuous import Request, compare_with_alone, measure_row_cost, serve
from oscar.lm import KVModel
from oscar.results import PredictionLog
from oscar.static_cache import StaticCache

#: prompts of 10 to 60 tokens and their new tokens: with R = 32 rows flush keys in the prompt, during decoding or not
#: at all, and with two rows the five samples finish at different steps
PROMPTS = ["The quick brown fox jumps over the lazy dog " * k for k in (1, 6, 2, 5, 3)]
NEW_TOKENS = [16, 7, 24, 11, 20]


@pytest.fixture(scope="module")
def method_for(make_method):
    """A short residual window, so that a few dozen tokens cross several flushes."""
    return lambda name, **overrides: make_method(name, **{"residual_length": 32, **overrides})


def kv_model(varied_tiny, method) -> KVModel:
    model, tokenizer = varied_tiny
    return KVModel(copy.deepcopy(model), tokenizer, method, decode="eager")


def requests(lm: KVModel, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> list[Request]:
    return [Request(i, tuple(lm.tokenizer(p)["input_ids"]), n) for i, (p, n) in enumerate(zip(prompts, new_tokens))]


def alone(lm: KVModel, request: Request, eos: set[int]) -> tuple[list[int], int]:
    """The engine's tokens for the request as a batch of its own, and what its cache stored."""
    ids = torch.tensor([request.input_ids])
    tokens = lm.engine.generate(ids, torch.ones_like(ids), request.max_new_tokens, eos)[0]
    return tokens, lm.engine.last_cache.nbytes


def joins_while_others_decode(monkeypatch) -> list[int]:
    """Record, at every adoption, how many other rows of the slot were decoding."""
    busy = []
    adopt = StaticCache.adopt

    def spy(cache, rows, source, source_rows):
        busy.append(cache.batch_size - len(cache.parked))
        adopt(cache, rows, source, source_rows)

    monkeypatch.setattr(StaticCache, "adopt", spy)
    return busy


@pytest.mark.parametrize("name", available_methods())
def test_every_sample_generates_what_it_generates_alone(name, method_for, varied_tiny, monkeypatch):
    """Five samples through a slot of two rows: each refill joins a row while the other decodes, some rows stop at an
    EOS picked from their own continuation (steps 3 and 5 of two of them), the others at their max_new_tokens; each
    sample's tokens and stored bytes equal those of the sample alone."""
    lm = kv_model(varied_tiny, method_for(name))
    reqs = requests(lm)
    free = {i: alone(lm, reqs[i], set())[0] for i in (2, 4)}
    eos = {free[2][3], free[4][5]}
    expected = {r.key: alone(lm, r, eos) for r in reqs}
    assert all(len(set(tokens)) >= 3 for tokens, _ in expected.values())  # varied: a wrong cache would show
    assert sum(len(tokens) < r.max_new_tokens for r, (tokens, _) in zip(reqs, expected.values())) >= 2
    busy = joins_while_others_decode(monkeypatch)
    got = {f.key: f for f in serve(lm.engine, reqs, 2, 256, eos)}
    assert {k: f.tokens for k, f in got.items()} == {k: tokens for k, (tokens, _) in expected.items()}
    assert {k: f.stored_bytes for k, f in got.items()} == {k: stored for k, (_, stored) in expected.items()}
    assert busy.count(1) >= 3  # rows joined mid-run


def test_a_step_binds_its_slot_without_walking_the_model_again(method_for, varied_tiny, monkeypatch):
    """Continuous batching binds its slot before every step: binding the cache every attention module holds walks no
    module; binding another cache, or the same one after a module was bound elsewhere or after detach, walks again."""
    from oscar import attention

    lm = kv_model(varied_tiny, method_for("kivi"))
    walks = []
    modules = attention.attention_modules
    monkeypatch.setattr(attention, "attention_modules", lambda model: walks.append(1) or modules(model))
    first, second = (lm.engine.backend.static_cache(lm.model, lm.method, [0], 64) for _ in range(2))
    attention.bind_cache(lm.model, first)
    attention.bind_cache(lm.model, first)
    assert len(walks) == 1
    attention.bind_cache(lm.model, second)
    assert len(walks) == 2 and all(m.kv_cache() is second for m in modules(lm.model))
    next(modules(lm.model)).kv_cache = weakref.ref(first)  # one module bound by hand: the next binding repairs it
    attention.bind_cache(lm.model, second)
    assert len(walks) == 3 and all(m.kv_cache() is second for m in modules(lm.model))
    attention.detach(lm.model)
    detached = len(walks)
    attention.bind_cache(lm.model, second)
    assert len(walks) == detached + 1
    attention.attach(lm.model, lm.method)
    steps = len(walks)
    assert len(list(serve(lm.engine, requests(lm)[:3], 2, 256, set()))) == 3
    assert len(walks) - steps < 12  # one walk per prefill and slot, not one per decode step (24 steps here)


def test_a_row_parked_longer_than_its_window_and_capacity_writes_nothing_out_of_bounds(method_for, varied_tiny):
    """A sample of 19 + 5 tokens ends while the other of 10 + 54 decodes: its row stays parked for 49 steps, past its
    key window (32) and the capacity (64) had it kept counting; the other sample's tokens are its own alone."""
    lm = kv_model(varied_tiny, method_for("kivi"))
    long, short = requests(lm, [PROMPTS[0], PROMPTS[2]], [54, 5])
    got = {f.key: f.tokens for f in serve(lm.engine, [long, short], 2, 64, set())}
    assert got == {0: alone(lm, long, set())[0], 1: alone(lm, short, set())[0]}


@pytest.mark.parametrize("name", ["kivi", "ott"])
def test_releasing_one_row_of_a_shared_row_group_keeps_the_others(name, method_for, varied_tiny):
    """A batch prefilled in place, two of its rows of one length (one row group, packed chunks of two rows): releasing
    one of them takes its rows out of the chunks (nbytes drops by what it holds alone) and the others decode on as
    they do alone."""
    lm = kv_model(varied_tiny, method_for(name))
    same = "Once upon a time in a land far away there lived a king " * 4
    reqs = requests(lm, [same, same.replace("king", "queen"), PROMPTS[2]], [12, 12, 12])
    assert len(reqs[0].input_ids) == len(reqs[1].input_ids) > 32  # one group, keys flushed in the prefill
    expected = [alone(lm, r, set()) for r in reqs]
    ids = torch.tensor([[0] * (len(reqs[0].input_ids) - len(r.input_ids)) + list(r.input_ids) for r in reqs])
    mask = (torch.arange(ids.shape[1]) >= ids.shape[1] - torch.tensor([len(r.input_ids) for r in reqs])[:, None])
    slot = lm.engine._slot([0, 0, ids.shape[1] - len(reqs[2].input_ids)], 256)
    first = lm.engine._prefill(ids, mask.long(), slot.cache).argmax(-1)
    slot.cache.begin_decode()
    assert [g.members for g in slot.cache.layers[0].groups] == [(0, 1), (2,)]
    held = slot.cache.nbytes
    slot.cache.release([1])
    assert [g.members for g in slot.cache.layers[0].groups] == [(0,), (2,)]
    row_alone = lm.engine.staging(256)
    lm.engine._prefill(torch.tensor([reqs[1].input_ids]), torch.ones(1, len(reqs[1].input_ids)), row_alone)
    assert held - slot.cache.nbytes == row_alone.nbytes
    tokens = lm.engine.decode(slot, first, 12, set())
    assert [tokens[0], tokens[2]] == [expected[0][0], expected[2][0]]
    assert slot.cache.nbytes == expected[0][1] + expected[2][1]


@pytest.mark.parametrize("name", ["kivi", "ott"])
def test_an_adopted_row_is_the_staging_row_copied_in_one_operation_a_layer(name, method_for, varied_tiny):
    """A sample prefilled in the staging cache moves into row 1 of a two-row slot whose row 0 holds another: every
    static tensor's row 1 (storage, window, counts, the method's state) is the staging row's, row 0 is untouched, and
    each layer's copy is one torch operation (a foreach copy of the row views, not a gather and a write per tensor)."""
    from benchmarks.prefill_census import Census

    lm = kv_model(varied_tiny, method_for(name))
    first, second = requests(lm)[:2]
    slot = lm.engine.open_slot(2, 256)
    slot.cache.open_slots()
    for row, request in ((0, first), (1, second)):
        staging, ids = lm.engine.staging(256), torch.tensor([request.input_ids])
        lm.engine._prefill(ids, torch.ones_like(ids), staging)
        staging.begin_decode()
        before = [[t[0].clone() for t in layer.static_tensors()] for layer in slot.cache.layers] if row else None
        with Census() as census:
            slot.cache.adopt([row], staging, [0])
    copies = sum(n for line, n in census.ops_by_line.items() if line.endswith("(_copy_rows)"))
    assert copies == len(slot.cache.layers)
    for layer, source, kept in zip(slot.cache.layers, staging.layers, before):
        for mine, theirs, row0 in zip(layer.static_tensors(), source.static_tensors(), kept):
            assert torch.equal(mine[1], theirs[0]) and torch.equal(mine[0], row0)
    storage = slot.cache.layers[0].static_tensors()[0]
    assert not torch.equal(storage[0], storage[1])  # two samples' rows: a copy into the wrong row would show


def test_a_slot_of_one_row_and_more_rows_than_samples(method_for, varied_tiny):
    """rows=1 prefills in place, rows > samples opens as many rows as samples; the tokens are the same; the samples
    come back as they finish (the shortest first), each under its key."""
    lm = kv_model(varied_tiny, method_for("kivi"))
    reqs = requests(lm)
    one = [(f.key, f.tokens) for f in serve(lm.engine, reqs, 1, 256, set())]
    assert [k for k, _ in one] == [0, 1, 2, 3, 4]
    many = [(f.key, f.tokens) for f in serve(lm.engine, reqs, 8, 256, set())]
    assert lm.engine._slots.keys() == {5}
    assert [k for k, _ in many] == sorted(range(5), key=lambda i: NEW_TOKENS[i])
    assert dict(many) == dict(one)


def test_requests_that_do_not_fit_are_refused_before_any_work(method_for, varied_tiny):
    lm = kv_model(varied_tiny, method_for("kivi"))
    reqs = requests(lm)
    with pytest.raises(ValueError, match="request 1: 55 prompt \\+ 7 new tokens do not fit rows of capacity 48"):
        next(serve(lm.engine, reqs, 2, 48, set()))
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        next(serve(lm.engine, [Request("empty", (), 3)], 2, 64, set()))
    assert not lm.engine._slots


def test_the_measured_row_cost_bounds_what_a_full_row_holds(method_for, varied_tiny):
    """The line through two small probes bounds the allocated bytes of a full row at a larger capacity (packed
    chunks included), within 2%."""
    for name in ("fp16", "kivi", "ott"):
        lm = kv_model(varied_tiny, method_for(name))
        cost = measure_row_cost(lm.engine)
        cache = lm.engine.staging(768)
        ids = torch.randint(0, 1000, (1, 767), generator=torch.Generator().manual_seed(3))
        lm.engine._prefill(ids, torch.ones_like(ids), cache)
        cache.begin_decode()
        assert cache.allocated_bytes <= cost(768) <= 1.02 * cache.allocated_bytes, name


def test_waves_are_ordered_by_need_and_sized_by_the_budget():
    needs = [300, 40, 1000, 90, 500, 260, 120, 70]
    capacity_of = lambda n: -(-n // 64) * 64  # noqa: E731
    waves = plan_waves(needs, capacity_of, token_budget(3000))
    assert [w.members for w in waves] == [(2,), (4, 0, 5), (6, 3, 7), (1,)]  # need > half the capacity
    assert [w.capacity for w in waves] == [1024, 512, 128, 64]
    assert [w.rows for w in waves] == [1, 3, 3, 1]  # 2 rows' worth holds one row; 5 rows' worth 4 (staging); <= samples
    same = plan_waves([200, 30, 90], lambda n: 256, token_budget(3000))  # one rounded capacity: one wave
    assert [(w.members, w.rows) for w in same] == [((0, 2, 1), 3)]
    longest_first = plan_waves([200, 30, 90, 150], lambda n: 256, token_budget(3000), decode_lengths=[32, 512, 64, 64])
    assert [w.members for w in longest_first] == [(1, 3, 2, 0)]  # most new tokens first, then the larger need
    assert all(token_budget(3000).held(w.rows, w.capacity) <= 3000 for w in waves)
    with pytest.raises(ValueError, match="a sample needs 1000 positions .* more than the budget of 900 tokens"):
        plan_waves(needs, capacity_of, token_budget(900))


@pytest.mark.parametrize("name", ["kivi", "fp16"])
def test_the_scheduler_never_holds_more_than_its_budget(name, method_for, varied_tiny, monkeypatch):
    """A byte budget of three rows of 256 tokens (measured row cost): one sample needs 261 positions and runs alone
    in a row of 512, the seven others in two rows of 256 and the staging row. After every prefill and decode step the
    engine's caches hold at most the budget, and over 80% of it at the peak; the texts are generate's alone, and the
    samples' stored tokens add up (prompt + new tokens - 1 each)."""
    lm = kv_model(varied_tiny, method_for(name))
    prompts = ["Once upon a time there was a story " * k for k in (2, 30, 4, 12, 8, 25, 3, 16)]
    jobs = [Job(f"s{i}", p, n) for i, (p, n) in enumerate(zip(prompts, [12, 20, 6, 16, 24, 10, 18, 8]))]
    cost = measure_row_cost(lm.engine)
    budget = Budget(3 * cost(256), cost, "bytes")
    peaks = []
    for where in ("_decode_step", "_prefill"):
        original = getattr(type(lm.engine), where)

        def counted(engine, *args, _original=original):
            out = _original(engine, *args)
            peaks.append(live_cache_bytes(engine))
            return out

        monkeypatch.setattr(type(lm.engine), where, counted)
    results = {job.key: (text, finished) for job, text, finished in scheduled_generate(lm, jobs, budget=budget)}
    assert 0.8 * budget.limit < max(peaks) <= budget.limit
    monkeypatch.undo()
    assert {k: text for k, (text, _) in results.items()} == {
        job.key: lm.generate([job.prompt], job.max_new_tokens)[0] for job in jobs}
    assert [results[j.key][1].stored_tokens for j in jobs] == [
        len(lm.tokenizer(j.prompt).input_ids) + len(results[j.key][1].tokens) - 1 for j in jobs]


def test_the_derived_budget_is_a_share_of_free_memory_at_the_measured_row_cost(method_for, varied_tiny, monkeypatch):
    lm = kv_model(varied_tiny, method_for("kivi"))
    budget = memory_budget(lm.engine)
    assert budget.unit == "bytes" and budget.cost == measure_row_cost(lm.engine)
    assert abs(budget.limit - MEMORY_SHARE * free_memory(lm.device)) < 0.05 * budget.limit
    monkeypatch.setattr(scheduler, "model_devices", lambda model: [torch.device("cpu"), torch.device("meta")])
    with pytest.raises(ValueError, match="the model runs on 2 devices.*set task.batch_tokens"):
        memory_budget(lm.engine)


def test_token_budget_caps_rows_times_capacity(method_for, varied_tiny, monkeypatch):
    lm = kv_model(varied_tiny, method_for("kivi"))
    jobs = [Job(f"s{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS))]
    held = []
    original = type(lm.engine).open_slot

    def spy(engine, rows, capacity, keep_logits=False):
        held.append((rows + (rows > 1)) * capacity)
        return original(engine, rows, capacity, keep_logits)

    monkeypatch.setattr(type(lm.engine), "open_slot", spy)
    list(scheduled_generate(lm, jobs, batch_tokens=768))
    assert held == [768]  # 2 rows + staging at 256


def test_agreement_with_batch_one_is_exact_on_the_cpu_and_sees_a_divergence(method_for, varied_tiny):
    """On the CPU continuous batching agrees with batch 1 token for token and its logits to rounding; noise added to
    the logits of batches of two rows or more (as bf16 rounding would) shows as lower agreement and a logit
    distance of the noise's size."""
    lm = kv_model(varied_tiny, method_for("oscar"))
    jobs = [Job(f"s{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS[:3], NEW_TOKENS))]
    exact = agreement_with_batch_one(lm, jobs, rows=2)
    assert [r["key"] for r in exact] == [j.key for j in jobs]
    assert all(r["identical"] and r["agreement"] == 1.0 and r["first_divergence"] is None for r in exact)
    assert max(r["max_logit_diff"] for r in exact) < 1e-4
    gen = torch.Generator().manual_seed(0)
    hook = lm.model.lm_head.register_forward_hook(
        lambda m, i, out: out + 0.5 * torch.randn(out.shape, generator=gen) if out.shape[0] > 1 else out)
    noisy = compare_with_alone(lm.engine, requests(lm)[:3], 2, 256, set())
    hook.remove()
    diverged = [r for r in noisy if not r["identical"]]
    assert diverged and all(r["agreement"] < 1 and r["first_divergence"] is not None for r in diverged)
    assert all(0.5 < r["max_logit_diff"] < 5 for r in noisy)


# ----------------------------------------------------------------------------- the tasks


def test_scheduler_options_are_typed_and_checked():
    for bad, message in ((dict(scheduler="yes"), "scheduler must be true or false"),
                         (dict(batch_tokens=0), "batch_tokens must be >= 1"),
                         (dict(scheduler=True, batch_size=4), "scheduler=true batches by length")):
        with pytest.raises(ValueError, match=message):
            build_task("longbench_e", **bad)
    with pytest.raises(ValueError, match="batch_tokens must be an integer"):
        build_task("niah", batch_tokens=1.5)


def test_longbench_with_the_scheduler_writes_what_fixed_batches_write(tmp_path, varied_tiny, method_for):
    """Every subset's samples at once (different max_new_tokens, chat and raw prompts, a middle-truncated one): the
    same predictions as batch 1, in another order; a run cut short resumes with the samples it lacks."""
    from scripts.longbench_fixture import build_fixture

    data = tmp_path / "data"
    build_fixture(data, per_subset=2, words=[60, 400])
    lm = kv_model(varied_tiny, method_for("kivi"))
    lm.max_length = 512
    options = dict(subsets=["hotpotqa_e", "multifieldqa_en_e"], data_dir=str(data), max_input_length=300,
                   no_template_subsets=["multifieldqa_en_e"])  # 64 new tokens, raw; 32, chat
    fixed = LongBenchE(**options).run(lm, tmp_path / "fixed")
    scheduled = LongBenchE(**options, scheduler=True, batch_tokens=4096).run(lm, tmp_path / "scheduled")
    read = lambda d: PredictionLog(tmp_path / d / "predictions.jsonl").done  # noqa: E731
    assert read("fixed") == read("scheduled") and list(read("fixed")) != list(read("scheduled"))
    records = read("fixed").values()
    assert {r["chat"] for r in records} == {True, False} and {r["truncated"] for r in records} == {True, False}
    assert scheduled.metrics == fixed.metrics
    lines = (tmp_path / "scheduled" / "predictions.jsonl").read_text().splitlines()
    (tmp_path / "scheduled" / "predictions.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:15])
    again = LongBenchE(**options, scheduler=True, batch_tokens=4096).run(lm, tmp_path / "scheduled")
    assert again.metrics == fixed.metrics and read("scheduled") == read("fixed")


def test_niah_with_the_scheduler_writes_what_one_cell_at_a_time_writes(tmp_path, varied_tiny, method_for):
    lm = kv_model(varied_tiny, method_for("oscar"))
    options = dict(lengths=[160, 320], depths=[0, 100], max_new_tokens=6)
    one = NeedleInAHaystack(**options).run(lm, tmp_path / "one")
    scheduled = NeedleInAHaystack(**options, scheduler=True, batch_tokens=2048).run(lm, tmp_path / "scheduled")
    read = lambda d: PredictionLog(tmp_path / d / "predictions.jsonl").done  # noqa: E731
    assert read("one") == read("scheduled") and scheduled.metrics == one.metrics


# ----------------------------------------------------------------------------- the benchmark's core


def test_the_column_is_longbench_e_as_task_md_states_it(data_file):
    counts = longbench_e_counts(data_file("longbench/task.md"))
    assert sum(n for buckets in counts.values() for n in buckets.values()) == 3668 and len(counts) == 13
    assert counts["multifieldqa_en"] == {"0-4k": 67, "4-8k": 70, "8k+": 13} and counts["qasper"]["8k+"] == 24
    column = draw_column(counts, tokens_per_word=1.5, max_prompt_tokens=30000)
    assert len(column) == 3668
    for s in column:
        low, high = {"0-4k": (0, 4000), "4-8k": (4000, 8000), "8k+": (8000, 20000)}[s.bucket]
        assert low <= s.words < high and s.prompt_tokens == min(max(1, round(1.5 * s.words)), 30000)
    assert {s.max_new_tokens for s in column if s.subset == "gov_report"} == {512}
    sub = stratified(column)
    assert len(sub) == 39 and len({(s.subset, s.bucket) for s in sub}) == 39
    assert column_minutes([6.0] * len(sub), sub, counts) == pytest.approx(3668 * 6 / 60)
    with pytest.raises(ValueError, match="no timed sample of hotpotqa 0-4k"):
        column_minutes([6.0] * 38, sub[1:], counts)


@pytest.mark.parametrize("subsets, rows, steps, drains", [
    (["hotpotqa", "passage_count"], 3, 2 * 31, False),  # six samples of 32 new tokens: two rounds of three rows
    (["hotpotqa", "trec"], 3, 63 + 31, False),         # trec's three 64s first, then the three 32s: no row idles
    (["hotpotqa", "trec"], 2, 63 + 3 * 31, True),     # rows 64, 64 and 64, 32, 32, 32: the last 32 ends alone
])
def test_a_replay_runs_every_sample_to_its_max_new_tokens_within_the_budget(subsets, rows, steps, drains, data_file,
                                                                              method_for, varied_tiny):
    """Six samples of two subsets (EOS ignored) through the scheduler: every new token is generated, each in a row of
    a decode step but the prefill's first; the samples that decode longest go first in their wave, so the decode
    steps are as few as the rows allow and a step has a free row only where the samples do not split evenly; the
    caches' peak stays within the byte budget, prefill and decode take most of the wall time; the official loop
    (transformers' generate at batch 1) times each sample."""
    counts = longbench_e_counts(data_file("longbench/task.md"))
    samples = stratified(draw_column(counts, tokens_per_word=0.01, max_prompt_tokens=100), 1, subsets)
    lm = kv_model(varied_tiny, method_for("kivi"))
    cost = measure_row_cost(lm.engine)
    budget = Budget((rows + 1) * cost(256), cost, "bytes")  # a slot of `rows` rows and the staging row
    times = replay(lm.engine, samples, budget)
    new_tokens = sum(s.max_new_tokens for s in samples)
    assert times.samples == 6 and times.new_tokens == new_tokens
    assert times.row_steps == new_tokens - 6 and times.decode_steps == steps
    assert (times.drain_s > 0) == drains and times.drain_s < times.decode_s
    assert times.decode_host_s == times.decode_s and times.step_ms == pytest.approx(1e3 * times.decode_s / steps)
    assert times.prompt_tokens == sum(s.prompt_tokens for s in samples) and times.device_peak_bytes is None
    assert 0 < times.cache_peak_bytes <= budget.limit
    assert times.prefill_s > 0 and times.decode_s > 0 and 0.5 < times.busy <= 1
    assert "_prefill" not in vars(lm.engine)  # the engine's own methods again
    seconds = official_loop(varied_tiny[0], samples[:2])
    assert len(seconds) == 2 and min(seconds) > 0
