"""The whole user path, timed: a real prefill of random prompts, then greedy decode, through ``DecodeEngine``.

    python scripts/bench_user_path.py [--out results/efficiency] [--model llama-3.1-8b]
                                      [--prefill 131072x1 32768x4] [--decode 32768x1] [--chunk 8192]
                                      [--kernels oscar kivi ... spectral] [--mirrors kivi oscar ...]
                                      [--steps 32] [--budget 500] [--profile]

What ``KVModel.generate`` and every task run, on a random-weight 8B architecture in bf16 (scripts/bench_e2e.CONFIGS):
no cache is filled with made-up contents. Rows of user_path.csv, in this order (a cell that would start after
``--budget`` seconds is skipped and logged):

- ``hf_forward``: transformers' own forward of the whole prompt (sdpa attention, its DynamicCache), per
  ``--prefill`` shape: the outside baseline of the prefill;
- ``attention_kernel``: one layer's prefill attention alone, per kernel (SDPA causal over the whole prompt;
  FlashAttention's variable-length kernel over the whole prompt and over its last ``--chunk`` queries): where the
  prefill's attention time goes;
- ``prefill``: ``DecodeEngine._prefill`` (what ``generate`` runs first) for fp16 (the static BF16 cache), each
  ``--kernels`` method on backend=cupy and each ``--mirrors`` method on the torch backend's mirror, whole
  (chunk 0) and in ``--chunk``-token chunks; ``seconds`` and the GPU's ``peak_gib`` during it;
- ``decode``: after a prefill, ``DecodeEngine.decode`` (CUDA-graph replay, EOS ignored) for ``--steps`` tokens
  after a warm-up that captures the graph: ``ms_per_token`` wall clock, host bookkeeping and flushes included; on a
  GPU ``step_ms`` (CUDA events around each step: its replay's time from launch to end) and ``between_ms`` (from
  one step's end to the next one's launch: the host's bookkeeping and the flushes it launches).
  The ``--decode`` shapes add decode rows at other shapes (prefilled in chunks).
- ``--profile``: each method's ops by their own GPU time over one more (untimed) chunked prefill of the first
  ``--prefill`` shape, logged (torch.profiler's table): where the prefill's time goes; on a GPU then the lines
  whose operations made the host wait for the GPU during one more such prefill and 16 decode steps after it
  (torch.cuda's sync debug mode), counted: where a host-bound prefill or step stalls; then 16 more decode steps
  under torch.profiler: the GPU's busy time per step against the traced wall clock's and the step's ops by their
  own GPU time; and 16 more under cProfile: the host's functions by their own time (the
  host waiting for the GPU: in ``tolist``). Before the sync count, one more prefill under cProfile: the host's
  functions by cumulative time (where a host-bound prefill's host time goes).

``vs_fp16``: fp16's figure at the same (part, batch, context, and chunk for a prefill) over the row's, so > 1 is
faster than fp16 in this run (for hf_forward: the engine's fp16 whole-prompt prefill over transformers' forward,
< 1 is slower).
The CSV is rewritten after each cell. Needs a CUDA GPU (and CuPy for the kernel methods); ``--model tiny-llama``
with tiny shapes runs on a CPU (the test's smoke run).
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import io
import logging
import pstats
import sys
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

sys.path.insert(0, str(REPO_ROOT))

log = logging.getLogger("bench_user_path")

KERNEL_METHODS = ["oscar", "kivi", "quarot", "turboquant", "ott", "rotatekv", "spectral"]
MIRROR_METHODS = ["kivi", "oscar", "quarot", "turboquant", "ott", "rotatekv", "spectral"]


def shape(text: str) -> tuple[int, int]:
    """'131072x1' -> (context, batch)."""
    context, _, batch = text.partition("x")
    return int(context), int(batch or 1)


def build_method_for_bench(name: str, model):
    """The method at its defaults, without calibration files here: RotateKV with reorder=false, OSCAR with random
    rotations of ``model``'s shape (scripts.bench_generate._method)."""
    from scripts.bench_generate import _method

    return _method(name, model)


def load(model_name: str):
    if model_name in ("llama-3.1-8b", "qwen3-8b"):
        from scripts.bench_e2e import build_model

        return build_model(model_name)
    from tests.conftest import build_tiny

    return build_tiny(model_name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@contextmanager
def sync_warnings():
    """Record a warning for every CUDA operation that synchronizes the host with the GPU (torch.cuda's sync debug
    mode) while the block runs: the list of warnings.WarningMessage."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def sync_sites(caught: list[warnings.WarningMessage]) -> Counter:
    """'path:line' -> how many synchronizing operations that Python line ran (paths inside the repository relative
    to it, others by their last two parts), from :func:`sync_warnings`' records."""
    sites = Counter()
    for w in caught:
        if "synchroniz" not in str(w.message):
            continue
        path = Path(w.filename)
        where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else Path(*path.parts[-2:])
        sites[f"{where}:{w.lineno}"] += 1
    return sites


def prompt(model, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device,
                        generator=torch.Generator(device).manual_seed(context + batch))
    return ids, torch.ones_like(ids)


def hf_forward(model, batch: int, context: int) -> dict:
    """transformers' own forward of the whole prompt (before any method is attached: its sdpa attention)."""
    from transformers import DynamicCache

    from oscar.cache import cache_argument

    device = next(model.parameters()).device
    ids, mask = prompt(model, batch, context)
    reset_peak(device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1,
              **cache_argument(model, DynamicCache(config=model.config)))
    sync(device)
    return dict(seconds=time.perf_counter() - start, peak_gib=peak_gib(device))


def attention_kernels(model, batch: int, context: int, chunk: int, repeats: int = 3) -> list[dict]:
    """Seconds of one layer's prefill attention over ``context`` random tokens, per kernel: SDPA's causal kernel over
    the whole prompt (what transformers' forward runs), FlashAttention's variable-length kernel over the whole prompt
    and over its last ``chunk`` queries (the chunked prefill's kernel; ``chunk`` column), the model's head counts."""
    import torch.nn.functional as F

    c = model.config
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(batch, c.num_attention_heads, context, c.head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    kv = torch.randn(2, batch, context, c.num_key_value_heads, c.head_dim, device="cuda", dtype=torch.bfloat16,
                     generator=gen)
    keys, values = kv[0].reshape(-1, *kv.shape[3:]), kv[1].reshape(-1, *kv.shape[3:])
    cu_k = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * context

    def flash(n: int):
        queries = q[:, :, -n:].transpose(1, 2).reshape(-1, c.num_attention_heads, c.head_dim)
        cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * n
        return torch.ops.aten._flash_attention_forward(queries, keys, values, cu_q, cu_k, n, context, 0.0, True, False,
                                                       scale=c.head_dim**-0.5)

    kernels = {("sdpa_causal", 0): lambda: F.scaled_dot_product_attention(
                   q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), is_causal=True, enable_gqa=True),
               ("flash_varlen", 0): lambda: flash(context), ("flash_varlen", chunk): lambda: flash(chunk)}
    rows = []
    for (name, n), fn in kernels.items():
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        rows.append(dict(part="attention_kernel", method=name, backend="torch", chunk=n,
                         seconds=(time.perf_counter() - start) / repeats))
    return rows


class Cells:
    """The engine of one (method, backend): prefill cells and the decode rows that follow them."""

    def __init__(self, model, method_name: str, backend_name: str, steps: int):
        from oscar.backend import build_backend
        from oscar.engine import DecodeEngine
        from scripts.bench_e2e import prepare_fresh

        self.model, self.steps = model, steps
        self.method = build_method_for_bench(method_name, model)
        backend = build_backend(backend_name)
        prepare_fresh(model, self.method)  # as KVModel does, on the weights as built
        backend.attach(model, self.method)
        mode = "graph" if next(model.parameters()).is_cuda else "eager"
        self.engine = DecodeEngine(model, self.method, backend, mode)
        self.device = next(model.parameters()).device

    def prefill(self, batch: int, context: int, chunk: int, decode: bool) -> list[dict]:
        """The prefill row (and, with ``decode``, the decode row after it)."""
        engine = self.engine
        engine.prefill_chunk = chunk or None
        ids, mask = prompt(self.model, batch, context)
        engine._slots.clear()
        reset_peak(self.device)
        slot = engine._slot([0] * batch, engine.capacity(context, 2 * self.steps + 8))
        sync(self.device)
        start = time.perf_counter()
        logits = engine._prefill(ids, mask, slot.cache)
        sync(self.device)
        rows = [dict(part="prefill", seconds=time.perf_counter() - start, peak_gib=peak_gib(self.device),
                     kv_gib=slot.cache.nbytes / 2**30)]
        if decode:
            picked = logits.argmax(-1)
            engine.decode(slot, picked, 4, eos_token_ids=set())  # warm-up: an eager step, the capture
            sync(self.device)
            with step_events(engine) as events:
                ms = self.decode_more(slot, self.steps)
            rows.append(dict(part="decode", ms_per_token=ms, **events.split(), peak_gib=peak_gib(self.device),
                             kv_gib=slot.cache.nbytes / 2**30))
        engine._slots.clear()
        return rows

    def decode_more(self, slot, steps: int) -> float:
        """``steps`` more greedy decode steps of ``slot`` (EOS ignored, the graph captured): wall clock, ms per step."""
        start = time.perf_counter()
        self.engine.decode(slot, slot.picked.clone(), steps + 1, eos_token_ids=set())
        sync(self.device)
        return (time.perf_counter() - start) / steps * 1e3

    def profile_user_path(self, batch: int, context: int, chunk: int, top: int = 15, steps: int = 16) -> str:
        """One prefill under torch.profiler (untimed): its ops by their own GPU time (CPU time on a CPU), the
        ``top`` first, as key_averages' table: where a prefill's time goes. On a GPU then one more prefill under
        cProfile (the host's functions by cumulative time), the lines that synchronized the host with the GPU
        during one more prefill and ``steps`` decode steps after it, counted;
        ``steps`` more under torch.profiler (:func:`decode_profile`) and ``steps`` more under cProfile
        (:func:`host_table`)."""
        from torch.profiler import ProfilerActivity, profile

        engine = self.engine
        engine.prefill_chunk = chunk or None
        ids, mask = prompt(self.model, batch, context)
        engine._slots.clear()
        slot = engine._slot([0] * batch, engine.capacity(context, 8))
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            engine._prefill(ids, mask, slot.cache)
            sync(self.device)
        engine._slots.clear()
        by = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=by, row_limit=top)
        if not cuda:
            return table
        lines = [table]
        host = cProfile.Profile()  # where a host-bound prefill's host time goes: the functions by cumulative time
        with host:
            engine._prefill(ids, mask, engine._slot([0] * batch, engine.capacity(context, 8)).cache)
            sync(self.device)
        engine._slots.clear()
        lines.append(f"host functions of the prefill by cumulative time:\n{host_table(host, 2 * top, 'cumulative')}")
        with sync_warnings() as caught:  # one more prefill, then decode: which lines made the host wait for the GPU
            slot = engine._slot([0] * batch, engine.capacity(context, 4 * steps))
            logits = engine._prefill(ids, mask, slot.cache)
        prefill_syncs = sync_sites(caught)
        with sync_warnings() as caught:
            engine.decode(slot, logits.argmax(-1), steps, eos_token_ids=set())
        for what, sites in (("the prefill", prefill_syncs), (f"{steps} decode steps", sync_sites(caught))):
            lines.append(f"host syncs of {what}: {sum(sites.values())}, by line:")
            lines += [f"{count:6d}  {site}" for site, count in sites.most_common(top)]
        with profile(activities=activities) as prof:  # the graph warm: what a decode step's time is
            wall = self.decode_more(slot, steps)
        lines.append(decode_profile(prof.key_averages(), steps, wall, top))
        host = cProfile.Profile()  # and where the host's time goes in them (a wait for the GPU: in tolist)
        with host:
            self.decode_more(slot, steps)
        engine._slots.clear()
        lines.append(f"host functions of {steps} decode steps by their own time:\n{host_table(host, top)}")
        return "\n".join(lines)

    def warm_up(self, batch: int, context: int) -> None:
        """A small prefill and decode first (kernel compiles, allocator, cuBLAS plans)."""
        self.prefill(batch, context, context // 2, decode=True)


class StepEvents:
    """CUDA events recorded around each decode step (the graph's replay, or the eager step): ``split`` gives the
    step's own time per step (``step_ms``: from the host's launch to its end) and the time between steps
    (``between_ms``: the host's bookkeeping and the flushes it launches), no tracer in the way. Empty on a CPU."""

    def __init__(self):
        self.pairs: list[tuple] = []

    def split(self) -> dict[str, float]:
        if len(self.pairs) < 2:
            return {}
        step = sum(a.elapsed_time(b) for a, b in self.pairs) / len(self.pairs)
        between = [b.elapsed_time(a) for (_, b), (a, _) in zip(self.pairs, self.pairs[1:])]
        return dict(step_ms=step, between_ms=sum(between) / len(between))


@contextmanager
def step_events(engine):
    """``engine``'s decode steps timed by CUDA events while inside (see :class:`StepEvents`)."""
    events, step = StepEvents(), engine._decode_step

    def timed(slot):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        step(slot)
        after.record()
        events.pairs.append((before, after))

    if next(engine.model.parameters()).is_cuda:
        engine._decode_step = timed
    try:
        yield events
    finally:
        engine.__dict__.pop("_decode_step", None)


def decode_profile(averages, steps: int, wall_ms: float, top: int) -> str:
    """``steps`` decode steps under torch.profiler: the GPU's busy time per step (every op's own device time:
    kernels and copies) against the wall clock's (the rest: the GPU idle, the tracer's own gaps included: the decode
    rows' step_ms and between_ms are the untraced split), and the ``top`` ops by their own GPU time."""
    busy = sum(e.self_device_time_total for e in averages) / steps / 1e3
    head = (f"decode steps: {wall_ms:.2f} ms/step wall, GPU busy {busy:.2f} ms/step "
            f"({busy / wall_ms:.0%}; idle {wall_ms - busy:.2f} ms/step)")
    return head + "\n" + averages.table(sort_by="self_device_time_total", row_limit=top)


def host_table(host: cProfile.Profile, top: int, sort: str = "tottime") -> str:
    """cProfile's ``top`` functions by their own time (or pstats' ``sort`` key; pstats' table, paths relative to the
    repository)."""
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats(sort).print_stats(top)
    return text.getvalue().replace(str(REPO_ROOT) + "/", "").strip()


def with_ratios(rows: list[dict]) -> list[dict]:
    """vs_fp16 per row (see the module docstring)."""
    def key(row):  # a decode step does not depend on how its prompt was prefilled
        return row["part"], row["batch"], row["context"], None if row["part"] == "decode" else row["chunk"]

    fp16 = {key(r): r for r in rows if r["method"] == "fp16" and r["part"] != "hf_forward"}
    for row in rows:
        ref = fp16.get(key(row) if row["part"] != "hf_forward" else ("prefill", row["batch"], row["context"], 0))
        if ref is None:
            row["vs_fp16"] = float("nan")
        elif row["part"] == "decode":
            row["vs_fp16"] = ref["ms_per_token"] / row["ms_per_token"]
        elif row["part"] == "hf_forward":
            row["vs_fp16"] = row["seconds"] / ref["seconds"]
        else:
            row["vs_fp16"] = ref["seconds"] / row["seconds"]
    return rows


def write(path: Path, rows: list[dict]) -> None:
    fields = ["model", "part", "method", "backend", "batch", "context", "chunk", "seconds", "ms_per_token", "step_ms",
              "between_ms", "vs_fp16", "peak_gib", "kv_gib"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(with_ratios([dict(r) for r in rows]))


def run(args) -> list[dict]:
    model = load(args.model)
    rows: list[dict] = []
    started = time.perf_counter()
    out = args.out / "user_path.csv"

    def add(new: list[dict], **where) -> None:
        for row in new:
            row = dict(model=args.model, **where, **row)
            rows.append(row)
            log.info("%-10s %-10s %-6s B=%-2d T=%-7d chunk=%-5d %s", row["part"], row["method"], row["backend"],
                     row["batch"], row["context"], row["chunk"],
                     f"{row['seconds']:.2f} s" if "seconds" in row else f"{row['ms_per_token']:.2f} ms/token"
                     + (f" (step {row['step_ms']:.2f}, between steps {row['between_ms']:.2f})" if "step_ms" in row
                        else ""))
        write(out, rows)

    def in_budget(what: str) -> bool:
        if time.perf_counter() - started > args.budget:
            log.info("budget: skipped %s", what)
            return False
        return True

    for context, batch in args.prefill:
        if in_budget(f"hf_forward {context}x{batch}"):
            with torch.no_grad():
                hf_forward(model, batch, min(context, 1024))  # warm-up
            add([dict(part="hf_forward", **hf_forward(model, batch, context))], method="fp16",
                backend="transformers", batch=batch, context=context, chunk=0)
    if next(model.parameters()).is_cuda and in_budget("attention kernels"):
        for context, batch in args.prefill:
            add(attention_kernels(model, batch, context, args.chunk), batch=batch, context=context)
    configs = ([("fp16", "torch")] + [(m, "cupy") for m in args.kernels] + [(m, "torch") for m in args.mirrors])
    for method, backend in configs:
        if not in_budget(f"{method}/{backend}"):
            continue
        cells = Cells(model, method, backend, args.steps)
        shapes = args.prefill + args.decode
        cells.warm_up(max(b for _, b in shapes), min(2048, min(c for c, _ in shapes)))
        # fp16 and OScaR's kernels: whole and chunked; the others chunked (what long-context tasks run)
        chunks = [0, args.chunk] if (method, backend) in (("fp16", "torch"), ("oscar", "cupy")) else [args.chunk]
        for context, batch in args.prefill:
            for chunk in chunks:
                if in_budget(f"{method}/{backend} prefill {context}x{batch} chunk {chunk}"):
                    add(cells.prefill(batch, context, chunk, decode=chunk == chunks[0]), method=method,
                        backend=backend, batch=batch, context=context, chunk=chunk)
        if args.profile and in_budget(f"{method}/{backend} profile"):
            context, batch = args.prefill[0]
            log.info("profile of %s/%s, prefill %dx%d in chunks of %d:\n%s", method, backend, context, batch,
                     args.chunk, cells.profile_user_path(batch, context, args.chunk))
        for context, batch in args.decode:
            if in_budget(f"{method}/{backend} decode {context}x{batch}"):
                decoded = [r for r in cells.prefill(batch, context, args.chunk, decode=True) if r["part"] == "decode"]
                add(decoded, method=method, backend=backend, batch=batch, context=context, chunk=args.chunk)
        del cells
    log.info("wrote %s", out)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "efficiency")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--prefill", type=shape, nargs="+", default=[shape("131072x1"), shape("32768x4")])
    p.add_argument("--decode", type=shape, nargs="*", default=[shape("32768x1")])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--kernels", nargs="*", default=KERNEL_METHODS)
    p.add_argument("--mirrors", nargs="*", default=MIRROR_METHODS)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--budget", type=float, default=500.0, help="seconds; cells that would start later are skipped")
    p.add_argument("--profile", action="store_true",
                   help="log each method's ops by GPU time over one chunked prefill of the first --prefill shape")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
