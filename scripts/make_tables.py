"""Build every table and figure from the tidy results rows alone (``make tables``), deterministically.

    python scripts/make_tables.py [--rows results/rows.csv] [--out results]

Writes under ``--out``: tables/methods.md (methods x tasks, every model), tables/table1_longbench_e
and table1_longbench_e_buckets (per subset, 13-subset average, length buckets), tables/niah (grid
averages) + figures/niah_<model>_<method>.png, tables/ablation (OScaR rotate/scale), tables/sweep_gxr
+ figures/sweep_gxr_<model>_<task>.png, figures/pareto_<model>_<task>.png (accuracy against stored bits
per value and decode latency: scripts/pareto.py, with results/efficiency's CSVs), each table as .md and
.tex. Cells the paper reports (INT2, G=32, R=128, design.md section 6) show the paper's number beside ours
and the difference.

Task settings: rows whose task options differ (the ``task_config`` column, e.g. ``max_windows=16``)
never share a table cell. Where one (model, task) has rows of several settings, each of its lines
carries the setting in brackets after the method (``kivi [max_windows=16]``, ``kivi [defaults]``);
a (model, task) with a single setting keeps the plain label. The NIAH options ``lengths`` and
``depths`` (GRID_OPTIONS) do not count: they only choose grid cells, and every cell's rows name it,
so runs that differ only there form one grid.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import defaultdict
from pathlib import Path

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

if __package__ in (None, ""):  # `python scripts/make_tables.py`
    sys.path.insert(0, str(REPO_ROOT))

from oscar.results import parse_task_config
from scripts.table_format import fmt, latex, markdown, method_config, method_labels, signed

log = logging.getLogger("make_tables")

LONGBENCH_E = ["qasper_e", "multifieldqa_en_e", "hotpotqa_e", "2wikimqa_e", "gov_report_e", "multi_news_e",
               "trec_e", "triviaqa_e", "samsum_e", "passage_count_e", "passage_retrieval_en_e", "lcc_e",
               "repobench-p_e"]
LENGTH_BUCKETS = ["0-4k", "4-8k", "8k+"]
METHOD_ORDER = ["fp16", "quarot", "rotatekv", "kivi", "turboquant", "ott", "oscar", "spectral"]

# The headline (subset, metric) pairs of each task; subset None = the task's only subset.
HEADLINE = {
    "niah": [("all", "score"), ("all", "exact")],
    "longbench_e": [("average", "score")],
    "perplexity": [(None, "perplexity")],
    "kv_error": [("mean", "k_rel_err"), ("mean", "v_rel_err"), ("mean", "attn_rel_err")],
}
SUMMARY_SUBSETS = ("all", "average", "mean")
#: task options that only choose which cells run, each cell's rows naming it in ``subset``
GRID_OPTIONS = {"niah": ("lengths", "depths")}

# design.md section 6: the paper's INT2 numbers (G=32, R=128). The paper does not name the NIAH
# model in design.md; we attach its NIAH numbers to Llama-3.1-8B-Instruct (a stated assumption).
PAPER = {
    ("longbench_e", "llama-3.1-8b-instruct"): {"fp16": 41.70, "quarot": 37.94, "rotatekv": 37.98, "kivi": 39.84,
                                               "turboquant": 40.03, "ott": 40.74, "oscar": 41.75},
    ("longbench_e", "qwen3-8b"): {"fp16": 49.56, "quarot": 40.13, "rotatekv": 42.95, "turboquant": 47.56,
                                  "kivi": 47.95, "ott": 48.21, "oscar": 48.74},
    ("niah", "llama-3.1-8b-instruct"): {"fp16": 96.0, "oscar": 96.5},
}
PAPER_SETTING = {"bits": "2", "group_size": "32", "residual_length": "128"}


# ----------------------------------------------------------------------------- selection helpers


def _method_key(label: str) -> tuple:
    name = label.split(" ")[0]
    return (METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER), label)


def task_setting(row: dict) -> str:
    """The row's task options that separate table cells: its ``task_config`` less the task's GRID_OPTIONS."""
    options = parse_task_config(row.get("task_config") or "")
    grid = GRID_OPTIONS.get(row["task"], ())
    return " ".join(f"{k}={v}" for k, v in sorted(options.items()) if k not in grid)


def setting_suffixes(rows: list[dict]) -> dict[tuple, str]:
    """(model, task, setting) -> " [setting]" (" [defaults]" for "") where that (model, task) has rows
    of several settings, else ""."""
    settings: dict[tuple, set[str]] = defaultdict(set)
    for r in rows:
        settings[(r["model"], r["task"])].add(task_setting(r))
    return {(model, task, s): f" [{s or 'defaults'}]" if len(found) > 1 else ""
            for (model, task), found in settings.items() for s in found}


def _suffix(suffixes: dict[tuple, str], row: dict) -> str:
    return suffixes[(row["model"], row["task"], task_setting(row))]


def _labelled(rows: list[dict]) -> list[dict]:
    """Rows with a ``label``: the method plus what differs between its runs on the same model, plus
    the task setting where the (model, task) ran several (see the module docstring)."""
    labels = {}
    for model in {r["model"] for r in rows}:
        for config, label in method_labels([r for r in rows if r["model"] == model]).items():
            labels[(model, config)] = label
    suffixes = setting_suffixes(rows)
    return [{**r, "label": labels[(r["model"], r.get("config") or "{}")] + _suffix(suffixes, r)} for r in rows]


def _value_table(rows: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """(model, label) -> (task, subset, metric) -> value; a later row wins over an earlier one."""
    table: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in rows:
        table[(r["model"], r["label"])][(r["task"], r["subset"], r["metric"])] = float(r["value"])
    return table


def headline_columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(task, subset, metric) columns of the methods table, in a stable order: HEADLINE's pairs
    (subset None = every subset that has the metric), else every metric of a summary subset."""
    from scripts.mm_tables import MM_HEADLINE

    headline = {**HEADLINE, **MM_HEADLINE}
    columns = []
    for task in sorted({r["task"] for r in rows}):
        have = {(r["subset"], r["metric"]) for r in rows if r["task"] == task}
        wanted = headline.get(task) or [(s, m) for s, m in sorted(have) if s in SUMMARY_SUBSETS] or sorted(have)
        for subset, metric in wanted:
            subsets = [subset] if subset is not None else sorted({s for s, m in have if m == metric})
            columns += [(task, s, metric) for s in subsets if (s, metric) in have]
    return columns


def _column_name(task: str, subset: str, metric: str) -> str:
    """``niah score``, ``perplexity wikitext-2`` (metric named like the task), ``kv_error k_rel_err``."""
    name = task if metric == task else f"{task} {metric}"
    return name if subset in SUMMARY_SUBSETS else f"{name} {subset}"


def paper_value(task: str, model: str, row: dict) -> float | None:
    if any(str(row.get(k)) != v for k, v in PAPER_SETTING.items()):
        return None
    return PAPER.get((task, model), {}).get(row["method"])


# ----------------------------------------------------------------------------- tables


def with_niah_grid_means(rows: list[dict]) -> list[dict]:
    """``rows`` with each NIAH ``all`` row replaced by the mean over the per-cell rows of every run of
    the same model, method configuration and task setting (a grid split over runs counts as one grid)."""
    key = lambda r: (r["model"], r.get("config") or "{}", task_setting(r), r["metric"])  # noqa: E731
    cells: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:
        if r["task"] == "niah" and "@" in r["subset"]:
            cells[key(r)][r["subset"]] = r
    merged = [r for r in rows if not (r["task"] == "niah" and r["subset"] == "all" and key(r) in cells)]
    for (_, _, _, metric), grid in sorted(cells.items()):
        values = [float(r["value"]) for r in grid.values()]
        example = next(iter(grid.values()))
        merged.append({**example, "subset": "all", "metric": metric, "value": sum(values) / len(values),
                       "n": len(values)})
    return merged


def methods_table(rows: list[dict], model: str | None = None, task: str | None = None) -> str:
    """Markdown: one line per (model, method), one column per task headline metric."""
    rows = [r for r in rows if (model is None or r["model"] == model) and (task is None or r["task"] == task)]
    rows = with_niah_grid_means(rows)
    if not rows:
        return "(no results yet)\n"
    rows = _labelled(rows)
    columns = headline_columns(rows)
    values = _value_table(rows)
    keys = sorted(values, key=lambda k: (k[0], _method_key(k[1])))
    body = [[m, label, *[values[(m, label)].get(c) for c in columns]] for m, label in keys]
    return markdown(["model", "method", *[_column_name(*c) for c in columns]], body)


def longbench_table(rows: list[dict]) -> tuple[list[str], list[list], list[str], list[list]]:
    """Table 1 (per subset + average, paper's average and the difference) and the length-bucket table."""
    rows = _labelled([r for r in rows if r["task"] == "longbench_e" and r["metric"] == "score"])
    values = _value_table(rows)
    present = {r["subset"] for r in rows}
    subsets = [s for s in LONGBENCH_E if s in present]
    buckets = [b for b in LENGTH_BUCKETS if b in present]
    example = {(r["model"], r["label"]): r for r in rows}
    header = ["model", "method", *[s.removesuffix("_e") for s in subsets], "avg", "paper", "Δ"]
    body, bucket_body = [], []
    for key in sorted(values, key=lambda k: (k[0], _method_key(k[1]))):
        v = values[key]
        avg = v.get(("longbench_e", "average", "score"))
        paper = paper_value("longbench_e", key[0], example[key])
        body.append([*key, *[v.get(("longbench_e", s, "score")) for s in subsets], avg, paper,
                     signed(avg - paper) if avg is not None and paper is not None else None])
        bucket_body.append([*key, *[v.get(("longbench_e", b, "score")) for b in buckets], avg])
    return header, body, ["model", "method", *buckets, "avg"], bucket_body


def niah_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Grid averages recomputed from the per-cell rows, so a grid split over several runs (one per
    context length, say) merges into one line per (model, method)."""
    rows = _labelled([r for r in rows if r["task"] == "niah" and "@" in r["subset"]])
    cells: dict[tuple, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    example = {}
    for r in rows:
        cells[(r["model"], r["label"])][r["metric"]][r["subset"]] = float(r["value"])
        example[(r["model"], r["label"])] = r
    body = []
    for key in sorted(cells, key=lambda k: (k[0], _method_key(k[1]))):
        score, exact = (cells[key].get(m, {}) for m in ("score", "exact"))
        mean_score = sum(score.values()) / len(score) if score else None
        paper = paper_value("niah", key[0], example[key])
        body.append([*key, len(score), mean_score, sum(exact.values()) / len(exact) if exact else None, paper,
                     signed(mean_score - paper) if mean_score is not None and paper is not None else None])
    return ["model", "method", "cells", "score (ROUGE-1 recall)", "exact (key fact)", "paper", "Δ"], body


def niah_grids(rows: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """(model, label) -> {(length, depth): score} from the per-cell rows ``<length>@<depth>``."""
    grids: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in _labelled([r for r in rows if r["task"] == "niah" and r["metric"] == "score" and "@" in r["subset"]]):
        length, depth = r["subset"].split("@")
        grids[(r["model"], r["label"])][(int(length), float(depth))] = float(r["value"])
    return dict(grids)


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
        model = r["model"] + _suffix(suffixes, r)
        values[(model, *switches(method_config(r)))][(r["task"], r["subset"], r["metric"])] = float(r["value"])
    body = [[m, "✓" if rot else "✗", "✓" if sc else "✗", *[values[(m, rot, sc)].get(c) for c in columns]]
            for m, rot, sc in sorted(values, key=lambda k: (k[0], not k[1], not k[2]))]
    return ["model", "rotate", "scale", *[_column_name(*c) for c in columns]], body


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
            key = (r["model"], task, _column_name(*task_column), r["method"] + _suffix(suffixes, r), others)
            grids[key][(int(r["group_size"]), int(r["residual_length"]))] = float(r["value"])
    return {k[:4]: g for k, g in sorted(grids.items()) if len(g) >= 2}


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


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in text).strip("_")


def write_table(out: Path, name: str, header: list[str], body: list[list], caption: str) -> list[Path]:
    tables = out / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    md, tex = tables / f"{name}.md", tables / f"{name}.tex"
    md.write_text(f"**{caption}**\n\n" + markdown(header, body))
    tex.write_text(latex(header, body, caption))
    return [md, tex]


def build_all(rows: list[dict], out: Path) -> list[Path]:
    """Every table and figure that ``rows`` supports; returns the files written (sorted)."""
    from evals.niah import plot_heatmap

    out = Path(out)
    rows = with_niah_grid_means(rows)
    written: list[Path] = []
    (out / "tables").mkdir(parents=True, exist_ok=True)
    methods_md = out / "tables" / "methods.md"
    methods_md.write_text("**Methods x tasks (headline metric per task)**\n\n" + methods_table(rows))
    written.append(methods_md)

    if any(r["task"] == "longbench_e" for r in rows):
        header, body, bucket_header, bucket_body = longbench_table(rows)
        written += write_table(out, "table1_longbench_e", header, body,
                               "LongBench-E per subset and 13-subset average (paper: INT2, G=32, R=128)")
        written += write_table(out, "table1_longbench_e_buckets", bucket_header, bucket_body,
                               "LongBench-E by input length (mean over the subsets' samples in each bucket)")
    if any(r["task"] == "niah" for r in rows):
        header, body = niah_table(rows)
        written += write_table(out, "niah", header, body, "Needle in a haystack: grid averages")
        figures = out / "figures"
        figures.mkdir(parents=True, exist_ok=True)
        for (model, label), grid in sorted(niah_grids(rows).items()):
            mean = sum(grid.values()) / len(grid)
            written.append(plot_heatmap(grid, figures / f"niah_{_slug(model)}_{_slug(label)}.png",
                                        f"NIAH {model} {label}: score {mean:.1f}"))
    from scripts.mm_tables import build_mm_tables  # imports this module: import it late

    written += build_mm_tables(rows, out)
    header, body = ablation_table(rows)
    if body:
        written += write_table(out, "ablation", header, body, "OScaR ablation: rotation and scaling")
    grids = sweep_grids(rows)
    if grids:
        header, body = sweep_table(grids)
        written += write_table(out, "sweep_gxr", header, body, "Group size G x residual length R")
        (out / "figures").mkdir(parents=True, exist_ok=True)
        for model, task in sorted({(k[0], k[1]) for k in grids}):
            written.append(plot_sweep(grids, model, task, out / "figures" / f"sweep_gxr_{_slug(model)}_{task}.png"))
    from scripts.efficiency_figures import build as build_efficiency  # GPU benchmark CSVs, not tidy rows
    from scripts.pareto import build as build_pareto

    written += build_efficiency(out / "efficiency")
    written += build_pareto(rows, out / "figures", out / "efficiency")  # rows + the benchmark CSVs
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = read_rows(Path(args.rows))
    if not rows:
        log.info("no rows in %s yet: run some experiments first (python run.py ...)", args.rows)
        return
    written = build_all(rows, Path(args.out))
    if args.wandb:
        mirror_to_wandb(written, args.wandb)
    log.info("wrote %d files under %s", len(written), args.out)
    sys.stdout.write(f"merged view: every row of {args.rows} (committed runs included), one line per model, method "
                     f"configuration and task setting; NIAH averages the cells of all their runs\n")
    sys.stdout.write(methods_table(rows))


if __name__ == "__main__":
    main()
