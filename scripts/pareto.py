"""The accuracy-efficiency Pareto figure, for ``make tables``: figures/pareto_<model>_<task>.png.

For every model and task of the tidy rows that declares a headline (``Task.headline``: its first headline metric
and direction), one point per method configuration (a run's ``config``; each task's summary rows merged over runs as
in the tables, ``evals.tables.merged``), its accuracy (y) against

- stored bits per value (left, every configuration): 8 x the real bytes of the packed keys and values that the
  configuration's own quantizers return for one block of PROBE_TOKENS real-looking tokens (outlier channels, a
  low-norm first token) at the rows' own model's attention shape (its KV heads and head_dim,
  ``oscar.models.model_attention``: declared in its spec, no weights loaded), divided by the number of values. The
  method is built from the row's config as it ran, calibration files included (RotateKV's channel orders, OSCAR's
  rotations: the files of that model), and prepared on a random-weight model of that model's attention shape. The
  full-precision residual window is not in it (its share falls with the context); RotateKV's sink tokens, chosen
  during a prefill, are not in the block.
- decode latency per token (right) at one batch and context, from the efficiency CSVs in results/efficiency
  (benchmarks.report.decode_latencies): user_path.csv (``python -m benchmarks user_path``: end to end through the
  decode engine, ms per token at batch 1 and the longest measured context, the model's random-weight architecture)
  where it has the model, else kernel.csv (``python -m benchmarks kernel``: decode attention per layer at
  Llama-3.1-8B's attention shape, batch 1, the longest context). Only the configurations those benchmarks ran have a
  latency (their defaults: 2 bits, G=32, R=128; kernel.csv also 4 bits, any R); fp16 is the BF16 baseline of the
  same run. The others appear on the bits panel only, and the figure names them.

Each (model, task) figure shows the task setting that has the most methods (then the most configurations): a
figure of every method the rows have of that model and task, where one setting has them all.

The Pareto frontier (the points no other point matches or beats on both axes) is drawn on each panel, in the
direction the task declares (lower is better for perplexity and errors). Generated from the rows and the CSVs
alone, deterministically.
"""

from __future__ import annotations

import functools
import json
import logging
import textwrap
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from matplotlib.text import Text
from matplotlib.transforms import Bbox
from tqdm import tqdm

from benchmarks.report import decode_latencies as latencies
from evals.paper import paper
from evals.tables import (basis, basis_words, column_name, describe_setting, headline, labelled, merged, slug,
                          task_setting, write_table)
from oscar.atomic import save_figure

log = logging.getLogger("pareto")

#: tokens of the block whose packed bytes give the bits per value
PROBE_TOKENS = 4096


# ----------------------------------------------------------------------------- stored bits per value


@functools.cache
def _probe_block(kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-looking keys and values [1, H, T, D] in bf16 (seeded): four channels 12x larger, a low-norm first token."""
    g = torch.Generator().manual_seed(0)
    blocks = []
    for _ in range(2):
        x = torch.randn(1, kv_heads, PROBE_TOKENS, head_dim, generator=g)
        x[..., torch.randperm(head_dim, generator=g)[:4]] *= 12.0
        x[:, :, 0] *= 0.05
        blocks.append(x.to(torch.bfloat16))
    return blocks[0], blocks[1]


def _probe_model(attention: dict[str, int]) -> torch.nn.Module:
    """A random-weight Llama with the attention shape ``attention`` (oscar.models.model_attention: every layer, the
    query and KV heads, head_dim) and a token width of one per query head (the narrowest transformers builds; no
    byte depends on it): what a method's ``prepare_model`` reads and changes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=attention["query_heads"], intermediate_size=8,
                         num_hidden_layers=attention["layers"],
                         num_attention_heads=attention["query_heads"], num_key_value_heads=attention["kv_heads"],
                         head_dim=attention["head_dim"], max_position_embeddings=2 * PROBE_TOKENS)
    return LlamaForCausalLM(config).eval()


@contextmanager
def _methods_quiet():
    """The methods' own notes while they prepare a probe model (RotateKV's narrower head groups) left out: a run
    that prepared the real model said them, and ``make tables`` would repeat them for every point of a figure."""
    methods_log = logging.getLogger("methods")
    level = methods_log.level
    methods_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        methods_log.setLevel(level)


@functools.cache
def stored_bits(config_json: str, model: str) -> float:
    """Bits per value of the packed keys and values of the configuration ``config_json`` (a rows ``config``) at the
    attention shape of ``model`` (a registered model)."""
    from oscar import build_method
    from oscar.cache import quantize_chunk
    from oscar.method import SequenceState, TokenSpan
    from oscar.models import model_attention

    config = json.loads(config_json)
    name = config.pop("name")  # KeyError: not a method's config
    method = build_method(name, **config)
    attention = model_attention(model)
    with _methods_quiet():
        method.prepare_model(_probe_model(attention))
    k, v = _probe_block(attention["kv_heads"], attention["head_dim"])
    span = TokenSpan(torch.tensor([0]), 0, SequenceState(method).allocate(1, k.shape[1], k.device))  # a fresh sequence
    with torch.no_grad():
        keys = quantize_chunk(method.quantize_keys, k, 0, span)
        values = quantize_chunk(method.quantize_values, v, 0, span)
    return 8 * (keys.nbytes + values.nbytes) / (k.numel() + v.numel())


# ----------------------------------------------------------------------------- latency


def _defaults(name: str) -> dict:
    from oscar import build_method

    return build_method(name).hyperparameters()


def _is_default(config: dict, free: tuple[str, ...] = ()) -> bool:
    """Whether the configuration is its method's default, except the hyperparameters in ``free``."""
    defaults = _defaults(config["name"])
    return all(config.get(k, v) == v for k, v in defaults.items() if k not in free)


def latency_of(config: dict, table: dict[str, float]) -> float | None:
    """The latency of a configuration, if a benchmark ran it (see the module docstring)."""
    name, bits = config["name"], config.get("k_bits")
    if name == "fp16":
        return table.get("fp16")
    if name in table and _is_default(config):  # user_path.csv: the methods' defaults
        return table[name]
    key = f"{name}@{bits}"  # kernel.csv: G=32, 2 or 4 bits, any R
    if key in table and config.get("v_bits") == bits and _is_default(config, ("k_bits", "v_bits", "residual_length")):
        return table[key]
    return None


# ----------------------------------------------------------------------------- the figure


def frontier(points: list[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of the Pareto-optimal points (x lower is better; y as said), sorted by x: no other point is at least
    as good on both axes and better on one."""
    sign = 1 if higher_is_better else -1

    def dominates(a, b):
        return a[0] <= b[0] and sign * a[1] >= sign * b[1] and (a[0] < b[0] or sign * a[1] > sign * b[1])

    best = [i for i, p in enumerate(points) if not any(dominates(q, p) for q in points)]
    return sorted(best, key=lambda i: (points[i][0], -sign * points[i][1]))


def method_style(method: str) -> tuple[str, str]:
    """(colour, marker) of a method, by its place in the paper's method order (evals/paper.yaml), the other
    registered methods after it in name order: the same in every figure."""
    from oscar import available_methods

    order = paper().method_order
    order = order + [m for m in available_methods() if m not in order]
    i = order.index(method) if method in order else len(order)
    return f"C{i % 10}", "*" if method == "fp16" else "os^vDPXhd"[i % 9]


def short_label(config: dict) -> str:
    """A configuration as the figure's key names it: the method and its hyperparameters that differ from the
    method's defaults (``oscar K=1 V=1``, ``kivi G=64 R=256``, ``fp16``)."""
    words = {"k_bits": "K", "v_bits": "V", "group_size": "G", "residual_length": "R"}
    defaults = _defaults(config["name"])
    changed = [(k, v) for k, v in config.items()  # a calibration file is the model's own: not a choice to name
               if k not in ("name", "calibration") and k in defaults and v != defaults[k]]
    text = lambda v: "on" if v is True else "off" if v is False else str(v)  # noqa: E731
    return " ".join([config["name"], *(f"{words.get(k, k)}={text(v)}" for k, v in sorted(
        changed, key=lambda kv: (kv[0] not in words, list(words).index(kv[0]) if kv[0] in words else 0, kv[0])))])


def numbered_frontier(points: list[dict], higher: bool) -> list[dict]:
    """The points on either panel's Pareto frontier (stored bits; latency, among the points that have one), in the
    order of their numbers (1, 2, ...): by bits, then accuracy, best first."""
    timed = [p for p in points if p["latency"] is not None]
    best = [points[i] for i in frontier([(p["bits"], p["accuracy"]) for p in points], higher)]
    best += [timed[i] for i in frontier([(p["latency"], p["accuracy"]) for p in timed], higher)]
    unique = list({id(p): p for p in best}.values())
    return sorted(unique, key=lambda p: (p["bits"], -p["accuracy"] if higher else p["accuracy"], p["label"]))


def point_table(metric: str, higher: bool, points: list[dict]) -> tuple[list[str], list[list]]:
    """Every point of a figure: its frontier number (blank: on no frontier), configuration, accuracy, stored bits per
    value, latency (blank: not measured) and the frontiers it is on; by method (the paper's order), then bits."""
    from evals.tables import method_key

    numbers = {id(p): i + 1 for i, p in enumerate(numbered_frontier(points, higher))}
    timed = [p for p in points if p["latency"] is not None]
    on_bits = {id(points[i]) for i in frontier([(p["bits"], p["accuracy"]) for p in points], higher)}
    on_time = {id(timed[i]) for i in frontier([(p["latency"], p["accuracy"]) for p in timed], higher)}
    body = []
    for p in sorted(points, key=lambda p: (method_key(p["label"]), p["bits"])):
        fronts = [name for name, ids in (("bits", on_bits), ("latency", on_time)) if id(p) in ids]
        latency = f"{p['latency']:.3g}" if p["latency"] is not None else None  # ms: 0.0524, 7.5 (3 digits)
        body.append([numbers.get(id(p)), p["label"], p["accuracy"], p["bits"], latency, ", ".join(fronts) or None])
    return ["#", "configuration", f"{metric} ({'higher' if higher else 'lower'} is better)", "bits / value",
            "latency", "Pareto frontier"], body


#: where a frontier point's number may go, nearest first: (distance in points, direction); the direction's y is
#: flipped to point first to the side of the frontier where no point can be (below it where lower is better);
#: a number beyond the ring gets a thin leader line to its point
_LABEL_OFFSETS = [(r, d) for r in (9, 15, 24, 34, 46)
                  for d in ((0.6, 1), (-0.6, 1), (0, 1.2), (1.2, 0.3), (-1.2, 0.3), (1, -0.8), (-1, -0.8), (0, -1.2))]
#: the ring around a frontier point (scatter size, points squared) and a marker's half width (points)
_RING, _MARKER = 110, 3.5


def _overlaps(box, boxes) -> int:
    return sum(box.overlaps(other) for other in boxes)


def _place_numbers(ax, points: list[tuple[float, float]], numbers: list[int], others: list[tuple[float, float]],
                   avoid: list, higher: bool) -> list:
    """Write each number beside its (ringed) point where its box overlaps no number written before, no ring, no
    marker of ``others`` and nothing in ``avoid`` (tick labels), within the axes; where every place collides, the
    least crowded one. Call with the axes' layout and limits final; returns the numbers' boxes (display units)."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    pixels = fig.dpi / 72
    ring = (_RING ** 0.5) / 2 * pixels

    def square(x, y, half):
        return Bbox.from_extents(x - half, y - half, x + half, y + half)

    rings = [square(*ax.transData.transform(p), ring) for p in points]
    markers = [square(*ax.transData.transform(p), _MARKER * pixels) for p in others]
    placed = []
    for (x, y), number in zip(points, numbers):
        best = None
        for r, (ux, uy) in _LABEL_OFFSETS:
            dx, dy, far = r * ux, r * uy * (1 if higher else -1), r > 9
            text = ax.annotate(str(number), (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=7,
                               fontweight="bold", ha="center", va="center", zorder=6,
                               arrowprops=dict(arrowstyle="-", lw=0.5, color="0.35", shrinkA=0,
                                               shrinkB=ring / pixels) if far else None)
            text.update_positions(renderer)
            box = Text.get_window_extent(text, renderer).expanded(1.15, 1.15)  # the number alone, not its line
            inside = ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1)
            cost = (10 * _overlaps(box, placed + avoid) + 3 * _overlaps(box, rings) + _overlaps(box, markers)
                    + 10 * (not inside) + 0.02 * r)
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, text, box)
            else:
                text.remove()
            if cost <= 0.02 * r:  # nothing in the way
                break
        placed.append(best[2])
    return placed


def _panel(ax, points: list[dict], x_key: str, higher: bool) -> list[int]:
    """Every point of ``points`` (x: ``x_key``, y: accuracy), coloured and marked by method; the Pareto frontier as
    a step line through ringed points; returns the frontier's indices into ``points``."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for method in dict.fromkeys(p["method"] for p in points):
        mine = [p for p in points if p["method"] == method]
        colour, marker = method_style(method)
        ax.scatter([p[x_key] for p in mine], [p["accuracy"] for p in mine], color=colour, marker=marker,
                   s=70 if marker == "*" else 26, alpha=0.85, zorder=3, linewidths=0)
    best = frontier([(p[x_key], p["accuracy"]) for p in points], higher)
    xs, ys = [points[i][x_key] for i in best], [points[i]["accuracy"] for i in best]
    ax.step(xs, ys, where="post", color="black", lw=0.9, ls="--", zorder=2)
    ax.scatter(xs, ys, s=110, facecolors="none", edgecolors="black", lw=1.0, zorder=4)
    values = [p["accuracy"] for p in points]
    if min(values) > 0 and max(values) / min(values) >= 20:  # perplexity of 1-bit caches: orders of magnitude
        ax.set_yscale("log")
        if max(values) / min(values) < 300:  # two decades or less: 1-2-5 ticks, else one a decade
            ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both" if ax.get_yscale() == "log" else "major")
    # room for the frontier's numbers on the side where no point can be (past the frontier): 15% more height
    scale = ax.yaxis.get_transform()
    low, high = scale.transform(np.array(ax.get_ylim()))
    pad = 0.15 * (high - low)
    ax.set_ylim(*scale.inverted().transform(np.array([low, high + pad] if higher else [low - pad, high])))
    return best


def pareto_figure(title: str, metric: str, higher: bool, points: list[dict], bits_label: str,
                  latency_label: str):
    """The figure of :func:`plot`, returned open for the caller to save and close."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    timed = [p for p in points if p["latency"] is not None]
    on_frontier = numbered_frontier(points, higher)
    numbers = {id(p): i + 1 for i, p in enumerate(on_frontier)}
    fig = plt.figure(figsize=(12, 4.6))
    left, right = fig.subplots(1, 2, gridspec_kw=dict(left=0.07, right=0.985, top=0.86, bottom=0.14, wspace=0.2))
    best_bits = _panel(left, points, "bits", higher)
    left.set_xscale("log", base=2)
    left.xaxis.set_major_locator(FixedLocator([1, 1.5, 2, 3, 4, 6, 8, 16]))
    left.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    left.xaxis.set_minor_formatter(NullFormatter())
    left.set_xlabel(bits_label, fontsize=8)
    left.set_ylabel(f"{metric} ({'higher' if higher else 'lower'} is better)", fontsize=9)
    left.set_title(f"every configuration ({len(points)}): {metric} against stored bits per value", fontsize=9)
    best_time = []
    if timed:
        best_time = _panel(right, timed, "latency", higher)
        right.set_xlabel(textwrap.fill(latency_label, 100), fontsize=8)
        right.set_title(f"the {len(timed)} configurations with a latency benchmark: {metric} against decode latency",
                        fontsize=9)
    else:
        right.set_title("no latency benchmark of this model", fontsize=9)
        right.text(0.5, 0.5, "no latency measurement for this model\n(results/efficiency: user_path.csv, "
                   "kernel.csv)", ha="center", va="center", fontsize=9, transform=right.transAxes)
        right.set_xticks([])
        right.set_yticks([])
    fig.suptitle(textwrap.fill(title, 150), fontsize=11)
    fig.canvas.draw()  # the panels' layout and limits are final: the numbers go where they collide with nothing
    renderer = fig.canvas.get_renderer()
    avoid = [label.get_window_extent(renderer) for ax in (left, right)
             for label in ax.get_xticklabels() + ax.get_yticklabels() if label.get_text()]
    for ax, shown, best, key in ((left, points, best_bits, "bits"), (right, timed, best_time, "latency")):
        _place_numbers(ax, [(shown[i][key], shown[i]["accuracy"]) for i in best],
                       [numbers[id(shown[i])] for i in best], [(p[key], p["accuracy"]) for p in shown], avoid, higher)
    # under the panels: the legend, then the frontier's numbers named, in as many columns as their width allows
    below = fig.transFigure.inverted().transform(
        (0, min(ax.get_tightbbox(renderer).y0 for ax in (left, right))))[1] - 0.02
    methods = list(dict.fromkeys(p["method"] for p in points))
    handles = [Line2D([], [], color=method_style(m)[0], marker=method_style(m)[1], ls="", markersize=7,
                      label=f"{m} ({sum(p['method'] == m for p in points)})") for m in methods]
    handles.append(Line2D([], [], color="black", ls="--", lw=0.9, marker="o", markerfacecolor="none",
                          markersize=9, label="Pareto frontier (numbered: below)"))
    legend = fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, below), ncol=len(handles),
                        fontsize=8, frameon=False, columnspacing=1.2, handletextpad=0.3)
    fig.canvas.draw()
    top = fig.transFigure.inverted().transform((0, legend.get_window_extent(renderer).y0))[1] - 0.01
    widest = max(len(p["label"]) for p in on_frontier) + 4
    columns = max(1, min(4, 150 // widest))
    line = 0.16 / fig.get_figheight()
    for i, p in enumerate(on_frontier):
        fig.text(0.07 + 0.915 / columns * (i % columns), top - line * (i // columns), f"{i + 1}  {p['label']}",
                 fontsize=8, va="top")
    return fig


def plot(title: str, metric: str, higher: bool, points: list[dict], bits_label: str, latency_label: str,
         path: Path) -> Path:
    """Two panels of ``points`` (dicts with method, label, accuracy, bits, latency: None where not measured;
    ``higher``: higher accuracy is better): accuracy against stored bits per value (every configuration, x on a
    log2 axis) and against decode latency (the configurations a benchmark ran); a log y axis where the accuracy spans
    more than a factor of 20 (perplexities of 1-bit caches). Each method has its colour and marker (the legend, with
    its number of configurations); each panel's Pareto frontier is a dashed step line through ringed points, numbered
    beside them where no other number, marker or tick label is, and the numbers are named under the legend (one
    number per configuration across both panels). Every point's values are in the table that :func:`build`
    writes beside the figure, not on it."""
    import matplotlib.pyplot as plt

    fig = pareto_figure(title, metric, higher, points, bits_label, latency_label)
    save_figure(fig, path, dpi=120, bbox_inches="tight", pad_inches=0.15, metadata={"Software": None})
    plt.close(fig)
    return path


def figure_points(rows: list[dict]) -> dict[tuple[str, str], tuple[str, bool, str, list[dict]]]:
    """(model, task) -> (metric column, higher is better, task setting, [method, label, config, accuracy]) of the
    task's first headline metric, in the task setting with the most methods, then the most configurations; labels
    name the hyperparameters that differ from each method's defaults (:func:`short_label`)."""
    # (model, task, setting, basis, subset, metric) -> config -> row: values over other grids or sample counts
    # (evals.tables.basis) are not points of one figure
    chosen: dict[tuple, dict[str, dict]] = defaultdict(dict)
    every = merged(rows)
    words = basis_words(every)
    for r in every:
        wanted = headline(r["task"])
        if not wanted:
            continue
        subset, metric = wanted[0].subset, wanted[0].metric
        if r["metric"] == metric and (subset is None or r["subset"] == subset):
            chosen[(r["model"], r["task"], task_setting(r), basis(r)[1], r["subset"], metric)][r["config"]] = r
    size = lambda k: (-len({r["method"] for r in chosen[k].values()}), -len(chosen[k]))  # noqa: E731
    out = {}
    for key in sorted(chosen, key=lambda k: (k[0], k[1], *size(k), k[2], k[3], k[4])):
        model, task, setting, identity, subset, metric = key
        if (model, task) in out:
            continue
        points = [dict(method=r["method"], label=_point_label(r), config=r.get("config") or "{}",
                       accuracy=float(r["value"])) for r in sorted(labelled(list(chosen[key].values())),
                                                                     key=lambda r: r["label"])]
        column = f"{column_name(task, subset, metric)} ({words[identity]})"
        out[(model, task)] = (column, headline(task)[0].higher_is_better, setting, points)
    return out


def _point_label(row: dict) -> str:
    """:func:`short_label` of the row's config; its table label where the config names no method this code has."""
    try:
        return short_label(json.loads(row.get("config") or "{}"))
    except (ValueError, KeyError, TypeError):
        return row["label"]


def measured_points(rows: list[dict], efficiency: Path) -> dict[tuple[str, str], tuple[str, bool, str, list[dict]]]:
    """:func:`figure_points` with each point's ``bits`` (:func:`stored_bits` at the model's attention shape) and
    ``latency`` (None where no benchmark ran it); a configuration no method builds from is left out, with a
    warning."""
    out = {}
    figures = figure_points(rows)
    bar = tqdm(total=sum(len(points) for *_, points in figures.values()), desc="make tables: Pareto points",
               unit="point", leave=False)
    for (model, task), (metric, higher, setting, points) in figures.items():
        table, _ = latencies(model, efficiency)
        kept = []
        for p in points:
            bar.update()
            config = json.loads(p["config"])
            try:
                p["bits"] = stored_bits(json.dumps(config, sort_keys=True), model)
            except (ValueError, TypeError, RuntimeError, KeyError, OSError) as e:  # no method builds from it here
                log.warning("pareto %s / %s: %s left out, its config does not build a method (%s)", model, task,
                            p["label"], e)
                continue
            p["latency"] = latency_of(config, table)
            kept.append(p)
        if kept:
            out[(model, task)] = (metric, higher, setting, kept)
    bar.close()
    return out


def build(rows: list[dict], figures: Path, efficiency: Path) -> list[Path]:
    """Write pareto_<model>_<task>.png under ``figures`` for every model and headline task, and beside it, under
    ``figures/../tables``, pareto_<model>_<task>.md/.tex with every point's values (:func:`point_table`); returns the
    files."""
    from oscar.models import model_attention

    written = []
    for (model, task), (metric, higher, setting, points) in measured_points(rows, efficiency).items():
        _, latency_label = latencies(model, efficiency)
        shape = model_attention(model)
        heads = f"{shape['kv_heads']} KV head{'s' if shape['kv_heads'] > 1 else ''}"
        bits_label = (f"stored bits per value (packed K and V of {PROBE_TOKENS} tokens at {model}'s "
                      f"{heads} x {shape['head_dim']})")
        figures.mkdir(parents=True, exist_ok=True)
        title = f"{model} / {describe_setting(task, setting)}: {metric} against stored bits and decode latency"
        name = f"pareto_{slug(model)}_{task}"
        written.append(plot(title, metric, higher, points, bits_label, latency_label, figures / f"{name}.png"))
        header, body = point_table(metric, higher, points)
        written += write_table(figures.parent, name, header, body,
                               f"{title}: every configuration of results/figures/{name}.png (#: its number on the "
                               f"figure's Pareto frontiers; bits: {bits_label}; latency: {latency_label or 'none'})")
        log.info("wrote %s (%d configurations, %d with a latency)", written[-1], len(points),
                 sum(p["latency"] is not None for p in points))
    return written
