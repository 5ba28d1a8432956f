"""Plain Markdown / LaTeX rendering and method labels for scripts/make_tables.py (no extra dependencies)."""

from __future__ import annotations

import json
import math

# Method hyperparameters worth naming when two runs of one method differ (config keys -> short label).
SHORT_NAMES = {"k_bits": "K", "v_bits": "V", "group_size": "G", "residual_length": "R"}
IGNORED_KEYS = {"name"}


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


def method_config(row: dict) -> dict:
    try:
        return json.loads(row.get("config") or "{}")
    except json.JSONDecodeError:
        return {}


def method_labels(rows: list[dict]) -> dict[str, str]:
    """run config (JSON) -> label: the method name, plus the hyperparameters that differ between the
    runs of that method in ``rows`` (e.g. ``oscar G=64 R=128`` or ``oscar rotate=off``)."""
    by_method: dict[str, set[str]] = {}
    for row in rows:
        by_method.setdefault(row["method"], set()).add(row.get("config") or "{}")
    labels = {}
    for method, configs in by_method.items():
        parsed = {c: json.loads(c) for c in configs}
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
