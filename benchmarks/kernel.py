"""The kernels: each method's decode attention and quantizers against BF16 attention and their own byte floor.

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, D=128), bf16, 2-bit keys and values, G=32 (TurboQuant+: its
2.5 bits per value), 64 full-precision window tokens per sequence; each packed storage holds random codes with
plausible parameters (benchmarks.filled.fill_storage). Rows (``part``):

- ``decode``: each method's decode attention over its packed cache (``ms``) against BF16 decode attention in the same
  run (``bf16_ms``: the fastest of SDPA with enable_gqa, SDPA with the query heads of a KV head as query rows, and
  FlashAttention's variable-length kernel over a capacity-sized cache with ``seqused_k``, what the engine's fp16
  static cache runs: each form's time in its own column, the three checked to agree) and against the method's own
  byte floor (``floor_ms``: the real stored bytes of its packed part, from the storage it reads, at the run's copy
  bandwidth; ``pct_floor`` = floor_ms / ms); batch 1, 8, 32 and contexts 4K-128K (4-bit KIVI, QuaRot, OScaR at
  batch 8 too);
- ``stages`` (batch 8; 32K and 128K; per layer over :data:`TUNE_LAYERS` layers' caches): the full kernel against its
  variants that only stream the packed bytes (``loads_only_ms``) and that skip the value product (``no_values_ms``):
  whether loads or arithmetic bound it;
- ``quant``: each method's key and value quantization kernels writing the decode layouts, a flush (128 tokens a
  sequence) and a prefill chunk (32K tokens), batch 1 and 8: bytes read and written, ``copy_frac`` of the copy
  bandwidth;
- ``tuning`` (unless ``--no-tune``): ring buffers x launch bound x most splits per method at the decode step's shapes
  (:data:`TUNE_SHAPES`: the user path's 1 x 128K and 4 x 32K, and 8 x 128K), each time per layer over
  :data:`TUNE_LAYERS` layers' caches in one graph (a step's layers run back to back, so a lone call's graph launch
  would swamp the difference); the decode rows use each method's best (the geometric mean over the shapes of its
  time over the shape's fastest). ``--tune-only``: the tuning rows and the stage rows at the user path's shapes.

GPU times are medians over replays of a CUDA graph holding one call (the tuning and stage rows: one call per layer's
cache, the time divided by the layers), the L2 cache flushed before each replay (benchmarks.harness.captured_ms);
``eager_ms``, the plain call's. Needs a CUDA GPU and CuPy.
"""

from __future__ import annotations

import logging
import math

import torch

from benchmarks.filled import fill_storage
from benchmarks.harness import Run, call_ms, captured_ms

log = logging.getLogger("benchmarks.kernel")

HQ, HKV, D, GROUP, RESIDUAL = 32, 8, 128, 32, 64
METHODS = ("oscar", "kivi", "quarot", "turboquant")
FIELDS = ["part", "method", "bits", "role", "batch", "context", "tokens", "ms", "floor_ms", "pct_floor", "bf16_ms",
          "speedup", "stored_bytes", "bits_per_value", "sdpa_gqa_ms", "sdpa_rows_ms", "flash_varlen_ms", "eager_ms",
          "loads_only_ms", "no_values_ms", "bytes", "gbs", "copy_frac", "copy_gbs", "knobs"]


#: (batch, context) of the tuning sweep, its knobs (decode_attention's ring buffers, launch bound and most splits a
#: row) and the layers' caches timed back to back in one graph
TUNE_SHAPES = ((1, 131072), (4, 32768), (8, 131072))
TUNE_GRID = [dict(nstage=n, min_blocks=m, max_splits=s) for n in (2, 3, 4) for m in (12, 16, 20, 24)
             for s in (128, 256, 512)]
TUNE_LAYERS = 4


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="a few shapes only (a smoke test)")
    p.add_argument("--no-tune", action="store_true", help="kernels.ops defaults for every method")
    p.add_argument("--tune-only", action="store_true",
                   help="only the tuning sweep and the stage rows at the user path's shapes (1 x 128K, 4 x 32K)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="the methods to time")


def method_cache(method: str, bits: int, batch: int, context: int, dtype=torch.bfloat16, device="cuda",
                 hkv: int = HKV, d: int = D, g: int = GROUP, residual: int = RESIDUAL) -> dict:
    """Packed storage of ``context`` tokens per sequence (random codes, plausible parameters), the windows, the lengths
    and the method's decode_attention keyword arguments."""
    from kernels import ops

    keys, values = ops.empty_storage(method, batch, hkv, context, d, k_bits=bits, v_bits=bits, group_size=g,
                                     dtype=dtype, device=device)
    fill_storage(method, keys, values, bits)
    kwargs = dict(k_bits=bits, v_bits=bits, group_size=g, scaling=d**-0.5, method=method, max_packed=context)
    if method == "turboquant":
        from oscar import build_method

        tq = build_method("turboquant", group_size=g)
        kwargs.update(signs=tq.signs(d, device), codebook=tq.codebook(2, d).tolist())
    k_res = torch.randn(batch, hkv, residual, d, dtype=dtype, device=device)
    return dict(keys=keys, values=values, k_res=k_res, v_res=torch.randn_like(k_res),
                n_packed=torch.full((batch,), context, dtype=torch.int32, device=device),
                n_res=torch.full((batch,), residual, dtype=torch.int32, device=device), kwargs=kwargs)


def stored_bytes(cache: dict) -> int:
    """Real bytes of the packed part the kernel reads: every buffer of the key and value storage."""
    return sum(b.numel() * b.element_size() for store in (cache["keys"], cache["values"]) for b in store.values())


def decode_call(cache: dict, query, **knobs):
    from kernels import ops

    return lambda: ops.decode_attention(query, cache["keys"], cache["values"], cache["k_res"], cache["v_res"],
                                        cache["n_packed"], cache["n_res"], **cache["kwargs"], **knobs)


def bf16_forms_ms(batch: int, context: int, spare: int = 100) -> dict[str, float]:
    """GPU milliseconds of BF16 decode attention of 32 query heads over 8 KV heads, three ways: SDPA with enable_gqa
    and SDPA with the query heads of a KV head as query rows, over [B, 8, context, D] keys and values; and
    FlashAttention's variable-length kernel over the same tokens in a token-major cache of ``context`` + ``spare``
    slots a row (``seqused_k``: the engine's fp16 static cache). The three outputs agree (each computes the right
    thing) before they are timed."""
    import torch.nn.functional as F

    q = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(2, batch, HKV, context, D, dtype=torch.bfloat16, device="cuda")
    capacity = context + spare
    cache = torch.zeros(2, batch, capacity, HKV, D, dtype=torch.bfloat16, device="cuda")
    cache[:, :, :context] = kv.transpose(2, 3)
    flat = cache.view(2, batch * capacity, HKV, D)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    used = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    forms = dict(
        sdpa_gqa=lambda: F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True),
        sdpa_rows=lambda: F.scaled_dot_product_attention(q.view(batch, HKV, HQ // HKV, D), kv[0], kv[1]),
        flash_varlen=lambda: torch.ops.aten._flash_attention_forward(
            q.view(batch, HQ, D), flat[0], flat[1], cu_q, cu_q * capacity, 1, capacity, 0.0, False, False,
            scale=D**-0.5, seqused_k=used)[0])
    reference = forms["sdpa_gqa"]().float().view(batch, HQ, D)
    for name, fn in forms.items():
        if not torch.allclose(fn().float().view(batch, HQ, D), reference, atol=2e-2, rtol=0):
            raise AssertionError(f"BF16 attention {name} disagrees with SDPA's at batch {batch}, {context} tokens")
    times = {name: captured_ms(fn, "cuda", flush_l2=True) for name, fn in forms.items()}
    del kv, cache, flat
    torch.cuda.empty_cache()
    return times


def tuning(bench: Run, methods, shapes=TUNE_SHAPES, grid=TUNE_GRID, layers: int = TUNE_LAYERS) -> dict:
    """Every knob set of ``grid`` per method at each shape (rows: ms per layer, % of the byte floor), and each
    method's best knobs (the geometric mean over the shapes of its time over the shape's fastest)."""
    best, default = {}, next(i for i, knobs in enumerate(grid) if knobs == _default_knobs())
    for method in methods:
        times = {}
        for batch, context in shapes:
            caches = [method_cache(method, 2, batch, context) for _ in range(layers)]
            q = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
            floor_ms = stored_bytes(caches[0]) / bench.copy_gbs / 1e6
            for i, knobs in enumerate(grid):
                ms = times[batch, context, i] = layer_ms(caches, q, **knobs)
                bench.add(dict(part="tuning", method=method, bits=2, batch=batch, context=context, ms=ms,
                               floor_ms=floor_ms, pct_floor=floor_ms / ms, copy_gbs=bench.copy_gbs,
                               knobs=_knobs(knobs), role="default" if i == default else ""))
            del caches
            torch.cuda.empty_cache()
        fastest = {shape: min(times[(*shape, i)] for i in range(len(grid))) for shape in shapes}
        score = {i: math.prod(times[(*shape, i)] / fastest[shape] for shape in shapes) for i in range(len(grid))}
        best[method] = grid[min(score, key=score.get)]
        log.info("best knobs for %s (geometric mean over %s): %s, %.3f of the defaults' time", method, shapes,
                 best[method], (min(score.values()) / score[default]) ** (1 / len(shapes)))
    return best


def _default_knobs() -> dict:
    from kernels import plans

    return dict(nstage=plans.NSTAGE, min_blocks=plans.MIN_BLOCKS, max_splits=plans.MAX_SPLITS)


def _knobs(knobs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def decode_rows(bench: Run, grid, knobs: dict) -> None:
    """(method, bits) x batch x context: the kernel's time, its byte floor, BF16 attention in the same run."""
    for batch, context, configs in grid:
        forms = bf16_forms_ms(batch, context)
        fastest = min(forms.values())
        q = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
        for method, bits in configs:
            cache = method_cache(method, bits, batch, context)
            call = decode_call(cache, q, **knobs.get(method, {}))
            ms, nbytes = captured_ms(call, "cuda", flush_l2=True), stored_bytes(cache)
            floor_ms = nbytes / bench.copy_gbs / 1e6
            bench.add(dict(part="decode", method=method, bits=bits, batch=batch, context=context, ms=ms,
                           floor_ms=floor_ms, pct_floor=floor_ms / ms, bf16_ms=fastest, speedup=fastest / ms,
                           stored_bytes=nbytes, bits_per_value=8 * nbytes / (2 * batch * HKV * context * D),
                           **{f"{name}_ms": t for name, t in forms.items()}, eager_ms=call_ms(call, "cuda"),
                           copy_gbs=bench.copy_gbs, knobs=_knobs(knobs.get(method, {}))))
            log.info("%-10s %d-bit B=%-3d T=%-6d %.3f ms, floor %.3f ms (%.0f%%), bf16 %.3f ms -> %.2fx", method, bits,
                     batch, context, ms, floor_ms, 100 * floor_ms / ms, fastest, fastest / ms)
            del cache
            torch.cuda.empty_cache()


def layer_ms(caches: list[dict], query, **knobs) -> float:
    """GPU milliseconds per layer of decode attention over each of ``caches`` in turn, one graph (a step's layers)."""
    calls = [decode_call(cache, query, **knobs) for cache in caches]
    return captured_ms(lambda: [call() for call in calls], "cuda", flush_l2=True) / len(calls)


def stage_rows(bench: Run, methods, knobs: dict, contexts, batch: int = 8, layers: int = TUNE_LAYERS) -> None:
    """The full kernel (MODE 0) against loads only (MODE 1) and no value product (MODE 2), per method, per layer
    over ``layers`` layers' caches."""
    for method in methods:
        for context in contexts:
            caches = [method_cache(method, 2, batch, context) for _ in range(layers)]
            q = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
            times = [layer_ms(caches, q, mode=mode, **knobs.get(method, {})) for mode in (0, 1, 2)]
            bench.add(dict(part="stages", method=method, bits=2, batch=batch, context=context, ms=times[0],
                           loads_only_ms=times[1], no_values_ms=times[2],
                           floor_ms=stored_bytes(caches[0]) / bench.copy_gbs / 1e6, copy_gbs=bench.copy_gbs,
                           knobs=_knobs(knobs.get(method, {}))))
            del caches
            torch.cuda.empty_cache()


def quantizers(method: str, k, out_keys: dict, out_values: dict):
    """(keys call, values call) of the method's quantization kernels writing the decode layouts."""
    from kernels import ops

    if method == "oscar":
        return (lambda: ops.quantize_keys(k, 2, GROUP, out=out_keys, decode_layout=True),
                lambda: ops.quantize_values(k, 2, GROUP, out=out_values, decode_layout=True))
    if method == "kivi":
        return (lambda: ops.quantize_channel_keys(k, 2, GROUP, out=out_keys, decode_layout=True),
                lambda: ops.quantize_values(k, 2, GROUP, out=out_values, decode_layout=True, zero_point="float"))
    if method == "quarot":
        return (lambda: ops.quantize_token_keys(k, 2, GROUP, out=out_keys, decode_layout=True),
                lambda: ops.quantize_values(k, 2, GROUP, out=out_values, decode_layout=True))
    from oscar import build_method

    tq = build_method("turboquant", group_size=GROUP)
    signs, levels = tq.signs(D, "cuda"), tq.codebook(2, D).tolist()
    return (lambda: ops.quantize_turboquant(k, GROUP, signs, levels, out=out_keys, decode_layout="keys"),
            lambda: ops.quantize_turboquant(k, GROUP, signs, levels, out=out_values, decode_layout="values"))


def quant_rows(bench: Run, methods, shapes) -> None:
    from kernels import ops

    for batch, tokens in shapes:
        k = torch.randn(batch, HKV, tokens, D, dtype=torch.bfloat16, device="cuda")
        for method in methods:
            keys, values = ops.empty_storage(method, batch, HKV, tokens, D, k_bits=2, v_bits=2, group_size=GROUP,
                                             dtype=k.dtype, device="cuda")
            for role, fn, store in zip(("keys", "values"), quantizers(method, k, keys, values), (keys, values)):
                ms = captured_ms(fn, "cuda", flush_l2=True)
                nbytes = k.numel() * 2 + sum(b.numel() * b.element_size() for b in store.values())
                gbs = nbytes / ms / 1e6
                bench.add(dict(part="quant", method=method, bits=2, role=role, batch=batch, tokens=tokens, ms=ms,
                               bytes=nbytes, gbs=gbs, copy_frac=gbs / bench.copy_gbs, copy_gbs=bench.copy_gbs))
            del keys, values
        del k
        torch.cuda.empty_cache()


def run(args, bench: Run) -> None:
    bench.require_gpu()
    torch.manual_seed(0)
    methods = args.methods
    knobs = {} if args.quick or args.no_tune else tuning(bench, methods)
    if args.tune_only:
        for batch, context in TUNE_SHAPES[:2]:
            stage_rows(bench, methods, knobs, (context,), batch)
        return
    two_bit = [(m, 2) for m in methods]
    four_bit = [(m, 4) for m in ("oscar", "kivi", "quarot") if m in methods]
    if args.quick:
        grid = [(1, 4096, two_bit), (8, 32768, two_bit + four_bit)]
    else:
        grid = [(b, t, two_bit + (four_bit if b == 8 else [])) for b in (1, 8, 32)
                for t in (4096, 8192, 16384, 32768, 65536, 131072)]
    decode_rows(bench, grid, knobs)
    stage_rows(bench, methods, knobs, (32768,) if args.quick else (32768, 131072))
    quant_rows(bench, methods, [(1, 128), (8, 32768)] if args.quick else [(1, 128), (8, 128), (1, 32768), (8, 32768)])


# ----------------------------------------------------------------------------- the README's tables and the figure


def table(rows: list[dict]) -> str:
    """Decode attention per method against BF16 and its floor; the tuning sweep; the stage variants; the
    quantizers (each where the run has its rows)."""
    from benchmarks.report import context, num, percent, ratio
    from evals.tables import markdown

    by = {part: [r for r in rows if r["part"] == part] for part in ("decode", "stages", "quant", "tuning")}
    oscar = {(r["bits"], r["batch"], r["context"]): r["ms"] for r in by["decode"] if r["method"] == "oscar"}
    parts = []
    if by["decode"]:
        parts.append(markdown(
            ["method", "bits", "batch", "context", "ms", "floor ms", "% of floor", "BF16 ms", "speedup",
             "stored bits / value", "OScaR / method time"],
            [[r["method"], r["bits"], r["batch"], context(r["context"]), num(r["ms"], 3), num(r["floor_ms"], 3),
              percent(r["pct_floor"]), num(r["bf16_ms"], 3), ratio(r["speedup"]), num(r["bits_per_value"]),
              ratio(oscar.get((r["bits"], r["batch"], r["context"]), math.nan) / r["ms"])] for r in by["decode"]]))
    if by["tuning"]:
        parts.append("Tuning (ms per layer; the default knobs against the fastest set at each shape):\n\n" + markdown(
            ["method", "batch", "context", "default ms", "fastest ms", "fastest knobs", "fastest / default",
             "fastest % of floor"], [_tuning_line(cell) for cell in _cells(by["tuning"])]))
    if by["stages"]:
        parts.append("Where the time goes (stage variants):\n\n" + markdown(
            ["method", "batch", "context", "kernel ms", "loads only ms", "keys only ms", "floor ms", "loads / floor",
             "arithmetic over the loads"],
            [[r["method"], r["batch"], context(r["context"]), num(r["ms"], 3), num(r["loads_only_ms"], 3),
              num(r["no_values_ms"], 3), num(r["floor_ms"], 3), num(r["loads_only_ms"] / r["floor_ms"]),
              percent(r["ms"] / r["loads_only_ms"] - 1)] for r in by["stages"]]))
    if by["quant"]:
        parts.append("Quantization kernels:\n\n" + markdown(
            ["method", "role", "batch", "tokens", "ms", "GB/s", "% of copy"],
            [[r["method"], r["role"], r["batch"], r["tokens"], num(r["ms"], 4), num(r["gbs"], 0),
              percent(r["copy_frac"])] for r in by["quant"]]))
    return "\n\n".join(parts)


def _cells(rows: list[dict]) -> list[list[dict]]:
    """Rows grouped by (method, batch, context), in their order."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["method"], r["batch"], r["context"]), []).append(r)
    return list(cells.values())


def _tuning_line(cell: list[dict]) -> list:
    from benchmarks.report import context, num, percent, ratio

    fastest = min(cell, key=lambda r: r["ms"])
    default = next((r for r in cell if r["role"] == "default"), None)
    default_ms = default["ms"] if default else math.nan
    return [fastest["method"], fastest["batch"], context(fastest["context"]), num(default_ms, 4), num(fastest["ms"], 4),
            fastest["knobs"], ratio(fastest["ms"] / default_ms), percent(fastest["pct_floor"])]


def figure(rows: list[dict], path) -> bool:
    """2-bit decode attention per method against context, one panel per batch, BF16 beside it (the newest run with
    2-bit decode rows: a ``--tune-only`` run has none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import context, runs
    from oscar.atomic import save_figure

    grouped = runs([r for r in rows if r["part"] == "decode" and r["bits"] == 2])  # newest first
    if not grouped:
        return False
    two_bit = grouped[0]
    batches = sorted({r["batch"] for r in two_bit})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for i, method in enumerate(dict.fromkeys(r["method"] for r in two_bit)):
            sel = sorted((r for r in two_bit if (r["batch"], r["method"]) == (batch, method)),
                         key=lambda r: r["context"])
            ax.plot([r["context"] for r in sel], [r["ms"] for r in sel], "o-", color=f"C{i}", label=method)
        sel = sorted({r["context"]: r for r in two_bit if r["batch"] == batch}.values(), key=lambda r: r["context"])
        contexts = [r["context"] for r in sel]
        ax.plot(contexts, [r["bf16_ms"] for r in sel], "k--", label="BF16")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(contexts, [context(c) for c in contexts])
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("decode attention, ms per layer")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"2-bit decode attention per method, Llama-3.1-8B attention shape, {two_bit[0]['gpu']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True
