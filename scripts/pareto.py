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

import torch
from tqdm import tqdm

from benchmarks.report import decode_latencies as latencies
from evals.tables import (basis, basis_words, column_name, describe_setting, headline, labelled, merged, slug,
                          task_setting)
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


def _panel(ax, points: list[tuple[float, float]], labels: list[str], higher_is_better: bool) -> None:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ax.scatter(xs, ys, s=22, zorder=3)
    for x, y, label in zip(xs, ys, labels):
        ax.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    best = frontier(points, higher_is_better)
    ax.step([points[i][0] for i in best], [points[i][1] for i in best], where="post", color="C3", lw=1.2,
            label="Pareto frontier", zorder=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def plot(title: str, metric: str, higher: bool, points: list[dict], bits_label: str, latency_label: str,
         path: Path) -> Path:
    """points: dicts with label, accuracy, bits, latency (None: not measured); ``higher``: higher is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    _panel(left, [(p["bits"], p["accuracy"]) for p in points], [p["label"] for p in points], higher)
    left.set_xlabel(bits_label, fontsize=8)
    left.set_ylabel(f"{metric} ({'higher' if higher else 'lower'} is better)")
    timed = [p for p in points if p["latency"] is not None]
    if timed:
        _panel(right, [(p["latency"], p["accuracy"]) for p in timed], [p["label"] for p in timed], higher)
        right.set_xlabel(textwrap.fill(latency_label, 75), fontsize=8)
    else:
        right.text(0.5, 0.5, "no latency measurement for this model\n(results/efficiency: user_path.csv, "
                   "kernel.csv)", ha="center", va="center", fontsize=9, transform=right.transAxes)
        right.set_xticks([])
        right.set_yticks([])
    untimed = [p["label"] for p in points if p["latency"] is None]
    if timed and untimed:
        fig.text(0.5, 0.01, "no latency measurement (bits panel only): " + ", ".join(untimed), ha="center",
                 fontsize=7, wrap=True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 if timed and untimed else 0, 1, 1))
    save_figure(fig, path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path


def figure_points(rows: list[dict]) -> dict[tuple[str, str], tuple[str, bool, str, list[dict]]]:
    """(model, task) -> (metric column, higher is better, task setting, [method, label, config, accuracy]) of the
    task's first headline metric, in the task setting with the most methods, then the most configurations; labels
    name what differs between the figure's configurations."""
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
        points = [dict(method=r["method"], label=r["label"], config=r["config"], accuracy=float(r["value"]))
                  for r in sorted(labelled(list(chosen[key].values())), key=lambda r: r["label"])]
        column = f"{column_name(task, subset, metric)} ({words[identity]})"
        out[(model, task)] = (column, headline(task)[0].higher_is_better, setting, points)
    return out


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
    """Write pareto_<model>_<task>.png under ``figures`` for every model and headline task; returns the files."""
    from oscar.models import model_attention

    written = []
    for (model, task), (metric, higher, setting, points) in measured_points(rows, efficiency).items():
        _, latency_label = latencies(model, efficiency)
        shape = model_attention(model)
        heads = f"{shape['kv_heads']} KV head{'s' if shape['kv_heads'] > 1 else ''}"
        bits_label = (f"stored bits per value (packed K and V of {PROBE_TOKENS} tokens at {model}'s "
                      f"{heads} x {shape['head_dim']})")
        figures.mkdir(parents=True, exist_ok=True)
        title = f"{model} / {describe_setting(task, setting)}: accuracy vs stored bits and latency"
        written.append(plot(title, metric, higher, points, bits_label, latency_label,
                            figures / f"pareto_{slug(model)}_{task}.png"))
        log.info("wrote %s (%d configurations, %d with a latency)", written[-1], len(points),
                 sum(p["latency"] is not None for p in points))
    return written
