"""The prefill's torch path: what each method's torch calls cost a prefill chunk, counted on any device.

On backend=cupy most of a chunked prefill runs in kernels, but not all of it: the methods whose kernel variant flushes
with the method's own quantizer (OSCAR's Lloyd-Max codebook: kernels.variant.OwnQuantizer) quantize each
chunk in torch, and a variant without a dequantize kernel (``reads_packed`` false; every variant has them now)
would read every chunk's stored prefix back in torch (CupyStorage.packed: ``method_layouts.load_packed`` from the
decode layouts into the method's, then the method's ``dequantize``), a part that grows with the prompt. On a GPU each
of those torch operations is (about) one kernel launch that reads its inputs and writes its output through device
memory. This question runs those torch calls on one chunk [batch, H, tokens, D] of the model's attention shape
(random K/V in bf16; the method prepared on a one-layer random-weight model of that architecture, as the user path
builds it): ``quantize_keys`` / ``quantize_values`` and ``dequantize_keys`` / ``dequantize_values`` for every method,
and ``load_packed_keys`` / ``load_packed_values`` where the prefix is read back in torch; each once uncounted (what a
method caches once: codebooks, tables), then once under a dispatch mode that counts:

- ``ops``: operations that compute (views, reshapes and metadata-only calls are not counted);
- ``bytes``: the bytes those operations read and write (each one's distinct tensor arguments read, its results
  written, as their elements; a broadcast input counts its stored bytes): about the device-memory traffic, above it
  where a GPU's cache serves a re-read;
- ``bytes_per_token``: ``bytes`` over the chunk's tokens (batch x tokens), and ``passes``: ``bytes`` over the bytes
  of the chunk's own bf16 K or V, i.e. how many times the call moves its input's size;
- ``cupy_reads_packed`` (the prefix-read calls): whether backend=cupy reads that stream's prefix through a kernel.

The lines that move the most bytes go to the log, and, for each method whose backend=cupy prefill reads its prefix in
torch, the bytes that read costs one layer over a ``--prompt``-token prompt in ``--chunk``-token chunks (each chunk
reads all tokens packed before it): set them against a user-path row's prefill time over fp16's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import ARCHITECTURES, Run, bench_method, build_model, method_name, model_name
from kernels import method_layouts
from kernels.storage import empty_storage
from kernels.variant import KERNELS
from oscar.method import TokenSpan, attention_shape
from oscar.paths import REPO_ROOT

log = logging.getLogger("benchmarks.prefill_census")

METHODS = ["kivi", "oscar", "quarot", "turboquant", "ott", "rotatekv", "spectral"]
DEVICE = "cpu"  # counted, not timed: the torch calls run on the CPU
FIELDS = ["model", "method", "call", "batch", "tokens", "ops", "bytes", "bytes_per_token", "passes",
          "cupy_reads_packed"]
#: where the attributed line is looked for: the project's own code
OWN_CODE = tuple(str(REPO_ROOT / part) for part in ("methods", "oscar", "kernels"))


#: operations that launch nothing and move no bytes (beside the views)
_NO_DATA = {torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.alias, torch.ops.aten.detach,
            torch.ops.aten.lift_fresh, torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
            torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel, torch.ops.aten.is_same_size,
            torch.ops.aten._local_scalar_dense}


def _metadata_only(func) -> bool:
    """Views, reshapes and other calls that launch nothing and move no bytes."""
    return func.is_view or func.overloadpacket in _NO_DATA


def _stored_bytes(t: torch.Tensor) -> int:
    """Bytes an operation touches for tensor ``t``: its elements, at most its storage (a broadcast view)."""
    elements = t.numel() * t.element_size()
    try:
        return min(elements, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass)
        return elements


def _distinct_bytes(tree) -> int:
    """The bytes of the distinct tensors in a (nested) argument or result."""
    tensors = {id(t): t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)}
    return sum(_stored_bytes(t) for t in tensors.values())


def _own_line() -> str:
    """The innermost caller in the project's own code: 'methods/rotatekv.py:330 (quantize_keys)'."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(OWN_CODE):
            return f"{Path(name).relative_to(REPO_ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "(elsewhere)"


class Census(TorchDispatchMode):
    """Counts the computing operations run inside it and their bytes by line: each one's distinct tensor arguments
    as read, its results as written (an in-place operation reads and writes its tensor)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.bytes = 0
        self.by_line: Counter = Counter()
        self.ops_by_line: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _metadata_only(func):
            return out
        moved = _distinct_bytes((args, kwargs)) + _distinct_bytes(out)  # read, then written
        line = _own_line()
        self.ops += 1
        self.bytes += moved
        self.by_line[line] += moved
        self.ops_by_line[line] += 1
        return out


def one_layer_model(name: str):
    """The architecture's attention (heads, KV heads, head_dim, RoPE) in one random-weight layer, small MLP and
    vocabulary, in float32 on the CPU: what the methods prepare on (RotateKV's RoPE tables, OSCAR's rotations, the
    value folds). A registry model as it is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in ARCHITECTURES:
        return build_model(name)
    config = AutoConfig.for_model(**{**ARCHITECTURES[name], "num_hidden_layers": 1, "intermediate_size": 256,
                                     "vocab_size": 256})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def census(method_name: str, model_name: str, batch: int, tokens: int) -> list[dict]:
    """The torch calls of one chunk of ``method_name``: its rows (see the module docstring)."""
    model = one_layer_model(model_name)
    method = bench_method(method_name, model)
    method.prepare_model(model)
    head_dim, heads = attention_shape(model.config)
    gen = torch.Generator().manual_seed(1)
    x = {stream: torch.randn(batch, heads, tokens, head_dim, generator=gen).to(torch.bfloat16)
         for stream in ("keys", "values")}
    state = method.new_state(batch, heads, "cpu")
    if "sinks" in state:  # RotateKV: what its prefill hook finds (the first tokens, as a real model's sinks are)
        state["sinks"][..., :] = torch.arange(state["sinks"].shape[-1])
    variant = KERNELS[method_name] if method_name in KERNELS else None
    chunk_bytes = x["keys"].numel() * x["keys"].element_size()
    rows, lines, line_ops = [], Counter(), Counter()

    def count(call: str, run, **extra) -> None:
        """One uncounted call of ``run`` (it fills what the method caches once: codebooks, tables, as a prefill's
        first chunk does), then one counted: a row."""
        run()
        with Census() as counted:
            run()
        rows.append({**_row(method_name, call, counted, batch, tokens, chunk_bytes), **extra})
        lines.update(counted.by_line)
        line_ops.update(counted.ops_by_line)

    for stream in ("keys", "values"):
        quantize = method.quantize_keys if stream == "keys" else method.quantize_values

        def packed_chunk(**span_options):
            span = TokenSpan(torch.arange(batch), 0, state, **span_options)
            return quantize(x[stream], 0, span=span) if method.uses_span else quantize(x[stream], 0)

        # the flush: the tokens the method keeps exactly are the cache's to store (OwnQuantizer.store_own)
        count(f"quantize_{stream}", lambda: packed_chunk(kept_elsewhere=True))
        reads_packed = "" if variant is None else variant.reads_packed(stream)
        packed = packed_chunk(fixed_shapes=True)  # with its kept tokens, as CupyStorage.packed gives them
        if variant is not None and variant.exact and not reads_packed:
            # the prefix read's first step (CupyStorage.packed): the storage's decode layouts back into the method's
            order = variant.channel_order(method, 0, heads * head_dim)
            store = _stored(variant, method, stream, packed_chunk(kept_elsewhere=True), order)
            count(f"load_packed_{stream}", lambda: method_layouts.load_packed(
                variant.kernel, stream, store, list(range(batch)), 0, tokens, packed, order), cupy_reads_packed=False)
        count(f"dequantize_{stream}", lambda: method.dequantize(packed), cupy_reads_packed=reads_packed)
    top = "\n".join(f"  {b / chunk_bytes:8.1f} chunk sizes {line_ops[line]:4d} ops  {line}"
                    for line, b in lines.most_common(8))
    log.info("%s: the lines moving the most bytes (over the chunk's bf16 K size, %.1f MB):\n%s", method_name,
             chunk_bytes / 1e6, top)
    return rows


def _stored(variant, method, stream: str, packed, order) -> dict[str, torch.Tensor]:
    """The storage of ``stream`` (the variant's decode layouts, kernels.storage.empty_storage) holding the chunk
    ``packed`` [B, H, T, D] from token 0, written as backend=cupy's flushes leave it."""
    b, h, t, d = packed.shape
    stores = empty_storage(variant.kernel, b, h, t, d, k_bits=method.k_bits, v_bits=method.v_bits,
                           group_size=variant.group(method, d), dtype=packed.dtype, device="cpu")
    store = stores[0] if stream == "keys" else stores[1]
    method_layouts.store_packed(variant.kernel, stream, packed, store, list(range(b)), [0] * b, order)
    return store


def _row(method: str, call: str, counted: Census, batch: int, tokens: int, chunk_bytes: int) -> dict:
    return dict(method=method, call=call, batch=batch, tokens=tokens, ops=counted.ops, bytes=counted.bytes,
                bytes_per_token=counted.bytes / (batch * tokens), passes=counted.bytes / chunk_bytes)


def prefix_bytes(rows: list[dict], prompt: int, chunk: int) -> dict[str, float]:
    """Per method whose backend=cupy prefill reads its stored prefix back in torch: the bytes one layer's reads of
    it move over one sequence's ``prompt``-token prefill in ``chunk``-token chunks, keys and values (chunk i reads
    the tokens packed before it: i * chunk, less the window's R at most)."""
    prefix_tokens = sum(i * chunk for i in range(prompt // chunk))
    per_token: dict[str, float] = {}
    for row in rows:
        if row["call"].startswith(("load_packed", "dequantize")) and row.get("cupy_reads_packed") is False:
            per_token[row["method"]] = per_token.get(row["method"], 0.0) + row["bytes_per_token"]
    return {method: prefix_tokens * b for method, b in per_token.items()}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text}")
    return value


def add_arguments(p) -> None:
    p.add_argument("--model", type=model_name, default="llama-3.1-8b",
                   help="an architecture of benchmarks.harness.ARCHITECTURES, or a registry tiny model")
    p.add_argument("--methods", type=method_name, nargs="+", default=METHODS)
    p.add_argument("--batch", type=positive, default=1)
    p.add_argument("--tokens", type=positive, default=8192, help="the chunk's tokens")
    p.add_argument("--prompt", type=positive, default=131072, help="one sequence's prompt, for the prefix "
                   "projection")
    p.add_argument("--chunk", type=positive, default=8192, help="the prefill chunk of the prefix projection")


def run(args, bench: Run) -> None:
    rows = []
    for name in args.methods:
        with torch.no_grad():
            new = census(name, args.model, args.batch, args.tokens)
        for row in new:
            bench.add(dict(model=args.model, **row))
            log.info("%-10s %-18s %5d ops  %9.1f MB  %7.1f B/token  %5.1f passes", name, row["call"], row["ops"],
                     row["bytes"] / 1e6, row["bytes_per_token"], row["passes"])
        rows += new
    for method, moved in prefix_bytes(rows, args.prompt, args.chunk).items():
        log.info("%s: its torch read of the stored prefix moves %.1f GB per layer over a %d-token prefill in "
                 "%d-token chunks", method, moved / 1e9, args.prompt, args.chunk)
