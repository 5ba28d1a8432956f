"""`make reproduce` (scripts/reproduce.py): its cheapest case, one NIAH cell of fp16 on SmolLM2, recomputes the
committed rows with the current code (the rows file only read), and a stored value the code no longer gives is a
disagreement with exit code 1."""

from __future__ import annotations

import hashlib
import json

from oscar.method import build_method
from oscar.paths import REPO_ROOT
from oscar.provenance import process_code_version
from oscar.results import append_rows, read_rows
from scripts.reproduce import Comparison, committed, main

COMMITTED = REPO_ROOT / "results" / "rows.csv"


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _line(out: str, metric: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith("fp16 ") and f" {metric} " in line)


def test_the_cheapest_case_reproduces_the_committed_rows_and_a_changed_value_disagrees(tmp_path, capsys):
    before = _digest(COMMITTED)
    runs = tmp_path / "runs"
    assert main(["--methods", "fp16", "--tasks", "niah", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    for metric in ("score", "exact"):
        method, task, cell, _, stored, recomputed, stored_code, current_code, agree = _line(out, metric)
        assert (task, cell, agree) == ("niah", "1024@50", "yes") and float(stored) == float(recomputed)
        assert stored_code == "unrecorded" and current_code != "unknown"     # committed before provenance existed
    assert "2 of 2 rows agree" in out and _digest(COMMITTED) == before    # results/rows.csv is only read

    rows = [r for r in read_rows(COMMITTED) if r["task"] == "niah" and r["subset"] == "1024@50"
            and json.loads(r["config"])["name"] == "fp16"]
    changed = tmp_path / "rows.csv"
    append_rows(changed, [{**r, "value": r["value"] - 10 if r["metric"] == "exact" else r["value"]} for r in rows])
    assert main(["--methods", "fp16", "--tasks", "niah", "--rows", str(changed), "--runs-dir", str(runs)]) == 1
    out = capsys.readouterr().out                                          # (the finished run reused, not recomputed)
    assert _line(out, "score")[-1] == "yes" and _line(out, "exact")[-1] == "no" and "1 of 2 rows agree" in out

    (metrics_file,) = runs.glob("niah/*/fp16-*/metrics.json")  # a run another version of the code finished there
    metrics_file.write_text(metrics_file.read_text().replace(json.loads(metrics_file.read_text())["code_version"],
                                                             "0ther00000"))
    assert main(["--methods", "fp16", "--tasks", "niah", "--runs-dir", str(runs)]) == 0
    capsys.readouterr()
    assert json.loads(metrics_file.read_text())["code_version"] == process_code_version()  # computed again


def test_the_newest_row_of_a_configuration_is_compared_and_agreement_has_a_stated_tolerance():
    config = json.dumps({"name": "kivi", **build_method("kivi").hyperparameters()})
    row = dict(model="smollm2-135m", method="kivi", task="perplexity", subset="wikitext-2-raw-v1",
               metric="perplexity", task_config="", config=config)
    rows = [{**row, "value": 49.551, "date": "2026-12-06T10:00:00+00:00"}, {**row, "value": 49.068, "date": ""},
            {**row, "value": 48.0, "task_config": "max_windows=16"}]
    found = committed(rows, json.loads(config), "perplexity", "wikitext-2-raw-v1", "perplexity")
    assert found["value"] == 49.551                                   # dated beats undated; another setting never
    assert committed(rows[1:2] * 2 + [{**row, "value": 50.0, "date": ""}], json.loads(config), "perplexity",
                     "wikitext-2-raw-v1", "perplexity")["value"] == 50.0   # undated: the last in the file
    compare = lambda a, b: Comparison("kivi", "perplexity", "w", "perplexity", a, b, "", "").agrees  # noqa: E731
    assert compare(24.14545, 24.14545 * (1 + 9e-5)) and not compare(41.104, 41.126) and not compare(None, 1.0)
