"""The memory-accuracy frontier below 2 bits, for ``make tables``, from the tidy rows alone.

Points: every method as its paper sets it, only ``k_bits``, ``v_bits`` and ``group_size`` varied (the other
hyperparameters at the method's defaults; conf/experiment/frontier.yaml), plus fp16, in the tasks' default settings.

- x: the real bytes the cache stores per token in that configuration: ``kv_bytes_per_token`` of its perplexity run
  (evals/perplexity.py: after each 2K window, every layer's packed K and V, scales, zeros, norms, exact tokens and the
  full-precision residual window, over the window's tokens), on a log axis; the same x for its other tasks;
- y: perplexity (4 x 2K windows, every token quantized), NIAH (the mean score over lengths 1K-4K x depths 0/50/100 %:
  only configurations with all 9 cells) and kv_error (attention-output relative error, mean over layers).

Writes figures/frontier_<model>_<task>.png (one colour per method: its points, and a line through the method's own
Pareto set; the Pareto set of all methods ringed), tables/frontier_<model>.{md,tex} (every point, the settings a
method lacks and why), tables/frontier_budgets.md (which configuration is best from each byte budget on, per model
and task), tables/oscar_vs_kivi.md and tables/oscar_choices.md (conf/experiment/oscar_choices.yaml).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from evals.tables import method_config, method_key, slug, task_setting, with_defaults, write_table
from oscar.atomic import save_figure, write_text

#: the swept (k_bits, v_bits) pairs and group sizes (conf/kv_bits, conf/experiment/frontier.yaml)
BIT_PAIRS = ((1, 1), (1, 2), (2, 1), (2, 2), (3, 3), (4, 4))
GROUPS = (32, 64, 128)
SWEPT = ("k_bits", "v_bits", "group_size")
#: per-model values, not hyperparameters of the setting (a calibration file's path)
PER_MODEL = ("name", "calibration")
#: the NIAH cells every point is averaged over (conf/experiment/frontier_niah.yaml; +experiment=niah's grid holds them)
NIAH_CELLS = tuple(f"{length}@{depth}" for length in (1024, 2048, 4096) for depth in (0, 50, 100))
#: task -> (what the y axis shows, higher is better)
TASKS = {"perplexity": ("perplexity (WikiText-2, 4 x 2K)", False),
         "niah": ("NIAH score, 1K-4K x 0/50/100 %", True),
         "kv_error": ("attention-output relative error", False)}
#: OScaR's open choices (conf/oscar_choice): the hyperparameters one of them changes
CHOICES = ("norm_scope", "norm_floor", "rotation", "rotate_values")


@dataclass
class Point:
    model: str
    config: dict
    kv_bytes: float | None = None
    values: dict[str, float] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.config["name"]

    @property
    def label(self) -> str:
        c = self.config
        return "fp16" if self.method == "fp16" else f"{self.method} K{c['k_bits']}V{c['v_bits']} G{c['group_size']}"


def config_key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def collect(rows: list[dict]) -> dict[tuple[str, str], Point]:
    """(model, config JSON) -> Point with its bytes and task values, from the rows of the tasks' default settings."""
    points: dict[tuple[str, str], Point] = {}
    cells: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["task"] not in TASKS or task_setting(r):
            continue
        config = method_config(r)
        key = (r["model"], config_key(config))
        p = points.setdefault(key, Point(r["model"], config))
        task, subset, metric, value = r["task"], r["subset"], r["metric"], float(r["value"])
        if task == "perplexity" and metric == "kv_bytes_per_token":
            p.kv_bytes = value
        elif task == "perplexity" and metric == "perplexity":
            p.values["perplexity"] = value
        elif task == "kv_error" and subset == "mean" and metric == "attn_rel_err":
            p.values["kv_error"] = value
        elif task == "niah" and metric == "score" and subset in NIAH_CELLS:
            cells[key][subset] = value
    for key, grid in cells.items():
        if len(grid) == len(NIAH_CELLS):
            points[key].values["niah"] = sum(grid.values()) / len(grid)
    return points


def is_frontier_config(config: dict) -> bool:
    """The method as its paper sets it, only the swept hyperparameters free (fp16: its one configuration)."""
    defaults = with_defaults({"name": config["name"]})
    return all(config.get(k) == v for k, v in defaults.items() if k not in SWEPT + PER_MODEL)


def pareto(points: list[Point], task: str) -> list[Point]:
    """The points no other point matches or beats on both axes (fewer bytes, better value), sorted by bytes."""
    sign = 1 if TASKS[task][1] else -1
    pts = [p for p in points if p.kv_bytes is not None and task in p.values]

    def dominates(a: Point, b: Point) -> bool:
        ya, yb = sign * a.values[task], sign * b.values[task]
        return a.kv_bytes <= b.kv_bytes and ya >= yb and (a.kv_bytes < b.kv_bytes or ya > yb)

    return sorted((p for p in pts if not any(dominates(q, p) for q in pts)), key=lambda p: p.kv_bytes)


def frontier_points(rows: list[dict]) -> dict[str, list[Point]]:
    """model -> its frontier configurations that have a byte count, in the paper's method order, then bits and G."""
    by_model: dict[str, list[Point]] = defaultdict(list)
    for p in collect(rows).values():
        if p.kv_bytes is not None and is_frontier_config(p.config):
            by_model[p.model].append(p)
    order = lambda p: (method_key(p.method), p.config.get("k_bits"), p.config.get("v_bits"),  # noqa: E731
                       p.config.get("group_size"))
    return {m: sorted(ps, key=order) for m, ps in sorted(by_model.items()) if any(p.method != "fp16" for p in ps)}


def missing_settings(model: str, points: list[Point]) -> list[str]:
    """The swept settings of each quantized method without a point, with the reason the run's checks give (the
    method's own checks, and its check against the model's attention shape where that is known without loading or
    converting anything), else "not run"."""
    from oscar import build_method

    have = {(p.method, p.config["k_bits"], p.config["v_bits"], p.config["group_size"]) for p in points}
    shape = known_attention_shape(model)
    template = {p.method: {k: v for k, v in p.config.items() if k != "name"} for p in points}
    out = []
    for method in sorted({p.method for p in points if p.method != "fp16"}, key=method_key):
        reasons: dict[str, list[str]] = defaultdict(list)
        for k, v in BIT_PAIRS:
            for g in GROUPS:
                if (method, k, v, g) in have:
                    continue
                try:  # the method's other hyperparameters (a calibration file) as its points have them
                    built = build_method(method, **{**template[method], "k_bits": k, "v_bits": v, "group_size": g})
                    if shape is not None:
                        built.check_model(*shape)
                    reason = "not run"
                except (ValueError, OSError) as e:
                    reason = f"refused: {e}"
                reasons[reason].append(f"K{k}V{v} G{g}")
        out += [f"{method} {', '.join(cells)} ({reason})" for reason, cells in reasons.items()]
    return out


def known_attention_shape(model: str) -> tuple[int, int] | None:
    """(head_dim, KV heads) where it is known without loading or fetching anything: the attention shape the
    model's spec declares, else its config when at hand (a registry config, or a GGUF model's converted copy; never
    converted or downloaded here); None otherwise. The spec first, so the table does not depend on what this
    machine's cache holds."""
    from oscar.models import attention_shape, build_config, load_spec
    from oscar.paths import user_cache

    try:
        spec = load_spec(model)
    except (ValueError, OSError):
        return None
    if spec.attention is not None:
        return spec.attention["head_dim"], spec.attention["kv_heads"]
    if spec.source == "hub" or (spec.source == "gguf" and not (user_cache() / spec.name / "config.json").exists()):
        return None
    return attention_shape(build_config(spec))


# ----------------------------------------------------------------------------- tables


def fp16_bytes(points: list[Point]) -> float | None:
    return next((p.kv_bytes for p in points if p.method == "fp16"), None)


def frontier_table(model: str, points: list[Point]) -> tuple[list[str], list[list]]:
    full = fp16_bytes(points)
    on = {task: {id(p) for p in pareto(points, task)} for task in TASKS}
    body = []
    for p in points:
        c = p.config
        marks = "".join(letter for task, letter in zip(TASKS, "PNE") if id(p) in on[task])
        body.append([p.method, c.get("k_bits"), c.get("v_bits"), None if p.method == "fp16" else c.get("group_size"),
                     round(p.kv_bytes), full / p.kv_bytes if full else None, p.values.get("perplexity"),
                     p.values.get("niah"), _digits(p.values.get("kv_error"), 3), marks])
    header = ["method", "K bits", "V bits", "G", "bytes / token", "× smaller than fp16", "perplexity",
              "NIAH 1K-4K", "attn rel err", "Pareto"]
    return header, body


def _digits(value: float | None, digits: int) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def budget_table(frontiers: dict[str, list[Point]]) -> tuple[list[str], list[list]]:
    """Per model and task, the Pareto points by bytes: from each one's bytes to the next one's, it is the best."""
    body = []
    for model, points in frontiers.items():
        for task in TASKS:
            best = pareto(points, task)
            for i, p in enumerate(best):
                upto = f"{round(best[i + 1].kv_bytes)}" if i + 1 < len(best) else "–"
                body.append([model, task, round(p.kv_bytes), upto, p.label, _digits(p.values[task], 3)])
    return ["model", "task", "from bytes / token", "below", "best configuration", "value"], body


def oscar_vs_kivi(frontiers: dict[str, list[Point]]) -> tuple[list[str], list[list]]:
    """KIVI against OScaR at each setting both ran: perplexity and the log-perplexity advantage (ln KIVI - ln
    OScaR, > 0: OScaR better), NIAH and its difference (OScaR - KIVI)."""
    body = []
    for model, points in frontiers.items():
        by = {(p.method, p.config["k_bits"], p.config["v_bits"], p.config["group_size"]): p for p in points
              if p.method in ("kivi", "oscar")}
        for (method, k, v, g), oscar in sorted(by.items(), key=lambda kv: (kv[0][3], kv[0][1:3])):
            kivi = by.get(("kivi", k, v, g))
            if method != "oscar" or kivi is None:
                continue
            ppl = (kivi.values.get("perplexity"), oscar.values.get("perplexity"))
            niah = (kivi.values.get("niah"), oscar.values.get("niah"))
            body.append([model, g, f"K{k}V{v}", *ppl, _digits(math.log(ppl[0] / ppl[1]), 3) if all(ppl) else None,
                         *niah, niah[1] - niah[0] if None not in niah else None])
    return ["model", "G", "bits", "KIVI ppl", "OScaR ppl", "ln KIVI - ln OScaR", "KIVI NIAH", "OScaR NIAH",
            "OScaR - KIVI NIAH"], body


def oscar_choices(rows: list[dict]) -> tuple[list[str], list[list]]:
    """OScaR at G=32 at its default R with one open choice changed (or none), at 1 and 2 bits (K = V)."""
    defaults = with_defaults({"name": "oscar"})
    fixed = {k: v for k, v in defaults.items() if k not in CHOICES + ("k_bits", "v_bits")}
    cells: dict[tuple[str, str], dict[tuple, float]] = defaultdict(dict)
    for p in collect(rows).values():
        c = p.config
        changed = [k for k in CHOICES if c.get(k) != defaults[k]]
        if (p.method != "oscar" or any(c.get(k) != v for k, v in fixed.items()) or len(changed) > 1
                or c["k_bits"] != c["v_bits"] or c["k_bits"] not in (1, 2)):
            continue
        choice = "paper" if not changed else f"{changed[0]}={_text(c[changed[0]])}"
        for task in ("perplexity", "niah"):
            if task in p.values:
                cells[(p.model, choice)][(task, c["k_bits"])] = p.values[task]
    columns = [("perplexity", 2), ("perplexity", 1), ("niah", 2), ("niah", 1)]
    order = lambda key: (key[0], key[1] != "paper", key[1])  # noqa: E731
    body = [[model, choice, *[cells[(model, choice)].get(c) for c in columns]] for model, choice in
            sorted(cells, key=order)]
    return ["model", "OScaR choice", "perplexity 2 bits", "perplexity 1 bit", "NIAH 2 bits", "NIAH 1 bit"], body


def _text(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


# ----------------------------------------------------------------------------- figures


def plot_frontier(model: str, task: str, points: list[Point], path: Path) -> Path:
    """Bytes per token (log) against the task's value: each method's points and its own Pareto line, the Pareto
    set of all methods ringed and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in points if task in p.values]
    ylabel, higher = TASKS[task]
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    methods = sorted({p.method for p in points}, key=method_key)
    for i, method in enumerate(methods):
        mine = [p for p in points if p.method == method]
        colour, marker = f"C{i % 10}", "*" if method == "fp16" else "os^vDPXhd"[i % 9]
        ax.scatter([p.kv_bytes for p in mine], [p.values[task] for p in mine], color=colour, marker=marker,
                   s=60 if method == "fp16" else 22, alpha=0.55, zorder=3)
        own = pareto(mine, task)
        ax.plot([p.kv_bytes for p in own], [p.values[task] for p in own], color=colour, marker=marker, lw=1.3,
                ms=5, label=method, zorder=4)
    best = pareto(points, task)
    ax.step([p.kv_bytes for p in best], [p.values[task] for p in best], where="post", color="black", lw=0.8,
            ls="--", zorder=4)
    ax.scatter([p.kv_bytes for p in best], [p.values[task] for p in best], s=150, facecolors="none",
               edgecolors="black", lw=1.2, zorder=5, label="Pareto set (all methods)")
    for p in best:
        ax.annotate(p.label, (p.kv_bytes, p.values[task]), fontsize=6.5, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    if task != "niah" and min(p.values[task] for p in points) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("real KV-cache bytes per token (stored buffers after a 2K perplexity window; fp32 parameters on "
                  "this CPU)", fontsize=8)
    ax.set_ylabel(f"{ylabel} ({'higher' if higher else 'lower'} is better)")
    ax.set_title(f"{model}: memory-accuracy frontier, {task}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    save_figure(fig, path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- make tables


def build(rows: list[dict], out: Path) -> list[Path]:
    """Every frontier figure and table ``rows`` supports; returns the files written."""
    out = Path(out)
    frontiers = frontier_points(rows)
    written: list[Path] = []
    for model, points in frontiers.items():
        header, body = frontier_table(model, points)
        caption = f"{model}: memory-accuracy frontier (Pareto: P perplexity, N NIAH, E attention error)"
        files = write_table(out, f"frontier_{slug(model)}", header, body, caption)
        lacking = missing_settings(model, points)
        if lacking:  # below the Markdown table: which swept settings have no point, and why
            write_text(files[0], files[0].read_text() + "\nSettings without a point:\n\n"
                       + "".join(f"- {line}\n" for line in lacking))
        written += files
        (out / "figures").mkdir(parents=True, exist_ok=True)
        for task in TASKS:
            if sum(task in p.values for p in points) >= 2:
                written.append(plot_frontier(model, task, points,
                                             out / "figures" / f"frontier_{slug(model)}_{task}.png"))
    if frontiers:
        header, body = budget_table(frontiers)
        written += write_table(out, "frontier_budgets", header, body,
                               "Best configuration from each byte budget on (the Pareto points by bytes per token)")
        header, body = oscar_vs_kivi(frontiers)
        if body:
            written += write_table(out, "oscar_vs_kivi", header, body, "OScaR against KIVI at equal bits and G")
    header, body = oscar_choices(rows)
    if body:
        written += write_table(out, "oscar_choices", header, body, "OScaR's open choices, one at a time (G=32, "
                               "R=128; perplexity 4 x 2K, NIAH 1K-4K x 0/50/100 %)")
    return written

