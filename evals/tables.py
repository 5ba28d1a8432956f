"""What every table of `make tables` shares: which rows it reads, rendering (Markdown, LaTeX), method labels and
order, task settings and headline columns, all from the tidy rows and the tasks' declarations.

A task declares its headline metrics (``Task.headline``), the options that only choose grid cells
(``Task.grid_options``, ``Task.grid_cell``), what a value is taken over (``Task.sample_words``), which rows a
table reads (``Task.shown``) and its own tables (``Task.report``); the paper's numbers are in evals/paper.yaml
(evals/paper.py reads them).
scripts/make_tables.py builds the tables across tasks (methods x tasks, ablation, sweep) and calls every
task's ``report``.

Which rows count (:func:`read_results`, :func:`current`):
- A row the tables cannot place is skipped with a warning naming its file and line (:func:`row_problem`): a config
  that is not a JSON object naming its method, group_size / residual_length / n that are not whole numbers, bits
  neither a whole number nor ``K<k>V<v>``, a subset its task cannot read; oscar.results.iter_rows already skips
  rows cut short, merged or with a value that is not a finite number. (A config is not rebuilt: a method's checks
  may grow stricter than the run that wrote the row.)
- A configuration is the model, the task, the method configuration (the row's ``config`` JSON completed by
  :func:`with_defaults`, so runs written before a hyperparameter existed share it) and the task setting (the
  ``task_config`` column less the task's grid options). One configuration has ONE value per (subset, metric) in
  every table: its newest row, the one with the latest ``date``, rows without one older than rows with one and
  ties broken by order (a later file, a later line wins). A summary row also keys on its grid options (the cells
  it averages); a grid cell does not (the same cell of two grids is one measurement). Where older rows of a
  configuration differ from the newest (beyond a relative 1e-6: float reductions reordered), one warning per
  configuration names them, their runs and code versions.
- The committed results (``make results``: results/rows.csv) are exactly those newest rows that a table or figure
  reads (``Task.shown``); a run's other rows stay in its folder and the results_file it appended to.

Task settings: rows whose task options differ (the ``task_config`` column, e.g. ``max_windows=16``) never
share a table cell. Where one (model, task) has rows of several settings, each of its lines carries, after the
method, the task and the values of the options that differ between those settings, in words
(``kivi (perplexity, 16 windows)`` beside ``kivi (perplexity, 4 windows)``: ``Task.option_words``; an option a
setting leaves out at the task's default); a (model, task) with a single setting keeps the plain label. Grid
options do not count: every row names its cell in ``subset``, so runs that differ only there form one grid.

Samples: a column never holds values taken over different grids or sample counts (:func:`basis`: NIAH averages
over 9 cells beside ones over 20, perplexity over 8,188 tokens beside 32,752): such a column splits into one
per basis, each header naming it (``niah score (20 cells)``), and a sweep draws one line per basis.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import re
from collections import defaultdict
from pathlib import Path

from evals.base import Headline, task_class
from evals.paper import paper
from oscar.atomic import write_text
from oscar.method import method_class
from oscar.results import iter_rows, parse_task_config

log = logging.getLogger("tables")

#: subsets that summarize a task (its headline when it declares none)
SUMMARY_SUBSETS = ("all", "average", "mean")
# Method hyperparameters worth naming when two runs of one method differ (config keys -> short label).
SHORT_NAMES = {"k_bits": "K", "v_bits": "V", "group_size": "G", "residual_length": "R"}
IGNORED_KEYS = {"name"}
#: relative difference below which two values of one configuration are the same number (float reductions reordered)
SAME_VALUE = 1e-6
#: the columns that must hold whole numbers
WHOLE_COLUMNS = ("group_size", "residual_length", "n")
#: the bits column: K and V bits, one number where they are equal (oscar.runner.tidy_rows)
BITS = re.compile(r"\d+|K\d+V\d+")


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
    """``out/tables/<name>.md`` (bold caption + Markdown) and ``.tex``, each written whole or not at all."""
    tables = Path(out) / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    md, tex = tables / f"{name}.md", tables / f"{name}.tex"
    write_text(md, f"**{caption}**\n\n" + markdown(header, body))
    write_text(tex, latex(header, body, caption))
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
    """What a table line is keyed on: the row's method config completed by :func:`with_defaults` (JSON)."""
    return json.dumps(method_config(row), sort_keys=True)


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


def basis_columns(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """:func:`headline_columns`, each split by what its values are taken over: (task, subset, metric, basis identity)
    (:func:`basis`), fewer samples first."""
    found: dict[tuple, dict[str, int]] = defaultdict(dict)
    for r in rows:
        found[(r["task"], r["subset"], r["metric"])].setdefault(basis(r)[1], int(r["n"]))
    return [(*column, identity) for column in headline_columns(rows)
            for identity in sorted(found[column], key=lambda i: (found[column][i], i))]


def basis_column_names(rows: list[dict], columns: list[tuple[str, str, str, str]]) -> list[str]:
    """Headers of :func:`basis_columns`: ``niah score (20 cells)``."""
    words = basis_words(rows)
    return [f"{column_name(task, subset, metric)} ({words[identity]})" for task, subset, metric, identity in columns]


def basis_values(rows: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """(model, label) -> (task, subset, metric, basis identity) -> value of labelled rows."""
    table: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in rows:
        table[(r["model"], r["label"])][(r["task"], r["subset"], r["metric"], basis(r)[1])] = float(r["value"])
    return table


def line_table(rows: list[dict], task: str, subset: str | None, columns: list[tuple[str, str, int]],
               count: str) -> tuple[list[str], list[list]]:
    """A task's own table: one line per (model, method label, subset) of ``task``'s rows of ``subset`` (None: every
    subset, then a subset column) that has one of the ``columns``' metrics, the ``count`` column (what the line's
    first metric is taken over: :func:`basis`), then one column per (metric, header, decimals)."""
    metrics = [m for m, _, _ in columns]
    chosen = labelled([r for r in rows if r["task"] == task and (subset is None or r["subset"] == subset)
                       and r["metric"] in metrics])
    lines: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in chosen:
        lines[(r["model"], r["label"], r["subset"])][r["metric"]] = r
    body = []
    for model, label, sub in sorted(lines, key=lambda k: (k[0], method_key(k[1]), k[2])):
        line = lines[(model, label, sub)]
        first = next(line[m] for m in metrics if m in line)
        values = [f"{float(line[m]['value']):,.{d}f}" if m in line else None for m, _, d in columns]
        body.append([model, label, *([sub] if subset is None else []), basis(first)[0], *values])
    header = ["model", "method", *(["subset"] if subset is None else []), count, *[h for _, h, _ in columns]]
    return header, body


def merged(rows: list[dict]) -> list[dict]:
    """``rows`` with each task's summary rows recomputed over its runs (``Task.merge_rows``: a grid split over
    several runs is one grid)."""
    for task in sorted({r["task"] for r in rows}):
        cls = task_class(task)
        if cls is not None:
            rows = cls.merge_rows(rows)
    return rows


# ----------------------------------------------------------------------------- which rows count


def row_problem(row: dict) -> str:
    """What keeps a tidy row out of the tables ("" when nothing does): see the module docstring."""
    problem = _config_problem(row.get("config") or "")
    if problem:
        return problem
    for column in WHOLE_COLUMNS:
        if not _whole(row.get(column)):
            return f"{column} {row.get(column)!r} is not a whole number"
    if not (_whole(row.get("bits")) or BITS.fullmatch(str(row.get("bits")))):
        return f"bits {row.get('bits')!r} is neither a whole number nor K<bits>V<bits>"
    task = task_class(row.get("task") or "")
    return task.subset_problem(row.get("subset") or "") if task is not None else ""


def _whole(value) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            or isinstance(value, str) and value.strip().lstrip("-").isdigit())


@functools.cache
def _config_problem(text: str) -> str:
    if not text:
        return "no method configuration (the config column is empty)"
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        return f"config is not JSON ({e.msg})"
    if not isinstance(config, dict) or not isinstance(config.get("name"), str) or not config["name"]:
        return f"config {text[:60]!r} is not a JSON object naming its method"
    return ""


def configuration(row: dict) -> tuple:
    """The configuration a row measures (model, task, method config, task setting; see the module docstring), plus
    the grid options where the row summarizes a grid."""
    task = task_class(row["task"])
    grid = "" if task is None or task.grid_cell(row["subset"]) else " ".join(
        f"{k}={v}" for k, v in sorted(parse_task_config(row.get("task_config") or "").items())
        if k in task.grid_options)
    return row["model"], row["task"], config_key(row), task_setting(row), grid


def newest(rows: list[dict], where: dict[int, str] | None = None) -> list[dict]:
    """One row per (configuration, subset, metric): the newest (latest ``date``; no date is older than any; ties:
    the later in ``rows``), in the order of ``rows``. One warning per configuration whose older rows differ from
    the newest, naming them (``where``: id(row) -> "file:line"), their runs and code versions."""
    rank = {id(r): (r.get("date") or "", i) for i, r in enumerate(rows)}
    best: dict[tuple, dict] = {}
    older: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        key = (*configuration(r), r["subset"], r["metric"])
        if key in best and rank[id(best[key])] > rank[id(r)]:
            older[key].append(r)
        else:
            if key in best:
                older[key].append(best[key])
            best[key] = r
    differing: dict[tuple, list[tuple[dict, dict]]] = defaultdict(list)
    for key, rs in older.items():
        for r in rs:
            if not math.isclose(float(r["value"]), float(best[key]["value"]), rel_tol=SAME_VALUE):
                differing[key[:-2]].append((r, best[key]))
    for config, pairs in sorted(differing.items()):
        _warn_differing(config, pairs, where or {})
    kept = {id(r) for r in best.values()}
    return [r for r in rows if id(r) in kept]


def _warn_differing(config: tuple, pairs: list[tuple[dict, dict]], where: dict[int, str]) -> None:
    model, task, method, setting, grid = config
    old, new = pairs[0]
    log.warning("%s / %s / %s%s: %d older row(s) differ from the newest, which the tables show; older: %s; newest: "
                "%s; e.g. %s %s %s -> %s", model, describe_setting(task, setting), config_words(json.loads(method)),
                f" ({grid})" if grid else "", len(pairs), _runs([o for o, _ in pairs], where),
                _runs([n for _, n in pairs], where), old["subset"], old["metric"], fmt(float(old["value"]), 4),
                fmt(float(new["value"]), 4))


def _runs(rows: list[dict], where: dict[int, str]) -> str:
    """The runs of ``rows``: run id, code version, date and where their rows are (the first, and how many more)."""
    runs: dict[tuple, list[str]] = defaultdict(list)
    for r in rows:
        runs[(r.get("run_id") or "?", r.get("code_version") or "unrecorded", r.get("date") or "")].append(
            where.get(id(r), ""))
    return "; ".join(f"run {run} (code {code}{', ' + date if date else ''}"
                     + (f", {places[0]}" if places[0] else "")
                     + (f" and {len(set(places)) - 1} more row(s)" if len(set(places)) > 1 else "") + ")"
                     for (run, code, date), places in sorted(runs.items()))


def config_words(config: dict) -> str:
    """A method configuration in words: its name and the hyperparameters that are not its defaults."""
    defaults = _defaults(config.get("name"))
    return " ".join([str(config.get("name")), *(f"{k}={_short(v)}" for k, v in sorted(config.items())
                                                  if k != "name" and (k not in defaults or defaults[k] != v))])


def current(rows: list[dict], where: dict[int, str] | None = None) -> list[dict]:
    """The rows the tables read: those :func:`row_problem` finds nothing wrong with (the others skipped with a
    warning naming ``where[id(row)]``, else the row's run), then :func:`newest`."""
    where = where or {}
    good = []
    for r in rows:
        problem = row_problem(r)
        if problem:
            log.warning("%s: malformed row skipped (%s)", where.get(id(r), f"row of run {r.get('run_id')!r}"), problem)
        else:
            good.append(r)
    return newest(good, where)


def read_results(*paths: Path) -> list[dict]:
    """:func:`current` of every row of the tidy-row CSVs ``paths`` (missing ones: none), later files newer on equal
    dates; every skipped row named by file and line."""
    rows, where = [], {}
    for path in paths:
        for line, row in iter_rows(path):
            rows.append(row)
            where[id(row)] = f"{path}:{line}"
    return current(rows, where)


def committed(rows: list[dict]) -> list[dict]:
    """The rows a table or figure reads (``Task.shown``) of :func:`current` rows: the committed results."""
    return [r for r in rows if (task_class(r["task"]) is None or task_class(r["task"]).shown(r))]


def basis(row: dict) -> tuple[str, str]:
    """(words, identity) of what the row's value is taken over (``Task.sample_words``; a merged NIAH summary: its
    cells): values of two identities never share a column."""
    task = task_class(row["task"])
    words = task.sample_words(row) if task is not None else f"n={row['n']}"
    return words, row.get("grid") or words


def basis_words(rows: list[dict]) -> dict[str, str]:
    """identity -> words for the bases of ``rows``; words that two identities share get a digest of each."""
    words = {identity: text for text, identity in map(basis, rows)}
    clash = {text for text in words.values() if list(words.values()).count(text) > 1}
    return {i: f"{t} #{hashlib.sha1(i.encode()).hexdigest()[:6]}" if t in clash else t for i, t in words.items()}
