"""What every table of `make tables` shares: rendering (Markdown, LaTeX), method labels and order, task settings,
headline columns and the paper's numbers, all from the tidy rows and the tasks' declarations.

A task declares its headline metrics (``Task.headline``), the options that only choose grid cells
(``Task.grid_options``) and its own tables (``Task.report``); the paper's numbers are in evals/paper.yaml.
scripts/make_tables.py builds the tables across tasks (methods x tasks, ablation, sweep) and calls every
task's ``report``.

Task settings: rows whose task options differ (the ``task_config`` column, e.g. ``max_windows=16``) never
share a table cell. Where one (model, task) has rows of several settings, each of its lines carries, after the
method, the task and the values of the options that differ between those settings, in words
(``kivi (perplexity, 16 windows)`` beside ``kivi (perplexity, 4 windows)``: ``Task.option_words``; an option a
setting leaves out at the task's default); a (model, task) with a single setting keeps the plain label. Grid
options do not count: every row names its cell in ``subset``, so runs that differ only there form one grid.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import defaultdict
from pathlib import Path

import yaml

from evals.base import Headline, task_class
from oscar.method import method_class
from oscar.results import parse_task_config

PAPER_FILE = Path(__file__).with_name("paper.yaml")
#: subsets that summarize a task (its headline when it declares none)
SUMMARY_SUBSETS = ("all", "average", "mean")
# Method hyperparameters worth naming when two runs of one method differ (config keys -> short label).
SHORT_NAMES = {"k_bits": "K", "v_bits": "V", "group_size": "G", "residual_length": "R"}
IGNORED_KEYS = {"name"}


# ----------------------------------------------------------------------------- rendering


def fmt(value, digits: int = 2) -> str:
    """A cell: numbers with fixed decimals, NaN/None as an en dash, anything else as text."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def signed(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def markdown(header: list[str], body: list[list]) -> str:
    """A GitHub Markdown table; the first column left-aligned, the others right-aligned."""
    cells = [[fmt(c) for c in row] for row in body]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def latex_escape(text: str) -> str:
    for a, b in [("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                 ("–", "--"), ("Δ", r"$\Delta$"), ("×", r"$\times$"), ("✓", r"\checkmark{}"), ("✗", "--")]:
        text = text.replace(a, b)
    return text


def latex(header: list[str], body: list[list], caption: str) -> str:
    """A booktabs tabular inside a table float."""
    spec = "l" + "r" * (len(header) - 1)
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{latex_escape(caption)}}}",
             rf"\begin{{tabular}}{{{spec}}}", r"\toprule", " & ".join(latex_escape(h) for h in header) + r" \\",
             r"\midrule"]
    lines += [" & ".join(latex_escape(fmt(c)) for c in row) + r" \\" for row in body]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def write_table(out: Path, name: str, header: list[str], body: list[list], caption: str) -> list[Path]:
    """``out/tables/<name>.md`` (bold caption + Markdown) and ``.tex``."""
    tables = Path(out) / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    md, tex = tables / f"{name}.md", tables / f"{name}.tex"
    md.write_text(f"**{caption}**\n\n" + markdown(header, body))
    tex.write_text(latex(header, body, caption))
    return [md, tex]


def slug(text: str) -> str:
    """A file-name-safe form of a label (figure names)."""
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in text).strip("_")


# ----------------------------------------------------------------------------- methods and their labels


def method_config(row: dict) -> dict:
    """The row's method configuration, completed by :func:`with_defaults` ({} for an unreadable one)."""
    try:
        return with_defaults(json.loads(row.get("config") or "{}"))
    except json.JSONDecodeError:
        return {}


def config_key(row: dict) -> str:
    """What a table line is keyed on: the row's method config completed by :func:`with_defaults` (JSON); for a row
    of an old file without one, its method (rows of two methods never share a line)."""
    return json.dumps(method_config(row), sort_keys=True) if row.get("config") else json.dumps({"name": row["method"]})


def with_defaults(config: dict) -> dict:
    """A method configuration with every hyperparameter its method has: one missing from a row written before the
    hyperparameter existed reads as its default (the behaviour that run had), so old and new runs of one setting
    share a label and a table cell. A method that is not registered (any more) is left as it is."""
    return {**_defaults(config.get("name")), **config}


@functools.cache
def _defaults(name: str | None) -> dict:
    try:
        cls = method_class(name)
    except ValueError:
        return {}
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def method_labels(rows: list[dict]) -> dict[str, str]:
    """run config (:func:`config_key`) -> label: the method name, plus the hyperparameters that differ between the
    runs of that method in ``rows`` (e.g. ``oscar G=64 R=128`` or ``oscar rotate=off``)."""
    by_method: dict[str, set[str]] = {}
    for row in rows:
        by_method.setdefault(row["method"], set()).add(config_key(row))
    labels = {}
    for method, configs in by_method.items():
        parsed = {c: with_defaults(json.loads(c)) for c in configs}
        keys = sorted({k for p in parsed.values() for k in p} - IGNORED_KEYS)
        varying = [k for k in keys if len({json.dumps(p.get(k)) for p in parsed.values()}) > 1]
        for config, p in parsed.items():
            parts = [f"{SHORT_NAMES.get(k, k)}={_short(p.get(k))}" for k in varying]
            labels[config] = " ".join([method, *parts])
    return labels


def _short(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def method_key(label: str) -> tuple:
    """Sort key of a line: its method in the order of the paper's tables (evals/paper.yaml), then the label."""
    order = paper().method_order
    name = label.split(" ")[0]
    return (order.index(name) if name in order else len(order), label)


def ordered(keys) -> list[tuple]:
    """(model, label) keys sorted by model, then :func:`method_key`."""
    return sorted(keys, key=lambda k: (k[0], method_key(k[1])))


# ----------------------------------------------------------------------------- task settings and headlines


def task_setting(row: dict) -> str:
    """The row's task options that separate table cells: its ``task_config`` less the task's grid options."""
    options = parse_task_config(row.get("task_config") or "")
    task = task_class(row["task"])
    grid = task.grid_options if task is not None else ()
    return " ".join(f"{k}={v}" for k, v in sorted(options.items()) if k not in grid)


def setting_suffixes(rows: list[dict]) -> dict[tuple, str]:
    """(model, task, setting) -> " (task, options in words)" where that (model, task) has rows of several settings
    (the options whose values differ between them, :func:`describe_setting`), else ""."""
    settings: dict[tuple, set[str]] = defaultdict(set)
    for r in rows:
        settings[(r["model"], r["task"])].add(task_setting(r))
    suffixes = {}
    for (model, task), found in settings.items():
        values = {s: _setting_values(task, s) for s in found}
        varying = sorted({k for v in values.values() for k in v}) if len(found) > 1 else []
        varying = [k for k in varying if len({v.get(k) for v in values.values()}) > 1]
        for s in found:
            suffixes[(model, task, s)] = f" ({describe_setting(task, s, varying)})" if len(found) > 1 else ""
    return suffixes


def _setting_values(task: str, setting: str) -> dict[str, str]:
    """Every option of ``task`` as text: the setting's values over the task's defaults."""
    cls = task_class(task)
    defaults = cls.default_options() if cls is not None else {}
    return {**defaults, **parse_task_config(setting)}


def describe_setting(task: str, setting: str, options: list[str] | None = None) -> str:
    """``task`` and its ``setting`` (a :func:`task_setting`) in words: ``perplexity, 16 windows``. ``options``: the
    options to name (default: those the setting gives, the ones that differ from the task's defaults); an option the
    setting leaves out has its default value."""
    cls = task_class(task)
    defaults = cls.default_options() if cls is not None else {}
    values = _setting_values(task, setting)
    names = sorted(parse_task_config(setting)) if options is None else options
    words = [cls.option_words[k](values[k]) if cls is not None and k in cls.option_words
             else f"default {k}" if values.get(k) == defaults.get(k) and str(values.get(k)).startswith("#")
             else f"{k} {values.get(k)}" for k in names]
    return ", ".join([task, *words])


def suffix(suffixes: dict[tuple, str], row: dict) -> str:
    return suffixes[(row["model"], row["task"], task_setting(row))]


def labelled(rows: list[dict]) -> list[dict]:
    """Rows with a ``label``: the method plus what differs between its runs on the same model, plus
    the task setting where the (model, task) ran several (see the module docstring)."""
    labels = {}
    for model in {r["model"] for r in rows}:
        for config, label in method_labels([r for r in rows if r["model"] == model]).items():
            labels[(model, config)] = label
    suffixes = setting_suffixes(rows)
    return [{**r, "label": labels[(r["model"], config_key(r))] + suffix(suffixes, r)} for r in rows]


def value_table(rows: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """(model, label) -> (task, subset, metric) -> value; a later row wins over an earlier one."""
    table: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in rows:
        table[(r["model"], r["label"])][(r["task"], r["subset"], r["metric"])] = float(r["value"])
    return table


def grouped(rows: list[dict], task: str) -> dict[tuple, dict[tuple, dict]]:
    """(model, label) -> (subset, metric) -> row of ``task``, the later row winning."""
    out: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in labelled([r for r in rows if r["task"] == task]):
        out[(r["model"], r["label"])][(r["subset"], r["metric"])] = r
    return out


def headline(task: str) -> tuple[Headline, ...]:
    cls = task_class(task)
    return cls.headline if cls is not None else ()


def headline_columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(task, subset, metric) columns of the methods table, in a stable order: each task's declared headline
    (subset None = every subset that has the metric), else every metric of a summary subset."""
    columns = []
    for task in sorted({r["task"] for r in rows}):
        have = {(r["subset"], r["metric"]) for r in rows if r["task"] == task}
        declared = [(h.subset, h.metric) for h in headline(task)]
        wanted = declared or [(s, m) for s, m in sorted(have) if s in SUMMARY_SUBSETS] or sorted(have)
        for subset, metric in wanted:
            subsets = [subset] if subset is not None else sorted({s for s, m in have if m == metric})
            columns += [(task, s, metric) for s in subsets if (s, metric) in have]
    return columns


def column_name(task: str, subset: str, metric: str) -> str:
    """``niah score``, ``perplexity wikitext-2`` (metric named like the task), ``kv_error k_rel_err``."""
    name = task if metric == task else f"{task} {metric}"
    return name if subset in SUMMARY_SUBSETS else f"{name} {subset}"


def merged(rows: list[dict]) -> list[dict]:
    """``rows`` with each task's summary rows recomputed over its runs (``Task.merge_rows``: a grid split over
    several runs is one grid)."""
    for task in sorted({r["task"] for r in rows}):
        cls = task_class(task)
        if cls is not None:
            rows = cls.merge_rows(rows)
    return rows


# ----------------------------------------------------------------------------- the paper's numbers


class PaperNumbers:
    """evals/paper.yaml: the paper's number for a row (its task, model, method and a metric)."""

    def __init__(self, data: dict):
        self.setting = {k: str(v) for k, v in data["setting"].items()}
        self.entries = data["numbers"]
        self._by_key = {(e["task"], e["metric"]): e for e in self.entries}
        self.method_order = list(dict.fromkeys(m for e in self.entries for model in e["models"].values()
                                               for m in model))

    def value(self, row: dict, metric: str | None = None) -> float | None:
        """The paper's ``metric`` (default: the row's) for the row's task, model and method, if the row is in the
        paper's setting (the 16-bit baseline: any) and, where the paper gives the benchmark's size, covers it."""
        entry = self._by_key.get((row["task"], metric or row["metric"]))
        if entry is None:
            return None
        if str(row.get("bits")) != "16" and any(str(row.get(k)) != v for k, v in self.setting.items()):
            return None
        if "samples" in entry and int(float(row["n"])) != entry["samples"]:
            return None
        return entry["models"].get(row["model"], {}).get(row["method"])


@functools.cache
def paper() -> PaperNumbers:
    return PaperNumbers(yaml.safe_load(PAPER_FILE.read_text()))
