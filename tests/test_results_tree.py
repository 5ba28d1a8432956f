"""What a committed result is and where everything else goes: a run and `make tables` leave a clean checkout clean,
a build removes the files whose rows are gone, the committed rows are the newest rows a table reads, and
docs/results.md quotes only numbers the committed tables show."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from oscar.paths import REPO_ROOT as REPO
from oscar.results import append_rows, read_rows
from scripts.make_tables import build_all

#: what a checkout needs to run and to build tables (results/ gets a small committed rows file of its own)
CODE = ("oscar", "evals", "methods", "kernels", "benchmarks", "scripts", "conf", "run.py", "Makefile", ".gitignore",
        "pyproject.toml")


def niah_row(model: str, method: str, cell: str, value: float, run_id: str, **config) -> dict:
    c = {"name": method, "k_bits": 16 if method == "fp16" else 2, "v_bits": 16 if method == "fp16" else 2, **config}
    return dict(model=model, method=method, bits=c["k_bits"], group_size=32, residual_length=128, task="niah",
                subset=cell, metric="score", value=value, n=1, run_id=run_id, config=json.dumps(c, sort_keys=True),
                task_config="")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


def test_a_run_and_make_tables_leave_a_clean_checkout_clean(repo_copy):
    """A run with the default results_file and `make tables` with its defaults write only where git does not track:
    `git status --porcelain` is the same before and after (a copy of the code with a small committed rows file)."""
    repo = repo_copy(CODE, "*.so")
    append_rows(repo / "results" / "rows.csv", [niah_row("smollm2-135m", m, f"1024@{d}", v, f"c-{m}")
                                                for m, v in (("fp16", 90.0), ("kivi", 70.0)) for d in (0, 100)])
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "checkout")
    assert git(repo, "status", "--porcelain") == ""
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "run.py", "model=tiny-llama", "method=fp16", "task.lengths=[96]",
                          "task.depths=[50]", "task.max_new_tokens=4", "logger=files"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    tables = subprocess.run([sys.executable, "scripts/make_tables.py"], cwd=repo, env=env, capture_output=True,
                            text=True, timeout=600)
    assert tables.returncode == 0, tables.stderr[-3000:]
    assert git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    assert len(read_rows(repo / "runs" / "rows.csv")) == 5      # the cell's and the grid's score and exact, KV bytes
    methods = (repo / "runs" / "tables" / "methods.md").read_text()
    assert "| tiny-llama | fp16 |" in methods and "| smollm2-135m | kivi |" in methods  # yours beside the committed
    assert "| smollm2-135m | kivi |" in tables.stdout


def test_a_build_removes_the_files_whose_rows_are_gone_and_keeps_the_rest(tmp_path):
    """A method's rows gone, or its label renamed (a second configuration of it arrived): the files the earlier build
    wrote under the old names go; files no build wrote (a hand-made note) stay."""
    rows = [niah_row("smollm2-135m", m, f"1024@{d}", v, f"r-{m}") for m, v in (("kivi", 70.0), ("oscar", 80.0))
            for d in (0, 100)]
    out = tmp_path / "out"
    build_all(rows, out)
    figures = out / "figures"
    assert {"niah_smollm2-135m_kivi.png", "niah_smollm2-135m_oscar.png"} <= {p.name for p in figures.iterdir()}
    note = figures / "notes.txt"
    note.write_text("mine")
    later = [r for r in rows if r["method"] == "oscar"]
    later += [niah_row("smollm2-135m", "oscar", f"1024@{d}", 60.0, "r-g64", group_size=64) for d in (0, 100)]
    written = build_all(later, out)
    names = {p.name for p in figures.iterdir()}
    assert "niah_smollm2-135m_kivi.png" not in names and "niah_smollm2-135m_oscar.png" not in names
    assert {"niah_smollm2-135m_oscar_G_32.png", "niah_smollm2-135m_oscar_G_64.png", "notes.txt", ".generated"} <= names
    assert names - {"notes.txt", ".generated"} == {p.name for p in written if p.parent == figures}
    assert note.read_text() == "mine"


def test_the_committed_rows_are_the_newest_rows_a_table_reads(caplog):
    """results/rows.csv is what `make results` leaves: every row well formed, one per configuration and (subset,
    metric), each read by a table; small."""
    from evals.tables import committed, read_results

    path = REPO / "results" / "rows.csv"
    with caplog.at_level(logging.WARNING):
        rows = read_results(path)
    assert not caplog.records, caplog.text[:2000]
    assert len(rows) == len(path.read_text().splitlines()) - 1
    assert committed(rows) == rows
    assert path.stat().st_size < 2_000_000


def test_the_frontier_table_does_not_depend_on_the_machines_model_cache(tmp_path, monkeypatch):
    """Which swept settings a model refuses is read from the attention shape its spec declares, so the committed
    frontier tables come out the same with an empty model cache (they said "not run" for every G=128 setting of
    SmolLM2 on a machine without its converted copy)."""
    from scripts.frontier import known_attention_shape

    monkeypatch.setenv("OSCAR_KV_CACHE", str(tmp_path / "empty"))
    assert known_attention_shape("smollm2-135m") == (64, 3)
    assert known_attention_shape("gemma3-270m") == (256, 1)


# ----------------------------------------------------------------------------- docs/results.md

#: a number as the docs and tables write it: 1,234.5 / 41.13 / -0.568 / +0.177 / 2.0e7
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e\d+)?(?![\w])")


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text.replace("**", ""))


def quoted_cells(doc: str) -> list[tuple[int, str]]:
    """(line, number) of every result a table of ``doc`` quotes: each cell that is a number, and each number with
    decimals or thousands separators inside a cell of text (labels such as K2V2, G64, 1K-4K have neither)."""
    found = []
    for line_number, line in enumerate(doc.splitlines(), 1):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        for cell in line.strip().strip("|").split("|"):
            cell = cell.strip().replace("**", "")
            if NUMBER.fullmatch(cell):
                found.append((line_number, cell))
            else:
                found += [(line_number, n) for n in numbers(cell) if "." in n or "," in n]
    return found


def value(text: str) -> float:
    return float(text.replace(",", ""))


def test_the_results_doc_quotes_only_numbers_the_committed_tables_show():
    """Every number a table of docs/results.md quotes is a number of results/tables/*.md at the precision quoted (the
    header rows are tables too: a column named after a setting quotes nothing)."""
    shown = [value(n) for path in (REPO / "results" / "tables").glob("*.md") for n in numbers(path.read_text())]
    doc = (REPO / "docs" / "results.md").read_text()
    missing = []
    for line, quoted in quoted_cells(doc):
        decimals = len(quoted.split(".")[1].split("e")[0]) if "." in quoted else 0
        if not any(abs(round(s, decimals) - value(quoted)) < 1e-9 or abs(s - value(quoted)) < 1e-9 for s in shown):
            missing.append(f"docs/results.md:{line}: {quoted}")
    assert not missing, missing


def test_the_results_doc_names_no_session_or_issue():
    doc = (REPO / "docs" / "results.md").read_text()
    assert not re.search(r"\b(session|issue)s?\b", doc, re.IGNORECASE), re.findall(r".{40}(?:session|issue).{40}", doc)
