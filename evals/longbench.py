"""LongBench-E (the 13 English subsets, ``<name>_e``), as LongBench's ``pred.py`` + ``eval.py`` run it.

Per sample: the official prompt of the subset filled with the row's ``context`` and ``input``;
middle truncation of the prompt's tokens to ``max_input_length`` (default: the model's max_length;
keep the first and last halves, as LongBench does), and further where the model would not hold the prompt as it
reads it (chat template or special tokens included: at most max_length tokens) and the subset's new tokens (within
its positions), so that every sample runs; the chat template unless the subset is in
``no_template_subsets`` (LongBench skips it for trec, triviaqa, samsum, lcc, repobench-p);
greedy decoding of the subset's official max new tokens with the torch seed set to ``seed + index``;
the score from ``evals.longbench_metrics`` (max over gold answers). Samples run in fixed left-padded batches of
``batch_size`` in dataset order, or (``scheduler=true``) every subset's samples at once through evals.scheduler:
ordered by length, batched up to ``batch_tokens`` (or a share of the free memory), each row refilled as it finishes;
predictions are written under their keys as samples finish, in any order (greedy decoding draws nothing at random:
the seed is set once).

Reported (x100): per subset the mean over its samples; per subset and length bucket (0-4k, 4-8k,
8k+ of the row's ``length`` field, LongBench's word count) as LongBench-E's ``scorer_e``; ``average``
= the unweighted mean of the subset scores (over the 13 subsets in a full run); a bucket's overall
score = the unweighted mean over the subsets that have samples in that bucket.

Data: the hub mirror lm-eval uses (``Xnhyacinth/LongBench``, configs ``<name>_e``, split test; the
original THUDM/LongBench is a loading script that current ``datasets`` no longer runs), or
``data_dir`` with one ``<name>_e.jsonl`` per subset in LongBench's row format (input, context,
answers, length, dataset, language, all_classes, _id).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from evals.base import (Headline, Task, TaskResult, register_task, stored_counts, stored_of, stored_since,
                         stored_total)
from evals.datafiles import DataError, check_hub_dataset, read_jsonl
from evals.longbench_metrics import score_sample
from evals.longbench_prompts import MAX_NEW_TOKENS, PROMPTS
from evals.paper import paper
from evals.scheduler import Job, ScheduledGeneration, scheduled_generate
from evals.tables import labelled, ordered, signed, value_table, write_table
from oscar.lm import KVModel, format_prompt, prompt_length
from oscar.options import bounded
from oscar.paths import locate_data, resolve_data
from oscar.results import NUMBER, PredictionLog

log = logging.getLogger(__name__)

SUBSETS = [f"{name}_e" for name in PROMPTS]
LENGTH_BUCKETS = [("0-4k", 0, 4000), ("4-8k", 4000, 8000), ("8k+", 8000, float("inf"))]
NO_TEMPLATE = ["trec_e", "triviaqa_e", "samsum_e", "lcc_e", "repobench-p_e"]
#: what a logged sample holds (a record without them is computed again); ``length`` is the dataset's, maybe absent
SAMPLE_FIELDS = dict(pred=str, score=NUMBER, length=(int, type(None)))


def bucket_of(length: int) -> str:
    return next(name for name, low, high in LENGTH_BUCKETS if low <= length < high)


def middle_truncate(tokenizer, prompt: str, max_tokens: int) -> tuple[str, bool]:
    """Keep the first and last ``max_tokens // 2`` tokens of ``prompt`` when it is longer."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return prompt, False
    half = max_tokens // 2
    return (tokenizer.decode(ids[:half], skip_special_tokens=True)
            + tokenizer.decode(ids[len(ids) - half:], skip_special_tokens=True)), True


#: the columns a LongBench row needs (the prompt's fields, the scorer's answers)
REQUIRED_COLUMNS = ("context", "answers")


def load_rows(subset: str, data_dir: str | None, hub_dataset: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` rows (None = all) of one subset from ``data_dir/<subset>.jsonl`` or the hub;
    ``input`` filled from the mirror's ``question`` column where needed. A local file is parsed with
    errors naming its file and line (malformed JSON, a missing column, no rows)."""
    if data_dir is not None:
        path = resolve_data(data_dir) / f"{subset}.jsonl"
        rows = read_jsonl(path, REQUIRED_COLUMNS, limit, task="longbench_e")
        for number, row in enumerate(rows, 1):
            if "input" not in row and "question" not in row:
                raise DataError(f"longbench_e: {path}: record {number}: missing 'input' (or 'question')")
            if not isinstance(row["answers"], list) or not row["answers"]:
                raise DataError(f"longbench_e: {path}: record {number}: 'answers' must be a non-empty list")
    else:
        try:
            from datasets import load_dataset

            rows = list(load_dataset(hub_dataset, subset, split="test"))
        except Exception as e:  # noqa: BLE001 - offline or missing config: one clear message
            raise RuntimeError(f"longbench_e: cannot load {hub_dataset}/{subset} from the hub ({type(e).__name__}: "
                               f"{e}); set task.data_dir to a folder of LongBench-format <subset>.jsonl files") from None
        rows = rows[:limit]
        if not rows:
            raise DataError(f"longbench_e: {hub_dataset}/{subset} has no rows")
    for row in rows:
        if "input" not in row:
            row["input"] = row.get("question", "")
    return rows


@register_task("longbench_e")
@dataclass
class LongBenchE(ScheduledGeneration, Task):
    """Options: ``subsets`` (default all 13), ``limit`` samples per subset, ``data_dir`` (local jsonl)
    or ``hub_dataset``, ``max_input_length`` (null = the model's), ``chat_template`` (auto: by
    subset, as LongBench; always; never), ``no_template_subsets``, ``batch_size``, ``seed``; ``scheduler`` and
    ``batch_tokens`` (evals.scheduler)."""

    subsets: list[str] = field(default_factory=lambda: list(SUBSETS))
    limit: int | None = bounded(None, ge=1)
    data_dir: str | None = None
    hub_dataset: str = "Xnhyacinth/LongBench"
    max_input_length: int | None = bounded(None, ge=1)
    chat_template: Literal["auto", "always", "never"] = "auto"
    no_template_subsets: list[str] = field(default_factory=lambda: list(NO_TEMPLATE))
    batch_size: int = bounded(1, ge=1)
    seed: int = 42

    headline = (Headline("score", "average"),)
    option_words = {"limit": lambda v: "every sample" if v == "null" else f"{v} samples per subset",
                    "data_dir": lambda v: f"data in {v}", "subsets": lambda v: f"subsets {v}"}

    @classmethod
    def sample_words(cls, row: dict) -> str:
        """The average and the length buckets are means over subsets, a subset (and its bucket) over samples."""
        n = int(row["n"])
        over_subsets = row["subset"] == "average" or row["subset"] in {name for name, _, _ in LENGTH_BUCKETS}
        return f"{n} subset{'s' if n != 1 else ''}" if over_subsets else f"{n} sample{'s' if n != 1 else ''}"

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = sorted(set(self.subsets) - set(SUBSETS))
        if unknown:
            raise ValueError(f"longbench_e: unknown subset(s) {unknown}; the 13 are {SUBSETS}")
        if not self.subsets:
            raise ValueError("longbench_e: subsets must name at least one subset")
        twice = sorted({s for s in self.subsets if self.subsets.count(s) > 1})
        if twice:
            raise ValueError(f"longbench_e: subset(s) {twice} named twice")
        unknown = sorted(set(self.no_template_subsets) - set(SUBSETS))
        if unknown:  # e.g. LongBench's own names without _e: the template would silently stay on
            raise ValueError(f"longbench_e: unknown no_template_subsets {unknown}; the 13 are {SUBSETS}")
        self.check_scheduler(self.batch_size)

    def check(self) -> None:
        """Every subset file the run reads, parsed (its first ``limit`` rows); or the hub reached."""
        if self.data_dir is None:
            check_hub_dataset(self.hub_dataset, "longbench_e",
                              "set task.data_dir to a folder of LongBench-format <subset>.jsonl files")
            return
        folder = resolve_data(self.data_dir)
        missing = [s for s in self.subsets if not (folder / f"{s}.jsonl").exists()]
        if missing:
            raise FileNotFoundError(f"longbench_e: no {', '.join(m + '.jsonl' for m in missing)} in {folder}")
        for subset in self.subsets:
            load_rows(subset, self.data_dir, self.hub_dataset, self.limit)

    def check_context(self, max_length: int) -> None:
        if self.max_input_length is not None and self.max_input_length > max_length:
            raise ValueError(f"longbench_e: max_input_length={self.max_input_length} exceeds the model's max_length "
                             f"{max_length}")

    def data_files(self) -> list[Path]:
        return [] if self.data_dir is None else [locate_data(self.data_dir) / f"{s}.jsonl" for s in self.subsets]

    def uses_chat(self, subset: str, tokenizer) -> bool:
        if self.chat_template == "never" or getattr(tokenizer, "chat_template", None) is None:
            return False
        return self.chat_template == "always" or subset not in self.no_template_subsets

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        self.check()
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        predictions = PredictionLog(Path(run_dir) / "predictions.jsonl", SAMPLE_FIELDS)
        rows = {subset: load_rows(subset, self.data_dir, self.hub_dataset, self.limit) for subset in self.subsets}
        keys = {subset: [f"{subset}/{i}" for i in range(len(rows[subset]))] for subset in self.subsets}
        todo = {subset: [i for i, key in enumerate(keys[subset]) if key not in predictions.done]
                for subset in self.subsets}

        def record(subset: str, i: int, output: str, truncated: bool, stored: dict) -> None:
            row, name = rows[subset][i], subset.removesuffix("_e")
            score = score_sample(name, output, row["answers"], row.get("all_classes"))
            predictions.write(keys[subset][i], {"id": row.get("_id"), "length": row.get("length"), "pred": output,
                                                "answers": row["answers"], "truncated": truncated,
                                                "chat": self.uses_chat(subset, lm.tokenizer), "score": 100 * score,
                                                **stored})

        if self.scheduler:
            torch.manual_seed(self.seed)
            jobs, cut = self.scheduled_jobs(lm, rows, todo)
            for job, output, finished in tqdm(scheduled_generate(lm, jobs, self.batch_tokens), total=len(jobs),
                                              desc=f"longbench_e {lm.method.name}"):
                subset, i = job.key.rsplit("/", 1)
                record(subset, int(i), output, cut[subset, int(i)], stored_of(finished))
        else:
            for subset in self.subsets:
                for start in tqdm(range(0, len(todo[subset]), self.batch_size), desc=f"{subset} {lm.method.name}"):
                    batch = todo[subset][start:start + self.batch_size]
                    texts, cut = zip(*self.prompts(lm, subset, [rows[subset][i] for i in batch]))
                    torch.manual_seed(self.seed + batch[0])
                    before = stored_counts(lm)
                    outputs = lm.generate(list(texts), MAX_NEW_TOKENS[subset.removesuffix("_e")],
                                          chat=self.uses_chat(subset, lm.tokenizer))
                    stored = stored_since(lm, before, share=len(batch))  # one cache per batch: each sample its share
                    for i, output, truncated in zip(batch, outputs, cut):
                        record(subset, i, output, truncated, stored)
        scored = {subset: [predictions.done[key] for key in keys[subset]] for subset in self.subsets}
        result = summarize(scored)
        result.stored = stored_total([r for records in scored.values() for r in records], predictions.path)
        return result

    def prompts(self, lm: KVModel, subset: str, rows: list[dict]) -> list[tuple[str, bool]]:
        """Each row's prompt filled from ``subset``'s template and cut as :meth:`truncated_all` cuts it; whether it
        was."""
        template = PROMPTS[subset.removesuffix("_e")]
        return self.truncated_all(lm, subset, [template.format(**row) for row in rows])

    def scheduled_jobs(self, lm: KVModel, rows: dict[str, list[dict]],
                       todo: dict[str, list[int]]) -> tuple[list[Job], dict[tuple[str, int], bool]]:
        """The scheduler's jobs of the rows ``todo`` names (per subset, indices into ``rows[subset]``), keyed
        "subset/index", each prompt as :meth:`prompts` gives it; and whether each was cut, by (subset, index)."""
        jobs, cut = [], {}
        for subset, indices in todo.items():
            for i, (text, cut[subset, i]) in zip(indices, self.prompts(lm, subset, [rows[subset][i] for i in indices])):
                jobs.append(Job(f"{subset}/{i}", text, MAX_NEW_TOKENS[subset.removesuffix("_e")],
                                self.uses_chat(subset, lm.tokenizer)))
        return jobs, cut

    def _room(self, lm: KVModel, subset: str) -> tuple[bool, int, int]:
        """(chat, room, keep): whether the subset's prompts take the chat template, the tokens a prompt may have as
        the model reads it, and the tokens :meth:`truncated` keeps of the text first."""
        chat, new = self.uses_chat(subset, lm.tokenizer), MAX_NEW_TOKENS[subset.removesuffix("_e")]
        room = lm.max_length if lm.positions is None else min(lm.max_length, lm.positions - new)
        return chat, room, min(self.max_input_length or lm.max_length, room - prompt_length(lm.tokenizer, "", chat))

    def truncated_all(self, lm: KVModel, subset: str, texts: list[str]) -> list[tuple[str, bool]]:
        """:meth:`truncated` of each of ``texts``: those that fit as they are, measured in two batched tokenizer
        calls (a fast tokenizer encodes a batch on every core), and the others cut one by one."""
        chat, room, keep = self._room(lm, subset)
        if keep < 2 or not texts:  # no room for a prompt (truncated says so), or nothing to measure
            return [self.truncated(lm, subset, text) for text in texts]
        tokenizer = lm.tokenizer
        raw = tokenizer(texts, add_special_tokens=False)["input_ids"]
        read = tokenizer([format_prompt(tokenizer, t, chat) for t in texts], add_special_tokens=not chat)["input_ids"]
        return [(text, False) if len(ids) <= keep and len(as_read) <= room else self.truncated(lm, subset, text)
                for text, ids, as_read in zip(texts, raw, read)]

    def truncated(self, lm: KVModel, subset: str, text: str) -> tuple[str, bool]:
        """``text`` middle-truncated to ``max_input_length`` tokens (null: the model's max_length) and, where the
        model would not hold it as it reads it (at most ``lm.max_length`` tokens, chat template or special tokens
        included, and within its positions with the subset's new tokens), to what it holds; whether it was cut. The
        halves are re-tokenized where they join, so the prompt is measured as read and cut again by any excess."""
        chat, room, keep = self._room(lm, subset)
        while True:
            if keep < 2:  # a token of each half at least
                raise ValueError(f"longbench_e: {subset}: the model's max_length {lm.max_length} and positions "
                                 f"{lm.positions} leave no room for a prompt and its "
                                 f"{MAX_NEW_TOKENS[subset.removesuffix('_e')]} new tokens")
            kept, cut = middle_truncate(lm.tokenizer, text, keep)
            excess = prompt_length(lm.tokenizer, kept, chat) - room
            if excess <= 0:
                return kept, cut
            keep -= excess

    # -- tables -------------------------------------------------------------------------------
    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """Table 1 (per subset, the average, the paper's average and the difference) and the length buckets."""
        header, body, bucket_header, bucket_body = longbench_table(rows)
        return (write_table(out, "table1_longbench_e", header, body,
                            "LongBench-E per subset and 13-subset average (paper: INT2, G=32, R=128)")
                + write_table(out, "table1_longbench_e_buckets", bucket_header, bucket_body,
                              "LongBench-E by input length (mean over the subsets' samples in each bucket)"))


def summarize(scored: dict[str, list[dict]]) -> TaskResult:
    """Per-subset means, per-subset-and-bucket means, the subset average and the bucket averages."""
    rows, metrics = [], {}
    by_bucket: dict[str, list[float]] = {name: [] for name, _, _ in LENGTH_BUCKETS}

    def add(subset: str, values: list[float]) -> float:
        value = sum(values) / len(values)
        rows.append({"subset": subset, "metric": "score", "value": value, "n": len(values)})
        metrics[subset] = value
        return value

    subset_scores = []
    for subset, records in scored.items():
        if not records:
            continue
        subset_scores.append(add(subset, [r["score"] for r in records]))
        for bucket, _, _ in LENGTH_BUCKETS:
            values = [r["score"] for r in records  # a row without its length is in no bucket
                      if r.get("length") is not None and bucket_of(int(r["length"])) == bucket]
            if values:
                by_bucket[bucket].append(add(f"{subset}@{bucket}", values))
    if subset_scores:
        add("average", subset_scores)
    for bucket, values in by_bucket.items():
        if values:
            add(bucket, values)
    return TaskResult(metrics=metrics, rows=rows)


def longbench_table(rows: list[dict]) -> tuple[list[str], list[list], list[str], list[list]]:
    """Table 1 (per subset + average, paper's average and the difference) and the length-bucket table."""
    rows = labelled([r for r in rows if r["task"] == "longbench_e" and r["metric"] == "score"])
    values = value_table(rows)
    present = {r["subset"] for r in rows}
    subsets = [s for s in SUBSETS if s in present]
    buckets = [name for name, _, _ in LENGTH_BUCKETS if name in present]
    example = {(r["model"], r["label"]): r for r in rows}
    header = ["model", "method", *[s.removesuffix("_e") for s in subsets], "avg", "paper", "Δ"]
    body, bucket_body = [], []
    for key in ordered(values):
        v = values[key]
        avg = v.get(("longbench_e", "average", "score"))
        number = paper().value(example[key])
        body.append([*key, *[v.get(("longbench_e", s, "score")) for s in subsets], avg, number,
                     signed(avg - number) if avg is not None and number is not None else None])
        bucket_body.append([*key, *[v.get(("longbench_e", b, "score")) for b in buckets], avg])
    return header, body, ["model", "method", *buckets, "avg"], bucket_body
