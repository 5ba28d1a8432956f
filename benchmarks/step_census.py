"""The host's work around a served decode step: what backend=cupy runs between two steps and per prefill, counted.

A decode step replays one CUDA graph; the cache's bookkeeping after it (``StaticCache.advance``: the flushes that fall
due, the stages prepared a step ahead, the tokens kept exactly, the counts) runs outside the graph, and so does each
sample's prefill (``DecodeEngine._prefill``). Every torch operation there costs the host its dispatch and the GPU a
small kernel: where a step's host time nears its GPU time, this is where it goes. This question serves ``--rows`` rows
of a continuous batch (oscar.continuous.serve, as the evaluation scheduler does) whose prompts have different lengths
(seeded, ``--min-prompt`` .. ``--max-prompt`` tokens, ``--new-tokens`` each: rows at different stream positions flush at
different steps), and counts per method (fp16: the static BF16 cache, the baseline), with no timing:

- ``step``: per decode step, inside the cache's ``advance``: ``ops``, torch operations that compute
  (prefill_census.Census: views and metadata calls not counted) and ``launches``, the project's kernels
  (kernels.runtime.launch);
- ``prefill``: the same per sample's prefill; ``per_layer``: ops and launches over the model's layers.

The log names each part's lines with the most operations and its kernels by name. Counted on whatever runs the kernels:
a GPU (the model's real shapes), or the tests' CPU emulator of the kernels on a tiny model.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import Counter
from unittest import mock

import torch

from benchmarks.harness import Run, bench_method, build_model, method_name, model_device, model_name, prepare_fresh
from benchmarks.prefill_census import Census, positive

log = logging.getLogger("benchmarks.step_census")

METHODS = ["fp16", "oscar", "kivi", "quarot", "turboquant", "ott", "rotatekv", "spectral"]
FIELDS = ["model", "method", "backend", "part", "rows", "count", "ops", "launches", "ops_per_layer",
          "launches_per_layer"]


def add_arguments(p) -> None:
    p.add_argument("--model", type=model_name, default="llama-3.1-8b")
    p.add_argument("--methods", type=method_name, nargs="+", default=METHODS)
    p.add_argument("--rows", type=positive, default=16, help="rows of the continuous batch")
    p.add_argument("--samples", type=positive, default=32, help="samples served (rows refilled as they finish)")
    p.add_argument("--min-prompt", type=positive, default=2048)
    p.add_argument("--max-prompt", type=positive, default=10240)
    p.add_argument("--new-tokens", type=positive, default=128, help="greedy tokens per sample (EOS ignored)")
    p.add_argument("--prefill-chunk", type=positive, default=8192)
    p.add_argument("--seed", type=int, default=0)


class _Counted:
    """Ops (a Census) and kernel launches by name, of the calls made while a part is open."""

    def __init__(self):
        self.census, self.launches, self.calls = Census(), Counter(), 0


def count_parts(engine, requests, rows: int, capacity: int) -> dict[str, _Counted]:
    """Serve ``requests`` on ``engine`` (``rows`` x ``capacity``) and count the ``step`` and ``prefill`` parts."""
    from kernels import runtime
    from oscar.continuous import serve
    from oscar.engine import DecodeEngine
    from oscar.static_cache import StaticCache

    parts = {"step": _Counted(), "prefill": _Counted()}
    open_parts: list[_Counted] = []
    launch, advance, prefill = runtime.launch, StaticCache.advance, DecodeEngine._prefill

    def counted_launch(source, name, *args, **kwargs):
        if open_parts:
            open_parts[-1].launches[name] += 1
        return launch(source, name, *args, **kwargs)

    def within(part: str, operation):
        def run(*args, **kwargs):
            counted = parts[part]
            counted.calls += 1
            open_parts.append(counted)
            try:
                with counted.census:
                    return operation(*args, **kwargs)
            finally:
                open_parts.pop()
        return run

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(runtime, "launch", counted_launch))
        stack.enter_context(mock.patch.object(StaticCache, "advance", within("step", advance)))
        stack.enter_context(mock.patch.object(DecodeEngine, "_prefill", within("prefill", prefill)))
        for _ in serve(engine, requests, rows, capacity, set()):
            pass
    return parts


def run(args, bench: Run) -> None:
    from oscar.backend import build_backend
    from oscar.continuous import Request
    from oscar.engine import DecodeEngine

    if args.min_prompt > args.max_prompt:
        raise SystemExit(f"step_census: --min-prompt {args.min_prompt} is past --max-prompt {args.max_prompt}")
    model = build_model(args.model).to(torch.bfloat16)  # the kernels take 16-bit K/V (a registry model comes in fp32)
    layers, vocab = model.config.num_hidden_layers, model.config.vocab_size
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    requests = [Request(i, tuple(torch.randint(0, vocab, (rng.randint(args.min_prompt, args.max_prompt),),
                                               generator=gen).tolist()), args.new_tokens)
                for i in range(args.samples)]
    capacity = args.max_prompt + args.new_tokens
    for name in args.methods:
        if not bench.budget.allows(name):
            continue
        method, backend = bench_method(name, model), build_backend("cupy")
        prepare_fresh(model, method)
        backend.attach(model, method)
        engine = DecodeEngine(model, method, backend, "auto", prefill_chunk=args.prefill_chunk)
        with torch.no_grad():
            parts = count_parts(engine, requests, args.rows, capacity)
        for part, counted in parts.items():
            n = max(counted.calls, 1)
            ops, launches = counted.census.ops / n, sum(counted.launches.values()) / n
            bench.add(dict(model=args.model, method=name, backend="cupy", part=part, rows=args.rows,
                           count=counted.calls, ops=ops, launches=launches, ops_per_layer=ops / layers,
                           launches_per_layer=launches / layers))
            top = ", ".join(f"{line} {c / n:.1f}" for line, c in counted.census.ops_by_line.most_common(4))
            log.info("%-10s %-7s %8.1f ops %6.1f launches a %s (%d of them); kernels: %s; lines: %s", name, part,
                     ops, launches, part, counted.calls,
                     ", ".join(f"{k} {v / n:.1f}" for k, v in counted.launches.most_common()), top)
        engine.drop_caches()
        del engine
    log.info("step_census on %s", model_device(model))
