"""Efficiency tables and figures from the GPU benchmark CSVs (results/efficiency/), for ``make tables``.

    python scripts/efficiency_figures.py [--dir results/efficiency]

Reads kernel_decode.csv, kernel_quant.csv (scripts/bench_kernels.py), kernel_methods*.csv
(scripts/bench_kernel_methods.py), e2e.csv (scripts/bench_e2e.py), generate.csv, generate_methods.csv (--methods)
and eval_throughput.csv (scripts/bench_generate.py), multi_gpu.csv (scripts/bench_multi_gpu.py), user_path*.csv
(scripts/bench_user_path.py), long_context.csv (scripts/bench_long_context.py); writes tables.md
(kernel, per-method kernel, end-to-end, generate (every method on the kernels against fp16 and OScaR: ratios only
within one run's file), multi-GPU and evaluation-throughput tables, targets beside the measurements),
figure_latency.png (decode attention time vs context: BF16 SDPA, the INT2 kernel, the INT2 byte floor),
figure_methods.png (2-bit decode attention per method vs context) and figure_throughput.png (end-to-end tokens/s vs
batch, per model and context), figure_long_context.png (decode ms/token and KV GiB against context, fp16 ending
where it no longer fits), figure_user_path.png (user_path.csv's prefill and decode against fp16, per method and
shape). Missing CSVs are skipped.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from pathlib import Path

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

if __package__ in (None, ""):  # `python scripts/efficiency_figures.py`
    sys.path.insert(0, str(REPO_ROOT))

from evals.tables import markdown

log = logging.getLogger("efficiency_figures")

#: the issue's targets (paper: decode 3.0x, KV memory 5.3x, throughput 4.1x vs BF16 at 128K)
TARGETS = dict(floor_frac=0.80, kernel_speedup=4.0, kernel_speedup_b1=3.0, quant_copy_frac=0.70,
               decode_speedup=3.0, kv_memory=5.3, throughput=4.1)
#: the decode engine's targets (through generate): graph generate within 15% of the graph step; OScaR (cupy)
#: vs fp16 >= 1.3x at batch 1 / 128K, >= 2.2x at BF16's largest batch, >= 3.4x throughput; accuracy runs
#: (torch + mirror, graph) <= 1.2x fp16's time per token
GENERATE_TARGETS = dict(loop_overhead=1.15, speedup_b1=1.3, speedup_bmax=2.2, throughput=3.4, mirror_vs_fp16=1.2)
#: the baseline kernels' targets: each method >= 60% of its own byte floor (batch >= 8, context >= 32K); OScaR's
#: decode at most 10% slower than KIVI's at equal bits
METHOD_TARGETS = dict(floor_frac=0.60, oscar_vs_kivi=1.1)


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _num(value: str):
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() and "." not in value else number


def _ctx(tokens: int) -> str:
    return f"{tokens // 1024}K"


def kernel_table(rows: list[dict]) -> str:
    header = ["batch", "context", "SDPA BF16 ms", "SDPA GB/s", "INT2 kernel ms", "INT2 floor ms", "% of floor",
              "speedup", "loads-only ms", "no-V ms"]
    body = [[r["batch"], _ctx(r["context"]), f"{r['sdpa_ms']:.3f}", f"{r['sdpa_bytes'] / r['sdpa_ms'] / 1e6:.0f}",
             f"{r['int2_ms']:.3f}", f"{r['int2_floor_ms']:.3f}", f"{100 * r['int2_floor_frac']:.0f}",
             f"{r['speedup']:.2f}x", f"{r['int2_loads_only_ms']:.3f}", f"{r['int2_no_values_ms']:.3f}"] for r in rows]
    return markdown(header, body)


def quant_table(rows: list[dict]) -> str:
    header = ["kernel", "batch", "tokens", "ms", "GB/s", "% of copy"]
    body = [[r["kernel"], r["batch"], r["tokens"], f"{r['ms']:.3f}", f"{r['gbs']:.0f}", f"{100 * r['copy_frac']:.0f}"]
            for r in rows]
    return markdown(header, body)


def method_kernel_tables(rows: list[dict], stages: list[dict], quant: list[dict]) -> str:
    """kernel_methods*.csv (scripts/bench_kernel_methods.py): decode attention per method and bits against BF16 SDPA
    and the method's own byte floor; the stage variants (the full kernel, its loads alone, keys only) that say
    whether loads or arithmetic bound it; the quantization kernels per method."""
    header = ["method", "bits", "batch", "context", "ms", "floor ms", "% of floor", "SDPA ms", "speedup",
              "stored bits / value", "OScaR / method time"]
    oscar = {(r["bits"], r["batch"], r["context"]): r["ms"] for r in rows if r["method"] == "oscar"}
    body = [[r["method"], r["bits"], r["batch"], _ctx(r["context"]), f"{r['ms']:.3f}", f"{r['floor_ms']:.3f}",
             f"{100 * r['pct_floor']:.0f}", f"{r['sdpa_ms']:.3f}", f"{r['speedup']:.2f}x", f"{r['bits_per_value']:.2f}",
             f"{oscar[r['bits'], r['batch'], r['context']] / r['ms']:.2f}"
             if (r["bits"], r["batch"], r["context"]) in oscar else "–"] for r in rows]
    sheader = ["method", "batch", "context", "kernel ms", "loads only ms", "keys only ms", "floor ms",
               "loads / floor", "arithmetic over the loads"]
    sbody = [[r["method"], r["batch"], _ctx(r["context"]), f"{r['ms']:.3f}", f"{r['loads_only_ms']:.3f}",
              f"{r['no_values_ms']:.3f}", f"{r['floor_ms']:.3f}", f"{r['loads_only_ms'] / r['floor_ms']:.2f}",
              f"{100 * (r['ms'] / r['loads_only_ms'] - 1):.0f}%"] for r in stages]
    t = METHOD_TARGETS
    text = (markdown(header, body) + f"\n\nTargets: every method >= {100 * t['floor_frac']:.0f}% of its own byte "
            f"floor at batch >= 8, context >= 32K; OScaR at most {t['oscar_vs_kivi']}x KIVI's time at equal bits "
            "(OScaR / method time >= 1 / that).")
    if stages:
        text += "\n\n### Where the time goes (stage variants)\n\n" + markdown(sheader, sbody)
    if quant:
        text += "\n\n### Quantization kernels per method\n\n" + markdown(
            ["method", "role", "batch", "tokens", "ms", "GB/s", "% of copy"],
            [[r["method"], r["role"], r["batch"], r["tokens"], f"{r['ms']:.4f}", f"{r['gbs']:.0f}",
              f"{100 * r['copy_frac']:.0f}"] for r in quant])
    return text


def e2e_summary(rows: list[dict]) -> list[dict]:
    """Per (model, context): the ratios the paper reports, from eager and CUDA-graph timings."""
    cells = {(r["model"], r["context"], r["method"], r["cell"]): r for r in rows}
    out = []
    for model, context in sorted({(r["model"], r["context"]) for r in rows}):
        get = lambda method, cell: cells.get((model, context, method, cell))  # noqa: E731
        b1, o1 = get("bf16", "batch1"), get("oscar_int2", "batch1")
        btop, osame, otop = get("bf16", "max_batch"), get("oscar_int2", "bf16_max_batch"), get("oscar_int2", "max_batch")
        if not all((b1, o1, btop, osame, otop)):
            continue
        out.append(dict(model=model, context=context, bf16_max_batch=btop["batch"], int2_max_batch=otop["batch"],
                        kv_memory=b1["kv_bytes"] / o1["kv_bytes"],
                        speedup_b1=b1["gpu_ms_per_token"] / o1["gpu_ms_per_token"],
                        speedup_bmax=btop["gpu_ms_per_token"] / osame["gpu_ms_per_token"],
                        throughput=otop["gpu_tokens_per_s"] / btop["gpu_tokens_per_s"],
                        speedup_b1_eager=b1["ms_per_token"] / o1["ms_per_token"],
                        speedup_bmax_eager=btop["ms_per_token"] / osame["ms_per_token"],
                        throughput_eager=otop["tokens_per_s"] / btop["tokens_per_s"]))
    return out


def e2e_tables(rows: list[dict]) -> str:
    header = ["model", "context", "method", "cell", "batch", "ms/token (graph)", "tok/s (graph)", "ms/token (eager)",
              "tok/s (eager)", "KV GiB", "peak GiB", "attention"]
    body = [[r["model"], _ctx(r["context"]), r["method"], r["cell"], r["batch"], f"{r['gpu_ms_per_token']:.2f}",
             f"{r['gpu_tokens_per_s']:.1f}", f"{r['ms_per_token']:.2f}", f"{r['tokens_per_s']:.1f}",
             f"{r['kv_bytes'] / 2**30:.2f}", f"{r['peak_gib']:.1f}", r.get("attention") or "–"] for r in rows]
    summary = e2e_summary(rows)
    sheader = ["model", "context", "KV memory", "decode speedup B=1", "decode speedup at BF16's max batch",
               "throughput at max batch", "(eager: B=1 / max batch / throughput)", "max batch BF16 / INT2"]
    sbody = [[s["model"], _ctx(s["context"]), f"{s['kv_memory']:.2f}x", f"{s['speedup_b1']:.2f}x",
              f"{s['speedup_bmax']:.2f}x", f"{s['throughput']:.2f}x",
              f"{s['speedup_b1_eager']:.2f}x / {s['speedup_bmax_eager']:.2f}x / {s['throughput_eager']:.2f}x",
              f"{s['bf16_max_batch']} / {s['int2_max_batch']}"] for s in summary]
    return (markdown(sheader, sbody) + f"\n\nTargets (paper, 128K): decode {TARGETS['decode_speedup']}x, KV memory "
            f"{TARGETS['kv_memory']}x, throughput {TARGETS['throughput']}x.\n\n" + markdown(header, body))


def generate_rows_table(rows: list[dict]) -> str:
    """generate.csv rows: one line per measured cell."""
    def label(r: dict) -> str:
        return r["method"] if r["method"] in ("fp16", "hf_static") else f"{r['method']} ({r['backend']})"

    header = ["model", "context", "cell", "batch", "configuration", "decode", "ms/token", "tok/s", "graph step ms",
              "loop / step", "KV GiB", "allocated GiB"]
    body = []
    for r in rows:
        step = r.get("step_ms")
        has_step = isinstance(step, float) and step == step
        kv = r.get("kv_bytes")
        body.append([r["model"], _ctx(r["context"]), r["cell"], r["batch"], label(r), r["decode"],
                     f"{r['ms_per_token']:.2f}", f"{r['tokens_per_s']:.1f}", f"{step:.2f}" if has_step else "–",
                     f"{r['ms_per_token'] / step:.2f}" if has_step else "–",
                     f"{kv / 2**30:.2f}" if isinstance(kv, (int, float)) and kv == kv else "–",
                     f"{r['allocated_bytes'] / 2**30:.2f}" if r.get("allocated_bytes") not in (None, "") else "–"])
    return markdown(header, body)


def generate_tables(rows: list[dict]) -> str:
    """generate.csv: per (model, context) the ratios against fp16 through the engine, then every row."""
    cells = {(r["model"], r["context"], r["cell"], r["method"], r["backend"], r["decode"]): r for r in rows}
    summary = []
    for model, context in sorted({(r["model"], r["context"]) for r in rows}):
        get = lambda cell, method, backend, mode="graph": cells.get((model, context, cell, method, backend, mode))  # noqa: E731
        f1, o1, m1 = get("batch1", "fp16", "torch"), get("batch1", "oscar", "cupy"), get("batch1", "oscar", "torch")
        ftop, otop = get("max_batch", "fp16", "torch"), get("max_batch", "oscar", "cupy")
        osame = get("bf16_max_batch", "oscar", "cupy")
        hf = get("batch1", "hf_static", "transformers", "torch.compile")

        def ratio(a, b, key="ms_per_token"):
            return f"{a[key] / b[key]:.2f}x" if a and b else "–"

        graphs = [r for r in (f1, o1, m1) if r]
        loop = f"{max(r['ms_per_token'] / r['step_ms'] for r in graphs):.2f}" if graphs else "–"
        summary.append([model, _ctx(context), ratio(f1, o1),
                        ratio(ftop, osame) + (f" (B={ftop['batch']})" if ftop else ""),
                        ratio(otop, ftop, "tokens_per_s") + (f" ({otop['batch']} vs {ftop['batch']})"
                                                              if otop and ftop else ""),
                        ratio(m1, f1), ratio(hf, f1), loop])
    sheader = ["model", "context", "OScaR vs fp16, B=1", "at BF16's largest batch", "throughput, each at its largest",
               "mirror (oscar, torch) / fp16 time", "hf_static / fp16 time, B=1", "worst loop / step, B=1"]
    t = GENERATE_TARGETS
    return (markdown(sheader, summary) + f"\n\nTargets: OScaR vs fp16 >= {t['speedup_b1']}x at batch 1 / 128K, >= "
            f"{t['speedup_bmax']}x at BF16's largest batch, throughput >= {t['throughput']}x; the mirror path <= "
            f"{t['mirror_vs_fp16']}x fp16's time; the generate loop within {t['loop_overhead']}x of the graph step. "
            "Ratios of ms/token, graph decode.\n\n" + generate_rows_table(rows))


def kernel_methods_summary(rows: list[dict]) -> str:
    """generate.csv: per (model, context) every method on the kernels (backend=cupy) against fp16 through the engine
    (graph decode): KV memory and time per token at batch 1, at BF16's largest batch, throughput each at its largest;
    and OScaR's time per token over the method's (below 1: OScaR faster)."""
    cells = {(r["model"], r["context"], r["cell"], r["method"], r["backend"]): r
             for r in rows if r["decode"] == "graph"}
    order = ["oscar", "kivi", "quarot", "turboquant"]
    methods = sorted({r["method"] for r in rows if r["backend"] == "cupy" and r["method"] != "fp16"},
                     key=lambda m: (order.index(m) if m in order else len(order), m))

    def ratio(a, b, key="ms_per_token"):
        return f"{a[key] / b[key]:.2f}x" if a and b else "–"

    body = []
    for model, context in sorted({(r["model"], r["context"]) for r in rows}):
        get = lambda cell, method, backend="cupy": cells.get((model, context, cell, method, backend))  # noqa: E731
        f1, ftop = get("batch1", "fp16", "torch"), get("max_batch", "fp16", "torch")
        o1, osame = get("batch1", "oscar"), get("bf16_max_batch", "oscar")
        for method in methods:
            m1, msame, mtop = get("batch1", method), get("bf16_max_batch", method), get("max_batch", method)
            if not (m1 or msame or mtop):
                continue
            body.append([model, _ctx(context), method, ratio(f1, m1, "kv_bytes"), ratio(f1, m1), ratio(ftop, msame),
                         ratio(mtop, ftop, "tokens_per_s") + (f" ({mtop['batch']} vs {ftop['batch']})"
                                                               if mtop and ftop else ""),
                         ratio(o1, m1), ratio(osame, msame)])
    header = ["model", "context", "method (cupy)", "KV memory: fp16 / method", "speedup vs fp16, B=1",
              "at BF16's largest batch", "throughput vs fp16, each at its largest", "OScaR / method time, B=1",
              "at BF16's largest batch"]
    return markdown(header, body)


def eval_table(rows: list[dict]) -> str:
    """eval_throughput.csv: seconds per LongBench-E-shaped sample, methods x (prompt length, batch); each ratio
    against fp16 of the same run (``log``), one line per method, backend and run."""
    columns = sorted({(r["prompt_tokens"], r["batch"]) for r in rows})
    runs = list(dict.fromkeys(r.get("log", "") for r in rows))
    configs = list(dict.fromkeys((r["method"], r["backend"], r.get("log", "")) for r in rows))
    cells = {(r["method"], r["backend"], r.get("log", ""), r["prompt_tokens"], r["batch"]): r["seconds_per_sample"]
             for r in rows}
    header = ["method (backend)"] + [f"{_ctx(t)} B={b}" for t, b in columns]
    body = []
    for method, backend, run in configs:
        line = [f"{method} ({backend})" + (f" [{run}]" if len(runs) > 1 else "")]
        for col in columns:
            v, fp16 = cells.get((method, backend, run, *col)), cells.get(("fp16", "torch", run, *col))
            line.append("–" if v is None else f"{v:.2f}" + (f" ({v / fp16:.2f}x)" if fp16 else ""))
        body.append(line)
    return markdown(header, body) + "\n\nSeconds per sample (prefill + 128 new tokens, EOS ignored), in parentheses " \
        "relative to fp16 in the same column and run; Qwen3-8B architecture, decode=graph."


def user_path_table(rows: list[dict]) -> str:
    """user_path.csv (scripts/bench_user_path.py): the prefill and decode rows of one run, ratios against fp16 of the
    same run (vs_fp16 > 1: faster than fp16; for hf_forward, the engine's whole-prompt fp16 prefill against it)."""
    header = ["part", "method (backend)", "B x context", "chunk", "seconds / ms per token", "vs fp16", "peak GiB"]
    body = []
    for r in rows:
        value = r["seconds"] if r["part"] in ("prefill", "hf_forward", "attention_kernel") else r["ms_per_token"]
        unit = "ms" if r["part"] == "decode" else "s"
        ratio = r.get("vs_fp16")
        body.append([r["part"], f"{r['method']} ({r['backend']})", f"{r['batch']} x {_ctx(r['context'])}",
                     r["chunk"] or "whole", f"{value:.2f} {unit}",
                     "–" if not isinstance(ratio, float) or ratio != ratio else f"{ratio:.2f}x",
                     "–" if not isinstance(r.get("peak_gib"), float) else f"{r['peak_gib']:.1f}"])
    return markdown(header, body)


def user_path_figure(rows: list[dict], path: Path) -> None:
    """user_path.csv as bars of vs_fp16 (fp16's time over the method's, same run and shape: > 1 is faster), one
    group per method and backend, one bar per shape: the chunked prefill (left) and the decode step (right), with
    issue 22's targets (prefill within 1.05x fp16's time, decode >= 1.2x its speed) as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), squeeze=False)
    panels = (("prefill", "chunked prefill", 1 / 1.05), ("decode", "decode, per token", 1.2))
    colors = {shape: f"C{i}" for i, shape in enumerate(sorted({(r["batch"], r["context"]) for r in rows}))}
    for ax, (part, title, target) in zip(axes[0], panels):
        sel = [r for r in rows if r["part"] == part and r["method"] != "fp16" and isinstance(r.get("vs_fp16"), float)
               and (part == "decode" or r["chunk"])]
        methods = list(dict.fromkeys(f"{r['method']} ({r['backend']})" for r in sel))
        shapes = sorted({(r["batch"], r["context"]) for r in sel})
        width = 0.8 / max(len(shapes), 1)
        for j, (batch, context) in enumerate(shapes):
            by = {f"{r['method']} ({r['backend']})": r["vs_fp16"] for r in sel
                  if (r["batch"], r["context"]) == (batch, context)}
            xs = [i + (j - (len(shapes) - 1) / 2) * width for i, m in enumerate(methods) if m in by]
            ax.bar(xs, [by[m] for m in methods if m in by], width, color=colors[batch, context],
                   label=f"{batch} x {_ctx(context)}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(target, color="gray", ls="--", lw=0.8, label="target")
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("fp16 time / method's time")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("The user path against fp16 of the same run (Llama-3.1-8B architecture, H200)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def long_context_table(rows: list[dict]) -> str:
    """long_context.csv (scripts/bench_long_context.py): decode per context (does-not-fit rows say so), the largest
    batches at one context and the real chunked prefill with its memory bound."""
    header = ["part", "method (backend)", "B x context", "ms/token", "attention ms", "rest ms", "KV GiB", "peak GiB",
              "notes"]
    body = []
    for r in rows:
        if r.get("fits") is False or r.get("fits") == "False":
            body.append([r["part"], f"{r['method']} ({r['backend']})", f"{r.get('batch', 1)} x {_ctx(r['context'])}",
                         "does not fit", "", "", "", "", ""])
            continue

        def num(key, fmt="{:.2f}"):
            return fmt.format(r[key]) if isinstance(r.get(key), (int, float)) else ""

        notes = ""
        if r["part"] == "prefill":
            notes = (f"{r['seconds']:.1f} s in chunks of {r['chunk']}; bound (weights + 2 x cache + 8 GiB) "
                     f"{r['bound_gib']:.1f} GiB")
        elif r["part"] == "max_batch":
            notes = f"{r['batch'] / r['ms_per_token'] * 1e3:.0f} tokens/s"
        body.append([r["part"], f"{r['method']} ({r['backend']})", f"{r['batch']} x {_ctx(r['context'])}",
                     num("ms_per_token"), num("attention_ms"), num("rest_ms"), num("kv_gib", "{:.1f}"),
                     num("peak_gib", "{:.1f}"), notes])
    return markdown(header, body)


def long_context_figure(rows: list[dict], path: Path) -> None:
    """Decode ms/token and KV GiB against context at batch 1, one line per method; fp16 ends where it no longer
    fits (marked x at the first context it does not)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if r["part"] == "decode"]
    models = list(dict.fromkeys(r["model"] for r in decode))
    fig, axes = plt.subplots(len(models), 2, figsize=(9, 3.4 * len(models)), squeeze=False)
    for (ax_time, ax_mem), model in zip(axes, models):
        for i, method in enumerate(dict.fromkeys(r["method"] for r in decode if r["model"] == model)):
            sel = sorted((r for r in decode if (r["model"], r["method"]) == (model, method)),
                         key=lambda r: r["context"])
            fit = [r for r in sel if r.get("fits") not in (False, "False")]
            for ax, key in ((ax_time, "ms_per_token"), (ax_mem, "kv_gib")):
                ax.plot([r["context"] for r in fit], [r[key] for r in fit], "o-", color=f"C{i}", label=method)
                for r in sel:
                    if r not in fit:
                        ax.plot([r["context"]], [fit[-1][key] if fit else 1], "x", color=f"C{i}", markersize=10)
        contexts = sorted({r["context"] for r in decode if r["model"] == model})
        for ax, label in ((ax_time, "decode ms per token (batch 1)"), (ax_mem, "KV cache GiB (stored bytes)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [_ctx(c) for c in contexts])
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"{model}: x = does not fit on one H200", fontsize=9)
            ax.grid(alpha=0.3)
        ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def multi_gpu_table(rows: list[dict]) -> str:
    """multi_gpu.csv: per (model, context) the ratios of OScaR (cupy) against fp16, then every row."""
    cells = {(r["model"], r["context"], r["cell"], r["method"]): r for r in rows}
    summary = []
    for model, context in sorted({(r["model"], r["context"]) for r in rows}):
        get = lambda cell, method: cells.get((model, context, cell, method))  # noqa: E731
        f1, o1, ftop, osame, otop = (get("batch1", "fp16"), get("batch1", "oscar"), get("max_batch", "fp16"),
                                     get("bf16_max_batch", "oscar"), get("max_batch", "oscar"))

        def ratio(a, b, key="ms_per_token"):
            return f"{a[key] / b[key]:.2f}x" if a and b and b[key] == b[key] and a[key] == a[key] else "–"

        any_row = next(r for r in rows if (r["model"], r["context"]) == (model, context))
        summary.append([model, _ctx(context), any_row["gpus"], any_row["layers_per_gpu"], any_row["weights_gib_per_gpu"],
                        ratio(f1, o1, "kv_bytes"), ratio(f1, o1), ratio(ftop, osame) + (f" (B={ftop['batch']})" if ftop
                                                                                         else ""),
                        ratio(otop, ftop, "tokens_per_s") + (f" ({otop['batch']} vs {ftop['batch']})" if otop and ftop
                                                             else "")])
    sheader = ["model", "context", "GPUs", "layers per GPU", "weights GiB per GPU", "KV memory fp16 / OScaR",
               "OScaR vs fp16, B=1", "at BF16's largest batch", "throughput, each at its largest"]
    header = ["model", "context", "cell", "configuration", "batch", "ms/token", "tok/s", "KV GiB", "KV GiB predicted",
              "peak GiB (fullest GPU)"]
    body = [[r["model"], _ctx(r["context"]), r["cell"], f"{r['method']} ({r['backend']})", r["batch"],
             f"{r['ms_per_token']:.2f}", f"{r['tokens_per_s']:.1f}",
             f"{r['kv_bytes'] / 2**30:.2f}" if r["kv_bytes"] == r["kv_bytes"] else "–",
             f"{r['kv_bytes_predicted'] / 2**30:.2f}", f"{r['peak_gib']:.1f}" if r["peak_gib"] == r["peak_gib"] else "–"]
            for r in rows]
    return (markdown(sheader, summary) + "\n\nRandom-weight architectures split over the GPUs by accelerate "
            "(device_map=balanced), decoded through the engine eagerly (a model over several GPUs is not captured as "
            "one CUDA graph); ratios of ms/token and tokens/s.\n\n" + markdown(header, body))


def latency_figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        sel = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        x = [r["context"] for r in sel]
        ax.plot(x, [r["sdpa_ms"] for r in sel], "o-", label="BF16 SDPA")
        ax.plot(x, [r["int2_ms"] for r in sel], "s-", label="OScaR INT2 kernel")
        ax.plot(x, [r["int2_loads_only_ms"] for r in sel], "x:", label="INT2 loads only")
        ax.plot(x, [r["int2_floor_ms"] for r in sel], "--", color="gray", label="INT2 byte floor")
        _context_panel(ax, batch, x)
    _save_context_figure(fig, axes, "Llama-3.1-8B attention shape (32 q / 8 KV heads, D=128), H200", path)


def _context_panel(ax, batch: int, contexts: list[int]) -> None:
    """Log-log axes of decode attention time against context, for one batch."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [_ctx(c) for c in contexts])
    ax.set_title(f"batch {batch}")
    ax.set_xlabel("context (tokens)")
    ax.grid(alpha=0.3)


def _save_context_figure(fig, axes, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    axes[0][0].set_ylabel("decode attention, ms per layer")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def methods_figure(rows: list[dict], path: Path) -> None:
    """Decode attention time per method (2 bits) against context, one panel per batch, BF16 SDPA beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    two_bit = [r for r in rows if r["bits"] == 2]
    batches = sorted({r["batch"] for r in two_bit})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for i, method in enumerate(dict.fromkeys(r["method"] for r in two_bit)):
            sel = sorted((r for r in two_bit if (r["batch"], r["method"]) == (batch, method)),
                         key=lambda r: r["context"])
            ax.plot([r["context"] for r in sel], [r["ms"] for r in sel], "o-", color=f"C{i}", label=method)
            if i == 0:
                x = [r["context"] for r in sel]
                ax.plot(x, [r["sdpa_ms"] for r in sel], "k--", label="BF16 SDPA")
        _context_panel(ax, batch, x)
    _save_context_figure(fig, axes, "2-bit decode attention per method, Llama-3.1-8B attention shape, H200", path)


def throughput_figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for i, context in enumerate(sorted({r["context"] for r in rows if r["model"] == model})):
            for method, style in (("bf16", "o--"), ("oscar_int2", "s-")):
                sel = sorted((r for r in rows if (r["model"], r["context"], r["method"]) == (model, context, method)),
                             key=lambda r: r["batch"])
                ax.plot([r["batch"] for r in sel], [r["gpu_tokens_per_s"] for r in sel], style, color=f"C{i}",
                        label=f"{'BF16' if method == 'bf16' else 'INT2'} {_ctx(context)}")
        ax.set_xscale("log")
        ax.set_xlabel("batch (1, BF16's largest, each method's largest)")
        ax.set_ylabel("decode tokens/s (CUDA graph)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def build(directory: Path = Path("results/efficiency")) -> list[Path]:
    """Write tables.md and the two figures from the CSVs in ``directory``; returns the files written."""
    (decode, quant, e2e, generate, generate_methods, evals, multi_gpu, methods, method_stages, method_quant,
     user_path, user_prefill, long_context) = (
        _read(directory / name) for name in (
            "kernel_decode.csv", "kernel_quant.csv", "e2e.csv", "generate.csv", "generate_methods.csv",
            "eval_throughput.csv", "multi_gpu.csv", "kernel_methods.csv", "kernel_methods_stages.csv",
            "kernel_methods_quant.csv", "user_path.csv", "user_path_prefill.csv", "long_context.csv"))
    written = []
    parts = ["# Efficiency (H200)\n"]
    if decode:
        parts.append(f"Measured copy bandwidth: {decode[0]['copy_gbs']:.0f} GB/s (read + write).\n")
        parts.append(f"## Decode attention (targets: >= {100 * TARGETS['floor_frac']:.0f}% of the INT2 floor, "
                     f">= {TARGETS['kernel_speedup']}x SDPA at batch >= 8 and context >= 32K; "
                     f">= {TARGETS['kernel_speedup_b1']}x at batch 1, 128K)\n\n" + kernel_table(decode) + "\n")
        latency_figure(decode, directory / "figure_latency.png")
        written.append(directory / "figure_latency.png")
    if quant:
        parts.append(f"## Quantization kernels (target for key preprocessing: >= "
                     f"{100 * TARGETS['quant_copy_frac']:.0f}% of copy bandwidth)\n\n" + quant_table(quant) + "\n")
    if methods:
        parts.append("## Decode attention per method (Llama-3.1-8B attention shape, scripts/bench_kernel_methods.py)"
                     "\n\n" + method_kernel_tables(methods, method_stages, method_quant) + "\n")
        methods_figure(methods, directory / "figure_methods.png")
        written.append(directory / "figure_methods.png")
    if e2e:
        parts.append("## End to end (random-weight 8B architectures, caches filled to the context)\n\n"
                     + e2e_tables(e2e) + "\n")
        throughput_figure(e2e, directory / "figure_throughput.png")
        written.append(directory / "figure_throughput.png")
    if generate:
        parts.append("## Through generate: the decode engine (random-weight 8B architectures, scripts/bench_generate.py)"
                     "\n\n" + generate_tables(generate) + "\n")
    if generate_methods:
        parts.append("### Every method on the kernels (generate_methods.csv: scripts/bench_generate.py --methods)\n\n"
                     + kernel_methods_summary(generate_methods) + "\n\n" + generate_rows_table(generate_methods)
                     + "\n")
    if evals:
        parts.append("## Evaluation throughput (LongBench-E-shaped samples through the engine)\n\n" + eval_table(evals)
                     + "\n")
    for table, title in ((user_path, "user_path.csv"), (user_prefill, "user_path_prefill.csv")):
        if table:
            parts.append(f"## The user path: real prefill, then decode ({title}: scripts/bench_user_path.py, "
                         "Llama-3.1-8B architecture)\n\n" + user_path_table(table) + "\n")
    if user_path:
        user_path_figure(user_path, directory / "figure_user_path.png")
        written.append(directory / "figure_user_path.png")
    if long_context:
        parts.append("## Past 128K on one GPU (long_context.csv: scripts/bench_long_context.py)\n\n"
                     + long_context_table(long_context) + "\n")
        long_context_figure(long_context, directory / "figure_long_context.png")
        written.append(directory / "figure_long_context.png")
    if multi_gpu:
        parts.append("## Models beyond one GPU (scripts/bench_multi_gpu.py)\n\n" + multi_gpu_table(multi_gpu) + "\n")
    if len(parts) > 1:
        (directory / "tables.md").write_text("\n".join(parts))
        written.append(directory / "tables.md")
    for path in written:
        log.info("wrote %s", path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("results/efficiency"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(args.dir)


if __name__ == "__main__":
    main()
