"""Past 128K on one GPU: decode at 128K-1M tokens where BF16 no longer fits, and a real chunked prefill at 256K.

Random-weight 8B architectures in bf16 (benchmarks.harness), their positions raised to what a context needs (RoPE
tables only: no shape or cost changes). Rows (``part``):

- ``decode``, batch 1, per context: fp16 (the static BF16 cache; ``fits`` = False where it does not) and each
  ``--methods`` method on ``--backend`` (default the kernels), through the engine's decode loop over a cache filled
  as a prefill would leave it (benchmarks.filled: a real prefill of 1M tokens costs many minutes and changes no decode
  cost): ``ms_per_token`` (wall clock), ``step_ms`` (GPU time of the replayed step), ``attention_ms`` (GPU time of
  every layer's decode attention over its own cache, the layers' calls captured in one CUDA graph as the step makes
  them: the part that grows with the context), ``rest_ms`` = step_ms - attention_ms, ``kv_gib`` (real stored bytes),
  ``peak_gib``;
- ``max_batch`` at ``--batch-context`` (256K): the largest batch of fp16 and of OScaR that fits;
- ``prefill``: one real chunked prefill of ``--prefill`` tokens through OScaR (``DecodeEngine._prefill``, chunks of
  ``--chunk``): ``seconds``, ``peak_gib``, ``kv_gib``, and ``bound_gib`` = weights + 2 x the cache's storage + 8 GiB
  (peak memory stays below it), ``weights_gib``.

``--model tiny-llama --backend torch`` with small contexts runs on a CPU (``--memory`` then sizes the largest batch).
"""

from __future__ import annotations

import logging

import torch

from benchmarks import filled
from benchmarks.harness import (Run, bench_method, build_model, captured_ms, method_name, model_device, model_name,
                                peak_gib, prepare_fresh, reset_peak, wall_seconds)

log = logging.getLogger("benchmarks.long_context")

KERNEL_METHODS = ["oscar", "kivi", "quarot", "turboquant", "ott", "rotatekv", "spectral"]
FIELDS = ["model", "part", "method", "backend", "batch", "context", "fits", "ms_per_token", "tokens_per_s",
          "step_ms", "attention_ms", "rest_ms", "kv_gib", "peak_gib", "seconds", "chunk", "weights_gib", "bound_gib"]


def add_arguments(p) -> None:
    p.add_argument("--models", type=model_name, nargs="+", default=["llama-3.1-8b", "qwen3-8b"])
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    p.add_argument("--methods", type=method_name, nargs="*", default=KERNEL_METHODS)
    p.add_argument("--backend", default="cupy", choices=["cupy", "torch"], help="the methods' backend")
    p.add_argument("--batch-context", type=int, default=262144, help="context of the max_batch rows (0: none)")
    p.add_argument("--prefill", type=int, default=262144, help="tokens of the real prefill (0: none)")
    p.add_argument("--chunk", type=int, default=16384)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--memory", type=float, default=None, help="GiB the largest batch's caches may take (a CPU)")
    p.set_defaults(budget=540.0)


def attention_ms(model, method_name: str, backend_name: str, context: int, replays: int = 10) -> float:
    """GPU time of one step's decode attention over a filled cache of ``context`` tokens: every layer attends its
    own cache (the bytes a step reads), the layers' calls captured in one CUDA graph as the step's are. (One layer
    timed eagerly and multiplied by the layers would count the host's launch gaps as attention.)"""
    from oscar.backend import build_backend
    from oscar.engine import DecodeEngine

    method, backend = bench_method(method_name, model), build_backend(backend_name)
    engine = DecodeEngine(model, method, backend, "auto")
    prepare_fresh(model, method)  # as KVModel does, on the weights as built
    backend.attach(model, method)
    slot = filled.fill(engine, 1, context, engine.capacity(context, 16))
    c = model.config
    device = model_device(model)
    query = torch.randn(1, c.num_attention_heads, 1, c.head_dim, device=device, dtype=next(model.parameters()).dtype)
    module = next(m for m in model.modules() if hasattr(m, "kv_method"))
    mask = slot.cache.decode_mask()

    def attend_every_layer() -> None:
        for layer in slot.cache.layers:
            layer.attend(module, query, mask, c.head_dim**-0.5)

    ms = captured_ms(attend_every_layer, device, replays)
    engine._slots.clear()
    reset_peak(device)
    return ms


def decode_row(model, method: str, backend: str, context: int, steps: int) -> dict:
    try:
        row = filled.decode_cell(model, method, backend, "auto", 1, context, steps)
    except torch.OutOfMemoryError:
        row = None
    if row is None:
        reset_peak(model_device(model))
        return dict(method=method, backend=backend, batch=1, fits=False)
    row.update(fits=True, kv_gib=row.pop("kv_bytes") / 2**30)
    row["attention_ms"] = attention_ms(model, method, backend, context)
    if "step_ms" in row:
        row["rest_ms"] = row["step_ms"] - row["attention_ms"]
    return row


def prefill_row(model, backend_name: str, context: int, chunk: int) -> dict:
    """One real prefill of ``context`` random tokens through OScaR in chunks of ``chunk``."""
    from oscar.backend import build_backend
    from oscar.engine import DecodeEngine

    method, backend = bench_method("oscar"), build_backend(backend_name)
    engine = DecodeEngine(model, method, backend, "auto", prefill_chunk=chunk)
    prepare_fresh(model, method)  # as KVModel does, on the weights as built
    backend.attach(model, method)
    device = model_device(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    warm = torch.randint(0, model.config.vocab_size, (1, 2 * chunk), device=device)
    engine.generate(warm, torch.ones_like(warm), 2, eos_token_ids=set())  # kernels compiled
    engine._slots.clear()
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    reset_peak(device)
    slot = engine._slot([0], engine.capacity(context, 16))
    seconds = wall_seconds(lambda: engine._prefill(ids, torch.ones_like(ids), slot.cache), device)
    row = dict(method="oscar", backend=backend_name, batch=1, context=context, chunk=chunk, seconds=seconds,
               peak_gib=peak_gib(device), kv_gib=slot.cache.nbytes / 2**30, weights_gib=weights / 2**30,
               bound_gib=(weights + 2 * slot.cache.allocated_bytes) / 2**30 + 8)
    engine._slots.clear()
    reset_peak(device)
    return row


def run(args, bench: Run) -> None:
    memory = None if args.memory is None else args.memory * 2**30
    for name in args.models:
        model = build_model(name, positions=max(args.contexts + [args.prefill]) + 4096)

        def add(row: dict, **where) -> None:
            row = bench.add(dict(model=name, **where, **row))
            log.info("%s", {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()
                            if k not in ("question", "gpu", "date", "code_version", "arguments")})

        for context in args.contexts:
            for method, backend in [("fp16", "torch")] + [(m, args.backend) for m in args.methods]:
                if bench.budget.allows(f"{name} {method} decode {context}"):
                    add(decode_row(model, method, backend, context, args.steps), part="decode", context=context)
        first = name == args.models[0]
        if first and args.prefill and bench.budget.allows(f"{name} prefill {args.prefill}"):
            add(prefill_row(model, args.backend, args.prefill, args.chunk), part="prefill")
        for method, backend in (("fp16", "torch"), ("oscar", args.backend)):
            if first and args.batch_context and bench.budget.allows(f"{name} {method} max batch"):
                try:
                    row = filled.largest_batch(model, method, backend, args.batch_context, args.steps, memory, "auto")
                except RuntimeError:  # not even batch 1 fits
                    add(dict(method=method, backend=backend, fits=False), part="max_batch", context=args.batch_context)
                    continue
                row.update(fits=True, kv_gib=row.pop("kv_bytes") / 2**30)
                add(row, part="max_batch", context=args.batch_context)
        del model
        reset_peak(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


# ----------------------------------------------------------------------------- the README's table and the figure


def table(rows: list[dict]) -> str:
    """Decode per context (rows that did not fit say so), the largest batches, the real chunked prefill."""
    from benchmarks.report import context, num
    from evals.tables import markdown

    body = []
    for r in rows:
        where = [r["model"], r["part"], f"{r['method']} ({r['backend']})",
                 f"{r.get('batch') or 1} x {context(r['context'])}"]
        if r.get("fits") is False:
            body.append(where + ["does not fit"] + [""] * 5)
            continue
        notes = ""
        if r["part"] == "prefill":
            notes = (f"{r['seconds']:.1f} s in chunks of {r['chunk']}; bound (weights + 2 x cache + 8 GiB) "
                     f"{r['bound_gib']:.1f} GiB")
        elif r["part"] == "max_batch":
            notes = f"{r['batch'] / r['ms_per_token'] * 1e3:.0f} tokens/s"
        body.append(where + [num(r.get("ms_per_token")), num(r.get("attention_ms")), num(r.get("rest_ms")),
                             num(r.get("kv_gib"), 1), num(r.get("peak_gib"), 1), notes])
    return markdown(["model", "part", "method (backend)", "B x context", "ms/token", "attention ms", "rest ms",
                     "KV GiB", "peak GiB", "notes"], body)


def figure_cells(rows: list[dict]) -> tuple[str | None, list[dict]]:
    """The GPU of the newest run with decode rows and, per (model, method, context), that GPU's newest decode row; a
    warning names the GPUs whose decode rows are left out (times differ across GPUs). (None, []) without decode rows."""
    from benchmarks.report import runs

    decode = [r for r in rows if r["part"] == "decode"]
    if not decode:
        return None, []
    grouped = runs(decode)
    gpu = grouped[0][0]["gpu"]
    others = sorted({str(r["gpu"]) for r in decode if r["gpu"] != gpu})
    if others:
        log.warning("long_context figure: %s only; left out the decode rows of %s", gpu, ", ".join(others))
    newest: dict[tuple, dict] = {}
    for run in reversed(grouped):  # oldest first: a newer run's cell replaces an older one's
        newest.update({(r["model"], r["method"], r["context"]): r for r in run if r["gpu"] == gpu})
    return gpu, list(newest.values())


def figure(rows: list[dict], path) -> bool:
    """Decode ms/token and KV GiB against context at batch 1, one line per method, on one GPU (:func:`figure_cells`);
    x where a method does not fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import context
    from oscar.atomic import save_figure

    gpu, decode = figure_cells(rows)
    models = list(dict.fromkeys(r["model"] for r in decode))
    if not models:
        return False
    fig, axes = plt.subplots(len(models), 2, figsize=(9, 3.4 * len(models)), squeeze=False)
    for (ax_time, ax_mem), model in zip(axes, models):
        for i, method in enumerate(dict.fromkeys(r["method"] for r in decode if r["model"] == model)):
            sel = sorted((r for r in decode if (r["model"], r["method"]) == (model, method)),
                         key=lambda r: r["context"])
            fit = [r for r in sel if r.get("fits") is not False]
            for ax, key in ((ax_time, "ms_per_token"), (ax_mem, "kv_gib")):
                ax.plot([r["context"] for r in fit], [r[key] for r in fit], "o-", color=f"C{i}", label=method)
                for r in sel:
                    if r not in fit:
                        ax.plot([r["context"]], [fit[-1][key] if fit else 1], "x", color=f"C{i}", markersize=10)
        contexts = sorted({r["context"] for r in decode if r["model"] == model})
        for ax, label in ((ax_time, "decode ms per token (batch 1)"), (ax_mem, "KV cache GiB (stored bytes)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [context(c) for c in contexts])
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"{model}: x = does not fit ({gpu})", fontsize=9)
            ax.grid(alpha=0.3)
        ax_time.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True
