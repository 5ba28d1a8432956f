"""Continuous batching on a GPU (oscar.continuous): rows refilled between CUDA-graph replays of the decode step.

For fp16 and every kernel method on backend=cupy (and three torch-path methods with the mirror), tiny Llama and
Qwen3 in bf16: a slot of two rows that samples join while the other row decodes, rows parked past their window,
an EOS in some rows: the graph's tokens equal eager decoding's, the step is captured once and replayed for the whole
run, and no buffer of the slot moves (refills copy into the addresses the graph reads). Against batch 1 the greedy
agreement and logit distance are measured (bf16 products round with the batch size) and bounded loosely; the
scheduler never holds more than its byte budget. The CPU half: tests/test_continuous.py and
tests/test_continuous_emulated.py."""

from __future__ import annotations

import pytest

from oscar.continuous import Request, compare_with_alone, measure_row_cost, serve
from oscar.engine import DecodeEngine
from tests.test_engine_gpu import CASES, _lm, tiny  # noqa: F401 (fixture)
from tests.test_kernels import _gpu_ready

gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")
pytestmark = [pytest.mark.gpu, gpu]

PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps on running through the field " * 2,
           "Hello world, this is", "Once upon a time, in a small village by the sea, there lived " * 3,
           "A short one", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
NEW_TOKENS = [70, 6, 40, 90, 25]


def requests(tokenizer) -> list[Request]:
    return [Request(i, tuple(tokenizer(p)["input_ids"]), n) for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS))]


def run(engine: DecodeEngine, reqs: list[Request], eos: set[int], pointers: list | None = None) -> dict:
    """Tokens by key through a slot of two rows of 256 tokens; ``pointers`` gets the slot's storage addresses after
    every step."""
    out = {}
    for finished in serve(engine, reqs, 2, 256, eos):
        out[finished.key] = finished.tokens
        if pointers is not None:
            pointers.append(engine._slots[2].cache.storage_pointers())
    return out


@pytest.mark.parametrize("method, backend", CASES)
def test_graph_replays_continuous_batching_as_eager_decoding(tiny, method, backend):
    model, tokenizer = tiny
    eager, graph = _lm(tiny, method, backend, "eager"), _lm(tiny, method, backend, "graph")
    reqs = requests(tokenizer)
    free = run(eager.engine, reqs, set())
    assert all(len(set(tokens)) >= 4 for tokens in free.values())
    eos = {free[0][20], free[2][10]}  # two rows end early
    expected = run(eager.engine, reqs, eos)
    assert len(expected[0]) <= 21 and len(expected[2]) <= 11
    pointers: list = []
    got = run(graph.engine, reqs, eos, pointers)
    assert got == expected
    slot = graph.engine._slots[2]
    assert slot.graph is not None and all(p == pointers[0] for p in pointers)


@pytest.mark.parametrize("method, backend", [("fp16", "cupy"), ("oscar", "cupy"), ("kivi", "cupy"), ("ott", "cupy")])
def test_continuous_batching_agrees_with_batch_one_up_to_bf16_rounding(tiny, method, backend):
    """Logits of the steps that fed the same tokens within 5% (relative L2) of batch 1's; most tokens agree."""
    model, tokenizer = tiny
    lm = _lm(tiny, method, backend, "graph")
    compared = compare_with_alone(lm.engine, requests(tokenizer), 2, 256, set())
    assert all(row["logit_rel_diff"] < 0.05 for row in compared), compared
    assert sum(row["agreement"] for row in compared) / len(compared) > 0.5, compared


@pytest.mark.parametrize("method, backend", [("fp16", "torch"), ("oscar", "cupy")])
def test_the_scheduler_holds_at_most_its_byte_budget_on_the_gpu(tiny, method, backend, monkeypatch):
    from evals.scheduler import Budget, Job, scheduled_generate
    from evals.scheduler_replay import live_cache_bytes

    model, tokenizer = tiny
    lm = _lm(tiny, method, backend, "graph")
    cost = measure_row_cost(lm.engine)
    budget = Budget(3 * cost(256), cost, "bytes")
    peaks = []
    step = DecodeEngine._decode_step

    def counted(engine, slot):
        step(engine, slot)
        peaks.append(live_cache_bytes(engine))

    monkeypatch.setattr(DecodeEngine, "_decode_step", counted)
    jobs = [Job(f"s{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS))]
    texts = {job.key: text for job, text, _ in scheduled_generate(lm, jobs, budget=budget)}
    assert len(texts) == len(jobs) and peaks and max(peaks) <= budget.limit
