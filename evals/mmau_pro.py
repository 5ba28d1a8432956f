"""MMAU-Pro (Kumar et al. 2025): audio understanding, scored per question category as the benchmark does.

Protocol (rows of ``test.parquet``: question, choices, answer, category, audio_path, and for
instruction following task_identifier + kwargs):
  1. prompt = the audio clip(s) then the question; multiple-choice questions list their choices
     (``choice_template``). Greedy decoding, ``max_new_tokens`` (``max_new_tokens_choice`` for
     multiple choice).
  2. scoring by category:
     - ``open`` (open-ended QA): a local judge model (``judge``, recorded in the rows' subset as
       ``open/judge=<name>``) grades correctness, relevance, completeness and clarity 1-5 in the
       benchmark's judge format; ``open`` = 100 x mean OVERALL / 5, ``good_rate`` = % with
       OVERALL >= 4 (unparsable scores read as 3, as the official script);
     - ``instruction following`` (AIF): the benchmark's deterministic checks per task_identifier
       (:func:`follows_instruction`), % passed; sentences are counted by splitting after . ! ?
       followed by white space (the official script uses nltk's punkt, not a dependency here);
     - every other category is multiple choice: the prediction is matched to the closest choice and
       scored against the answer. The official script matches with NV-Embed-v2 embeddings
       (``choice_matcher: embedding``, ``choice_embedder``); the offline default ``fuzzy`` takes an
       exact / option-letter / unique-containment match, else the highest rapidfuzz token-set ratio.
  3. ``weighted``: the official overall score, categories weighted by their sizes (open as mean/5).
The paper reports open, good_rate and aif. The judge decodes greedily (the official script samples
at temperature 0.1): a stated choice, for reproducible scores.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from evals.base import Headline, Task, TaskResult, check_template, register_task
from evals.datafiles import DataError, check_hub_dataset
from evals.mm_common import (DataUnavailableError, check_multimodal, generate_logged, hub_dataset_dir, require_dir,
                              resolve_dir)
from evals.paper import paper
from evals.tables import grouped, ordered, signed, write_table
from oscar.lm import KVModel
from oscar.multimodal import MMSample, load_audio
from oscar.options import bounded

log = logging.getLogger(__name__)

OPEN, AIF = "open", "instruction following"
#: columns of test.parquet the task cannot do without
REQUIRED_COLUMNS = ("question", "category", "answer", "audio_path")
CHOICE_TEMPLATE = "{question}\nChoose the correct answer from the following options:\n{choices}"

# The benchmark's judge rubric (its output format is what the score parser reads).
JUDGE_SYSTEM = "You are a helpful and objective evaluator."
JUDGE_TEMPLATE = """You are an expert evaluator for general open-ended question answering tasks. Please evaluate the quality of a model's response to a question.

Question: {question}

Reference Answer: {reference}

Model Response: {response}

Please evaluate the model response on the following criteria and provide scores from 1-5 (where 5 is best):

1. **Correctness**: How factually accurate is the response compared to the reference?
2. **Relevance**: How well does the response address the specific question asked?
3. **Completeness**: Does the response cover all important aspects mentioned in the reference?
4. **Clarity**: How clear and well-structured is the response?

For each criterion, provide:
- A score from 1-5
- A brief justification (1-2 sentences)

Format your response as:

CORRECTNESS: [score] - [justification]
RELEVANCE: [score] - [justification] 
COMPLETENESS: [score] - [justification]
CLARITY: [score] - [justification]
OVERALL: [average score] - [overall assessment]"""
CRITERIA = ("correctness", "relevance", "completeness", "clarity")


# ----------------------------------------------------------------------------- open-ended


def parse_judge_scores(text: str) -> dict[str, float]:
    """Scores 1-5 from a judge's answer; a missing one reads as 3. OVERALL, when missing or exactly
    3, is replaced by the mean of the four criteria (the official script's rule)."""
    scores = {}
    for name in CRITERIA:
        match = re.search(rf"{name.upper()}:\s*(\d+)", text, re.IGNORECASE)
        scores[name] = float(match.group(1)) if match else 3.0
    match = re.search(r"OVERALL:\s*(\d+(?:\.\d+)?)", text, re.IGNORECASE)
    overall = float(match.group(1)) if match else 3.0
    scores["overall"] = overall if overall != 3.0 else float(np.mean([scores[c] for c in CRITERIA]))
    return scores


def open_metrics(overall: list[float]) -> dict[str, float]:
    """``open`` = 100 x mean/5, ``good_rate`` = % of answers rated >= 4."""
    return {"open": 100.0 * float(np.mean(overall)) / 5.0, "good_rate": 100.0 * float(np.mean([o >= 4.0 for o in overall]))}


# ----------------------------------------------------------------------------- instruction following


def _alpha(text: str, keep_space: bool = False) -> str:
    return re.sub(r"[^a-zA-Z ]" if keep_space else r"[^a-zA-Z]", "", text).lower()


def _sentences(text: str) -> int:
    """Sentence count: pieces split after . ! or ? followed by white space (approximates nltk's punkt)."""
    return len([s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()])


def _capital_words(text: str) -> int:
    return sum(word.isupper() for word in text.split())


def _in_range(value: int, kw: dict) -> bool:
    return kw.get("N1", 0) <= value <= kw.get("N2", 999)


def _sections(text: str, n: int, splitter: str) -> bool:
    parts = re.split(rf"\s*{re.escape(splitter)}\s*", text.strip())
    return len([p for p in parts if p.strip()]) == n


def _keyword_count(text: str, keyword: str) -> int:
    return len(re.findall(rf"\b{re.escape(keyword.lower())}\b", text.lower()))


AIF_CHECKS: dict[str, Callable[[str, dict, str], bool]] = {
    "Include Keywords": lambda r, kw, q: all(k.lower() in r.lower() for k in kw.get("keywords", "").split(", ")),
    "Keyword Frequency": lambda r, kw, q: _keyword_count(r, kw.get("keyword", "")) == kw.get("N", 0),
    "Forbidden Words": lambda r, kw, q: not any(w.lower() in r.lower() for w in kw.get("forbidden_words", "").split(", ")),
    "Number Paragraphs": lambda r, kw, q: len([p for p in r.split("***") if p.strip()]) == kw.get("N", 0),
    "Number Words (at least)": lambda r, kw, q: len(r.split()) >= kw.get("N", 0),
    "Number Words (at most)": lambda r, kw, q: len(r.split()) <= kw.get("N", 0),
    "Number Words (range)": lambda r, kw, q: _in_range(len(r.split()), kw),
    "Number Sentences (at least)": lambda r, kw, q: _sentences(r) >= kw.get("N", 0),
    "Number Sentences (at most)": lambda r, kw, q: _sentences(r) <= kw.get("N", 0),
    "Number Sentences (range)": lambda r, kw, q: _in_range(_sentences(r), kw),
    "Postscript": lambda r, kw, q: _alpha(kw.get("postscript_marker", "")) in _alpha(r),
    "Number Placeholder": lambda r, kw, q: len(re.findall(r"\[[^\]]+\]", r)) >= kw.get("N", 0),
    "Number Bullets": lambda r, kw, q: len(re.findall(r"(?:^|\n)\s*\*\s+", r)) == kw.get("N", 0),
    "Title": lambda r, kw, q: bool(re.search(r"<<[^>]+>>", r)),
    "Minimum Number Highlighted Section": lambda r, kw, q: len(re.findall(r"\*([^*]+)\*", r)) >= kw.get("N", 0),
    "Multiple Sections": lambda r, kw, q: _sections(r, kw.get("N", 0), kw.get("section_splitter", "")),
    "Repeat Prompt": lambda r, kw, q: r.strip().lower().startswith(q.strip().lower()),
    "Two Responses": lambda r, kw, q: len(p := r.split("******")) == 2 and p[0].lower().strip() != p[1].lower().strip(),
    "All Uppercase": lambda r, kw, q: r.isupper(),
    "All Lowercase": lambda r, kw, q: r.islower(),
    "All-capital Words (at least)": lambda r, kw, q: _capital_words(r) >= kw.get("N", 0),
    "All-capital Words (at most)": lambda r, kw, q: _capital_words(r) <= kw.get("N", 0),
    "All-capital Words (range)": lambda r, kw, q: _in_range(_capital_words(r), kw),
    "Start Checker": lambda r, kw, q: _alpha(r, True).startswith(_alpha(kw.get("start_phrase", ""), True)),
    "End Checker": lambda r, kw, q: _alpha(r, True).endswith(_alpha(kw.get("end_phrase", ""), True)),
    "Quotation": lambda r, kw, q: r.strip().startswith('"') and r.strip().endswith('"'),
    "No Commas": lambda r, kw, q: "," not in r,
}


def follows_instruction(response: str, task_identifier: str, kwargs: dict | str | None, question: str = "") -> bool:
    """The benchmark's check for one instruction-following answer; an unknown identifier fails."""
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs) if kwargs.strip() else {}
    check = AIF_CHECKS.get(task_identifier)
    return bool(check(response, dict(kwargs or {}), question)) if check else False


# ----------------------------------------------------------------------------- multiple choice


def match_choice(prediction: str, choices: list[str], embed: Callable[[list[str]], np.ndarray] | None = None) -> str:
    """The choice a free-form prediction names.

    With ``embed`` (texts -> [n, d] embeddings): the choice of highest cosine similarity (the official
    NV-Embed-v2 matching). Without: exact match, then an option letter ("B", "(B)", "B." first), then
    the only choice contained in the prediction, then the highest rapidfuzz token-set ratio.
    """
    if embed is not None:
        vectors = np.asarray(embed([prediction, *choices]), dtype=np.float64)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True).clip(min=1e-12)
        return choices[int(np.argmax(vectors[1:] @ vectors[0]))]
    pred = prediction.strip().lower()
    lowered = [c.strip().lower() for c in choices]
    if pred in lowered:
        return choices[lowered.index(pred)]
    letter = re.match(r"^\(?([A-Z])(?:[).:\s]|$)", prediction.strip())
    if letter and ord(letter.group(1)) - ord("A") < len(choices):
        return choices[ord(letter.group(1)) - ord("A")]
    contained = [c for c, low in zip(choices, lowered) if low and low in pred]
    if len(contained) == 1:
        return contained[0]
    from rapidfuzz import fuzz

    return max(choices, key=lambda c: fuzz.token_set_ratio(pred, c.lower()))


def nvembed_embedder(name: str, device: str) -> Callable[[list[str]], np.ndarray]:
    """NV-Embed-v2's ``encode`` (remote code, as the official scorer); needs the hub or a local copy."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(name, trust_remote_code=True).to(device).eval()
    return lambda texts: model.encode(texts, instruction="", max_length=4096).float().cpu().numpy()


# ----------------------------------------------------------------------------- task


def _as_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


@register_task("mmau_pro")
@dataclass
class MMAUPro(Task):
    """Options: ``data_dir`` (test.parquet + audio; null = hub), ``limit``, ``batch_size``,
    ``max_new_tokens`` / ``max_new_tokens_choice``, ``categories`` (null = all), ``judge`` (a model
    registry name or hub id; null = open-ended answers are generated but not scored),
    ``choice_matcher`` (fuzzy | embedding) and ``choice_embedder``."""

    data_dir: str | None = None
    questions: str = "test.parquet"
    hub_id: str = "gamma-lab-umd/MMAU-Pro"
    limit: int | None = bounded(None, ge=1)
    batch_size: int = bounded(1, ge=1)
    max_new_tokens: int = bounded(512, ge=1)
    max_new_tokens_choice: int = bounded(64, ge=1)
    categories: list[str] | None = None
    choice_template: str = CHOICE_TEMPLATE
    judge: str | None = "Qwen/Qwen2.5-7B-Instruct"
    judge_max_new_tokens: int = bounded(512, ge=1)
    choice_matcher: Literal["fuzzy", "embedding"] = "fuzzy"
    choice_embedder: str = "nvidia/NV-Embed-v2"

    headline = (Headline("open"), Headline("good_rate"), Headline("aif", AIF))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_template("mmau_pro", "choice_template", self.choice_template, ("question", "choices"))

    def check(self) -> None:
        if self.data_dir is None:
            check_hub_dataset(self.hub_id, "mmau_pro", "download it where the hub is reachable and pass "
                              "task.data_dir=/local/copy")
            return
        root = require_dir(self.data_dir, "mmau_pro")
        if not (root / self.questions).exists():
            raise DataUnavailableError(f"mmau_pro: {root / self.questions} not found (task.data_dir / task.questions)")
        rows = self.load_rows()
        if not rows:
            raise DataError(f"mmau_pro: no question of {root / self.questions} is in categories {self.categories}")
        missing = [p for r in rows for p in r["audio_paths"] if not (root / p).exists()]
        if missing:
            raise DataUnavailableError(f"mmau_pro: {len(missing)} audio files missing under {root} (first: {missing[0]})")

    def root(self) -> Path:
        return resolve_dir(self.data_dir) if self.data_dir else hub_dataset_dir(self.hub_id, "mmau_pro")

    def data_files(self) -> list[Path]:
        if self.data_dir is None:
            return []
        root = resolve_dir(self.data_dir)
        if not (root / self.questions).is_file():
            return [root / self.questions]  # check() names what is missing
        return [root / self.questions, *sorted({root / p for r in self.load_rows() for p in r["audio_paths"]})]

    def load_rows(self) -> list[dict]:
        import pandas as pd

        path = self.root() / self.questions
        try:
            frame = pd.read_parquet(path)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors vary: name the file
            raise DataError(f"mmau_pro: {path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
        if missing:
            raise DataError(f"mmau_pro: {path}: missing column(s) {missing} (has {list(frame.columns)})")
        if frame.empty:
            raise DataError(f"mmau_pro: {path}: no rows")
        rows = []
        for i, r in enumerate(frame.to_dict("records")):
            if self.categories and r["category"] not in self.categories:
                continue
            kwargs = r.get("kwargs")
            rows.append(dict(key=str(r.get("id", i)), question=str(r["question"]), answer=r.get("answer"),
                             category=str(r["category"]), choices=[str(c) for c in _as_list(r.get("choices"))],
                             audio_paths=[str(p) for p in _as_list(r.get("audio_path"))],
                             task_identifier=r.get("task_identifier"),
                             kwargs=kwargs if isinstance(kwargs, (str, type(None))) else _plain(kwargs)))
        return rows[:self.limit] if self.limit else rows

    def is_choice(self, row: dict) -> bool:
        return row["category"] not in (OPEN, AIF) and len(row["choices"]) > 1

    def sample(self, row: dict, root: Path) -> MMSample:
        text = row["question"]
        if self.is_choice(row):
            text = self.choice_template.format(question=text, choices="\n".join(row["choices"]))
        return MMSample(text, audios=[load_audio(root / p) for p in row["audio_paths"]])

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        check_multimodal(lm, "mmau_pro", "audio")
        root = self.root()
        rows = self.load_rows()
        budget = lambda row: self.max_new_tokens_choice if self.is_choice(row) else self.max_new_tokens  # noqa: E731
        records = generate_logged(lm, rows, lambda r: self.sample(r, root), run_dir, budget, self.batch_size,
                                  desc=f"mmau_pro {lm.name}")
        return self.score(records, run_dir, device=str(lm.device))

    def score(self, records: list[dict], run_dir: Path, device: str = "cpu",
              judge_fn: Callable[[list[str]], list[str]] | None = None) -> TaskResult:
        """Metrics and rows from answered records (``judge_fn`` replaces the judge model, for tests)."""
        metrics: dict[str, float] = {}
        rows: list[dict] = []
        weighted: list[tuple[float, int]] = []
        aif = [r for r in records if r["category"] == AIF]
        if aif:
            passed = [follows_instruction(r["prediction"], r["task_identifier"], r["kwargs"], r["question"]) for r in aif]
            metrics["aif"] = 100.0 * float(np.mean(passed))
            rows.append({"subset": AIF, "metric": "aif", "value": metrics["aif"], "n": len(aif)})
            weighted.append((metrics["aif"] / 100.0, len(aif)))
        choice = [r for r in records if r["category"] not in (OPEN, AIF) and len(r["choices"]) > 1]
        if choice:
            embed = nvembed_embedder(self.choice_embedder, device) if self.choice_matcher == "embedding" else None
            correct = [match_choice(r["prediction"], r["choices"], embed) == str(r["answer"]) for r in choice]
            for category in sorted({r["category"] for r in choice}):
                hits = [c for c, r in zip(correct, choice) if r["category"] == category]
                value = 100.0 * float(np.mean(hits))
                metrics[f"accuracy/{category}"] = value
                rows.append({"subset": category, "metric": "accuracy", "value": value, "n": len(hits)})
                weighted.append((value / 100.0, len(hits)))
            metrics["accuracy"] = 100.0 * float(np.mean(correct))
            rows.append({"subset": "multiple choice", "metric": "accuracy", "value": metrics["accuracy"], "n": len(choice)})
        opened = [r for r in records if r["category"] == OPEN]
        if opened and (self.judge or judge_fn):
            judge_name = self.judge or "custom"
            verdicts = self.judge_answers(opened, run_dir, device, judge_fn)
            overall = [parse_judge_scores(v)["overall"] for v in verdicts]
            for name, value in open_metrics(overall).items():
                metrics[name] = value
                rows.append({"subset": f"{OPEN}/judge={judge_name}", "metric": name, "value": value, "n": len(opened)})
            weighted.append((metrics["open"] / 100.0, len(opened)))
        elif opened:
            log.warning("mmau_pro: %d open-ended answers generated but not scored (task.judge is null)", len(opened))
        if weighted:
            n = sum(k for _, k in weighted)
            metrics["weighted"] = 100.0 * sum(v * k for v, k in weighted) / n
            rows.append({"subset": "all", "metric": "weighted", "value": metrics["weighted"], "n": n})
        return TaskResult(metrics=metrics, rows=rows)

    def judge_answers(self, records: list[dict], run_dir: Path, device: str,
                      judge_fn: Callable[[list[str]], list[str]] | None = None) -> list[str]:
        """The judge's verdicts (logged to judge.jsonl with the judge's name, resumable)."""
        from oscar.results import PredictionLog

        verdict_log = PredictionLog(Path(run_dir) / "judge.jsonl", dict(verdict=str))
        todo = [r for r in records if _judge_key(r) not in verdict_log.done]
        if todo:
            prompts = [JUDGE_TEMPLATE.format(question=r["question"], reference=r["answer"], response=r["prediction"])
                       for r in todo]
            verdicts = (judge_fn or self.judge_model(device))(prompts)
            for r, v in zip(todo, verdicts):
                verdict_log.write(_judge_key(r), {"judge": self.judge, "verdict": v, **parse_judge_scores(v)})
        return [verdict_log.done[_judge_key(r)]["verdict"] for r in records]

    def judge_model(self, device: str) -> Callable[[list[str]], list[str]]:
        """The judge, unquantized (plain transformers generation, greedy), one prompt at a time."""
        import torch

        from oscar.models import available_models, load_model

        spec = self.judge if self.judge in available_models() else \
            {"name": self.judge.split("/")[-1].lower(), "source": "hub", "kind": "causal_lm", "hf_id": self.judge}
        model, tokenizer = load_model(spec, device=device)

        @torch.no_grad()
        def judge(prompts: list[str]) -> list[str]:
            out = []
            for prompt in prompts:
                messages = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": prompt}]
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True).to(device)
                gen = model.generate(**ids, max_new_tokens=self.judge_max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
                out.append(tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
            return out

        return judge

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """tables/mmau_pro: open-ended QA, good rate and audio instruction following beside the paper's."""
        header, body = mmau_pro_table(rows)
        caption = ("MMAU-Pro: open-ended QA (judge mean / 5), good rate (% rated >= 4), audio instruction "
                   "following")
        return write_table(out, "mmau_pro", header, body, caption) if body else []


def _judge_key(record: dict) -> str:
    return f"{record['question']}\x00{record['prediction']}"


def _plain(value):
    """numpy scalars/arrays inside a parquet struct -> JSON-able Python values."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def mmau_pro_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    groups = grouped(rows, "mmau_pro")
    value = lambda row: None if row is None else float(row["value"])  # noqa: E731
    body = []
    for key in ordered(groups):
        g = groups[key]
        opened = {metric: r for (subset, metric), r in g.items() if subset.startswith("open/judge=")}
        judges = sorted({subset.split("judge=", 1)[1] for subset, _ in g if subset.startswith("open/judge=")})
        example = next(iter(g.values()))
        numbers = [paper().value(example, metric) for metric in ("open", "good_rate", "aif")]
        ours = (value(opened.get("open")), value(opened.get("good_rate")), value(g.get((AIF, "aif"))))
        body.append([*key, *ours, *numbers,
                     signed(ours[0] - numbers[0], 1) if None not in (ours[0], numbers[0]) else None,
                     value(g.get(("multiple choice", "accuracy"))), value(g.get(("all", "weighted"))),
                     ", ".join(judges) or None])
    header = ["model", "method", "open", "good rate", "AIF", "paper open", "paper good", "paper AIF", "Δ open",
              "MC acc", "weighted", "judge"]
    return header, body
