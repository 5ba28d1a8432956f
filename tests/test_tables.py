"""`make tables` on a small fixture of tidy rows: golden Markdown, paper numbers and differences,
labels of ablation / sweep runs, every expected file, byte-identical output on a second build."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oscar.paths import REPO_ROOT as REPO
from oscar.results import append_rows, read_rows
from scripts.make_tables import build_all, methods_table


def config(method: str, **changes) -> dict:
    c = dict(name=method, k_bits=2, v_bits=2, group_size=32, residual_length=128, flush="block")
    if method == "oscar":
        c.update(rotate=True, scale=True)
    return {**c, **changes}


def row(model, method, task, subset, metric, value, run_id, **changes):
    c = config(method, **changes)
    return dict(model=model, method=method, bits=2, group_size=c["group_size"], residual_length=c["residual_length"],
                task=task, subset=subset, metric=metric, value=value, n=3, run_id=run_id,
                config=json.dumps(c, sort_keys=True))


@pytest.fixture
def rows(tmp_path) -> list[dict]:
    """Written to and read back from a CSV, as `make tables` sees them."""
    rows = []
    for i, (method, base) in enumerate([("kivi", 40.0), ("fp16", 42.5), ("oscar", 41.25)]):
        for subset, offset in [("qasper_e", 1.0), ("trec_e", -1.0), ("average", 0.0), ("0-4k", 2.0)]:
            rows.append(row("llama-3.1-8b-instruct", method, "longbench_e", subset, "score", base + offset, f"lb{i}"))
        for length in (1024, 2048):
            for depth in (0, 100):
                rows.append(row("smollm2-135m", method, "niah", f"{length}@{depth}", "score",
                                100.0 if depth == 0 else 50.0 + i, f"n{i}"))
        rows.append(row("smollm2-135m", method, "niah", "all", "score", (100 + 50 + i) / 2, f"n{i}"))
        rows.append(row("smollm2-135m", method, "niah", "all", "exact", 50.0, f"n{i}"))
    for rotate in (True, False):
        for scale in (True, False):
            rows.append(row("smollm2-135m", "oscar", "perplexity", "wikitext-2", "perplexity",
                            20.0 + 3 * (not rotate) + 5 * (not scale), f"p{rotate}{scale}", rotate=rotate, scale=scale))
    for g in (32, 64):
        for r in (64, 128):
            rows.append(row("smollm2-135m", "kivi", "perplexity", "wikitext-2", "perplexity", 20 + g / 32 + r / 64,
                            f"s{g}{r}", group_size=g, residual_length=r))
    path = tmp_path / "rows.csv"
    append_rows(path, rows)
    return read_rows(path)


def test_methods_table_golden(rows):
    niah = methods_table(rows, model="smollm2-135m", task="niah")
    assert niah == (
        "| model | method | niah score (4 cells) | niah exact (3 cells) |\n"
        "|:---|---:|---:|---:|\n"
        "| smollm2-135m | fp16 | 75.50 | 50.00 |\n"
        "| smollm2-135m | kivi | 75.00 | 50.00 |\n"
        "| smollm2-135m | oscar | 76.00 | 50.00 |\n")
    assert methods_table([]) == "(no results yet)\n"


def test_table1_shows_paper_numbers_and_differences(rows, tmp_path):
    build_all(rows, tmp_path / "out")
    table = (tmp_path / "out" / "tables" / "table1_longbench_e.md").read_text()
    lines = table.splitlines()
    assert "| model | method | qasper | trec | avg | paper | Δ |" in lines
    # ours 42.50 vs the paper's 16-bit 41.70 -> +0.80; KIVI 40.00 vs 39.84 -> +0.16; OScaR 41.25 vs 41.75
    assert "| llama-3.1-8b-instruct | fp16 | 43.50 | 41.50 | 42.50 | 41.70 | +0.80 |" in lines
    assert "| llama-3.1-8b-instruct | kivi | 41.00 | 39.00 | 40.00 | 39.84 | +0.16 |" in lines
    assert "| llama-3.1-8b-instruct | oscar | 42.25 | 40.25 | 41.25 | 41.75 | -0.50 |" in lines
    assert [l.split(" | ")[1] for l in lines[4:]] == ["fp16", "kivi", "oscar"]          # method order


def test_ablation_and_sweep_tables(rows, tmp_path):
    build_all(rows, tmp_path / "out")
    ablation = (tmp_path / "out" / "tables" / "ablation.md").read_text().splitlines()
    assert "| smollm2-135m | ✓ | ✓ | 20.00 |" in ablation
    assert "| smollm2-135m | ✗ | ✗ | 28.00 |" in ablation
    sweep = (tmp_path / "out" / "tables" / "sweep_gxr.md").read_text().splitlines()
    assert "| smollm2-135m | perplexity wikitext-2 (3 tokens) | kivi | 64 | 128 | 24.00 |" in sweep
    assert sum("| kivi |" in l for l in sweep) == 4
    assert not any("| oscar |" in l for l in sweep)             # OScaR ran with one (G, R) only
    methods = (tmp_path / "out" / "tables" / "methods.md").read_text()
    assert "| oscar rotate=off scale=on |" in methods and "| kivi G=64 R=128 |" in methods


def test_every_file_written_and_deterministic(rows, tmp_path):
    first = build_all(rows, tmp_path / "a")
    second = build_all(rows, tmp_path / "b")
    names = sorted(p.relative_to(tmp_path / "a").as_posix() for p in first)
    assert names == sorted(p.relative_to(tmp_path / "b").as_posix() for p in second)
    expected = {"tables/methods.md", "tables/table1_longbench_e.md", "tables/table1_longbench_e.tex",
                "tables/table1_longbench_e_buckets.md", "tables/niah.md", "tables/niah.tex", "tables/ablation.md",
                "tables/sweep_gxr.md", "tables/sweep_gxr.tex", "figures/sweep_gxr_smollm2-135m_perplexity.png",
                "figures/niah_smollm2-135m_fp16.png", "figures/niah_smollm2-135m_oscar.png"}
    assert expected <= set(names)
    for a, b in zip(sorted(first), sorted(second)):
        assert a.read_bytes() == b.read_bytes(), a.name
    tex = (tmp_path / "a" / "tables" / "table1_longbench_e.tex").read_text()
    assert r"\begin{tabular}{lrrrrrr}" in tex and r"$\Delta$" in tex and "+0.80" in tex


def test_cli_writes_tables(rows, tmp_path):
    rows_csv = tmp_path / "rows.csv"
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "make_tables.py"), "--rows", str(rows_csv),
                          "--out", str(tmp_path / "cli")], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "| smollm2-135m | oscar rotate=off scale=off |" in out.stdout
    assert (tmp_path / "cli" / "tables" / "niah.md").exists()


def test_markdown_tables_parse_back_for_wandb(rows, tmp_path):
    from scripts.make_tables import markdown_rows

    build_all(rows, tmp_path / "out")
    header, body = markdown_rows(tmp_path / "out" / "tables" / "niah.md")
    assert header[:3] == ["model", "method", "cells"]
    assert [r[1] for r in body] == ["fp16", "kivi", "oscar"] and body[0][2] == "4"


def test_niah_grid_split_over_runs_is_one_grid(rows):
    # a second fp16 run holding another context length: its cells join the first run's grid
    extra = [row("smollm2-135m", "fp16", "niah", f"4096@{d}", "score", 0.0, "n-extra") for d in (0, 100)]
    extra.append(row("smollm2-135m", "fp16", "niah", "all", "score", 0.0, "n-extra"))
    table = methods_table(rows + extra, model="smollm2-135m", task="niah")
    # fp16 cells: 100, 51, 100, 51 (first run) + 0, 0 -> 302 / 6: a grid of 6 cells, a column of its own
    assert table.splitlines()[0] == "| model | method | niah score (4 cells) | niah score (6 cells) | niah exact (3 cells) |"
    assert f"| smollm2-135m | fp16 | – | {302 / 6:.2f} | 50.00 |" in table.splitlines()


# ----------------------------------------------------------------------------- task options in the rows


def test_task_config_label_names_only_changed_options_stably():
    from oscar.results import MAX_VALUE_CHARS, parse_task_config, task_config_label

    defaults = dict(window=2048, max_windows=4, lengths=[1024, 2048], chat=False, data_dir=None)
    assert task_config_label(dict(name="perplexity", **defaults), defaults) == ""
    label = task_config_label(dict(name="niah", **{**defaults, "max_windows": 16, "lengths": [4096, 8192],
                                                    "chat": True, "data_dir": "../d"}), defaults)
    assert label == "chat=true data_dir=../d lengths=4096,8192 max_windows=16"   # sorted by name
    assert parse_task_config(label) == dict(chat="true", data_dir="../d", lengths="4096,8192", max_windows="16")
    assert task_config_label(dict(max_windows=None), defaults) == "max_windows=null"
    assert task_config_label(dict(extra=1), defaults) == "extra=1"              # no default: always shown
    # a long or spaced value becomes a digest: short, one token, stable, distinct per value
    long_a, long_b = "x" * (MAX_VALUE_CHARS + 1), "y" * (MAX_VALUE_CHARS + 1)
    digest = task_config_label(dict(data_dir=long_a), defaults)
    assert digest == task_config_label(dict(data_dir=long_a), defaults)
    assert digest != task_config_label(dict(data_dir=long_b), defaults)
    assert digest.startswith("data_dir=#") and len(digest) == len("data_dir=#") + 8
    spaced = task_config_label(dict(prompt="Answer: {q}", needles=[dict(text="a b")]), {})
    assert len(spaced.split()) == 2 and set(parse_task_config(spaced)) == {"prompt", "needles"}


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_runner_rows_carry_the_task_options_that_differ_from_the_defaults():
    from evals import build_task
    from oscar.runner import plan, tidy_rows

    result = [dict(subset="wikitext-2", metric="perplexity", value=21.5, n=100)]
    (changed,) = tidy_rows(plan(_compose("task=perplexity", "task.max_windows=16", "method=kivi"), build_task), result)
    assert changed["task_config"] == "max_windows=16" and changed["method"] == "kivi" and changed["value"] == 21.5
    (two,) = tidy_rows(plan(_compose("task=perplexity", "task.max_windows=16", "task.window=1024"), build_task), result)
    assert two["task_config"] == "max_windows=16 window=1024"


@pytest.mark.parametrize("task", sorted(p.stem for p in (REPO / "conf" / "task").glob("*.yaml")))
def test_conf_task_yaml_is_the_task_defaults(task):
    """conf/task/<name>.yaml and the task dataclass agree, so a run with the yaml as is has task_config ""."""
    from evals import build_task
    from oscar.runner import plan, tidy_rows

    (r,) = tidy_rows(plan(_compose(f"task={task}"), build_task), [dict(subset="s", metric="m", value=1.0, n=1)])
    assert r["task_config"] == ""


OLD_FIELDS = ["model", "method", "bits", "group_size", "residual_length", "task", "subset", "metric", "value",
              "n", "run_id", "config"]


def _old_file(path: Path, rows: list[dict]) -> None:
    """A rows.csv as written before the task_config column existed."""
    import csv

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=OLD_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def test_read_rows_of_a_file_without_task_config(tmp_path):
    old = [row("smollm2-135m", "kivi", "perplexity", "wikitext-2", "perplexity", 21.25, "a"),
           row("smollm2-135m", "oscar", "perplexity", "wikitext-2", "perplexity", 20.5, "b")]
    _old_file(tmp_path / "rows.csv", old)
    back = read_rows(tmp_path / "rows.csv")
    assert [(r["method"], r["value"], r["task_config"]) for r in back] == [("kivi", 21.25, ""), ("oscar", 20.5, "")]


def test_append_to_an_old_file_migrates_its_header_once(tmp_path):
    from oscar.results import ROW_FIELDS

    path = tmp_path / "rows.csv"
    old = [row("smollm2-135m", "kivi", "perplexity", "wikitext-2", "perplexity", 21.25, "a")]
    _old_file(path, old)
    old_line = path.read_text().splitlines()[1]
    new = row("smollm2-135m", "kivi", "perplexity", "wikitext-2", "perplexity", 19.75, "c")
    append_rows(path, [{**new, "task_config": "max_windows=16"}])
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(ROW_FIELDS) and len(lines) == 3
    assert lines[1] == old_line + "," * (len(ROW_FIELDS) - len(OLD_FIELDS))  # the old row, its new columns empty
    back = {r["run_id"]: r for r in read_rows(path)}
    assert (back["a"]["value"], back["a"]["task_config"]) == (21.25, "")
    assert (back["c"]["value"], back["c"]["task_config"]) == (19.75, "max_windows=16")
    append_rows(path, [{**new, "run_id": "d", "task_config": "window=1024"}])    # current header: append only
    assert path.read_text().splitlines()[:3] == lines and len(path.read_text().splitlines()) == 4


def test_append_refuses_a_file_with_unknown_columns(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("model,method,mystery\nsmollm2-135m,kivi,7\n")
    with pytest.raises(ValueError, match="mystery"):
        append_rows(path, [row("smollm2-135m", "kivi", "perplexity", "w", "perplexity", 1.5, "a")])
    assert path.read_text() == "model,method,mystery\nsmollm2-135m,kivi,7\n"


def test_different_task_settings_never_share_a_cell(rows, tmp_path):
    # KIVI at G=32 R=128 on perplexity: the defaults (fixture: 20 + 32/32 + 128/64) and max_windows=16
    (base,) = [r for r in rows if r["run_id"] == "s32128"]
    more = [{**base, "value": 21.5, "run_id": "w16", "task_config": "max_windows=16"}]
    table = methods_table(rows + more, model="smollm2-135m", task="perplexity").splitlines()
    assert "| smollm2-135m | kivi G=32 R=128 (perplexity, 4 windows) | 23.00 |" in table
    assert "| smollm2-135m | kivi G=32 R=128 (perplexity, 16 windows) | 21.50 |" in table
    # a single non-default setting for the (model, task) keeps the plain label
    alone = methods_table([{**r, "task_config": "max_windows=16"} for r in rows], model="smollm2-135m",
                          task="perplexity").splitlines()
    assert "| smollm2-135m | kivi G=32 R=128 | 23.00 |" in alone
    # the OScaR ablation and the KIVI sweep at max_windows=16 are tables of their own beside the defaults'
    w16 = [{**r, "run_id": r["run_id"] + "w16", "value": r["value"] - 1, "task_config": "max_windows=16"}
           for r in rows if r["task"] == "perplexity"]
    build_all(rows + w16, tmp_path / "out")
    ablation = (tmp_path / "out" / "tables" / "ablation.md").read_text().splitlines()
    assert "| smollm2-135m (perplexity, 4 windows) | ✗ | ✗ | 28.00 |" in ablation
    assert "| smollm2-135m (perplexity, 16 windows) | ✗ | ✗ | 27.00 |" in ablation
    sweep = (tmp_path / "out" / "tables" / "sweep_gxr.md").read_text().splitlines()
    column = "perplexity wikitext-2 (3 tokens)"
    assert f"| smollm2-135m | {column} | kivi (perplexity, 4 windows) | 64 | 128 | 24.00 |" in sweep
    assert f"| smollm2-135m | {column} | kivi (perplexity, 16 windows) | 64 | 128 | 23.00 |" in sweep


def test_niah_runs_differing_only_in_grid_options_form_one_grid(rows):
    """lengths / depths only choose cells: runs split by context length still make one grid, while
    another needle (a setting) makes a line of its own."""
    tagged = [{**r, "task_config": "lengths=1024,2048"} for r in rows]
    extra = [{**row("smollm2-135m", "fp16", "niah", f"4096@{d}", "score", 0.0, "n-extra"),
              "task_config": "lengths=4096"} for d in (0, 100)]
    needle = [{**r, "run_id": "needle", "value": 10.0, "task_config": "needles=#0123abcd"}
              for r in extra]
    table = methods_table(tagged + extra + needle, model="smollm2-135m", task="niah").splitlines()
    assert table[0] == ("| model | method | niah score (2 cells) | niah score (4 cells) | niah score (6 cells) | "
                        "niah exact (3 cells) |")
    assert f"| smollm2-135m | fp16 (niah, default needles) | – | – | {302 / 6:.2f} | 50.00 |" in table
    assert "| smollm2-135m | fp16 (niah, needles #0123abcd) | 10.00 | – | – | – |" in table
    assert "| smollm2-135m | kivi (niah, default needles) | – | 75.00 | – | 50.00 |" in table  # two settings


def test_make_tables_writes_every_committed_table_and_figure(tmp_path):
    """`make results` on the committed results/rows.csv (and the efficiency CSVs) writes exactly the files committed
    under results/tables and results/figures, as their manifests list them: no table or figure of a task is lost to
    the task declarations, and none is left over from rows that are gone. (The committed bytes: `make results &&
    git status results`.)"""
    import shutil

    results = REPO / "results"
    (tmp_path / "efficiency").mkdir()
    for csv_file in (results / "efficiency").glob("*.csv"):
        shutil.copy(csv_file, tmp_path / "efficiency" / csv_file.name)
    written = {p.relative_to(tmp_path).as_posix() for p in build_all(read_rows(results / "rows.csv"), tmp_path)
               if p.parent.name != "efficiency"}
    committed = {p.relative_to(results).as_posix() for folder in ("tables", "figures")
                 for p in (results / folder).iterdir() if p.name != ".generated"}
    assert committed == written, (sorted(committed - written), sorted(written - committed))
    for folder in ("tables", "figures"):
        assert (results / folder / ".generated").read_text() == (tmp_path / folder / ".generated").read_text()


# ----------------------------------------------------------------------------- one value per configuration


def _write(path: Path, rows: list[dict]) -> Path:
    append_rows(path, rows)
    return path


def _write_with_provenance(path: Path, rows: list[dict]) -> Path:
    """A rows file with the provenance columns (code_version, config_digest, date) after task_config."""
    from oscar.results import ROW_FIELDS

    fields = list(dict.fromkeys([*ROW_FIELDS, "code_version", "config_digest", "date"]))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_one_configuration_has_one_value_the_newest_and_one_warning_names_the_older(tmp_path, caplog):
    """One configuration under two run ids (a run written before a hyperparameter existed: its config lacks it) and a
    run listed twice: the tables show the newest row (the latest date; undated rows are older; then the later line)
    and one warning per configuration names the older rows, their runs and code versions."""
    from evals.tables import read_results

    old = row("smollm2-135m", "oscar", "perplexity", "wikitext-2", "perplexity", 41.035, "run-old")
    old["config"] = json.dumps({k: v for k, v in json.loads(old["config"]).items() if k != "scale"})  # a default
    new = {**row("smollm2-135m", "oscar", "perplexity", "wikitext-2", "perplexity", 41.126, "run-new"),
           "code_version": "abc1234", "date": "2026-12-01T10:00:00Z"}
    newer_but_first = {**row("gemma3-270m", "kivi", "perplexity", "wikitext-2", "perplexity", 51.00, "db1378a70b"),
                       "code_version": "def5678", "date": "2026-12-02T10:00:00Z"}
    same_run_later_line = {**newer_but_first, "value": 51.87, "date": "2026-11-30T10:00:00Z", "code_version": "0ld0ld0"}
    path = _write_with_provenance(tmp_path / "rows.csv", [new, newer_but_first, old, same_run_later_line])
    with caplog.at_level(logging.WARNING, logger="tables"):
        rows = read_results(path)
    assert sorted(r["value"] for r in rows) == [41.126, 51.00]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    (smol,) = [m for m in messages if m.startswith("smollm2-135m")]
    assert "older: run run-old (code unrecorded, " in smol and f"{path}:4)" in smol
    assert "newest: run run-new (code abc1234, 2026-12-01T10:00:00Z" in smol and "41.0350 -> 41.1260" in smol
    (gemma,) = [m for m in messages if m.startswith("gemma3-270m")]
    assert "older: run db1378a70b (code 0ld0ld0" in gemma and "newest: run db1378a70b (code def5678" in gemma
    table = methods_table(rows, task="perplexity").splitlines()
    assert "| gemma3-270m | kivi | 51.00 |" in table and "| smollm2-135m | oscar | 41.13 |" in table


def test_equal_values_of_one_configuration_warn_nothing(tmp_path, caplog):
    from evals.tables import read_results

    first = row("smollm2-135m", "kivi", "perplexity", "wikitext-2", "perplexity", 21.25, "a")
    again = {**first, "run_id": "b", "value": 21.25 * (1 + 1e-8)}       # a float reduction reordered
    with caplog.at_level(logging.WARNING, logger="tables"):
        rows = read_results(_write(tmp_path / "rows.csv", [first, again]))
    assert [r["run_id"] for r in rows] == ["b"] and not caplog.records


def test_a_sweep_never_joins_grids_of_different_cells_into_one_line(tmp_path):
    """OScaR at R=128 over a 4-cell grid and at R=256 over a 1-cell grid are two lines of one cell each, not one line
    (no G x R table then); the methods table puts them in columns of their own, each naming its cells."""
    cells = [row("smollm2-135m", "oscar", "niah", f"{length}@{depth}", "score", 60.0, "r128")
             for length in (1024, 2048) for depth in (0, 100)]
    one = [row("smollm2-135m", "oscar", "niah", "1024@50", "score", 9.52, "r256", residual_length=256)]
    written = build_all(read_rows(_write(tmp_path / "rows.csv", cells + one)), tmp_path / "out")
    assert not (tmp_path / "out" / "tables" / "sweep_gxr.md").exists(), [p.name for p in written]
    table = (tmp_path / "out" / "tables" / "methods.md").read_text().splitlines()
    assert "| model | method | niah score (1 cell) | niah score (4 cells) |" in table
    assert "| smollm2-135m | oscar R=128 | – | 60.00 |" in table and "| smollm2-135m | oscar R=256 | 9.52 | – |" in table
    # with the same grid at both R, one line of the sweep
    more = [{**r, "run_id": "r256b", "config": one[0]["config"], "residual_length": 256, "value": 50.0} for r in cells]
    build_all(read_rows(_write(tmp_path / "rows2.csv", cells + more)), tmp_path / "out2")
    sweep = (tmp_path / "out2" / "tables" / "sweep_gxr.md").read_text().splitlines()
    assert "| smollm2-135m | niah score (4 cells) | oscar | 32 | 256 | 50.00 |" in sweep


def test_niah_perplexity_and_kv_error_tables_say_what_a_value_is_taken_over(rows, tmp_path):
    extra = [{**row("smollm2-135m", "kivi", "perplexity", "wikitext-2", "kv_bytes_per_token", 7020.0, "s32128"),
              "n": 8192},
             {**row("smollm2-135m", "kivi", "kv_error", "mean", "k_rel_err", 0.2024, "e1"), "n": 1024},
             {**row("smollm2-135m", "kivi", "kv_error", "layer0", "k_rel_err", 0.5, "e1"), "n": 1024}]
    build_all(rows + extra, tmp_path / "out")
    niah = (tmp_path / "out" / "tables" / "niah.md").read_text().splitlines()
    assert niah[2] == "| model | method | cells | score (ROUGE-1 recall) | exact (key fact) | score 1K | score 2K | paper | Δ |"
    assert "| smollm2-135m | kivi | 4 | 75.00 | – | 75.00 | 75.00 | – | – |" in niah
    perplexity = (tmp_path / "out" / "tables" / "perplexity.md").read_text().splitlines()
    assert perplexity[2] == "| model | method | subset | tokens scored | perplexity | KV bytes / token |"
    assert "| smollm2-135m | kivi G=32 R=128 | wikitext-2 | 3 tokens | 23.00 | 7,020 |" in perplexity
    kv_error = (tmp_path / "out" / "tables" / "kv_error.md").read_text()
    assert "| smollm2-135m | kivi | 1,024 tokens | – | – | 0.202 | – |" in kv_error and "0.500" not in kv_error


# ----------------------------------------------------------------------------- rows the tables cannot place


BAD_ROWS = {  # column -> value: each one malformed row
    "empty config": {"config": ""}, "config a JSON list": {"config": "[1, 2]"},
    "config a JSON string": {"config": '"oscar"'}, "config not JSON": {"config": '{"name": "oscar"'},
    "group_size 32.0": {"group_size": "32.0"}, "NIAH subset abc@def": {"subset": "abc@def"},
}


def test_make_tables_skips_every_malformed_row_naming_file_and_line(tmp_path, caplog):
    """Each malformed row skipped with file:line and the build finishing: a config that is empty, a list, a string or
    not JSON, group_size 32.0, a NIAH subset abc@def; a last line cut in the middle of its run id is no result."""
    from scripts.make_tables import main

    good = [row("smollm2-135m", method, "niah", f"1024@{depth}", "score", value, f"g-{method}")
            for method, value in (("kivi", 70.0), ("oscar", 80.0)) for depth in (0, 100)]
    bad = [{**row("smollm2-135m", "oscar", "niah", "2048@0", "score", 1.0, f"bad{i}"), **change}
           for i, change in enumerate(BAD_ROWS.values())]
    path = _write(tmp_path / "rows.csv", good + bad)
    cut = path.read_text().splitlines()[1].replace("1024@0", "4096@0").replace("70.0", "99.0")  # kivi's, g-kivi
    path.write_text(path.read_text() + cut[:cut.index("g-kivi") + 4])        # the last line cut inside its run id
    with caplog.at_level(logging.WARNING):
        main(["--rows", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    lines = {int(m.split(":")[1]): m for m in (r.getMessage() for r in caplog.records)
             if m.startswith(f"{path}:") and "malformed row skipped" in m}
    assert sorted(lines) == list(range(len(good) + 2, len(good) + len(BAD_ROWS) + 3)), caplog.text
    assert "a line cut short" in lines[len(good) + len(BAD_ROWS) + 2]
    niah = (tmp_path / "out" / "tables" / "niah.md").read_text()
    assert "| smollm2-135m | kivi | 2 | 70.00 |" in niah and "| smollm2-135m | oscar | 2 | 80.00 |" in niah
    assert "99.00" not in niah and "4K" not in niah


def test_run_py_show_tables_survives_a_bad_row_in_results_file(tmp_path):
    """show_tables=true with a malformed row in results_file: the run finishes and logs its tables, the row named."""
    results = _write(tmp_path / "rows.csv", [{**row("tiny-llama", "kivi", "niah", "96@50", "score", 1.0, "x"),
                                              "config": "[1, 2]"}])
    out = subprocess.run([sys.executable, "run.py", "model=tiny-llama", "method=fp16", "task.lengths=[96]",
                          "task.depths=[50]", "task.max_new_tokens=4", "logger=files", f"runs_dir={tmp_path / 'runs'}",
                          f"results_file={results}", "show_tables=true"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert f"{results}:2: malformed row skipped (config '[1, 2]' is not a JSON object naming its method)" in log
    assert "merged view: every row of tiny-llama / niah" in log and "| tiny-llama | fp16 |" in log


# ----------------------------------------------------------------------------- files whole or absent


def test_table_and_figure_writes_are_whole_or_absent(rows, tmp_path, monkeypatch):
    """A build that fails as it replaces a file (a full disk) leaves every table and figure of the last build as it
    was, and no temporary file behind."""
    import oscar.atomic

    out = tmp_path / "out"
    build_all(rows, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(oscar.atomic.os, "replace", full_disk)
    changed = [{**r, "value": r["value"] + 1.0} for r in rows]
    with pytest.raises(OSError, match="No space left"):
        build_all(changed, out)
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
