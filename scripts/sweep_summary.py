"""The short answer of a sweep (what ``make demo`` ends on): its methods' headline numbers, real KV bytes per
token and their ratio to fp16's, a sentence per method that reads them (every headline metric against fp16's, and the
bytes against fp16's cache, naming float32 where fp16 stored it and giving the factor against a 16-bit cache too), and
where the runs' figures are.

    python scripts/sweep_summary.py multirun/demo [--runs-dir runs]

Reads ``<sweep>/rows.csv`` (run.py appends every run of a multirun there) and nothing else: the merged views of
``results/rows.csv`` are ``make tables`` (or ``show_tables=true`` on run.py). One block per (model, task) of the
sweep: a line per method configuration (summaries merged over its runs as in the tables, ``evals.tables.merged``),
the task's headline columns (``Task.headline``), ``kv_bytes_per_token`` (the runs' own stored bytes:
``oscar.runner.storage_rows``, total bytes over total tokens where a line has several runs) and its ratio to the
fp16 line's.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from oscar.paths import REPO_ROOT

if __package__ in (None, ""):  # `python scripts/sweep_summary.py`
    sys.path.insert(0, str(REPO_ROOT))

from evals.tables import column_name, headline, headline_columns, labelled, markdown, merged, method_key
from oscar.results import read_rows
from oscar.runner import KV_BYTES_METRIC


def kv_bytes(rows: list[dict]) -> dict[tuple, float]:
    """(model, task, label) -> stored bytes per token over the line's runs (total bytes / total tokens)."""
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        if r["metric"] == KV_BYTES_METRIC:
            total = totals[(r["model"], r["task"], r["label"])]
            total[0] += float(r["value"]) * float(r["n"])
            total[1] += float(r["n"])
    return {k: b / n for k, (b, n) in totals.items() if n}


def run_figures(rows: list[dict], runs_dir: Path) -> list[Path]:
    """The figures (PNG) in the run folders of ``rows`` (``<runs_dir>/<task>/<model>/<method>-<run_id>/``)."""
    folders = sorted({Path(runs_dir) / r["task"] / r["model"] / f"{r['method']}-{r['run_id']}" for r in rows})
    return [png for folder in folders for png in sorted(folder.glob("*.png"))]


def compact(paths: list[Path]) -> str:
    """``a/{x,y}/f.png`` for files of one name in sibling folders, else the paths joined by commas."""
    if len(paths) > 1 and len({p.name for p in paths}) == 1 and len({p.parent.parent for p in paths}) == 1:
        return f"{paths[0].parent.parent}/{{{','.join(p.parent.name for p in paths)}}}/{paths[0].name}"
    return ", ".join(map(str, paths))


def _against(value: float, base: float | None, higher: bool, first: bool) -> str:
    """A headline value beside fp16's: its share of fp16's where higher is better (fp16's value named the first
    time), else fp16's value beside it."""
    if base is None:
        return f"{value:.2f}"
    if higher and base:
        share = f"{100 * value / base:.0f}%"
        return f"{value:.2f} ({share} of fp16's {base:.2f})" if first else f"{value:.2f} ({share})"
    return f"{value:.2f} (fp16 {base:.2f})"


def _fewer_bytes(per_token: float | None, base: float | None, per_value: float | None, first: bool) -> str:
    """How many times fewer KV bytes per token than fp16's cache; where fp16 stored float32 (a CPU run), also against
    a 16-bit cache (half of fp16's bytes), and the sentence says so."""
    if not per_token or not base:
        return ""
    ratio = base / per_token
    if per_value == 4:
        return (f"{ratio:.1f}x fewer KV bytes per token than fp16's float32 cache, {ratio / 2:.1f}x fewer than a 16-bit "
                f"cache" if first else f"{ratio:.1f}x and {ratio / 2:.1f}x fewer")
    return f"{ratio:.1f}x fewer KV bytes per token than fp16's cache" if first else f"{ratio:.1f}x fewer"


def reading(lines: list[dict], names: list[str], higher: list[bool], per_value: float | None) -> str:
    """One sentence per quantized line (label, values: one per headline column, bytes), best first by the first
    headline: every headline value against fp16's, and its factor of fewer KV bytes per token (``per_value``: the
    bytes per value fp16's cache stored, 4 naming float32)."""
    base = next((line for line in lines if line["label"].split(" ")[0] == "fp16"), None)
    others = [line for line in lines if line is not base and line["values"][0] is not None]
    others.sort(key=lambda line: -line["values"][0] if higher[0] else line["values"][0])
    if not others:
        return f"No quantized method in this sweep to compare on {names[0]}."
    if base is None or base["values"][0] is None:
        return f"No fp16 line in this sweep to compare with; the best {names[0]}: {others[0]['label']} " \
               f"{others[0]['values'][0]:.2f}."
    sentences = []
    for i, line in enumerate(others):
        values = [f"{name} {_against(value, fp16, up, i == 0)}"
                  for name, value, fp16, up in zip(names, line["values"], base["values"], higher) if value is not None]
        fewer = _fewer_bytes(line["bytes"], base["bytes"], per_value, i == 0)
        sentences.append(f"{line['label']}: {', '.join(values)}{'; ' + fewer if fewer else ''}.")
    return " ".join(sentences)


def bytes_per_value(model: str, fp16_bytes: float) -> tuple[float | None, str]:
    """(fp16's stored bytes per value, a line saying what they are: its K and V as the model computes them, every
    layer); (None, why) where the model's attention shape is unknown here."""
    from oscar.models import model_attention

    try:
        shape = model_attention(model)
    except (ValueError, OSError, RuntimeError) as e:  # an unregistered model, a hub config not at hand
        return None, f"fp16: K and V unquantized in the model's dtype ({model}'s attention shape unknown here: {e})"
    per_value = fp16_bytes / (2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"])
    dtype = {4: " (float32, the model's dtype on a CPU)", 2: " (16-bit)"}.get(per_value, "")
    return per_value, (f"fp16 stores K and V unquantized in the model's dtype: {per_value:g} bytes per value{dtype}, "
                       f"{shape['layers']} layers x {shape['kv_heads']} KV heads x {shape['head_dim']}, K and V.")


def _higher(task: str, subset: str, metric: str) -> bool:
    return next((h.higher_is_better for h in headline(task) if h.metric == metric), True)


def summary(rows: list[dict], runs_dir: Path) -> str:
    """The block per (model, task) of the sweep rows (see the module docstring)."""
    rows = labelled(merged(rows))
    per_token = kv_bytes(rows)
    blocks = []
    for model, task in sorted({(r["model"], r["task"]) for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["task"] == task]
        columns = headline_columns(mine)
        values: dict[str, dict[tuple, float]] = defaultdict(dict)
        for r in mine:
            values[r["label"]][(r["task"], r["subset"], r["metric"])] = float(r["value"])
        labels = sorted(values, key=method_key)
        base = next((per_token.get((model, task, label)) for label in labels if label.split(" ")[0] == "fp16"), None)
        body = []
        for label in labels:
            b = per_token.get((model, task, label))
            body.append([label, *[values[label].get(c) for c in columns], f"{b:,.0f}" if b else None,
                         f"{b / base:.2f}x" if b and base else None])
        header = ["method", *[column_name(*c) for c in columns], "KV bytes / token", "vs fp16"]
        runs = len({r["run_id"] for r in mine})
        text = [f"{task} on {model}: {runs} run(s) of this sweep", markdown(header, body).rstrip("\n")]
        per_value, note = bytes_per_value(model, base) if base else (None, "")
        if headline(task) and columns:
            lines = [dict(label=label, values=[values[label].get(c) for c in columns],
                          bytes=per_token.get((model, task, label))) for label in labels]
            text.append(reading(lines, [column_name(*c) for c in columns], [_higher(*c) for c in columns], per_value))
        if note:
            text.append(note)
        if any(row[-2] is None for row in body):
            text.append("KV bytes –: the run stored no figure (it generated nothing here, or finished before runs "
                        "recorded one: rerun=true)")
        figures = run_figures(mine, runs_dir)
        text.append(f"Figures: {compact(figures)}" if figures else f"No figures in the run folders under {runs_dir}.")
        blocks.append("\n".join(text))
    return "\n\n".join(blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="the multirun's folder (hydra.sweep.dir), holding rows.csv")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"), help="the runs' runs_dir (default: runs)")
    args = parser.parse_args(argv)
    rows = read_rows(args.sweep / "rows.csv")
    if not rows:
        sys.stderr.write(f"no rows in {args.sweep / 'rows.csv'}: did the sweep run? (python run.py -m ...)\n")
        return 1
    sys.stdout.write(summary(rows, args.runs_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
