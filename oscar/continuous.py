"""Continuous batching inside the decode engine: rows of one static cache are slots, refilled as samples finish.

Evaluation generation runs many samples of different lengths, each to its own EOS or ``max_new_tokens``. A static
batch decodes until its longest member is done while the others idle; here a slot of ``rows`` rows keeps decoding
and every row that finishes is refilled from a queue between two decode steps. :func:`serve` does it; the task
layer (evals.scheduler) decides the order of the queue and the slot's rows and capacity from a memory budget.

How a sample enters and leaves a row (the design; the mechanics are oscar.row_slots):

- The slot is the engine's static cache of ``rows`` x ``capacity`` tokens (``capacity`` covers every sample it
  will hold: prompt + max_new_tokens), its decode step captured as one CUDA graph on a GPU. Shapes never change:
  rows are slots, and a refill copies into the addresses the graph reads, so the graph stays valid.
- Admission: the new sample is prefilled *alone*, with no padding, in a one-row staging cache of the same class and
  capacity (``DecodeEngine.staging``), by the same code that prefills any batch: chunked prefill, the method's
  prefill hooks (RotateKV's sinks chosen from this prompt alone), flushes as its policy says. Its row then moves
  into a free row of the slot (``StaticCache.adopt``): every static tensor of the row is copied in place (storage,
  key window, the counts the step reads, the method's per-sequence state: OTT's pool, RotateKV's sinks, kept
  tokens), its host bookkeeping moves over (the torch cache's row group with its packed chunks: each sample is a
  group of its own, so its flushes start at its own first token, ``TokenSpan.rows`` naming its row; the CuPy
  cache's per-row counts), and the row's length is set: the step's position ids and masks are per row, so the row
  continues at its own positions. Its first token (the prefill's argmax) is the row's input at the next step.
- Release: a row that picked an EOS or a stop token, or reached its ``max_new_tokens``, is released
  (``StaticCache.release``): its bookkeeping goes (``nbytes`` drops by what it held, which is what its
  ``Finished.stored_bytes`` reports) and the row is parked; the step keeps computing it and its counts are set
  back to zero after each step, so its writes stay at the start of its own storage until the next sample arrives.
- A slot of one row prefills in place (``reset``, prefill, ``begin_decode``): no staging row. Otherwise the
  staging cache is one more row of ``capacity`` tokens: memory holds (rows + 1) rows at most.

Why a sample's tokens are the ones it gets alone: its prefill *is* alone, and every decode operation is per row
(positions, masks, counts, flushes per row group, per-sequence state); rows share only the batch dimension of the
model's matrix products. On a CPU that gives the same greedy tokens (tests/test_continuous.py, every method); a
GPU's bf16 products round differently with the batch size, so :func:`compare_with_alone` measures the greedy
agreement and the logit distance against batch 1 on given samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from oscar.attention import bind_cache
from oscar.engine import DecodeEngine, _Slot
from oscar.method import deferred_finite_checks
from oscar.static_cache import StaticCache


@dataclass(frozen=True)
class Request:
    """One sample to generate: ``key`` (the caller's name for it), its prompt's token ids (no padding) and its
    budget of new tokens."""

    key: Hashable
    input_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def tokens_needed(self) -> int:
        """Cache positions the sample can fill: prompt + new tokens."""
        return len(self.input_ids) + self.max_new_tokens


@dataclass
class Finished:
    """A sample's greedy continuation (ending with its EOS or stop token, if it picked one), what its cache row
    stored when it ended (real bytes of every layer, ``nbytes``; tokens of one layer) and, where kept, the logits
    each token was picked from ([len(tokens), vocab] float32 on the CPU)."""

    key: Hashable
    tokens: list[int]
    stored_bytes: int
    stored_tokens: int
    logits: Tensor | None = None


@dataclass
class _Row:
    request: Request
    tokens: list[int] = field(default_factory=list)
    logits: list[Tensor] = field(default_factory=list)


def check_requests(requests: Iterable[Request], capacity: int) -> list[Request]:
    """The requests as a list; ValueError naming the first that is empty, has no new token, or needs more than
    ``capacity`` positions."""
    requests = list(requests)
    for r in requests:
        if not r.input_ids or r.max_new_tokens < 1:
            raise ValueError(f"request {r.key!r}: needs a non-empty prompt and max_new_tokens >= 1")
        if r.tokens_needed > capacity:
            raise ValueError(f"request {r.key!r}: {len(r.input_ids)} prompt + {r.max_new_tokens} new tokens do not fit "
                             f"rows of capacity {capacity}")
    return requests


def _stored_tokens(cache: StaticCache) -> int:
    counts = cache.token_counts(0)
    return counts["keys_packed"] + counts["keys_residual"]


class _ContinuousBatch:
    """The state of one :func:`serve`: the slot, its rows, the queue."""

    def __init__(self, engine: DecodeEngine, slot: _Slot, queue: deque, eos: set[int], stop_after: set[int]):
        self.engine, self.slot, self.cache, self.queue = engine, slot, slot.cache, queue
        self.ends = set(eos) | set(stop_after)
        self.running: list[_Row | None] = [None] * len(slot.ids)
        self.device = slot.picked.device
        if len(self.running) > 1:
            self.cache.open_slots()

    def free_rows(self) -> list[int]:
        return [i for i, row in enumerate(self.running) if row is None]

    def done(self, row: _Row) -> bool:
        return row.tokens[-1] in self.ends or len(row.tokens) == row.request.max_new_tokens

    def admit(self) -> list[Finished]:
        """Fill the free rows from the queue (one prefill each); the samples done at their first token come back."""
        finished, first = [], {}
        for i in self.free_rows():
            while self.queue and self.running[i] is None:
                request = self.queue.popleft()
                target = self.cache if len(self.running) == 1 else self.engine.staging(self.cache.capacity)
                if target is self.cache:
                    target.reset([0])
                ids = torch.tensor([request.input_ids], device=self.device)
                logits = self.engine._prefill(ids, torch.ones_like(ids), target)
                target.begin_decode()
                row = _Row(request, [int(logits[0].argmax())])
                if self.slot.logits is not None:
                    row.logits.append(logits[0].to("cpu", torch.float32, copy=True))
                if self.done(row):
                    finished.append(self._finish(row, target, 0))
                    continue
                if target is not self.cache:
                    self.cache.adopt([i], target, [0])
                self.running[i] = row
                first[i] = row.tokens[0]
        if first:
            self.slot.picked[torch.tensor(list(first), device=self.device)] = torch.tensor(list(first.values()),
                                                                                          device=self.device)
        return finished

    def step(self) -> list[Finished]:
        """One decode step of every row; the rows that are done come back (and are released)."""
        slot = self.slot
        bind_cache(self.engine.model, self.cache)
        slot.ids.copy_(slot.picked.view(-1, 1))
        self.engine._decode(slot)
        tokens = slot.picked.tolist()
        logits = None if slot.logits is None else slot.logits.to("cpu", torch.float32, copy=True)
        finished = []
        for i, row in enumerate(self.running):
            if row is None:
                continue
            row.tokens.append(tokens[i])
            if logits is not None:
                row.logits.append(logits[i])
            if self.done(row):
                finished.append(self._finish(row, self.cache, i))
        return finished

    def _finish(self, row: _Row, cache: StaticCache, i: int) -> Finished:
        """The row's result; a slot row is released (what it stored: the cache's bytes and tokens it gives back)."""
        if cache is self.cache:
            stored, tokens = cache.nbytes, _stored_tokens(cache)
            cache.release([i])
            stored, tokens = stored - cache.nbytes, tokens - _stored_tokens(cache)
            self.running[i] = None
        else:  # a staging cache holds that sample alone
            stored, tokens = cache.nbytes, _stored_tokens(cache)
        logits = torch.stack(row.logits) if row.logits else None
        return Finished(row.request.key, row.tokens, stored, tokens, logits)


@torch.no_grad()
def serve(engine: DecodeEngine, requests: Iterable[Request], rows: int, capacity: int, eos_token_ids: set[int],
          stop_after_ids: set[int] = frozenset(), keep_logits: bool = False) -> Iterator[Finished]:
    """Greedy continuations of ``requests`` through one slot of ``rows`` rows (fewer if there are fewer requests) of
    ``capacity`` tokens, refilled in the order given as rows finish (module docstring); each :class:`Finished` is
    yielded as its sample ends (any order). A row ends at its first EOS (kept, as transformers' generate keeps it),
    its first token of ``stop_after_ids``, or its ``max_new_tokens``. ``keep_logits``: each Finished carries the
    logits of its tokens. The input checks of the method's quantizers are read after every step, before the samples
    that step finished are handed out."""
    if rows < 1:
        raise ValueError(f"serve: rows must be >= 1, got {rows}")
    queue = deque(check_requests(requests, capacity))
    if not queue:
        return
    slot = engine.open_slot(min(rows, len(queue)), capacity, keep_logits)
    batch = _ContinuousBatch(engine, slot, queue, eos_token_ids, stop_after_ids)
    while True:
        with deferred_finite_checks():
            finished = batch.admit()
            if any(row is not None for row in batch.running):
                finished += batch.step()
        yield from finished
        if not batch.queue and all(row is None for row in batch.running):
            return


@dataclass(frozen=True)
class RowCost:
    """Bytes a static cache row of ``capacity`` tokens holds when full: ``per_token * capacity + per_row``."""

    per_token: float
    per_row: float

    def __call__(self, capacity: int) -> int:
        return int(-(-(self.per_token * capacity + self.per_row) // 1))


@torch.no_grad()
def measure_row_cost(engine: DecodeEngine, seed: int = 0) -> RowCost:
    """What one row of the engine's static cache holds, measured: a one-row cache at each of the two smallest
    capacities, prefilled to its last free position with random tokens, its ``allocated_bytes`` read (every byte its
    storage holds: the method's packed buffers, full-precision windows, the torch backend's dequantized mirror, the
    static tensors preallocated to capacity); the line through both."""
    first = engine.capacity(1, 0)
    second = engine.capacity(first + 1, 0)
    vocab = engine.model.config.get_text_config().vocab_size
    device = next(engine.model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    held = []
    for capacity in (first, second):
        cache = engine.backend.static_cache(engine.model, engine.method, [0], capacity)
        if cache is None:
            raise ValueError(f"backend={engine.backend.name} has no static cache for method={engine.method.name}")
        ids = torch.randint(0, vocab, (1, capacity - 1), generator=generator).to(device)
        with deferred_finite_checks():
            engine._prefill(ids, torch.ones_like(ids), cache)
        cache.begin_decode()
        held.append(cache.allocated_bytes)
        del cache
    per_token = (held[1] - held[0]) / (second - first)
    return RowCost(per_token, held[0] - per_token * first)


def compare_with_alone(engine: DecodeEngine, requests: list[Request], rows: int, capacity: int,
                       eos_token_ids: set[int], stop_after_ids: set[int] = frozenset()) -> list[dict]:
    """Continuous batching (``rows`` x ``capacity``) against batch 1 (each request alone, at the capacity the engine
    gives it alone) on the same requests, logits kept: per request its ``key``, ``identical`` (the same tokens),
    ``first_divergence`` (the first step whose tokens differ; None if none), ``agreement`` (the share of the longer
    continuation that the common prefix covers), ``max_logit_diff`` and ``logit_rel_diff`` (max |a - b| and
    ||a - b|| / ||b|| of the logits over the steps both fed the same tokens: the common prefix and the step after it,
    b batch 1's)."""
    batched = {f.key: f for f in serve(engine, requests, rows, capacity, eos_token_ids, stop_after_ids, True)}
    rows_out = []
    for request in requests:
        alone = next(serve(engine, [request], 1, engine.capacity(len(request.input_ids), request.max_new_tokens),
                           eos_token_ids, stop_after_ids, True))
        got = batched[request.key]
        common = next((i for i, (a, b) in enumerate(zip(got.tokens, alone.tokens)) if a != b),
                      min(len(got.tokens), len(alone.tokens)))
        identical = got.tokens == alone.tokens
        steps = min(common + 1, len(got.tokens), len(alone.tokens))
        diff = got.logits[:steps] - alone.logits[:steps]
        rows_out.append(dict(key=request.key, identical=identical, first_divergence=None if identical else common,
                             agreement=common / max(len(got.tokens), len(alone.tokens)),
                             max_logit_diff=float(diff.abs().max()),
                             logit_rel_diff=float(diff.norm() / alone.logits[:steps].norm())))
    return rows_out
