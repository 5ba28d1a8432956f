"""Past 128K on one GPU: decode at 128K-1M tokens where BF16 no longer fits, and a real chunked prefill at 256K.

    python scripts/bench_long_context.py [--out results/efficiency] [--models llama-3.1-8b qwen3-8b]
                                         [--contexts 131072 262144 524288 1048576] [--methods oscar kivi ...]
                                         [--prefill 262144] [--chunk 16384] [--steps 16] [--budget 540]

Random-weight 8B architectures in bf16 (scripts/bench_e2e.CONFIGS). Rows of long_context.csv:

- ``decode``, batch 1, per context: fp16 (the static BF16 cache; ``fits`` = False where it does not) and each
  ``--methods`` kernel method on backend=cupy, through the engine's CUDA-graph decode loop with the prompt's cache
  filled as a prefill would leave it (scripts/bench_generate.fill: a real prefill of 1M tokens costs many minutes and
  changes no decode cost): ``ms_per_token`` (wall clock), ``step_ms`` (GPU time of the replayed step),
  ``attention_ms`` (GPU time of every layer's decode attention over its own cache, one CUDA graph of the layers'
  attention calls as the step makes them: the part that grows with the context), ``rest_ms`` = step_ms -
  attention_ms, ``kv_gib`` (real stored bytes, PackedTensor counts),
  ``peak_gib`` (the GPU's peak during the cell);
- ``max_batch`` at ``--batch-context`` (256K): the largest batch of fp16 and of OScaR that fits;
- ``prefill``: one real chunked prefill of ``--prefill`` tokens through OScaR's kernels (``DecodeEngine._prefill``,
  chunks of ``--chunk``): ``seconds``, ``peak_gib``, ``kv_gib``, and ``bound_gib`` = weights + 2 x the packed cache +
  8 GiB (the target: peak below it), ``weights_gib``.

The model's positions are raised to 1M+ where a context needs it (RoPE tables only; no shape or cost changes). The
CSV is rewritten after each cell; cells that would start after ``--budget`` seconds are skipped.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
import time
from pathlib import Path

import torch

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

sys.path.insert(0, str(REPO_ROOT))

from scripts.bench_e2e import CONFIGS, graph_ms, prepare_fresh  # noqa: E402
from scripts.bench_generate import KERNEL_METHODS, _method, cell, fill, largest_batch  # noqa: E402

log = logging.getLogger("bench_long_context")
FIELDS = ["model", "part", "method", "backend", "batch", "context", "fits", "ms_per_token", "tokens_per_s", "step_ms",
          "attention_ms", "rest_ms", "kv_gib", "peak_gib", "seconds", "chunk", "weights_gib", "bound_gib"]


def build(name: str, positions: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**CONFIGS[name], "max_position_embeddings": positions})
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def attention_ms(model, method_name: str, backend_name: str, context: int, repeats: int = 10) -> float:
    """GPU time of one step's decode attention over a filled cache of ``context`` tokens: every layer attends its
    own cache (the bytes a step reads), the layers' calls captured in one CUDA graph as the step's are, replayed
    ``repeats`` times. (One layer timed eagerly and multiplied by the layers counted the host's launch gaps as
    attention: 3.1 ms for OScaR at 128K where this gives 1.6, so the rest of the step seemed to grow with the
    context; results/efficiency/long_context_step.csv.)"""
    from oscar.backend import build_backend
    from oscar.engine import DecodeEngine

    method, backend = _method(method_name), build_backend(backend_name)
    engine = DecodeEngine(model, method, backend, "graph")
    prepare_fresh(model, method)  # as KVModel does, on the weights as built
    backend.attach(model, method)
    slot = fill(engine, 1, context, engine.capacity(context, 16))
    c = model.config
    query = torch.randn(1, c.num_attention_heads, 1, c.head_dim, device="cuda", dtype=torch.bfloat16)
    module = next(m for m in model.modules() if hasattr(m, "kv_method"))
    mask = slot.cache.decode_mask()

    def attend_every_layer() -> None:
        for layer in slot.cache.layers:
            layer.attend(module, query, mask, c.head_dim**-0.5)

    ms = graph_ms(attend_every_layer, repeats)
    engine._slots.clear()
    torch.cuda.empty_cache()
    return ms


def decode_row(model, method_name: str, backend_name: str, context: int, steps: int) -> dict:
    try:
        row = cell(model, method_name, backend_name, "graph", 1, context, steps)
    except torch.OutOfMemoryError:
        row = None
    if row is None:
        torch.cuda.empty_cache()
        return dict(method=method_name, backend=backend_name, batch=1, fits=False)
    row.update(fits=True, kv_gib=row.pop("kv_bytes") / 2**30)
    row["attention_ms"] = attention_ms(model, method_name, backend_name, context)
    row["rest_ms"] = row["step_ms"] - row["attention_ms"]
    return row


def prefill_row(model, context: int, chunk: int) -> dict:
    """One real prefill of ``context`` random tokens through OScaR's kernels in chunks of ``chunk``."""
    from oscar.backend import build_backend
    from oscar.engine import DecodeEngine

    method, backend = _method("oscar"), build_backend("cupy")
    engine = DecodeEngine(model, method, backend, "graph", prefill_chunk=chunk)
    prepare_fresh(model, method)  # as KVModel does, on the weights as built
    backend.attach(model, method)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    warm = torch.randint(0, model.config.vocab_size, (1, 2 * chunk), device="cuda")
    engine.generate(warm, torch.ones_like(warm), 2, eos_token_ids=set())  # kernels compiled
    engine._slots.clear()
    ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    slot = engine._slot([0], engine.capacity(context, 16))
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine._prefill(ids, torch.ones_like(ids), slot.cache)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    kv = slot.cache.nbytes
    row = dict(method="oscar", backend="cupy", batch=1, context=context, chunk=chunk, seconds=seconds,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30, kv_gib=kv / 2**30, weights_gib=weights / 2**30,
               bound_gib=(weights + 2 * slot.cache.allocated_bytes) / 2**30 + 8)
    engine._slots.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "efficiency")
    p.add_argument("--models", nargs="+", default=list(CONFIGS))
    p.add_argument("--contexts", nargs="+", type=int, default=[131072, 262144, 524288, 1048576])
    p.add_argument("--methods", nargs="*", default=KERNEL_METHODS)
    p.add_argument("--batch-context", type=int, default=262144, help="context of the max_batch rows (0: none)")
    p.add_argument("--prefill", type=int, default=262144, help="tokens of the real prefill (0: none)")
    p.add_argument("--chunk", type=int, default=16384)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--budget", type=float, default=540.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    started, rows = time.perf_counter(), []
    out = args.out / "long_context.csv"

    def add(row: dict, **where) -> None:
        rows.append({**where, **row})
        log.info("%s", {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in rows[-1].items()})
        with out.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def in_budget(what: str) -> bool:
        if time.perf_counter() - started > args.budget:
            log.info("budget: skipped %s", what)
            return False
        return True

    for name in args.models:
        model = build(name, max(args.contexts + [args.prefill]) + 4096)
        for context in args.contexts:
            for method, backend in [("fp16", "torch")] + [(m, "cupy") for m in args.methods]:
                if in_budget(f"{name} {method} decode {context}"):
                    add(decode_row(model, method, backend, context, args.steps), model=name, part="decode",
                        context=context)
        if name == args.models[0] and in_budget(f"{name} prefill {args.prefill}") and args.prefill:
            add(prefill_row(model, args.prefill, args.chunk), model=name, part="prefill")
        for method, backend in (("fp16", "torch"), ("oscar", "cupy")):
            if args.batch_context and name == args.models[0] and in_budget(f"{name} {method} max batch"):
                one = cell(model, method, backend, "graph", 1, args.batch_context, args.steps)
                if one is None:
                    add(dict(method=method, backend=backend, fits=False), model=name, part="max_batch",
                        context=args.batch_context)
                    continue
                batch, row = largest_batch(model, method, backend, args.batch_context, args.steps, one)
                row.update(fits=True, kv_gib=row.pop("kv_bytes") / 2**30)
                add(row, model=name, part="max_batch", context=args.batch_context)
        del model
        torch.cuda.empty_cache()
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
