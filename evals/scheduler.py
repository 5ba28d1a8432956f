"""Scheduled generation for the evaluation tasks: samples ordered by length, batched up to a memory budget and
decoded with continuous batching (oscar.continuous), each sample to its own EOS or ``max_new_tokens``.

A task hands over its :class:`Job` s (key, prompt, new tokens, chat); :func:`scheduled_generate` tokenizes and checks
every prompt first (nothing runs if one is refused), orders the samples by the positions they need (prompt + new
tokens, longest first) and cuts that order into *waves* (:func:`plan_waves`): a wave's rows share one capacity, the
need of its first sample rounded up by the engine, and it takes the following samples while their need exceeds half
of it (so no row wastes more than half its capacity) or rounds to it; its slot has as many rows as the budget holds
at that capacity, one staging row counted (oscar.continuous), and at most its number of samples; within a wave the
samples with the most new tokens go first, so that its last rows to finish are short ones. Each wave runs
``oscar.continuous.serve`` on the engine's slot; results come back as samples finish, to be written under their own
keys in any order. ``run_requests`` does the same for token requests (evals.scheduler_replay's benchmark core).
A model split over several devices needs ``batch_tokens`` (the free memory is read on one device).

The budget (:class:`Budget`): ``task.batch_tokens`` caps the token positions the static caches hold at once (rows x
capacity, the staging row included); unset, it is the bytes of :data:`MEMORY_SHARE` of the device's free memory
(after the weights, the engine's old caches dropped), each row costing what a row of the method's cache really holds
at that capacity (oscar.continuous.measure_row_cost: ``allocated_bytes`` of a real cache, which for the torch
backend includes its full-precision mirror).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from oscar.continuous import Finished, Request, compare_with_alone, measure_row_cost, serve
from oscar.engine import DecodeEngine
from oscar.lm import KVModel, check_prompts
from oscar.options import bounded
from oscar.placement import model_devices

log = logging.getLogger(__name__)

#: the share of the free device memory the static caches may hold when no ``batch_tokens`` is set; the rest is
#: for activations (a whole prompt's prefill, the captured step's pool) and the allocator's fragmentation
MEMORY_SHARE = 0.8
#: a wave takes samples that need more than 1 / WAVE_GROWTH of its capacity
WAVE_GROWTH = 2.0


@dataclass(frozen=True)
class Job:
    """One generation of a task: ``prompt`` (formatted with the chat template if ``chat``) and its new tokens."""

    key: str
    prompt: str
    max_new_tokens: int
    chat: bool = False


@dataclass(frozen=True)
class Budget:
    """At most ``limit`` units held by the static caches at once, a row of capacity C costing ``cost(C)`` units
    (``unit``: "tokens" or "bytes")."""

    limit: int
    cost: Callable[[int], int]
    unit: str = "tokens"

    def rows(self, capacity: int) -> int:
        """Rows of a slot at ``capacity`` within the budget: a slot of two rows or more also holds the staging row
        (oscar.continuous), so n rows' worth gives n - 1, and two rows' worth one row; 0 when one row is too many."""
        n = self.limit // max(1, self.cost(capacity))
        return n - 1 if n >= 3 else min(n, 1)

    def held(self, rows: int, capacity: int) -> int:
        """Units a slot of ``rows`` rows at ``capacity`` holds, its staging row included."""
        return (rows + (rows > 1)) * self.cost(capacity)


def token_budget(batch_tokens: int) -> Budget:
    return Budget(batch_tokens, lambda capacity: capacity, "tokens")


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: CUDA's free memory plus what PyTorch's allocator holds unused; on a CPU the
    system's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the free memory of this machine: set task.batch_tokens")


def memory_budget(engine: DecodeEngine) -> Budget:
    """:data:`MEMORY_SHARE` of the free memory of the model's device, rows at their measured cost (the engine's
    caches dropped first). A model split over several devices is refused: set ``task.batch_tokens``."""
    devices = model_devices(engine.model)
    if len(devices) > 1:
        raise ValueError(f"scheduler: the model runs on {len(devices)} devices; the budget is read from one device's "
                         "free memory: set task.batch_tokens")
    engine.drop_caches()
    cost = measure_row_cost(engine)
    limit = int(MEMORY_SHARE * free_memory(devices[0]))
    log.info("scheduler: %.2f GB for the caches, a row costs %.0f bytes per token + %.0f", limit / 1e9,
             cost.per_token, cost.per_row)
    return Budget(limit, cost, "bytes")


@dataclass(frozen=True)
class Wave:
    """Samples (indices, in order) decoded through one slot of ``rows`` rows of ``capacity`` tokens."""

    capacity: int
    rows: int
    members: tuple[int, ...]


def plan_waves(needs: list[int], capacity_of: Callable[[int], int], budget: Budget,
               growth: float = WAVE_GROWTH, decode_lengths: list[int] | None = None) -> list[Wave]:
    """Samples needing ``needs`` positions each, longest first, cut into waves (module docstring): a wave's capacity
    is ``capacity_of`` its first need; it takes the next samples while need * ``growth`` > capacity (or the need rounds
    to the same capacity); its rows are what ``budget`` holds at that capacity, at most its samples. Within a wave,
    given ``decode_lengths`` (each sample's new tokens), the samples that decode longest go first (longest processing
    time first), so that the rows still decoding once the wave's queue is empty are its shortest: a short drain.
    ValueError if one row of some wave exceeds the budget."""
    order = sorted(range(len(needs)), key=lambda i: (-needs[i], i))
    waves, start = [], 0
    while start < len(order):
        capacity = capacity_of(needs[order[start]])
        end = start + 1
        while end < len(order) and (needs[order[end]] * growth > capacity
                                    or capacity_of(needs[order[end]]) == capacity):
            end += 1
        rows = min(budget.rows(capacity), end - start)
        if rows < 1:
            raise ValueError(f"scheduler: a sample needs {needs[order[start]]} positions (a row of capacity "
                             f"{capacity}: {budget.cost(capacity)} {budget.unit}), more than the budget of "
                             f"{budget.limit} {budget.unit}; raise task.batch_tokens or shorten the inputs")
        members = order[start:end]
        if decode_lengths is not None:
            members = sorted(members, key=lambda i: (-decode_lengths[i], -needs[i], i))
        waves.append(Wave(capacity, rows, tuple(members)))
        start = end
    return waves


def requests_for(lm: KVModel, jobs: list[Job]) -> list[Request]:
    """Each job's prompt formatted and tokenized as ``KVModel.generate`` does (no padding), checked as it checks
    them (oscar.lm.check_prompts; the error names the job): :class:`Request` s keyed by the jobs' indices. The
    prompts are tokenized in one batched call per kind (chat or not): a fast tokenizer encodes a batch on every
    core."""
    tokenized: list[list[int]] = [[] for _ in jobs]
    for chat in {job.chat for job in jobs}:
        indices = [i for i, job in enumerate(jobs) if job.chat == chat]
        texts = [lm.format_prompt(jobs[i].prompt, chat) for i in indices]
        for i, ids in zip(indices, lm.tokenizer(texts, add_special_tokens=not chat)["input_ids"]):
            tokenized[i] = ids
    requests = []
    for index, (job, ids) in enumerate(zip(jobs, tokenized)):
        try:
            check_prompts([job.prompt], [len(ids)], lm.max_length, job.max_new_tokens, lm.positions)
        except ValueError as e:
            raise ValueError(f"{job.key}: {e}") from None
        requests.append(Request(index, tuple(ids), job.max_new_tokens))
    return requests


def run_requests(engine: DecodeEngine, requests: list[Request], budget: Budget, eos_token_ids: set[int]
                 ) -> Iterator[Finished]:
    """``requests`` in waves (:func:`plan_waves`) through the engine's continuous batching, each Finished as its
    sample ends."""
    waves = plan_waves([r.tokens_needed for r in requests], lambda n: engine.capacity(n, 0), budget,
                       decode_lengths=[r.max_new_tokens for r in requests])
    log.info("scheduler: %d samples in %d waves (rows x capacity: %s; at most %d of %d %s held)", len(requests),
             len(waves), ", ".join(f"{w.rows}x{w.capacity}" for w in waves),
             max(budget.held(w.rows, w.capacity) for w in waves), budget.limit, budget.unit)
    for wave in waves:
        yield from serve(engine, [requests[i] for i in wave.members], wave.rows, wave.capacity, eos_token_ids)


def scheduled_generate(lm: KVModel, jobs: list[Job], batch_tokens: int | None = None,
                       budget: Budget | None = None) -> Iterator[tuple[Job, str, Finished]]:
    """Greedy continuations of ``jobs`` (module docstring), as (job, text, Finished) when each sample ends; the text
    decoded as ``KVModel.generate`` decodes it. ``budget`` (else ``batch_tokens``, else the free memory) bounds
    the caches. ``lm.stored_bytes`` / ``stored_tokens`` count what each sample's row stored."""
    lm.check_prepared()
    requests = requests_for(lm, jobs)
    if not requests:
        return
    budget = budget or (token_budget(batch_tokens) if batch_tokens is not None else memory_budget(lm.engine))
    for finished in run_requests(lm.engine, requests, budget, lm.eos_token_ids()):
        lm.stored_bytes += finished.stored_bytes
        lm.stored_tokens += finished.stored_tokens
        yield jobs[finished.key], lm.tokenizer.decode(finished.tokens, skip_special_tokens=True), finished


def agreement_with_batch_one(lm: KVModel, jobs: list[Job], rows: int) -> list[dict]:
    """Greedy agreement and logit distance of continuous batching against batch 1 on ``jobs`` (one slot of ``rows``
    rows at the capacity the longest needs; oscar.continuous.compare_with_alone), each row keyed by its job's key."""
    requests = requests_for(lm, jobs)
    capacity = lm.engine.capacity(max(r.tokens_needed for r in requests), 0)
    compared = compare_with_alone(lm.engine, requests, rows, capacity, lm.eos_token_ids())
    return [{**row, "key": jobs[row["key"]].key} for row in compared]


@dataclass
class ScheduledGeneration:
    """The options of a task that generates through the scheduler (a base of its dataclass)."""

    #: order the samples by length and decode them with continuous batching up to a memory budget
    scheduler: bool = False
    #: the budget: token positions the static caches hold at once (null: a share of the free device memory)
    batch_tokens: int | None = bounded(None, ge=1)

    def check_backend(self, backend, method) -> None:
        """Refuse scheduler=true where the backend makes no decode-engine cache for the method (continuous batching
        refills the engine's static cache)."""
        if self.scheduler and not backend.has_static_cache(method):
            raise ValueError(f"{self.name}: scheduler=true decodes through the decode engine's static caches, and "
                             f"backend={backend.name} makes none for method={method.name} "
                             f"({', '.join(f'{k}={v}' for k, v in backend.describe().items() if k != 'name')}): "
                             "use backend=torch with backend.mirror=true, or backend=cupy, or scheduler=false")

    def check_scheduler(self, batch_size: int = 1) -> None:
        """Refuse scheduler=true with fixed batches of ``batch_size`` > 1 (the scheduler makes its own batches), and a
        ``batch_tokens`` that scheduler=false would ignore (it would still make another run)."""
        if self.scheduler and batch_size > 1:
            raise ValueError(f"{self.name}: scheduler=true batches by length and memory; batch_size={batch_size} "
                             "would be ignored: leave batch_size at 1 (or scheduler=false)")
        if not self.scheduler and self.batch_tokens is not None:
            raise ValueError(f"{self.name}: batch_tokens={self.batch_tokens} is the scheduler's budget, and "
                             "scheduler=false: set scheduler=true, or leave batch_tokens null")
