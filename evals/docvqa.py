"""DocVQA (Mathew et al. 2021), validation split, scored by ANLS.

Protocol:
  1. prompt = "{question}\\nAnswer the question using a single word or phrase." (lmms-eval's), one
     page image, the model's chat template; greedy, ``max_new_tokens`` (32), first line kept;
  2. ANLS (Biten et al. 2019): strings lower-cased, stripped, inner whitespace collapsed;
     NL = Levenshtein(pred, gold) / max(len(pred), len(gold)); a question scores max over its gold
     answers of (1 - NL if NL < 0.5 else 0); the task score is 100 x the mean.
     (lmms-eval measures the length on the unnormalized strings and keeps NL = 0.5; we follow the
     paper's definition on normalized strings: a stated choice, different only at such edges.)

Data: ``data_dir`` with the official ``val_v1.0.json`` layout (``{"data": [{questionId, question,
image: "documents/x.png", answers}]}``, images relative to data_dir); or ``data_dir: null`` for the
hub dataset lmms-lab/DocVQA (config DocVQA, split validation, images embedded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from evals.base import Headline, Task, TaskResult, register_task
from evals.datafiles import DataError, check_hub_dataset, check_records, read_json
from evals.mm_common import DataUnavailableError, check_multimodal, generate_logged, require_dir, resolve_dir
from evals.tables import grouped, ordered, write_table
from oscar.lm import KVModel
from oscar.options import bounded
from oscar.multimodal import MMSample, load_image

PROMPT = "{question}\nAnswer the question using a single word or phrase."
#: the fields of a question in val_v1.0.json that the task reads
REQUIRED_FIELDS = ("questionId", "question", "image", "answers")


def _normalize(s: str) -> str:
    return " ".join(s.strip().lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls(prediction: str, answers: list[str], threshold: float = 0.5) -> float:
    """Average Normalized Levenshtein Similarity of one prediction against its gold answers, in [0, 1]."""
    pred = _normalize(prediction)
    best = 0.0
    for answer in answers:
        gold = _normalize(answer)
        length = max(len(pred), len(gold))
        nl = levenshtein(pred, gold) / length if length else 0.0
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


@register_task("docvqa")
@dataclass
class DocVQA(Task):
    """Options: ``data_dir`` (null = hub), ``questions`` (file in data_dir), ``limit``, ``batch_size``,
    ``max_new_tokens``, ``prompt`` (with {question}), ``threshold`` (ANLS, 0.5)."""

    data_dir: str | None = None
    questions: str = "val_v1.0.json"
    hub_id: str = "lmms-lab/DocVQA"
    limit: int | None = bounded(None, ge=1)
    batch_size: int = bounded(1, ge=1)
    max_new_tokens: int = bounded(32, ge=1)
    prompt: str = PROMPT
    threshold: float = bounded(0.5, gt=0, le=1)

    headline = (Headline("anls", "validation"),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if "{question}" not in self.prompt:
            raise ValueError("docvqa: prompt needs {question}")

    def check(self) -> None:
        if self.data_dir is None:
            check_hub_dataset(self.hub_id, "docvqa", "pass task.data_dir with val_v1.0.json and documents/")
            return
        path = require_dir(self.data_dir, "docvqa") / self.questions
        if not path.exists():
            raise DataUnavailableError(f"docvqa: {path} not found (task.data_dir / task.questions)")
        missing = [r["image"] for r in self.load_rows() if not (resolve_dir(self.data_dir) / r["image"]).exists()]
        if missing:
            raise DataUnavailableError(f"docvqa: {len(missing)} page images missing under {resolve_dir(self.data_dir)} "
                                       f"(first: {missing[0]})")

    def data_files(self) -> list[Path]:
        if self.data_dir is None:
            return []
        root = resolve_dir(self.data_dir)
        if not (root / self.questions).is_file():
            return [root / self.questions]  # check() names what is missing
        return [root / self.questions, *sorted({root / r["image"] for r in self.load_rows()})]

    def load_rows(self) -> list[dict]:
        if self.data_dir is None:
            rows = _hub_rows(self.hub_id)
        else:
            path = resolve_dir(self.data_dir) / self.questions
            document = read_json(path, "docvqa")
            if not isinstance(document, dict) or "data" not in document:
                raise DataError(f"docvqa: {path}: expected an object with a 'data' list (the val_v1.0.json layout)")
            rows = document["data"][:self.limit] if self.limit else document["data"]
            check_records(rows, REQUIRED_FIELDS, f"docvqa: {path}", "question")
        rows = [dict(r, key=str(r["questionId"])) for r in rows]
        return rows[:self.limit] if self.limit else rows

    def sample(self, row: dict) -> MMSample:
        image = row["image"]
        image = load_image(resolve_dir(self.data_dir) / image) if isinstance(image, str) else image.convert("RGB")
        return MMSample(self.prompt.format(question=row["question"]), images=[image])

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        check_multimodal(lm, "docvqa", "image")
        rows = self.load_rows()
        records = generate_logged(lm, rows, self.sample, run_dir, self.max_new_tokens, self.batch_size,
                                  desc=f"docvqa {lm.name}", stop_at_newline=True)
        scores = [anls(r["prediction"], r["answers"], self.threshold) for r in records]
        value = 100.0 * sum(scores) / len(scores)
        return TaskResult(metrics={"anls": value},
                          rows=[{"subset": "validation", "metric": "anls", "value": value, "n": len(scores)}])

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """tables/docvqa: ANLS x 100 and the number of questions (the paper has no DocVQA number)."""
        header, body = docvqa_table(rows)
        return write_table(out, "docvqa", header, body, "DocVQA validation: ANLS x 100") if body else []


def _hub_rows(hub_id: str) -> list[dict]:
    try:
        import datasets

        ds = datasets.load_dataset(hub_id, "DocVQA", split="validation")
    except Exception as e:  # noqa: BLE001 - offline or missing: say how to fix it
        raise DataUnavailableError(f"docvqa: cannot load {hub_id} ({type(e).__name__}: {e}); pass task.data_dir "
                                   f"with val_v1.0.json and documents/") from None
    return list(ds)


def docvqa_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    groups = grouped(rows, "docvqa")
    body = [[*key, float(row["value"]), int(float(row["n"]))] for key in ordered(groups)
            if (row := groups[key].get(("validation", "anls"))) is not None]
    return ["model", "method", "ANLS", "n"], body
