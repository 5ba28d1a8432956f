"""Tables of the multimodal benchmarks (OCRBench, DocVQA, MMAU-Pro) from the tidy rows alone.

    python scripts/mm_tables.py [--rows results/rows.csv] [--out results]

``build_mm_tables(rows, out)`` (called by scripts/make_tables.py) writes tables/ocrbench,
tables/docvqa and tables/mmau_pro (.md and .tex). The paper's numbers (design.md section 6; INT2,
G=32, R=128; the 16-bit baseline in any setting) stand beside ours when the run covers the whole
benchmark (OCRBench: 1000 questions); DocVQA has no paper number. Rows of different task settings
(``task_config``, e.g. a smoke set's ``data_dir``) get lines of their own, as in make_tables.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import defaultdict
from pathlib import Path

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

if __package__ in (None, ""):  # `python scripts/mm_tables.py`
    sys.path.insert(0, str(REPO_ROOT))

from scripts.make_tables import PAPER_SETTING, _labelled, _method_key, write_table
from scripts.table_format import signed

log = logging.getLogger("mm_tables")

MM_TASKS = ("ocrbench", "docvqa", "mmau_pro")
#: headline (subset, metric) pairs for the methods table (subset None = the task's only subset)
MM_HEADLINE = {
    "ocrbench": [("all", "score")],
    "docvqa": [("validation", "anls")],
    "mmau_pro": [(None, "open"), (None, "good_rate"), ("instruction following", "aif")],
}
OCR_COMPONENTS = ["Text Recognition", "Scene Text-centric VQA", "Doc-oriented VQA", "Key Information Extraction",
                  "Handwritten Mathematical Expression Recognition"]
OCR_SHORT = ["recognition", "scene VQA", "doc VQA", "KIE", "HMER"]
OCRBENCH_SIZE = 1000

# design.md section 6 (INT2, G=32, R=128); "fp16" is the paper's 16-bit / BF16 baseline.
PAPER_OCRBENCH = {
    "qwen3-vl-8b": {"fp16": 858, "kivi": 851, "ott": 850, "turboquant": 847, "oscar": 856},
    "qwen3-vl-4b": {"fp16": 852, "kivi": 813, "ott": 831, "turboquant": 828, "oscar": 838},
}
PAPER_MMAU_PRO = {  # (open, good rate, audio instruction following)
    "qwen3-omni-30b-a3b": {"fp16": (66.2, 27.8, 87.4), "kivi": (65.8, 27.0, 78.2), "ott": (65.8, 26.9, 83.9),
                           "turboquant": (66.6, 27.0, 79.3), "oscar": (67.4, 29.8, 88.5)},
}


def paper_entry(table: dict, row: dict):
    """The paper's number for this row's (model, method), if the row is in the paper's setting."""
    if row["method"] != "fp16" and any(str(row.get(k)) != v for k, v in PAPER_SETTING.items()):
        return None
    return table.get(row["model"], {}).get(row["method"])


def _grouped(rows: list[dict], task: str) -> dict[tuple, dict[tuple, dict]]:
    """(model, label) -> (subset, metric) -> row, the later row winning."""
    out: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in _labelled([r for r in rows if r["task"] == task]):
        out[(r["model"], r["label"])][(r["subset"], r["metric"])] = r
    return out


def _ordered(groups: dict) -> list[tuple]:
    return sorted(groups, key=lambda k: (k[0], _method_key(k[1])))


def ocrbench_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    groups = _grouped(rows, "ocrbench")
    body = []
    for key in _ordered(groups):
        g = groups[key]
        total = g.get(("all", "score"))
        if total is None:
            continue
        n = int(float(total["n"]))
        paper = paper_entry(PAPER_OCRBENCH, total) if n == OCRBENCH_SIZE else None
        score = float(total["value"])
        body.append([*key, *[_value(g.get((c, "score"))) for c in OCR_COMPONENTS], score, n, paper,
                     signed(score - paper, 0) if paper is not None else None])
    return ["model", "method", *OCR_SHORT, "score", "n", "paper", "Δ"], body


def docvqa_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    groups = _grouped(rows, "docvqa")
    body = [[*key, _value(row), int(float(row["n"]))] for key in _ordered(groups)
            if (row := groups[key].get(("validation", "anls"))) is not None]
    return ["model", "method", "ANLS", "n"], body


def mmau_pro_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    groups = _grouped(rows, "mmau_pro")
    body = []
    for key in _ordered(groups):
        g = groups[key]
        opened = {metric: r for (subset, metric), r in g.items() if subset.startswith("open/judge=")}
        judges = sorted({subset.split("judge=", 1)[1] for subset, _ in g if subset.startswith("open/judge=")})
        aif = g.get(("instruction following", "aif"))
        example = next(iter(g.values()))
        paper = paper_entry(PAPER_MMAU_PRO, example) or (None, None, None)
        ours = (_value(opened.get("open")), _value(opened.get("good_rate")), _value(aif))
        body.append([*key, *ours, *paper,
                     signed(ours[0] - paper[0], 1) if None not in (ours[0], paper[0]) else None,
                     _value(g.get(("multiple choice", "accuracy"))), _value(g.get(("all", "weighted"))),
                     ", ".join(judges) or None])
    header = ["model", "method", "open", "good rate", "AIF", "paper open", "paper good", "paper AIF", "Δ open",
              "MC acc", "weighted", "judge"]
    return header, body


def _value(row: dict | None) -> float | None:
    return None if row is None else float(row["value"])


def build_mm_tables(rows: list[dict], out: Path) -> list[Path]:
    """Write the tables of the multimodal tasks present in ``rows``; returns the files written."""
    out = Path(out)
    written: list[Path] = []
    builders = [("ocrbench", ocrbench_table, "OCRBench: score out of 1000 by component (paper: INT2, G=32, R=128)"),
                ("docvqa", docvqa_table, "DocVQA validation: ANLS x 100"),
                ("mmau_pro", mmau_pro_table,
                 "MMAU-Pro: open-ended QA (judge mean / 5), good rate (% rated >= 4), audio instruction following")]
    for name, build, caption in builders:
        if any(r["task"] == name for r in rows):
            header, body = build(rows)
            if body:
                written += write_table(out, name, header, body, caption)
    return written


def main(argv: list[str] | None = None) -> None:
    from oscar.results import read_rows

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="results/rows.csv")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    written = build_mm_tables(read_rows(Path(args.rows)), Path(args.out))
    for path in written:
        if path.suffix == ".md":
            sys.stdout.write(path.read_text() + "\n")
    log.info("wrote %d files under %s", len(written), args.out)


if __name__ == "__main__":
    main()
