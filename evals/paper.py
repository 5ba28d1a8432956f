"""The paper's numbers (evals/paper.yaml, from design.md section 6): the value a table puts beside a row of ours,
and the paper's order of the methods."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

PAPER_FILE = Path(__file__).with_name("paper.yaml")


class PaperNumbers:
    """evals/paper.yaml: the paper's number for a row (its task, model, method and a metric)."""

    def __init__(self, data: dict):
        self.setting = {k: str(v) for k, v in data["setting"].items()}
        self.entries = data["numbers"]
        self._by_key = {(e["task"], e["metric"]): e for e in self.entries}
        self.method_order = list(dict.fromkeys(m for e in self.entries for model in e["models"].values()
                                               for m in model))

    def value(self, row: dict, metric: str | None = None) -> float | None:
        """The paper's ``metric`` (default: the row's) for the row's task, model and method, if the row is in the
        paper's setting (the 16-bit baseline: any) and, where the paper gives the benchmark's size, covers it."""
        entry = self._by_key.get((row["task"], metric or row["metric"]))
        if entry is None:
            return None
        if str(row.get("bits")) != "16" and any(str(row.get(k)) != v for k, v in self.setting.items()):
            return None
        if "samples" in entry and int(float(row["n"])) != entry["samples"]:
            return None
        return entry["models"].get(row["model"], {}).get(row["method"])


@functools.cache
def paper() -> PaperNumbers:
    return PaperNumbers(yaml.safe_load(PAPER_FILE.read_text()))
