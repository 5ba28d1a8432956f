"""Build every table and figure from tidy result rows alone, deterministically.

    python scripts/make_tables.py [--rows FILE ...] [--out DIR] [--efficiency DIR] [--compact] [--quiet]

``make tables`` (the defaults): your runs beside the committed results, read from results/rows.csv and then
runs/rows.csv (where run.py appends by default), written under runs/tables and runs/figures, which git does not
track. ``make results``: the committed results, ``--rows results/rows.csv --out results --compact``: results/rows.csv
rewritten to the rows the tables read (one per configuration, the newest), then results/tables, results/figures and
the efficiency tables and figures of results/efficiency. Prints the merged methods table (``--quiet``: not) and ends
on one line saying where the files are.

Which rows count (evals/tables.py): a malformed row is skipped with a warning naming its file and line; one
configuration has one value, its newest row's, with a warning naming the older rows that differ and their code
versions; a column never mixes values over different grids or sample counts.

Writes under ``--out``: tables/methods.md (methods x tasks: each task's declared headline metrics, every
model), each task's own tables and figures (``Task.report``: Table 1 for LongBench-E, the NIAH grid
averages and heatmaps, perplexity, kv_error, OCRBench, DocVQA, MMAU-Pro, ...), tables/ablation (OScaR
rotate/scale), tables/sweep_gxr + figures/sweep_gxr_<model>_<task>.png, the frontier's and the Pareto
figures' files (scripts/frontier.py, scripts/pareto.py), each table as .md and .tex; with ``--out results``
also the efficiency tables and figures (``--efficiency``: the benchmark CSVs the Pareto figures' latency panel
reads). Every file is written whole or not at all (oscar.atomic); each of tables/ and figures/ lists what the
build wrote in ``.generated``, and a file an earlier build listed there that this one did not write (its rows
are gone, or its name changed with a method's label) is removed. Cells the paper reports (evals/paper.yaml:
INT2, G=32, R=128) show the paper's number beside ours and the difference. A new benchmark needs no edit here:
its task class declares what it shows (evals/base.py, evals/tables.py).

Task settings: rows whose task options differ (the ``task_config`` column) never share a table cell
(evals/tables.py says how lines are labelled then).
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

if __package__ in (None, ""):  # `python scripts/make_tables.py`
    sys.path.insert(0, str(REPO_ROOT))

from evals.base import available_tasks, task_class
from evals.tables import (basis, basis_column_names, basis_columns, basis_values, committed, current, labelled,
                          markdown, merged, method_config, method_key, read_results, setting_suffixes, slug, suffix,
                          task_setting, write_table)
from oscar.atomic import atomic_open, save_figure, write_text
from oscar.results import ROW_FIELDS

#: rows files of `make tables`: the committed results, then your runs (run.py's default results_file)
DEFAULT_ROWS = ("results/rows.csv", "runs/rows.csv")
#: the list of files a build wrote, in each of tables/ and figures/ (a file listed there that the next build does
#: not write is removed)
MANIFEST = ".generated"

log = logging.getLogger("make_tables")


# ----------------------------------------------------------------------------- tables


def methods_table(rows: list[dict], model: str | None = None, task: str | None = None) -> str:
    """Markdown: one line per (model, method), one column per task headline metric and what its values are taken
    over (:func:`evals.tables.basis_columns`); ``rows`` as read (the malformed skipped, the newest kept)."""
    rows = [r for r in current(rows) if (model is None or r["model"] == model) and (task is None or r["task"] == task)]
    rows = merged(rows)
    if not rows:
        return "(no results yet)\n"
    rows = labelled(rows)
    columns = basis_columns(rows)
    values = basis_values(rows)
    keys = sorted(values, key=lambda k: (k[0], method_key(k[1])))
    body = [[m, label, *[values[(m, label)].get(c) for c in columns]] for m, label in keys]
    return markdown(["model", "method", *basis_column_names(rows, columns)], body)


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
    columns = basis_columns(chosen)
    suffixes = setting_suffixes(chosen)
    values: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in chosen:
        model = r["model"] + suffix(suffixes, r)
        values[(model, *switches(method_config(r)))][(r["task"], r["subset"], r["metric"], basis(r)[1])] = \
            float(r["value"])
    body = [[m, "✓" if rot else "✗", "✓" if sc else "✗", *[values[(m, rot, sc)].get(c) for c in columns]]
            for m, rot, sc in sorted(values, key=lambda k: (k[0], not k[1], not k[2]))]
    return ["model", "rotate", "scale", *basis_column_names(chosen, columns)], body


def sweep_grids(rows: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """(model, task, column, method) -> {(G, R): value} where a method ran with >= 2 (G, R) pairs and
    otherwise equal hyperparameters, task setting and basis (a grid of other cells, other sample counts: another
    line); the method carries the setting's suffix, the column names the basis."""
    grids: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    suffixes = setting_suffixes(rows)
    columns = basis_columns(rows)
    for column, name in zip(columns, basis_column_names(rows, columns)):
        task, subset, metric, identity = column
        for r in rows:
            if (r["task"], r["subset"], r["metric"], basis(r)[1]) != column:
                continue
            c = method_config(r)
            others = tuple(sorted((k, str(v)) for k, v in c.items() if k not in ("group_size", "residual_length")))
            key = (r["model"], task, name, r["method"] + suffix(suffixes, r), others)
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
    save_figure(fig, path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main


def task_tables(rows: list[dict], out: Path) -> list[Path]:
    """Every registered task's own tables and figures (``Task.report``) for the tasks in ``rows``."""
    present = [name for name in available_tasks() if name in {r["task"] for r in rows}]
    return [path for name in tqdm(present, desc="make tables: task tables", unit="task", leave=False)
            for path in task_class(name).report(rows, out)]


def build_all(rows: list[dict], out: Path, efficiency: Path | None = None) -> list[Path]:
    """Every table and figure that ``rows`` supports (:func:`evals.tables.current` of them) under ``out``, the
    Pareto figures' latencies from the benchmark CSVs in ``efficiency`` (default: ``out/efficiency``, whose
    efficiency tables and figures are rebuilt too where it has CSVs); removes what an earlier build wrote there and
    this one did not (:func:`prune`); returns the files written (sorted)."""
    out = Path(out)
    rows = merged(current(rows))
    written: list[Path] = []
    (out / "tables").mkdir(parents=True, exist_ok=True)
    methods_md = out / "tables" / "methods.md"
    write_text(methods_md, "**Methods x tasks (headline metric per task, and what its values are taken over)**\n\n"
               + methods_table(rows))
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

    if (out / "efficiency").is_dir():
        written += build_efficiency(out / "efficiency")
    written += build_pareto(rows, out / "figures", efficiency or out / "efficiency")  # rows + the benchmark CSVs
    written += build_frontier(rows, out)
    prune(out, written)
    return sorted(written)


def prune(out: Path, written: list[Path]) -> list[Path]:
    """In ``out``'s tables/ and figures/: remove every file the manifest (``MANIFEST``) of an earlier build lists that
    ``written`` does not hold, then list ``written``'s files of that folder; returns the files removed. Files no
    build listed (written by hand) are left alone."""
    removed = []
    for folder in (Path(out) / "tables", Path(out) / "figures"):
        manifest = folder / MANIFEST
        mine = sorted(p.name for p in written if p.parent.resolve() == folder.resolve())
        before = manifest.read_text().split("\n")[1:] if manifest.exists() else []
        for name in sorted(set(before) - set(mine) - {""}):
            if "/" not in name and (folder / name).is_file():
                (folder / name).unlink()
                removed.append(folder / name)
                log.info("removed %s (its rows are gone, or its name changed)", folder / name)
        if mine or before:
            write_text(manifest, "# written by scripts/make_tables.py; a file listed here that the next build does "
                                 "not write is removed\n" + "\n".join(mine) + "\n")
    return removed


def compact(path: Path, rows: list[dict]) -> None:
    """Rewrite the tidy-row CSV ``path`` (whole or not at all) to :func:`evals.tables.committed` of ``rows`` (read
    from it): no run may be appending to it meanwhile."""
    with atomic_open(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore", restval="")
        writer.writeheader()
        writer.writerows(committed(rows))


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS),
                        help="tidy-row CSVs, later ones newer where rows carry no date (default: results/rows.csv "
                             "runs/rows.csv: the committed results and your runs; a missing file has no rows)")
    parser.add_argument("--out", default="runs", help="output folder for tables/ and figures/ (default: runs; "
                                                      "`make results` writes results)")
    parser.add_argument("--efficiency", default="results/efficiency",
                        help="the benchmark CSVs the Pareto figures' latency panel reads (default: results/efficiency)")
    parser.add_argument("--compact", action="store_true",
                        help="first rewrite the one --rows file to the rows the tables read (one per configuration, "
                             "the newest): what `make results` commits")
    parser.add_argument("--wandb", choices=["offline", "online"], default=None,
                        help="also log every table and figure to a W&B run (job_type=tables)")
    parser.add_argument("--quiet", action="store_true",
                        help="no merged methods table, no per-file log lines (make demo ends on its sweep's summary)")
    args = parser.parse_args(argv)
    if args.compact and len(args.rows) != 1:
        parser.error("--compact rewrites one rows file: give exactly one --rows")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    paths = [Path(p) for p in args.rows]
    rows = read_results(*paths)
    sources = " and ".join(str(p) for p in paths)
    if args.compact:
        lines = len(paths[0].read_text().splitlines()) - 1 if paths[0].exists() else 0
        compact(paths[0], rows)
        rows = committed(rows)
        log.info("%s: %d rows -> %d (the newest of each configuration, those a table reads)", paths[0], lines,
                 len(rows))
    if not rows:
        log.info("no rows in %s yet: run some experiments first (python run.py ...)", sources)
        return
    written = build_all(rows, Path(args.out), Path(args.efficiency))
    if args.wandb:
        mirror_to_wandb(written, args.wandb)
    if not args.quiet:
        sys.stdout.write(f"merged view: every row of {sources}, one line per model, method configuration and task "
                         f"setting (its newest rows); NIAH averages the cells of all their runs\n")
        sys.stdout.write(methods_table(rows))
    tables = sum(p.suffix in (".md", ".tex") for p in written)
    sys.stdout.write(f"make tables: {tables} tables and {len(written) - tables} figures written under {args.out}/ "
                     f"(tables/, figures/), from {sources}\n")


if __name__ == "__main__":
    main()
