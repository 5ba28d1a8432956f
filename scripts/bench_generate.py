"""Generation speed as users get it: the decode engine (oscar.engine) behind ``KVModel.generate`` / ``run.py``.

    python scripts/bench_generate.py [--out results/efficiency] [--models llama-3.1-8b qwen3-8b]
                                     [--contexts 32768 131072] [--steps 24] [--eval-lengths 4096 16384 32768]
                                     [--methods oscar kivi quarot turboquant] [--modes eager graph]
                                     [--parts batch1 max_batch hf_static profile eval] [--budget 480]

Random-weight 8B architectures (scripts/bench_e2e.CONFIGS) in bf16 on the GPU. Two tables:

generate.csv: per model, context, batch and configuration, decoding through the engine's own loop
(``DecodeEngine.decode``, what ``generate`` runs after the prefill) eagerly and replaying the CUDA graph:
``ms_per_token`` is the wall-clock per new token of that loop (host bookkeeping, flushes and the EOS check
included) and ``step_ms`` the GPU time of the step alone (events around each replay, graph rows). The
prompt's cache is written directly with random contents, as a prefill would leave it (a real prefill of 128K
tokens through an 8B model would cost minutes per cell and changes no decode cost): random codes with plausible
parameters in each method's packed storage, token counts as its flush policy leaves them. Configurations:
fp16 (static BF16 cache, FlashAttention over each row's tokens), each method of ``--methods`` on the CuPy
kernels (default oscar; kivi, quarot, turboquant: the baselines' kernels, 2 bits, G=32, R=128), oscar on the
torch backend's mirror (when oscar is measured; kv_bytes not reported: its packed chunks are not written by the
fill); batch 1 and BF16's largest batch, plus fp16 and each kernel method at its own largest batch
(throughput). ``kv_bytes``: the cache's real stored bytes (``nbytes``); ``allocated_bytes``: what its storage
holds. The outside
baseline, method ``hf_static``: transformers' ``generate`` on its own StaticCache (filled the same way),
which compiles the decode step (torch.compile, CUDA graphs) itself; timed after a warm-up call that compiles,
at batch 1. A run with the baselines in ``--methods`` writes these rows to generate_methods.csv instead, so that
ratios are only taken within one run's file.

eval_throughput.csv: seconds per LongBench-E-shaped sample (a random prompt of 4K / 16K / 32K tokens, 128 new
tokens, EOS ignored) through ``DecodeEngine.generate`` (prefill included, in chunks of ``--prefill-chunk``
tokens), batch 1 and 8, every method on the
torch backend's mirror (graph) plus the ``--methods`` on the kernels, Qwen3-8B architecture; the log adds the GPU-hours
Table 1 would take at these rates (7 methods x 2 models x 3,800 samples, lengths spread evenly over the three).

Every CSV is rewritten after each cell, so a run cut short keeps what it measured; ``--budget`` (seconds)
skips the cells that would start after it. No Hydra; needs torch, transformers and cupy.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

sys.path.insert(0, str(REPO_ROOT))

from oscar import build_method  # noqa: E402
from oscar.backend import build_backend  # noqa: E402
from oscar.engine import DecodeEngine  # noqa: E402
from scripts.bench_e2e import CONFIGS, build_model, prepare_fresh, random_spectral_calibration  # noqa: E402

log = logging.getLogger("bench_generate")

#: methods with kernels (backend=cupy), measured beside fp16 as ``--methods`` says
KERNEL_METHODS = ["oscar", "kivi", "quarot", "turboquant", "ott", "rotatekv", "spectral"]
EVAL_METHODS = ["fp16", "kivi", "oscar", "quarot", "ott", "turboquant", "rotatekv"]
HEADROOM = 6 * 2**30  # bytes left free when sizing the largest batch (activations, logits, graph pool)
#: Table 1's size for the GPU-hours estimate: models and LongBench-E samples (every method of EVAL_METHODS)
TABLE1 = dict(models=2, samples=3800)

_started = time.perf_counter()


class OutOfBudget(Exception):
    pass


def _check_budget(budget: float) -> None:
    if time.perf_counter() - _started > budget:
        raise OutOfBudget


def _method(name: str, model=None):
    """Defaults of the paper's comparison (2 bits, G=32, R=128); RotateKV without its calibration file, OSCAR with
    random rotations of ``model``'s shape (scripts.bench_e2e.random_spectral_calibration: the time does not depend
    on which)."""
    if name == "spectral":
        if model is None:
            raise ValueError("spectral: the benchmark's random rotations need the model (its layers and head_dim)")
        return build_method(name, calibration=random_spectral_calibration(model))
    return build_method(name, **({"reorder": False} if name == "rotatekv" else {}))


def _write(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def synchronize() -> None:
    """Wait for every GPU (a model split over several has work queued on each)."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


def configurations(methods: list[str]) -> list[tuple[str, str]]:
    """(method, backend) of the batch-1 rows: fp16, each kernel method, OScaR's mirror path when OScaR is measured."""
    return [("fp16", "torch")] + [(m, "cupy") for m in methods] + ([("oscar", "torch")] if "oscar" in methods else [])


def fill(engine: DecodeEngine, batch: int, context: int, capacity: int):
    """A slot whose cache holds ``context`` tokens per row after a prefill, written directly with random contents
    (BF16 / mirror: normal keys and values; the kernels' caches: random codes with plausible parameters in the
    method's storage, normal windows; token counts as the method's flush policy leaves them), so no prompt-sized
    transient limits the batch. Each layer's storage on its layer's device (a model split over GPUs:
    oscar.placement)."""
    from kernels.backend import CupyKVCache
    from oscar.placement import layer_devices
    from oscar.row_groups import CountedRowGroup
    from scripts.bench_kernel_methods import fill_storage

    c = engine.model.config.get_text_config()
    dtype = next(engine.model.parameters()).dtype
    slot = engine._slot([0] * batch, capacity)
    cache, method = slot.cache, engine.method
    keys_packed, values_packed = method.flush_policy.packed(context)
    for layer, device in zip(cache.layers, layer_devices(engine.model), strict=True):
        dummy = torch.zeros(batch, c.num_key_value_heads, 1, c.head_dim, dtype=dtype, device=device)
        layer.lazy_initialization(dummy, dummy)
        if isinstance(cache, CupyKVCache):
            fill_storage(method.name, layer.keys_store, layer.values_store, method.k_bits,
                         getattr(method, "zero_point", "float" if method.name == "spectral" else None))
            layer.key_residual.normal_()
            layer.value_residual.normal_()
            if layer.kept is not None:  # the exactly kept tokens (assume_stored: each row's first ones)
                layer.kept.buffers["keys"].normal_()
                layer.kept.buffers["values"].normal_()
            layer.assume_stored(context)
        else:
            layer.keys[:, :, :context].normal_()
            layer.values[:, :, :context].normal_()
            layer.groups = [CountedRowGroup(torch.arange(batch, device=device), 0, keys_packed=keys_packed,
                                            keys_residual=context - keys_packed, values_packed=values_packed,
                                            values_residual=context - values_packed)]
            layer.key_window_fill.fill_(context - keys_packed)
            layer.values_packed_count.fill_(values_packed)
            layer.cache_lengths = cache.lengths_on(device)
        layer.seq_len, layer.decoding = context, True
    cache.lengths.fill_(context)
    for device in layer_devices(engine.model):
        cache.lengths_on(device).fill_(context)
    cache.decoding = True
    synchronize()
    return slot


def time_decode(engine: DecodeEngine, slot, steps: int) -> dict:
    """Wall-clock per token of the engine's decode loop (after a warm-up that also captures the graph), and
    for graph mode the GPU time of the replays alone."""
    b = len(slot.ids)
    first = torch.randint(0, engine.model.config.get_text_config().vocab_size, (b,), device=slot.ids.device)
    engine.decode(slot, first, 3, eos_token_ids=set())  # warm-up: eager step, capture (graph mode)
    synchronize()
    start = time.perf_counter()
    engine.decode(slot, first, steps + 1, eos_token_ids=set())  # steps decode steps
    synchronize()
    wall = (time.perf_counter() - start) / steps * 1e3
    row = dict(ms_per_token=wall, tokens_per_s=b / wall * 1e3)
    if engine.mode == "graph":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for begin, end in events:
            begin.record()
            slot.graph.replay()
            end.record()
            slot.cache.advance()
        torch.cuda.synchronize()
        row["step_ms"] = sum(b_.elapsed_time(e) for b_, e in events) / steps
    return row


def cell(model, method_name: str, backend_name: str, mode: str, batch: int, context: int, steps: int) -> dict | None:
    """One generate.csv row, or None if the batch does not fit. ``peak_gib``: the fullest GPU's peak."""
    method, backend = _method(method_name, model), build_backend(backend_name)
    engine = DecodeEngine(model, method, backend, mode)
    prepare_fresh(model, method)  # as KVModel does, on the weights as built
    backend.attach(model, method)
    capacity = engine.capacity(context, 3 * steps + 8)
    torch.cuda.empty_cache()
    for index in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(index)
    try:
        slot = fill(engine, batch, context, capacity)
        row = time_decode(engine, slot, steps)
        mirror = backend_name == "torch" and method_name != "fp16"  # its packed chunks are not filled
        row.update(kv_bytes=float("nan") if mirror else slot.cache.nbytes, allocated_bytes=slot.cache.allocated_bytes)
    except torch.OutOfMemoryError:
        return None
    finally:
        engine._slots.clear()
    row["peak_gib"] = max((torch.cuda.max_memory_allocated(i) / 2**30 for i in range(torch.cuda.device_count())),
                          default=float("nan"))
    torch.cuda.empty_cache()
    return dict(method=method_name, backend=backend_name, decode=mode, batch=batch, **row)


def largest_batch(model, method_name: str, backend_name: str, context: int, steps: int,
                  one: dict, mode: str = "graph") -> tuple[int, dict]:
    """The largest batch whose cache and step fit, searched down from the memory estimate (``one``: the batch-1
    row, whose allocation plus a margin for activations sizes a sequence; on a model split over GPUs each GPU
    holds its layers' share of it, and the GPU that fills first bounds the estimate)."""
    from collections import Counter

    from oscar.placement import layer_devices

    layers = Counter(d.index if d.index is not None else torch.cuda.current_device() for d in layer_devices(model))
    total = sum(layers.values())

    def fits(index: int) -> int:
        free = (torch.cuda.mem_get_info(index)[0] + torch.cuda.memory_reserved(index)
                - torch.cuda.memory_allocated(index))
        return int((free - HEADROOM) // (one["allocated_bytes"] * layers[index] / total + 256 * 2**20))

    batch = max(1, min(fits(index) for index in layers))
    while batch >= 1:
        row = cell(model, method_name, backend_name, mode, batch, context, steps)
        if row is not None:
            return batch, row
        batch = int(batch * 0.93) if batch > 12 else batch - 1
    raise RuntimeError("not even batch 1 fits")


def hf_static(model, batch: int, context: int, steps: int) -> dict | None:
    """transformers' generate on its own StaticCache (filled with random keys/values), compiled by generate."""
    from transformers import StaticCache

    c = model.config
    model.get_decoder().set_attn_implementation("sdpa")
    for m in model.modules():
        m.__dict__.pop("kv_cache", None)

    def run(new_tokens: int) -> float:  # one cache length for every call: one compiled step
        cache = StaticCache(config=c, max_cache_len=context + steps + 16)
        dummy = torch.zeros(batch, c.num_key_value_heads, 1, c.head_dim, dtype=torch.bfloat16, device="cuda")
        for layer in cache.layers:
            layer.lazy_initialization(dummy, dummy)
            layer.keys[:, :, :context].normal_()
            layer.values[:, :, :context].normal_()
            layer.cumulative_length.fill_(context)
        ids = torch.randint(0, c.vocab_size, (batch, context + 1), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    torch.cuda.empty_cache()
    try:
        run(4)  # compiles the decode step
        short, long = run(4), run(4 + steps)
    except torch.OutOfMemoryError:
        return None
    wall = (long - short) / steps * 1e3  # per extra new token: the prefill of the last prompt token cancels out
    return dict(method="hf_static", backend="transformers", decode="torch.compile", batch=batch, ms_per_token=wall,
                tokens_per_s=batch / wall * 1e3)


def profile_decode(model, method_name: str, backend_name: str, context: int) -> None:
    """Log the device time of one eager decode step by kernel (where a configuration's step time goes)."""
    from torch.profiler import ProfilerActivity, profile

    method, backend = _method(method_name, model), build_backend(backend_name)
    engine = DecodeEngine(model, method, backend, "eager")
    prepare_fresh(model, method)  # as KVModel does, on the weights as built
    backend.attach(model, method)
    slot = fill(engine, 1, context, engine.capacity(context, 16))
    first = torch.randint(0, model.config.vocab_size, (1,), device="cuda")
    engine.decode(slot, first, 3, eos_token_ids=set())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.decode(slot, first, 3, eos_token_ids=set())
        torch.cuda.synchronize()
    log.info("profile %s/%s B=1 T=%d, 2 eager decode steps, by device time:\n%s", method_name, backend_name, context,
             prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    engine._slots.clear()
    torch.cuda.empty_cache()


def generate_table(methods: list[str]) -> str:
    """The file of a run's decode rows: generate_methods.csv when it measures the baselines' kernels (every method
    against fp16 in one run), else generate.csv (fp16, OScaR on the kernels and the mirror, hf_static)."""
    return "generate_methods.csv" if set(methods) - {"oscar"} else "generate.csv"


def bench_generate(args) -> list[dict]:
    rows: list[dict] = []
    for name in tqdm(args.models, desc="bench_generate", unit="model"):
        model = build_model(name)

        def add(row: dict | None, context: int, kind: str) -> None:
            if row is None:
                log.info("%s T=%d %s: does not fit", name, context, kind)
                return
            rows.append(dict(model=name, context=context, cell=kind, **row))
            log.info("%-12s T=%-6d %-16s %-5s/%-5s %-5s B=%-3d %8.2f ms/token %8.1f tok/s  step %s ms  KV %.2f GiB",
                     name, context, kind, row["method"], row["backend"], row["decode"], row["batch"],
                     row["ms_per_token"], row["tokens_per_s"], f"{row.get('step_ms', float('nan')):.2f}",
                     row.get("kv_bytes", float("nan")) / 2**30)
            _write(args.out / generate_table(args.methods), rows)

        for context in args.contexts:
            try:
                ones = {}
                # batch-1 rows that size the searches for the largest batches
                sizing = [("fp16", "torch", "graph")] + [(m, "cupy", "graph") for m in args.methods]
                for key in ([(m, b, mode) for m, b in configurations(args.methods) for mode in args.modes]
                            if "batch1" in args.parts else sizing):
                    _check_budget(args.budget)
                    ones[key] = cell(model, *key, 1, context, args.steps)
                    if "batch1" in args.parts:
                        add(ones[key], context, "batch1")
                if "max_batch" not in args.parts:
                    continue
                _check_budget(args.budget)
                bf16_top, top_row = largest_batch(model, "fp16", "torch", context, args.steps,
                                                  ones["fp16", "torch", "graph"])
                add(top_row, context, "max_batch")
                if "eager" in args.modes:
                    add(cell(model, "fp16", "torch", "eager", bf16_top, context, args.steps), context, "max_batch")
                for method_name in args.methods:  # the mirror path holds a BF16 mirror: it fits no more than fp16
                    for mode in args.modes:
                        _check_budget(args.budget)
                        add(cell(model, method_name, "cupy", mode, bf16_top, context, args.steps), context,
                            "bf16_max_batch")
                    _check_budget(args.budget)
                    add(largest_batch(model, method_name, "cupy", context, args.steps,
                                      ones[method_name, "cupy", "graph"])[1], context, "max_batch")
            except OutOfBudget:
                log.warning("time budget spent: skipping the rest of %s T=%d", name, context)
        if "profile" in args.parts:
            for method_name, backend_name in configurations(args.methods):
                profile_decode(model, method_name, backend_name, args.contexts[0])
        if "hf_static" in args.parts:  # last: its compiled graphs keep memory; batch 1 (each batch size recompiles)
            for context in args.contexts:
                try:
                    _check_budget(args.budget)
                except OutOfBudget:
                    break
                add(hf_static(model, 1, context, args.steps), context, "batch1")
            torch._dynamo.reset()
        del model
        torch.cuda.empty_cache()
    return rows


def bench_eval(args) -> list[dict]:
    """Seconds per LongBench-E-shaped sample through DecodeEngine.generate, Qwen3-8B architecture."""
    model = build_model("qwen3-8b")
    rows: list[dict] = []
    configs = [(m, "torch") for m in args.eval_methods] + [(m, "cupy") for m in args.methods]
    configs.sort(key=lambda mb: mb[0] == "rotatekv")  # RotateKV's sink hooks stay on the model: last
    for method_name, backend_name in tqdm(configs, desc="bench_generate eval", unit="method"):
        method, backend = _method(method_name, model), build_backend(backend_name)
        engine = DecodeEngine(model, method, backend, "graph", prefill_chunk=args.prefill_chunk)
        prepare_fresh(model, method)  # as KVModel does, on the weights as built
        backend.attach(model, method)
        warm = torch.randint(0, model.config.vocab_size, (1, 256), device="cuda")
        engine.generate(warm, torch.ones_like(warm), 8, eos_token_ids=set())  # kernels compiled, libraries up
        for length in args.eval_lengths:
            for batch in (1, 8):
                try:
                    _check_budget(args.budget)
                except OutOfBudget:
                    log.warning("time budget spent: skipping %s T=%d B=%d", method_name, length, batch)
                    continue
                ids = torch.randint(0, model.config.vocab_size, (batch, length), device="cuda")
                torch.cuda.synchronize()
                start = time.perf_counter()
                try:
                    out = engine.generate(ids, torch.ones_like(ids), 128, eos_token_ids=set())
                except torch.OutOfMemoryError:
                    log.warning("eval %s T=%d B=%d does not fit", method_name, length, batch)
                    engine._slots.clear()
                    torch.cuda.empty_cache()
                    continue
                torch.cuda.synchronize()
                seconds = (time.perf_counter() - start) / batch
                assert all(len(row) == 128 for row in out)
                rows.append(dict(method=method_name, backend=backend_name, prompt_tokens=length, batch=batch,
                                 new_tokens=128, prefill_chunk=args.prefill_chunk, seconds_per_sample=seconds))
                log.info("eval %-10s %-5s T=%-6d B=%d  %.3f s/sample", method_name, backend_name, length, batch, seconds)
                _write(args.out / "eval_throughput.csv", rows)
                engine._slots.clear()
                torch.cuda.empty_cache()
    for batch in (1, 8):
        per = {}
        for r in rows:
            if r["batch"] == batch and r["backend"] == "torch":
                per.setdefault(r["method"], []).append(r["seconds_per_sample"])
        if per:
            seconds = sum(sum(v) / len(v) for v in per.values())  # one sample through every method
            hours = seconds * TABLE1["samples"] * TABLE1["models"] / 3600
            log.info("Table 1 at batch %d: %.2f s per sample through the %d methods -> %.1f GPU-hours for %d models x "
                     "%d samples (8B models, these prompt lengths evenly)", batch, seconds, len(per), hours,
                     TABLE1["models"], TABLE1["samples"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/efficiency"))
    parser.add_argument("--models", nargs="+", default=list(CONFIGS))
    parser.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-lengths", nargs="+", type=int, default=[4096, 16384, 32768])
    parser.add_argument("--eval-methods", nargs="+", default=EVAL_METHODS, choices=EVAL_METHODS,
                        help="eval: the methods timed on the torch backend (with the mirror)")
    parser.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"],
                        help="decode modes of the batch-1 and BF16-largest-batch rows (the searches run graph)")
    parser.add_argument("--methods", nargs="+", default=["oscar"], choices=KERNEL_METHODS,
                        help="methods measured on backend=cupy beside fp16 (the baselines' kernels: kivi quarot "
                             "turboquant)")
    parser.add_argument("--parts", nargs="+", default=["batch1", "max_batch", "hf_static", "eval"],
                        choices=["batch1", "max_batch", "hf_static", "profile", "eval"])
    parser.add_argument("--prefill-chunk", type=int, default=8192, help="eval: prefill in chunks of this many tokens")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds after which no cell starts")
    args = parser.parse_args()
    if "graph" not in args.modes:
        parser.error("--modes needs graph: the largest-batch searches and the sizing rows decode by graph replay")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if {"batch1", "max_batch", "hf_static", "profile"} & set(args.parts) and bench_generate(args):
        written.append(args.out / generate_table(args.methods))
    if "eval" in args.parts and bench_eval(args):
        written.append(args.out / "eval_throughput.csv")
    log.info("bench_generate: outputs in %s", ", ".join(map(str, written)) or "(none: nothing was measured)")


if __name__ == "__main__":
    main()
