"""OCRBench (Liu et al. 2024): 1000 OCR questions over 5 components, scored out of 1000.

Protocol:
  1. prompt = the question alone, one image, the model's chat template; greedy, ``max_new_tokens``
     (128, as lmms-eval);
  2. a question scores 1 if any gold answer is contained in the prediction: case-insensitive after
     stripping and turning newlines into spaces; for handwritten math (HME100k) case-sensitive with
     all spaces removed (the official rule, :func:`ocrbench_hit`);
  3. the score is the number of hits (out of 1000 on the full set), broken down into the paper's five
     components: Text Recognition (six recognition types, 300), Scene Text-centric VQA (200),
     Doc-oriented VQA (200), Key Information Extraction (200), Handwritten Mathematical Expression
     Recognition (100).

Data: ``data_dir`` with the official ``OCRBench.json`` (``dataset_name, id, image_path, question,
answers, type``) and the images under ``image_dir`` (default: ``data_dir/OCRBench_Images`` if it
exists, else ``data_dir``); or ``data_dir: null`` for the hub dataset echo840/OCRBench
(``dataset, question, question_type, answer, image``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from evals.base import Headline, Task, TaskResult, register_task
from evals.datafiles import check_hub_dataset, check_records, read_json, read_jsonl
from evals.mm_common import DataUnavailableError, check_multimodal, generate_logged, require_dir, resolve_dir
from evals.paper import paper
from evals.tables import grouped, ordered, signed, write_table
from oscar.lm import KVModel
from oscar.options import bounded
from oscar.multimodal import MMSample, load_image

RECOGNITION_TYPES = ("Regular Text Recognition", "Irregular Text Recognition", "Artistic Text Recognition",
                     "Handwriting Recognition", "Digit String Recognition", "Non-Semantic Text Recognition")
COMPONENTS = {**{t: "Text Recognition" for t in RECOGNITION_TYPES},
              "Scene Text-centric VQA": "Scene Text-centric VQA", "Doc-oriented VQA": "Doc-oriented VQA",
              "Key Information Extraction": "Key Information Extraction",
              "Handwritten Mathematical Expression Recognition": "Handwritten Mathematical Expression Recognition"}
MATH_DATASET = "HME100k"
#: fields a local question needs (any one name of each tuple: the official layout or the hub's)
LOCAL_FIELDS = (("question",), ("answers", "answer"), ("type", "question_type"), ("image_path",))


def ocrbench_hit(prediction: str, answers: str | list[str], dataset_name: str) -> int:
    """1 if a gold answer is contained in the prediction by OCRBench's rule, else 0."""
    answers = [answers] if isinstance(answers, str) else list(answers)
    if dataset_name == MATH_DATASET:
        def norm(s: str) -> str:
            return s.strip().replace("\n", " ").replace(" ", "")
    else:
        def norm(s: str) -> str:
            return s.lower().strip().replace("\n", " ")
    pred = norm(prediction)
    return int(any(norm(a) in pred for a in answers))


def ocrbench_scores(records: list[dict]) -> dict[str, tuple[int, int]]:
    """``{subset: (hits, n)}`` for every question type, every component and ``all``."""
    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        hit = ocrbench_hit(r["prediction"], r["answers"], r["dataset_name"])
        for subset in {r["type"], COMPONENTS.get(r["type"], r["type"]), "all"}:
            scores[subset][0] += hit
            scores[subset][1] += 1
    return {k: (v[0], v[1]) for k, v in scores.items()}


def normalize_row(row: dict) -> dict:
    """One question in the official layout, whichever source it came from."""
    return dict(dataset_name=row.get("dataset_name", row.get("dataset")), question=row["question"],
                answers=row.get("answers", row.get("answer")), type=row.get("type", row.get("question_type")),
                image_path=row.get("image_path"), id=row.get("id"), image=row.get("image"))


@register_task("ocrbench")
@dataclass
class OCRBench(Task):
    """Options: ``data_dir`` (null = hub), ``questions`` (file in data_dir), ``image_dir``,
    ``limit`` (first N questions, for smoke runs), ``batch_size``, ``max_new_tokens``."""

    data_dir: str | None = None
    questions: str = "OCRBench.json"
    image_dir: str | None = None
    hub_id: str = "echo840/OCRBench"
    limit: int | None = bounded(None, ge=1)
    batch_size: int = bounded(1, ge=1)
    max_new_tokens: int = bounded(128, ge=1)

    headline = (Headline("score", "all"),)

    def _images_root(self) -> Path:
        if self.image_dir:
            return resolve_dir(self.image_dir)
        root = resolve_dir(self.data_dir)
        return root / "OCRBench_Images" if (root / "OCRBench_Images").is_dir() else root

    def check(self) -> None:
        if self.data_dir is None:
            check_hub_dataset(self.hub_id, "ocrbench", "pass task.data_dir with OCRBench.json and OCRBench_Images/")
            return
        path = require_dir(self.data_dir, "ocrbench") / self.questions
        if not path.exists():
            raise DataUnavailableError(f"ocrbench: {path} not found (task.data_dir / task.questions)")
        rows = self.load_rows()
        missing = [r["image_path"] for r in rows if not (self._images_root() / r["image_path"]).exists()]
        if missing:
            raise DataUnavailableError(f"ocrbench: {len(missing)} of {len(rows)} images missing under "
                                       f"{self._images_root()} (first: {missing[0]}); set task.image_dir")

    def data_files(self) -> list[Path]:
        if self.data_dir is None:
            return []
        questions = resolve_dir(self.data_dir) / self.questions
        if not questions.is_file():
            return [questions]  # check() names what is missing
        return [questions, *sorted({self._images_root() / r["image_path"] for r in self.load_rows()})]

    def load_rows(self) -> list[dict]:
        if self.data_dir is None:
            rows = _hub_rows(self.hub_id)
        else:
            path = resolve_dir(self.data_dir) / self.questions
            if path.suffix == ".jsonl":
                rows = read_jsonl(path, LOCAL_FIELDS, task="ocrbench")
            else:
                rows = read_json(path, "ocrbench")
                check_records(rows, LOCAL_FIELDS, f"ocrbench: {path}", "question")
        rows = [normalize_row(r) for r in rows]
        for i, r in enumerate(rows):
            r["key"] = f"{i}"
        return rows[:self.limit] if self.limit else rows

    def sample(self, row: dict) -> MMSample:
        image = row["image"] if row.get("image") is not None else load_image(self._images_root() / row["image_path"])
        return MMSample(row["question"].strip(), images=[image.convert("RGB")])

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        check_multimodal(lm, "ocrbench", "image")
        rows = self.load_rows()
        records = generate_logged(lm, rows, self.sample, run_dir, self.max_new_tokens, self.batch_size,
                                  desc=f"ocrbench {lm.name}")
        scores = ocrbench_scores(records)
        metrics = {"score": float(scores["all"][0]), "accuracy": 100.0 * scores["all"][0] / scores["all"][1]}
        metrics.update({f"score/{k}": float(v[0]) for k, v in scores.items() if k != "all"})
        rows_out = [{"subset": k, "metric": "score", "value": float(h), "n": n} for k, (h, n) in scores.items()]
        rows_out.append({"subset": "all", "metric": "accuracy", "value": metrics["accuracy"], "n": scores["all"][1]})
        return TaskResult(metrics=metrics, rows=rows_out)

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """tables/ocrbench: the score out of 1000 by component, the paper's beside runs of the whole benchmark."""
        header, body = ocrbench_table(rows)
        caption = "OCRBench: score out of 1000 by component (paper: INT2, G=32, R=128)"
        return write_table(out, "ocrbench", header, body, caption) if body else []


def _hub_rows(hub_id: str) -> list[dict]:
    try:
        import datasets

        ds = datasets.load_dataset(hub_id, split="test")
    except Exception as e:  # noqa: BLE001 - offline or missing: say how to fix it
        raise DataUnavailableError(f"ocrbench: cannot load {hub_id} ({type(e).__name__}: {e}); pass task.data_dir "
                                   f"with OCRBench.json and OCRBench_Images/") from None
    return list(ds)


#: the table's columns: the paper's five components, short
COMPONENT_COLUMNS = {"Text Recognition": "recognition", "Scene Text-centric VQA": "scene VQA",
                     "Doc-oriented VQA": "doc VQA", "Key Information Extraction": "KIE",
                     "Handwritten Mathematical Expression Recognition": "HMER"}


def ocrbench_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    groups = grouped(rows, "ocrbench")
    body = []
    for key in ordered(groups):
        g = groups[key]
        total = g.get(("all", "score"))
        if total is None:
            continue
        number = paper().value(total)
        score = float(total["value"])
        components = [g.get((c, "score")) for c in COMPONENT_COLUMNS]
        body.append([*key, *[None if c is None else float(c["value"]) for c in components], score,
                     int(float(total["n"])), number, signed(score - number, 0) if number is not None else None])
    return ["model", "method", *COMPONENT_COLUMNS.values(), "score", "n", "paper", "Δ"], body
