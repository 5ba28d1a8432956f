"""Build every table and figure from the tidy results rows alone (``make tables``), deterministically.

    python scripts/make_tables.py [--rows results/rows.csv] [--out results] [--quiet]

Prints the merged methods table of every row (``--quiet``: not) and ends on one line saying where the files are.

Writes under ``--out``: tables/methods.md (methods x tasks: each task's declared headline metrics, every
model), each task's own tables and figures (``Task.report``: Table 1 for LongBench-E, the NIAH grid
averages and heatmaps, OCRBench, DocVQA, MMAU-Pro, ...), tables/ablation (OScaR rotate/scale),
tables/sweep_gxr + figures/sweep_gxr_<model>_<task>.png, each table as .md and .tex, and the efficiency
tables and figures. Cells the paper reports (evals/paper.yaml: INT2, G=32, R=128) show the paper's number
beside ours and the difference. A new benchmark needs no edit here: its task class declares what it shows
(evals/base.py, evals/tables.py).

Task settings: rows whose task options differ (the ``task_config`` column) never share a table cell
(evals/tables.py says how lines are labelled then).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

if __package__ in (None, ""):  # `python scripts/make_tables.py`
    sys.path.insert(0, str(REPO_ROOT))

from evals.base import available_tasks, task_class
from evals.tables import (column_name, headline_columns, labelled, markdown, merged, method_config, method_key,
                          setting_suffixes, slug, suffix, task_setting, value_table, write_table)

log = logging.getLogger("make_tables")


# ----------------------------------------------------------------------------- tables


def methods_table(rows: list[dict], model: str | None = None, task: str | None = None) -> str:
    """Markdown: one line per (model, method), one column per task headline metric."""
    rows = [r for r in rows if (model is None or r["model"] == model) and (task is None or r["task"] == task)]
    rows = merged(rows)
    if not rows:
        return "(no results yet)\n"
    rows = labelled(rows)
    columns = headline_columns(rows)
    values = value_table(rows)
    keys = sorted(values, key=lambda k: (k[0], method_key(k[1])))
    body = [[m, label, *[values[(m, label)].get(c) for c in columns]] for m, label in keys]
    return markdown(["model", "method", *[column_name(*c) for c in columns]], body)


def ablation_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """OScaR's rotate x scale combinations, for each (model, task, task setting) that ran at least two
    of them with the other hyperparameters equal; the model carries the setting's suffix."""
    switches = lambda c: (bool(c.get("rotate", True)), bool(c.get("scale", True)))  # noqa: E731
    rest = lambda c: tuple(sorted((k, str(v)) for k, v in c.items() if k not in ("rotate", "scale")))  # noqa: E731
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["method"] == "oscar":
            groups[(r["model"], r["task"], task_setting(r), rest(method_config(r)))].append(r)
    chosen = [r for group in groups.values() if len({switches(method_config(r)) for r in group}) >= 2 for r in group]
    if not chosen:
        return [], []
    columns = headline_columns(chosen)
    suffixes = setting_suffixes(chosen)
    values: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in chosen:
        model = r["model"] + suffix(suffixes, r)
        values[(model, *switches(method_config(r)))][(r["task"], r["subset"], r["metric"])] = float(r["value"])
    body = [[m, "✓" if rot else "✗", "✓" if sc else "✗", *[values[(m, rot, sc)].get(c) for c in columns]]
            for m, rot, sc in sorted(values, key=lambda k: (k[0], not k[1], not k[2]))]
    return ["model", "rotate", "scale", *[column_name(*c) for c in columns]], body


def sweep_grids(rows: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """(model, task, column, method) -> {(G, R): value} where a method ran with >= 2 (G, R) pairs and
    otherwise equal hyperparameters and task setting; the method carries the setting's suffix."""
    grids: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    suffixes = setting_suffixes(rows)
    for task_column in headline_columns(rows):
        task, subset, metric = task_column
        for r in rows:
            if (r["task"], r["subset"], r["metric"]) != task_column:
                continue
            c = method_config(r)
            others = tuple(sorted((k, str(v)) for k, v in c.items() if k not in ("group_size", "residual_length")))
            key = (r["model"], task, column_name(*task_column), r["method"] + suffix(suffixes, r), others)
            grids[key][(int(r["group_size"]), int(r["residual_length"]))] = float(r["value"])
    # a G x R grid: >= 2 residual lengths (the frontier's G-only series, scripts/frontier.py, are not one)
    return {k[:4]: g for k, g in sorted(grids.items()) if len({r for _, r in g}) >= 2}


def sweep_table(grids: dict[tuple, dict[tuple, float]]) -> tuple[list[str], list[list]]:
    body = []
    for (model, task, column, method), grid in grids.items():
        for (g, r), value in sorted(grid.items()):
            body.append([model, column, method, g, r, value])
    return ["model", "metric", "method", "G", "R", "value"], body


# ----------------------------------------------------------------------------- figures


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(grids: dict[tuple, dict[tuple, float]], model: str, task: str, path: Path) -> Path:
    """One panel per (metric, method): value against R, one line per G."""
    plt = _plt()
    panels = [(k, g) for k, g in grids.items() if k[0] == model and k[1] == task]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, ((_, _, column, method), grid) in zip(axes[0], panels):
        for g in sorted({g for g, _ in grid}):
            points = sorted((r, v) for (gg, r), v in grid.items() if gg == g)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"G={g}")
        ax.set_xlabel("residual length R")
        ax.set_ylabel(column)
        ax.set_title(f"{model} {method}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main


def task_tables(rows: list[dict], out: Path) -> list[Path]:
    """Every registered task's own tables and figures (``Task.report``) for the tasks in ``rows``."""
    present = [name for name in available_tasks() if name in {r["task"] for r in rows}]
    return [path for name in tqdm(present, desc="make tables: task tables", unit="task", leave=False)
            for path in task_class(name).report(rows, out)]


def build_all(rows: list[dict], out: Path) -> list[Path]:
    """Every table and figure that ``rows`` supports; returns the files written (sorted)."""
    out = Path(out)
    rows = merged(rows)
    written: list[Path] = []
    (out / "tables").mkdir(parents=True, exist_ok=True)
    methods_md = out / "tables" / "methods.md"
    methods_md.write_text("**Methods x tasks (headline metric per task)**\n\n" + methods_table(rows))
    written.append(methods_md)
    written += task_tables(rows, out)
    header, body = ablation_table(rows)
    if body:
        written += write_table(out, "ablation", header, body, "OScaR ablation: rotation and scaling")
    grids = sweep_grids(rows)
    if grids:
        header, body = sweep_table(grids)
        written += write_table(out, "sweep_gxr", header, body, "Group size G x residual length R")
        (out / "figures").mkdir(parents=True, exist_ok=True)
        for model, task in sorted({(k[0], k[1]) for k in grids}):
            written.append(plot_sweep(grids, model, task, out / "figures" / f"sweep_gxr_{slug(model)}_{task}.png"))
    from benchmarks.report import build as build_efficiency  # GPU benchmark CSVs, not tidy rows
    from scripts.frontier import build as build_frontier
    from scripts.pareto import build as build_pareto

    written += build_efficiency(out / "efficiency")
    written += build_pareto(rows, out / "figures", out / "efficiency")  # rows + the benchmark CSVs
    written += build_frontier(rows, out)
    return sorted(written)


def markdown_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """Header and body of the Markdown table in ``path`` (as written by ``write_table``)."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


def mirror_to_wandb(files: list[Path], mode: str) -> None:
    """One W&B run (job_type=tables) with every Markdown table as a wandb.Table and every PNG."""
    import wandb

    run = wandb.init(project="oscar-kv", job_type="tables", mode=mode, reinit="finish_previous")
    for path in files:
        if path.suffix == ".md":
            header, body = markdown_rows(path)
            run.log({f"tables/{path.stem}": wandb.Table(columns=header, data=body)})
        elif path.suffix == ".png":
            run.log({f"figures/{path.stem}": wandb.Image(str(path))})
    run.finish()


def main(argv: list[str] | None = None) -> None:
    from oscar.results import read_rows

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="results/rows.csv", help="tidy rows CSV (default: results/rows.csv)")
    parser.add_argument("--out", default="results", help="output folder for tables/ and figures/")
    parser.add_argument("--wandb", choices=["offline", "online"], default=None,
                        help="also log every table and figure to a W&B run (job_type=tables)")
    parser.add_argument("--quiet", action="store_true",
                        help="no merged methods table, no per-file log lines (make demo ends on its sweep's summary)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    rows = read_rows(Path(args.rows))
    if not rows:
        log.info("no rows in %s yet: run some experiments first (python run.py ...)", args.rows)
        return
    written = build_all(rows, Path(args.out))
    if args.wandb:
        mirror_to_wandb(written, args.wandb)
    if not args.quiet:
        sys.stdout.write(f"merged view: every row of {args.rows} (committed runs included), one line per model, "
                         f"method configuration and task setting; NIAH averages the cells of all their runs\n")
        sys.stdout.write(methods_table(rows))
    tables = sum(p.suffix in (".md", ".tex") for p in written)
    sys.stdout.write(f"make tables: {tables} tables and {len(written) - tables} figures written under {args.out}/ "
                     f"(tables/, figures/, efficiency/), from {args.rows}\n")


if __name__ == "__main__":
    main()
