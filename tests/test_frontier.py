"""The frontier experiments: the configs compose into the swept settings, one tiny-model cell runs and
stores its bytes per token, and scripts/frontier.py builds its figures and tables from tidy rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from oscar import build_method
from oscar.paths import REPO_ROOT as REPO
from oscar.results import append_rows, read_rows
from scripts import frontier
from tests.test_low_bits import QUANTIZING
from tests.test_sweep import sweep_values


def composed(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_the_experiments_sweep_the_frontiers_settings():
    cfg = composed("+experiment=frontier")
    swept = sweep_values(cfg.hydra.sweeper.params)
    assert cfg.task.name == "perplexity" and sorted(swept["method"]) == sorted(m for m in QUANTIZING)
    assert [int(g) for g in swept["method.group_size"]] == list(frontier.GROUPS)
    pairs = [(composed(f"+kv_bits={name}").method.k_bits, composed(f"+kv_bits={name}").method.v_bits)
             for name in swept["+kv_bits"]]
    assert pairs == list(frontier.BIT_PAIRS)
    niah = composed("+experiment=frontier_niah")
    assert niah.task.name == "niah" and list(niah.task.lengths) == [1024, 2048, 4096]
    cells = [f"{length}@{depth}" for length in niah.task.lengths for depth in niah.task.depths]
    assert cells == list(frontier.NIAH_CELLS)
    defaults = build_method("oscar").hyperparameters()
    for experiment in ("oscar_choices", "oscar_choices_niah"):
        choices = sweep_values(composed(f"+experiment={experiment}").hydra.sweeper.params)["+oscar_choice"]
        for choice in choices:  # each one switch of frontier.CHOICES away from the paper's reading (paper: none)
            method = composed(f"+experiment={experiment}", f"+oscar_choice={choice}").method
            changed = {k for k, v in defaults.items() if method[k] != v}
            assert changed <= set(frontier.CHOICES) and len(changed) == (choice != "paper"), (choice, changed)


def test_one_tiny_frontier_cell_runs_and_stores_its_bytes(tmp_path, data_file):
    data_root = data_file("text/wikitext-2-raw-v1.test.rows.jsonl").parents[1]
    args = [sys.executable, "run.py", "+experiment=frontier", "model=tiny-llama", "method=oscar", "+kv_bits=k1v2",
            "task.window=64", "task.max_windows=1", "logger=files", f"runs_dir={tmp_path / 'runs'}",
            f"results_file={tmp_path / 'rows.csv'}", f"data_root={data_root}"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_rows(tmp_path / "rows.csv")
    assert {(r["bits"], r["metric"]) for r in rows} == {("K1V2", "perplexity"), ("K1V2", "kv_bytes_per_token")}
    (run_dir,) = (tmp_path / "runs" / "perplexity" / "tiny-llama").iterdir()
    (record,) = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    stored = next(r for r in rows if r["metric"] == "kv_bytes_per_token")
    assert stored["value"] == record["kv_bytes"] / 64 > 0
    # the table of the one point says which swept settings it lacks, and why G=128 cannot run on head_dim 64
    for r in rows:
        r["task_config"] = ""  # as if the task's default setting: the frontier reads only those
    frontier.build(rows, tmp_path / "out")
    table = (tmp_path / "out" / "tables" / "frontier_tiny-llama.md").read_text()
    assert "| oscar | 1 | 2 | 32 |" in table
    assert "oscar: group_size=128 must divide head_dim=64 (per-token value groups)" in table
    assert "K1V1 G32" in table and "not run" in table


def row(model, config, task, subset, metric, value, run_id):
    return dict(model=model, method=config["name"], bits=2, group_size=config.get("group_size", 32),
                residual_length=config.get("residual_length", 128), task=task, subset=subset, metric=metric,
                value=value, n=1, run_id=run_id, config=json.dumps(config, sort_keys=True), task_config="")


def method(name, **changes):
    return {"name": name, **build_method(name, **changes).hyperparameters()}


@pytest.fixture
def rows(tmp_path) -> list[dict]:
    """fp16, KIVI and OScaR points on one model (bytes, perplexity, NIAH cells), an OScaR row written before its
    newer switches existed, and two OScaR choices; through a CSV, as `make tables` reads them."""
    points = [(method("fp16"), 1000.0, 20.0, 80.0),
              (method("kivi"), 125.0, 40.0, 50.0), (method("kivi", k_bits=1, v_bits=1), 94.0, 400.0, 10.0),
              (method("oscar"), 126.0, 35.0, 60.0), (method("oscar", k_bits=1, v_bits=1), 95.0, 150.0, 30.0),
              (method("oscar", k_bits=1, v_bits=1, rotation="orthogonal"), 95.0, 170.0, 20.0),
              (method("oscar", norm_floor="group_median"), 126.0, 33.0, 62.0)]
    out = []
    for i, (config, kv_bytes, ppl, niah) in enumerate(points):
        out += [row("m", config, "perplexity", "wiki", "kv_bytes_per_token", kv_bytes, f"p{i}"),
                row("m", config, "perplexity", "wiki", "perplexity", ppl, f"p{i}")]
        out += [row("m", config, "niah", cell, "score", niah, f"n{i}") for cell in frontier.NIAH_CELLS]
    old = {k: v for k, v in method("oscar").items() if k not in ("norm_floor", "rotation", "rotation_seed")}
    out.append(row("m", old, "kv_error", "mean", "attn_rel_err", 0.4, "e-old"))  # joins the default OScaR point
    path = tmp_path / "rows.csv"
    append_rows(path, out)
    return read_rows(path)


def test_points_pareto_sets_and_tables(rows, tmp_path):
    points = frontier.frontier_points(rows)["m"]
    assert [p.label for p in points] == ["fp16", "kivi K1V1 G32", "kivi K2V2 G32", "oscar K1V1 G32", "oscar K2V2 G32"]
    default_oscar = points[-1]
    assert default_oscar.values == {"perplexity": 35.0, "niah": 60.0, "kv_error": 0.4}  # the older row joined it
    assert [p.label for p in frontier.pareto(points, "perplexity")] == ["kivi K1V1 G32", "oscar K1V1 G32",
                                                                         "kivi K2V2 G32", "oscar K2V2 G32", "fp16"]
    assert [p.label for p in frontier.pareto(points, "niah")] == ["kivi K1V1 G32", "oscar K1V1 G32",
                                                                   "kivi K2V2 G32", "oscar K2V2 G32", "fp16"]
    written = frontier.build(rows, tmp_path / "a")
    names = sorted(p.relative_to(tmp_path / "a").as_posix() for p in written)
    assert names == ["figures/frontier_m_niah.png", "figures/frontier_m_perplexity.png", "tables/frontier_budgets.md",
                     "tables/frontier_budgets.tex", "tables/frontier_m.md", "tables/frontier_m.tex",
                     "tables/oscar_choices.md", "tables/oscar_choices.tex", "tables/oscar_vs_kivi.md",
                     "tables/oscar_vs_kivi.tex"]
    again = sorted(frontier.build(rows, tmp_path / "b"))
    assert [p.read_bytes() for p in sorted(written)] == [p.read_bytes() for p in again]
    table = (tmp_path / "a" / "tables" / "frontier_m.md").read_text()
    assert "| oscar | 2 | 2 | 32 | 126 | 7.94 | 35.00 | 60.00 | 0.400 | PNE |" in table
    vs = (tmp_path / "a" / "tables" / "oscar_vs_kivi.md").read_text()
    assert "| m | 32 | K1V1 | 400.00 | 150.00 | 0.981 | 10.00 | 30.00 | 20.00 |" in vs  # ln(400/150) = 0.981
    choices = (tmp_path / "a" / "tables" / "oscar_choices.md").read_text().splitlines()
    assert choices[4:] == ["| m | paper | 35.00 | 150.00 | 60.00 | 30.00 |",
                           "| m | norm_floor=group_median | 33.00 | – | 62.00 | – |",
                           "| m | rotation=orthogonal | – | 170.00 | – | 20.00 |"]
    budgets = (tmp_path / "a" / "tables" / "frontier_budgets.md").read_text()
    assert "| m | perplexity | 94 | 95 | kivi K1V1 G32 | 400.000 |" in budgets
