"""`make tables` on a small fixture of tidy rows: golden Markdown, paper numbers and differences,
labels of ablation / sweep runs, every expected file, byte-identical output on a second build."""

from __future__ import annotations

import json
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
        "| model | method | niah score | niah exact |\n"
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
    assert "| smollm2-135m | perplexity wikitext-2 | kivi | 64 | 128 | 24.00 |" in sweep
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
                          "--out", str(tmp_path / "cli")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
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
    # fp16 cells: 100, 51, 100, 51 (first run) + 0, 0 -> 302 / 6
    assert f"| smollm2-135m | fp16 | {302 / 6:.2f} | 50.00 |" in table.splitlines()


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
    assert "| smollm2-135m | perplexity wikitext-2 | kivi (perplexity, 4 windows) | 64 | 128 | 24.00 |" in sweep
    assert "| smollm2-135m | perplexity wikitext-2 | kivi (perplexity, 16 windows) | 64 | 128 | 23.00 |" in sweep


def test_niah_runs_differing_only_in_grid_options_form_one_grid(rows):
    """lengths / depths only choose cells: runs split by context length still make one grid, while
    another needle (a setting) makes a line of its own."""
    tagged = [{**r, "task_config": "lengths=1024,2048"} for r in rows]
    extra = [{**row("smollm2-135m", "fp16", "niah", f"4096@{d}", "score", 0.0, "n-extra"),
              "task_config": "lengths=4096"} for d in (0, 100)]
    needle = [{**r, "run_id": "needle", "value": 10.0, "task_config": "needles=#0123abcd"}
              for r in extra]
    table = methods_table(tagged + extra + needle, model="smollm2-135m", task="niah").splitlines()
    assert f"| smollm2-135m | fp16 (niah, default needles) | {302 / 6:.2f} | 50.00 |" in table
    assert "| smollm2-135m | fp16 (niah, needles #0123abcd) | 10.00 | – |" in table
    assert "| smollm2-135m | kivi (niah, default needles) | 75.00 | 50.00 |" in table  # the (model, task): two settings


def test_make_tables_writes_every_committed_table_and_figure(tmp_path):
    """`make tables` on the committed results/rows.csv (and the efficiency CSVs) writes a file of every name committed
    under results/tables and results/figures: no table or figure of a task is lost to the task declarations. (The
    committed bytes: `make tables && git diff results/tables`; rows appended by runs still going change them.)"""
    import shutil

    results = REPO / "results"
    (tmp_path / "efficiency").mkdir()
    for csv in (results / "efficiency").glob("*.csv"):
        shutil.copy(csv, tmp_path / "efficiency" / csv.name)
    written = {p.relative_to(tmp_path).as_posix() for p in build_all(read_rows(results / "rows.csv"), tmp_path)}
    committed = {p.relative_to(results).as_posix() for folder in ("tables", "figures") for p in (results / folder).iterdir()}
    assert committed <= written, sorted(committed - written)
