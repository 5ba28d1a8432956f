"""Run folders and tidy result rows.

A run folder holds config.yaml, predictions.jsonl (written sample by sample), metrics.json (written
last: its presence marks the run finished) and env.json. Tidy rows (one per metric) are appended to
``results/rows.csv``; ``make tables`` reads nothing else.
"""

from __future__ import annotations

import csv
import fcntl
import json
from collections.abc import Iterable
from pathlib import Path

ROW_FIELDS = ["model", "method", "bits", "group_size", "residual_length", "task", "subset", "metric", "value",
              "n", "run_id", "config"]


class PredictionLog:
    """Append-only per-sample predictions, so a killed run resumes at the sample in flight.

    ``log.done`` maps a sample key to its stored record; ``log.write(key, record)`` appends one
    line and flushes it to disk at once.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.done: dict[str, dict] = {}
        if self.path.exists():
            text = self.path.read_text()
            if text and not text.endswith("\n"):  # end a line cut by a kill, so the next record starts afresh
                with self.path.open("a") as f:
                    f.write("\n")
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: recompute that sample
                    continue
                self.done[record["key"]] = record

    def write(self, key: str, record: dict) -> dict:
        record = {"key": key, **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        self.done[key] = record
        return record


def append_rows(path: Path, rows: Iterable[dict]) -> None:
    """Append tidy rows to a CSV under an exclusive lock (parallel sweep jobs share the file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        if f.tell() == 0:
            writer.writeheader()
        for row in rows:
            writer.writerow(row)
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def read_rows(path: Path) -> list[dict]:
    """Tidy rows, the last row of each (run_id, subset, metric) winning."""
    path = Path(path)
    if not path.exists():
        return []
    latest: dict[tuple, dict] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            row["value"] = float(row["value"])
            latest[(row["run_id"], row["subset"], row["metric"])] = row
    return list(latest.values())
