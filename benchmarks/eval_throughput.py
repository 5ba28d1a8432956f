"""Evaluation throughput: seconds per LongBench-E-shaped sample through DecodeEngine.generate, per method.

A random prompt of ``--lengths`` tokens (4K / 16K / 32K), 128 new tokens (EOS ignored), batch 1 and 8, through
``DecodeEngine.generate`` (prefill in ``--prefill-chunk``-token chunks, then decode as CUDA-graph replays): every
``--mirrors`` method on the torch backend's mirror (what the accuracy runs use) and every ``--kernels`` method on
backend=cupy, on the random-weight Qwen3-8B architecture. ``seconds_per_sample`` is the call's wall clock over the
batch. The log adds the GPU-hours Table 1 would take at these rates (the mirror methods x 2 models x 3,800 samples,
the lengths spread evenly). A cell that does not fit is logged and left out. ``--model tiny-llama`` with short
lengths runs on a CPU (eager decode).
"""

from __future__ import annotations

import logging
import time

import torch

from benchmarks.harness import (Run, bench_method, build_model, method_name, model_device, model_name, prepare_fresh,
                                reset_peak, sync)

log = logging.getLogger("benchmarks.eval_throughput")

MIRROR_METHODS = ["fp16", "kivi", "oscar", "quarot", "ott", "turboquant", "rotatekv"]
#: Table 1's size for the GPU-hours estimate: models and LongBench-E samples
TABLE1 = dict(models=2, samples=3800)
FIELDS = ["model", "method", "backend", "prompt_tokens", "batch", "new_tokens", "prefill_chunk", "seconds_per_sample"]


def add_arguments(p) -> None:
    p.add_argument("--model", type=model_name, default="qwen3-8b")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--mirrors", type=method_name, nargs="*", default=MIRROR_METHODS,
                   help="methods on the torch backend (the mirror)")
    p.add_argument("--kernels", type=method_name, nargs="*", default=["oscar", "kivi", "quarot", "turboquant"],
                   help="methods on backend=cupy")
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.set_defaults(budget=480.0)


def run(args, bench: Run) -> None:
    from oscar.backend import build_backend
    from oscar.engine import DecodeEngine

    model = build_model(args.model)
    device = model_device(model)
    configs = [(m, "torch") for m in args.mirrors] + [(m, "cupy") for m in args.kernels]
    configs.sort(key=lambda mb: mb[0] == "rotatekv")  # RotateKV's sink hooks stay on the model: last
    for method_name_, backend_name in configs:
        if not bench.budget.allows(f"{method_name_}/{backend_name}"):
            continue
        method, backend = bench_method(method_name_, model), build_backend(backend_name)
        engine = DecodeEngine(model, method, backend, "auto", prefill_chunk=args.prefill_chunk)
        prepare_fresh(model, method)  # as KVModel does, on the weights as built
        backend.attach(model, method)
        warm = torch.randint(0, model.config.vocab_size, (1, 256), device=device)
        engine.generate(warm, torch.ones_like(warm), 8, eos_token_ids=set())  # kernels compiled, libraries up
        for length in args.lengths:
            for batch in args.batches:
                if not bench.budget.allows(f"{method_name_}/{backend_name} T={length} B={batch}"):
                    continue
                ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
                sync(device)
                start = time.perf_counter()
                try:
                    out = engine.generate(ids, torch.ones_like(ids), args.new_tokens, eos_token_ids=set())
                except torch.OutOfMemoryError:
                    log.warning("%s/%s T=%d B=%d does not fit", method_name_, backend_name, length, batch)
                    continue
                finally:
                    sync(device)
                    seconds = (time.perf_counter() - start) / batch
                    engine._slots.clear()
                    reset_peak(device)
                assert all(len(row) == args.new_tokens for row in out)
                bench.add(dict(model=args.model, method=method_name_, backend=backend_name, prompt_tokens=length,
                               batch=batch, new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk,
                               seconds_per_sample=seconds))
                log.info("%-10s %-5s T=%-6d B=%d  %.3f s/sample", method_name_, backend_name, length, batch, seconds)
    rows = bench.tables.get(bench.question, [])
    for batch in args.batches:
        per: dict[str, list[float]] = {}
        for r in rows:
            if r["batch"] == batch and r["backend"] == "torch":
                per.setdefault(r["method"], []).append(r["seconds_per_sample"])
        if per:
            seconds = sum(sum(v) / len(v) for v in per.values())  # one sample through every method
            log.info("Table 1 at batch %d: %.2f s per sample through the %d methods -> %.1f GPU-hours for %d models x "
                     "%d samples (these prompt lengths evenly)", batch, seconds, len(per),
                     seconds * TABLE1["samples"] * TABLE1["models"] / 3600, TABLE1["models"], TABLE1["samples"])


def table(rows: list[dict]) -> str:
    """Seconds per sample, methods x (prompt length, batch), each against fp16 of the same column."""
    from benchmarks.report import context
    from evals.tables import markdown

    columns = sorted({(r["prompt_tokens"], r["batch"]) for r in rows})
    cells = {(r["method"], r["backend"], r["prompt_tokens"], r["batch"]): r["seconds_per_sample"] for r in rows}
    body = []
    for method, backend in dict.fromkeys((r["method"], r["backend"]) for r in rows):
        line = [f"{method} ({backend})"]
        for column in columns:
            v, fp16 = cells.get((method, backend, *column)), cells.get(("fp16", "torch", *column))
            line.append("–" if v is None else f"{v:.2f}" + (f" ({v / fp16:.2f}x)" if fp16 else ""))
        body.append(line)
    return (markdown(["method (backend)"] + [f"{context(t)} B={b}" for t, b in columns], body)
            + "\n\nSeconds per sample (prefill + the new tokens), in parentheses over fp16's in the same column.")
