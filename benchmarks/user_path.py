"""The user path: a real prefill, then greedy decode through DecodeEngine, against fp16 and the hardware's floor.

What ``KVModel.generate`` and every task run, on a random-weight 8B architecture in bf16 (benchmarks.harness): no
cache is filled with made-up contents, except in the largest-batch rows. Rows (``part``), in this order (a cell
that would start after ``--budget`` seconds is skipped and logged):

- ``hf_forward``: transformers' own forward of the whole prompt (sdpa attention, its DynamicCache), per
  ``--prefill`` shape: the outside baseline of the prefill;
- ``attention_kernel`` (GPU): one layer's prefill attention alone, per kernel (SDPA causal over the whole prompt;
  FlashAttention's variable-length kernel over the whole prompt and over its last ``--chunk`` queries);
- ``prefill``: ``DecodeEngine._prefill`` (what ``generate`` runs first) for fp16 (the static BF16 cache), each
  ``--kernels`` method on backend=cupy and each ``--mirrors`` method on the torch backend's mirror, in ``--chunk``
  -token chunks (fp16 and OScaR's kernels also whole, chunk 0): ``seconds``, the GPU's ``peak_gib``;
- ``decode``: after the first prefill of a shape, ``DecodeEngine.decode`` (CUDA-graph replay, EOS ignored) for
  ``--steps`` tokens after a warm-up that captures the graph: ``ms_per_token`` (wall clock, host bookkeeping and
  flushes included); on a GPU ``step_ms`` (CUDA events around each step) and ``between_ms`` (from one step's end to
  the next one's launch). The ``--decode`` shapes add decode rows after chunked prefills of other shapes;
- at ``--max-batch-context`` (decode over a cache filled as a prefill leaves it, benchmarks.filled): ``max_batch``,
  each configuration at its own largest batch (estimated from one sequence's allocated cache and the free memory,
  verified by allocating: ``tokens_per_s``), and ``at_fp16_max_batch``, each method at fp16's largest batch.

With ``--fused-layers`` the engine's fused layers (oscar.engine: RMSNorm, RoPE and the SiLU product as one
kernel each; ``merged`` also one GEMM for q/k/v and one for gate/up) are set per run (``auto``: the engine's choice)
or compared: ``both`` runs each configuration with them on and off, ``all`` on, merged and off (the prefill fuses
as the decode step does); whole-prompt prefills and the largest-batch rows are the first setting's. Prefill and decode
rows say which (``fused_layers``), ``vs_unfused`` (the same configuration's seconds or ms per token with them off over
the row's, in this run)
and, on a GPU, ``kernels_per_step``: the GPU operations (kernels, copies) of one decode step, torch.profiler's device
events over 8 steps (flushes included).

Where a decode step's GPU time goes (on a GPU, the same 8 profiled steps; the log names each row's top kernels):
``<group>_ms`` and ``<group>_kernels`` a step for ``gemm`` (cuBLAS: the projections and the output head),
``attention`` (the decode attention kernels), ``cache`` (the methods' append, quantize and flush kernels),
``layers`` (the fused RMSNorm, RoPE and SiLU product) and ``torch`` (the rest: torch's elementwise ops, copies,
reductions, the sampling); ``gemm_gbs``, the weights a step reads over the GEMMs' time (do the GEMVs inside the graph
run at the copy bandwidth?). The GPU time is the kernels' own (under the profiler); the wall clock adds the gaps.

The roofline of every decode row of fp16 and the kernel methods (a mirror reads its BF16 mirror, not what it
stores): ``read_gb``, the bytes a step reads once (every weight the step reads in full: all parameters but the input
embedding, of which it reads one row a sequence; plus the cache's real stored bytes, ``nbytes``, at the end of the
timed steps), ``floor_ms`` (those bytes at the run's measured ``copy_gbs``), ``gbs`` (achieved: read_gb over
ms_per_token) and ``floor_frac`` (gbs over copy_gbs = floor_ms over ms_per_token).

``vs_fp16``: fp16's figure over the row's at the same part, batch, context (and chunk, for a prefill), so > 1 is
faster than fp16 in this run; for ``max_batch`` the row's tokens/s over fp16's at its own largest batch; for
``hf_forward``, the engine's fp16 whole-prompt prefill over transformers' forward (< 1 is slower). ``--profile``
logs each configuration's ops by GPU time over one chunked prefill of the first ``--prefill`` shape, then on a GPU
the host's functions of one more prefill, the lines that made the host wait for the GPU during a prefill and 16
decode steps, those steps' GPU busy time and their host functions (benchmarks.profiling). ``--model tiny-llama`` with
tiny shapes runs on a CPU (``--memory`` then sizes the largest batches).
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import math

import torch

from benchmarks import filled
from benchmarks.harness import (Run, bench_method, build_model, method_name, model_device, model_name, peak_gib,
                                prepare_fresh, reset_peak, sync, wall_seconds)
from benchmarks.profiling import (STEP_GROUPS, decode_profile, host_table, step_breakdown, step_events, sync_sites,
                                  sync_warnings, top_kernels)

log = logging.getLogger("benchmarks.user_path")

KERNEL_METHODS = ["oscar", "kivi", "quarot", "turboquant", "ott", "rotatekv", "spectral"]
#: a decode step's GPU time and operations by group (benchmarks.profiling.STEP_PARTS, the rest ``torch``)
STEP_FIELDS = [f"{part}_{what}" for what in ("ms", "kernels") for part in STEP_GROUPS]
FIELDS = ["model", "part", "method", "backend", "fused_layers", "batch", "context", "chunk", "seconds", "ms_per_token",
          "tokens_per_s", "step_ms", "between_ms", "kernels_per_step", *STEP_FIELDS, "gemm_gbs", "vs_fp16",
          "vs_unfused", "read_gb", "floor_ms", "gbs", "floor_frac", "copy_gbs", "kv_gib", "peak_gib"]
#: decode steps profiled for a decode row's kernels_per_step and its step split (after its timed steps)
PROFILED_STEPS = 8
#: --fused-layers -> the engine settings decoded, in order (the first one's prefill and largest-batch rows)
FUSED_SETTINGS = {"auto": ["auto"], "on": ["on"], "merged": ["merged"], "off": ["off"], "both": ["on", "off"],
                  "all": ["on", "merged", "off"]}


def shape(text: str) -> tuple[int, int]:
    """'131072x1' -> (context, batch)."""
    context, _, batch = text.partition("x")
    try:
        parsed = int(context), int(batch or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is CONTEXTxBATCH, e.g. 32768x4, got {text!r}") from None
    if min(parsed) < 1:
        raise argparse.ArgumentTypeError(f"a shape's context and batch are positive, got {text!r}")
    return parsed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_name, default="llama-3.1-8b")
    p.add_argument("--prefill", type=shape, nargs="+", default=[shape("131072x1"), shape("32768x4")])
    p.add_argument("--decode", type=shape, nargs="*", default=[shape("32768x1")])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--kernels", type=method_name, nargs="*", default=KERNEL_METHODS,
                   help="methods on backend=cupy (default: every method with kernels)")
    p.add_argument("--mirrors", type=method_name, nargs="*", default=[],
                   help="methods on the torch backend's mirror (default: none)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--max-batch-context", type=int, default=131072, help="context of the largest-batch rows (0: none)")
    p.add_argument("--memory", type=float, default=None,
                   help="GiB the largest batch's caches may take (default: the GPU's free memory less 6 GiB; "
                        "needed on a CPU)")
    p.add_argument("--fused-layers", choices=list(FUSED_SETTINGS), default="auto",
                   help="the engine's fused layers: a setting, both (on and off) or all (on, merged, off)")
    p.add_argument("--profile", action="store_true",
                   help="log where each configuration's prefill and decode time goes (see the docstring)")
    p.set_defaults(budget=450.0)


def prompt(model, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = model_device(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device,
                        generator=torch.Generator(device).manual_seed(context + batch))
    return ids, torch.ones_like(ids)


def hf_forward(model, batch: int, context: int) -> dict:
    """transformers' own forward of the whole prompt (before any method is attached: its sdpa attention)."""
    from transformers import DynamicCache

    from oscar.cache import cache_argument

    device = model_device(model)
    ids, mask = prompt(model, batch, context)
    reset_peak(device)
    with torch.no_grad():
        seconds = wall_seconds(lambda: model(input_ids=ids, attention_mask=mask, logits_to_keep=1,
                                             **cache_argument(model, DynamicCache(config=model.config))), device)
    return dict(seconds=seconds, peak_gib=peak_gib(device))


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
        seconds = wall_seconds(lambda: [fn() for _ in range(repeats)], "cuda") / repeats
        rows.append(dict(part="attention_kernel", method=name, backend="torch", chunk=n, seconds=seconds))
    return rows


def weights_read(model, batch: int) -> int:
    """Bytes of the weights one decode step of ``batch`` sequences reads: every parameter in full, but the input
    embedding table of which it reads one row a sequence (unless the output head is that table)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head is not None and head.weight is embed:
        return total
    return total - embed.numel() * embed.element_size() + batch * embed[0].numel() * embed.element_size()


def roofline(model, batch: int, kv_bytes: int, ms_per_token: float, copy_gbs: float) -> dict:
    """A decode row's roofline columns (the module docstring)."""
    read = weights_read(model, batch) + kv_bytes
    return dict(read_gb=read / 1e9, floor_ms=read / copy_gbs / 1e6, gbs=read / ms_per_token / 1e6,
                floor_frac=read / copy_gbs / 1e6 / ms_per_token, copy_gbs=copy_gbs)


class Cells:
    """The engine of one (method, backend): prefill cells and the decode rows that follow them."""

    def __init__(self, model, method: str, backend: str, steps: int, fused_layers: str = "auto"):
        from oscar.backend import build_backend
        from oscar.engine import DecodeEngine

        self.model, self.steps, self.device = model, steps, model_device(model)
        self.method = bench_method(method, model)
        backend_ = build_backend(backend)
        prepare_fresh(model, self.method)  # as KVModel does, on the weights as built
        backend_.attach(model, self.method)
        self.engine = DecodeEngine(model, self.method, backend_, "auto", fused_layers=fused_layers)

    def _slot(self, batch: int, context: int, chunk: int, new_tokens: int):
        self.engine.prefill_chunk = chunk or None
        self.engine._slots.clear()
        return self.engine._slot([0] * batch, self.engine.capacity(context, new_tokens))

    def prefill(self, batch: int, context: int, chunk: int, decode: bool) -> list[dict]:
        """The prefill row (and, with ``decode``, the decode row after it: its roofline left to the caller)."""
        ids, mask = prompt(self.model, batch, context)
        reset_peak(self.device)
        slot = self._slot(batch, context, chunk, 2 * self.steps + 9 + PROFILED_STEPS)
        holder = {}
        seconds = wall_seconds(lambda: holder.update(logits=self.engine._prefill(ids, mask, slot.cache)), self.device)
        rows = [dict(part="prefill", fused_layers=self.engine.fused_layers, seconds=seconds,
                     peak_gib=peak_gib(self.device), kv_gib=slot.cache.nbytes / 2**30)]
        if decode:
            self.engine.decode(slot, holder["logits"].argmax(-1), 4, eos_token_ids=set())  # warm-up and capture
            sync(self.device)
            with step_events(self.engine) as events:
                ms = self.decode_more(slot, self.steps)
            kv_bytes = slot.cache.nbytes  # at the end of the timed steps
            split = {}
            if self.device.type == "cuda":
                split, ops = step_breakdown(lambda: self.decode_more(slot, PROFILED_STEPS), PROFILED_STEPS)
                log.info("a decode step's top GPU operations, %d x %d:\n%s", batch, context,
                         top_kernels(ops, PROFILED_STEPS))
            rows.append(dict(part="decode", fused_layers=self.engine.fused_layers, ms_per_token=ms,
                             tokens_per_s=batch / ms * 1e3, **events.split(), **split, peak_gib=peak_gib(self.device),
                             kv_bytes=kv_bytes, kv_gib=kv_bytes / 2**30))
        self.engine._slots.clear()
        return rows

    def decode_more(self, slot, steps: int) -> float:
        """``steps`` more greedy decode steps of ``slot`` (EOS ignored, the graph captured): ms per step."""
        seconds = wall_seconds(lambda: self.engine.decode(slot, slot.picked.clone(), steps + 1, eos_token_ids=set()),
                               self.device)
        return seconds / steps * 1e3

    def profile(self, batch: int, context: int, chunk: int, top: int = 15, steps: int = 16) -> str:
        """Where the time goes (the module docstring's ``--profile``): torch.profiler's table of one chunked prefill
        (GPU time; CPU time on a CPU), then on a GPU cProfile's of one more, the host-sync lines of a prefill and
        ``steps`` decode steps, those steps' GPU busy time and their host functions."""
        from torch.profiler import ProfilerActivity, profile

        ids, mask = prompt(self.model, batch, context)
        cuda = self.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            wall_seconds(lambda: self.engine._prefill(ids, mask, self._slot(batch, context, chunk, 8).cache),
                         self.device)
        table = prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=top)
        if not cuda:
            self.engine._slots.clear()
            return table
        lines = [table]
        host = cProfile.Profile()  # where a host-bound prefill's host time goes
        with host:
            wall_seconds(lambda: self.engine._prefill(ids, mask, self._slot(batch, context, chunk, 8).cache),
                         self.device)
        lines.append(f"host functions of the prefill by cumulative time:\n{host_table(host, 2 * top, 'cumulative')}")
        with sync_warnings() as caught:  # one more prefill, then decode: which lines made the host wait for the GPU
            slot = self._slot(batch, context, chunk, 4 * steps)
            logits = self.engine._prefill(ids, mask, slot.cache)
        prefill_syncs = sync_sites(caught)
        with sync_warnings() as caught:
            self.engine.decode(slot, logits.argmax(-1), steps, eos_token_ids=set())
        for what, sites in (("the prefill", prefill_syncs), (f"{steps} decode steps", sync_sites(caught))):
            lines.append(f"host syncs of {what}: {sum(sites.values())}, by line:")
            lines += [f"{count:6d}  {site}" for site, count in sites.most_common(top)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = self.decode_more(slot, steps)
        lines.append(decode_profile(prof.key_averages(), steps, wall, top))
        host = cProfile.Profile()
        with host:
            self.decode_more(slot, steps)
        self.engine._slots.clear()
        lines.append(f"host functions of {steps} decode steps by their own time:\n{host_table(host, top)}")
        return "\n".join(lines)


def with_ratios(rows: list[dict]) -> list[dict]:
    """vs_fp16 and vs_unfused per row (the module docstring), against fp16's rows and the configuration's own unfused
    decode rows of the same run."""
    def key(row):  # a decode step does not depend on how its prompt was prefilled; the largest batches: fp16's
        part = row["part"]
        if part in ("max_batch", "at_fp16_max_batch"):
            return "max_batch", row["context"]
        if part in ("prefill", "decode"):
            return part, row["batch"], row["context"], row["chunk"] if part == "prefill" else 0, row.get("fused_layers")
        return part, row["batch"], row["context"]

    def own(row):  # the configuration's own row of the same part and shape
        chunk = row["chunk"] if row["part"] == "prefill" else 0
        return row["method"], row["backend"], row["part"], row["batch"], row["context"], chunk

    fp16 = {key(r): r for r in rows if r["method"] == "fp16" and r["part"] in ("prefill", "decode", "max_batch")}
    whole = {}  # transformers' forward against fp16's first whole-prompt prefill (the first fused setting's)
    for r in rows:
        if r["method"] == "fp16" and r["part"] == "prefill" and r["chunk"] == 0:
            whole.setdefault((r["batch"], r["context"]), r)
    unfused = {own(r): r for r in rows if r["part"] in ("prefill", "decode") and r.get("fused_layers") == "off"}
    for row in rows:
        ref = whole.get((row["batch"], row["context"])) if row["part"] == "hf_forward" else fp16.get(key(row))
        if ref is None or row["part"] == "attention_kernel":
            row["vs_fp16"] = math.nan
        elif row["part"] == "hf_forward":
            row["vs_fp16"] = row["seconds"] / ref["seconds"]
        elif row["part"] == "max_batch":
            row["vs_fp16"] = row["tokens_per_s"] / ref["tokens_per_s"]
        elif "ms_per_token" in row:
            row["vs_fp16"] = ref["ms_per_token"] / row["ms_per_token"]
        else:
            row["vs_fp16"] = ref["seconds"] / row["seconds"]
        off = unfused.get(own(row))
        figure = "ms_per_token" if row["part"] == "decode" else "seconds"
        row["vs_unfused"] = off[figure] / row[figure] if off else math.nan
    return rows


def check_fused_layers(args) -> list[str]:
    """The engine settings of ``--fused-layers``; SystemExit naming the option where one cannot run here (before
    any weight is built: the architectures are built on the GPU, the registry models on the CPU)."""
    from transformers import AutoConfig

    from benchmarks.harness import ARCHITECTURES
    from oscar.backend import offered_layer_fusion
    from oscar.engine import resolve_fused_layers
    from oscar.models import build_config, load_spec

    settings = FUSED_SETTINGS[args.fused_layers]
    on_gpu = args.model in ARCHITECTURES
    config = AutoConfig.for_model(**ARCHITECTURES[args.model]) if on_gpu else build_config(load_spec(args.model))
    offered = offered_layer_fusion(config) is not None
    for setting in settings:
        try:
            resolve_fused_layers(setting, "cuda" if on_gpu else "cpu", offered)
        except ValueError as e:
            raise SystemExit(f"--fused-layers {args.fused_layers}: {e}") from None
    return settings


def run(args, bench: Run) -> None:
    settings = check_fused_layers(args)
    model = build_model(args.model)
    bench.derive = with_ratios
    device = model_device(model)
    copy_gbs = bench.copy_gbs  # measured once, before the caches take the memory

    def add(rows: list[dict], method: str, backend: str, batch: int, context: int, chunk: int = 0) -> None:
        for row in rows:
            kv = row.pop("kv_bytes", None)
            if row["part"] != "prefill" and kv is not None and (method == "fp16" or backend == "cupy"):
                row.update(roofline(model, batch, kv, row["ms_per_token"], copy_gbs))
            if row.get("gemm_ms"):
                row["gemm_gbs"] = weights_read(model, batch) / row["gemm_ms"] / 1e6
            row = bench.add(dict(model=args.model, method=method, backend=backend, batch=batch, context=context,
                               chunk=chunk, **row))
            log.info("%-18s %-10s %-6s B=%-3d T=%-7d chunk=%-5d %s", row["part"], method, backend, batch, context,
                     chunk, f"{row['seconds']:.2f} s" if "seconds" in row else
                     f"{row['ms_per_token']:.2f} ms/token" + (f", {row['floor_frac']:.0%} of its floor"
                                                              if "floor_frac" in row else "")
                     + (f", fused layers {row['fused_layers']}" if "fused_layers" in row else "")
                     + (f", {row['kernels_per_step']:.0f} kernels a step" if "kernels_per_step" in row else ""))

    for context, batch in args.prefill:
        if bench.budget.allows(f"hf_forward {context}x{batch}"):
            hf_forward(model, batch, min(context, 1024))  # warm-up
            add([dict(part="hf_forward", **hf_forward(model, batch, context))], "fp16", "transformers", batch,
                context)
    if device.type == "cuda" and bench.budget.allows("attention kernels"):
        for context, batch in args.prefill:
            for row in attention_kernels(model, batch, context, args.chunk):
                add([row], row.pop("method"), row.pop("backend"), batch, context, row.pop("chunk"))
    fp16_max_batch = None
    for method, backend in [("fp16", "torch")] + [(m, "cupy") for m in args.kernels] + [(m, "torch")
                                                                                        for m in args.mirrors]:
        if not bench.budget.allows(f"{method}/{backend}"):
            continue
        for setting in settings:
            first = setting == settings[0]  # whole-prompt prefills and the profile once
            cells = Cells(model, method, backend, args.steps, setting)
            shapes = args.prefill + args.decode
            warm = min(2048, min(c for c, _ in shapes))  # kernel compiles, the allocator, cuBLAS plans
            cells.prefill(max(b for _, b in shapes), warm, warm // 2, decode=True)
            # fp16 and OScaR's kernels: whole and chunked; the others chunked (what long-context tasks run)
            chunks = [0, args.chunk] if (method, backend) in (("fp16", "torch"), ("oscar", "cupy")) else [args.chunk]
            chunks = chunks if first else chunks[-1:]
            for context, batch in args.prefill:
                for chunk in chunks:
                    if bench.budget.allows(f"{method}/{backend} ({setting}) prefill {context}x{batch} chunk {chunk}"):
                        rows = cells.prefill(batch, context, chunk, decode=chunk == chunks[0])
                        add(rows, method, backend, batch, context, chunk)
            if args.profile and first and bench.budget.allows(f"{method}/{backend} profile"):
                context, batch = args.prefill[0]
                log.info("profile of %s/%s, prefill %dx%d in chunks of %d:\n%s", method, backend, context, batch,
                         args.chunk, cells.profile(batch, context, args.chunk))
            for context, batch in args.decode:
                if bench.budget.allows(f"{method}/{backend} ({setting}) decode {context}x{batch}"):
                    rows = cells.prefill(batch, context, args.chunk, decode=True)
                    add([r for r in rows if r["part"] == "decode"], method, backend, batch, context, args.chunk)
            cells.engine.unfuse()  # the model as built for the next configuration (merged projections split)
            del cells
        if args.max_batch_context:
            fp16_max_batch = max_batch_rows(args, bench, model, method, backend, fp16_max_batch, add)


def max_batch_rows(args, bench: Run, model, method: str, backend: str, fp16_batch: int | None, add) -> int | None:
    """The largest-batch rows of one configuration at ``--max-batch-context`` (decode over filled caches): at fp16's
    largest batch, then at its own. fp16's largest batch (the one its rows set, else ``fp16_batch`` as it was)."""
    context, device = args.max_batch_context, model_device(model)
    memory = None if args.memory is None else args.memory * 2**30
    if device.type != "cuda" and memory is None:
        log.info("largest batches on a CPU need --memory: skipped")
        return fp16_batch
    if method != "fp16" and fp16_batch and bench.budget.allows(f"{method} at fp16's largest batch"):
        row = filled.decode_cell(model, method, backend, "auto", fp16_batch, context, args.steps)
        if row is not None:
            add([dict(part="at_fp16_max_batch", **_filled_row(row))], method, backend, fp16_batch, context)
    if not bench.budget.allows(f"{method}/{backend} largest batch"):
        return fp16_batch
    row = filled.largest_batch(model, method, backend, context, args.steps, memory, mode="auto")
    add([dict(part="max_batch", **_filled_row(row))], method, backend, row["batch"], context)
    return row["batch"] if method == "fp16" else fp16_batch


def _filled_row(row: dict) -> dict:
    """A decode row of benchmarks.filled as this question's columns."""
    return dict(ms_per_token=row["ms_per_token"], tokens_per_s=row["tokens_per_s"], kv_bytes=row["kv_bytes"],
                kv_gib=row["kv_bytes"] / 2**30, peak_gib=row["peak_gib"],
                **({"step_ms": row["step_ms"]} if "step_ms" in row else {}))


# ----------------------------------------------------------------------------- the README's table and the figure


def table(rows: list[dict]) -> str:
    """One run's rows: seconds or ms per token, fp16's over the row's, the roofline, peak memory."""
    from benchmarks.report import context, num, percent, ratio
    from evals.tables import markdown

    header = ["part", "method (backend)", "B x context", "chunk", "s / ms per token", "tokens/s", "vs fp16",
              "vs unfused", "kernels / step", "GPU ms: " + " / ".join(STEP_GROUPS), "GEMM GB/s",
              "GB a step reads", "GB/s", "% of floor", "peak GiB"]
    body = []
    for r in rows:
        decode = r.get("ms_per_token") is not None
        fused = f", fused {r['fused_layers']}" if r.get("fused_layers") else ""
        body.append([r["part"], f"{r['method']} ({r['backend']}{fused})", f"{r['batch']} x {context(r['context'])}",
                     r["chunk"] or "whole", f"{r['ms_per_token']:.2f} ms" if decode else f"{r['seconds']:.2f} s",
                     num(r.get("tokens_per_s"), 0), ratio(r.get("vs_fp16")), ratio(r.get("vs_unfused")),
                     num(r.get("kernels_per_step"), 0), step_split(r), num(r.get("gemm_gbs"), 0),
                     num(r.get("read_gb")), num(r.get("gbs"), 0),
                     percent(r.get("floor_frac")), num(r.get("peak_gib"), 1)])
    return markdown(header, body)


def step_split(row: dict) -> str:
    """A decode row's GPU time a step by group, in STEP_PARTS' order then torch ('1.20 / 5.61 / ...'), '–' where it
    has none."""
    times = [row.get(f"{part}_ms") for part in STEP_GROUPS]
    if not all(isinstance(t, float) and not math.isnan(t) for t in times):
        return "–"
    return " / ".join(f"{t:.2f}" for t in times)


def pictured_run(rows: list[dict]) -> list[dict]:
    """The run the figure draws: the newest of those that measured the most methods (a run of a few, a profile say,
    does not replace the fuller picture)."""
    from benchmarks.report import runs

    return max(runs(rows), key=lambda run: len({r["method"] for r in run}))  # the first of the largest: the newest


def figure(rows: list[dict], path) -> None:
    """Four panels of :func:`pictured_run`: the chunked prefill and the decode step against fp16 (fp16's time over the
    method's: > 1 is faster), one bar per shape; each decode row's share of its byte floor (the roofline); and where
    the GPU time of a step goes at the first decode shape (:func:`step_panel`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import context
    from oscar.atomic import save_figure

    rows = pictured_run(rows)

    def label(r):
        return f"{r['method']} ({r['backend']}" + (f", fused {r['fused_layers']})" if r.get("fused_layers") else ")")

    def shape(r):
        if r["part"] == "max_batch":
            return f"largest batch x {context(r['context'])}"
        return f"{r['batch']} x {context(r['context'])}" + (" (fp16's largest)" if r["part"] == "at_fp16_max_batch"
                                                             else "")

    decode_parts = ("decode", "at_fp16_max_batch", "max_batch")
    panels = [("chunked prefill: fp16's time / method's", "vs_fp16",
               [r for r in rows if r["part"] == "prefill" and r["chunk"] and r["method"] != "fp16"]),
              ("decode: fp16's time per token / method's (largest: tokens/s)", "vs_fp16",
               [r for r in rows if r["part"] in decode_parts and r["method"] != "fp16"]),
              ("decode: share of its byte floor (weights + stored KV)", "floor_frac",
               [r for r in rows if r["part"] in decode_parts and isinstance(r.get("floor_frac"), float)])]
    shapes = list(dict.fromkeys(shape(r) for r in rows if r["part"] in ("prefill",) + decode_parts))
    colors = {s: f"C{i}" for i, s in enumerate(shapes)}
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.2), squeeze=False)
    step_panel(axes[0][3], [r for r in rows if r["part"] == "decode"], label, shape)
    for ax, (title, key, sel) in zip(axes[0], panels):
        sel = [r for r in sel if isinstance(r.get(key), float) and not math.isnan(r[key])]
        methods = list(dict.fromkeys(label(r) for r in sel))
        present = [s for s in shapes if any(shape(r) == s for r in sel)]
        width = 0.8 / max(len(present), 1)
        for j, s in enumerate(present):
            by = {label(r): r[key] for r in sel if shape(r) == s}
            xs = [i + (j - (len(present) - 1) / 2) * width for i, m in enumerate(methods) if m in by]
            ax.bar(xs, [by[m] for m in methods if m in by], width, color=colors[s], label=s)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if not present:
            ax.text(0.5, 0.5, "not in this run", ha="center", va="center", transform=ax.transAxes)
    first = rows[0]
    fig.suptitle(f"The user path, {first['model']} architecture, {first['gpu']}, {str(first['date'])[:10]}",
                 fontsize=10)
    # one legend for the shapes, above the panels (inside one it would hide bars)
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in shapes], shapes, loc="upper right",
               ncol=len(shapes), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def step_panel(ax, rows: list[dict], label, shape) -> None:
    """Stacked bars: each decode row's GPU time a step by group (gemm, attention, ...) at the first decode shape that
    has them, and its byte floor as a black tick."""
    rows = [r for r in rows if step_split(r) != "–"]
    if not rows:
        ax.text(0.5, 0.5, "not in this run", ha="center", va="center", transform=ax.transAxes)
        return
    first = shape(rows[0])
    rows = [r for r in rows if shape(r) == first]
    bottom = [0.0] * len(rows)
    for i, part in enumerate(STEP_GROUPS):
        heights = [r[f"{part}_ms"] for r in rows]
        ax.bar(range(len(rows)), heights, 0.6, bottom=bottom, color=f"C{i + 4}", label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    floors = [(i, r["floor_ms"]) for i, r in enumerate(rows) if isinstance(r.get("floor_ms"), float)]
    ax.scatter([i for i, _ in floors], [f for _, f in floors], marker="_", s=300, color="black",
               label="byte floor", zorder=3)
    ax.set_xticks(range(len(rows)), [label(r) for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GPU ms a step", fontsize=8)
    ax.set_title(f"decode at {first}: GPU time a step by kernel group", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
