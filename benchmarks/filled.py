"""Decode over a cache filled as a prefill would leave it: the cells of the questions that decode at contexts or
batches a real prefill would take minutes to reach (long contexts, the largest batches, models over several GPUs).

A real prefill of 17 x 128K tokens through an 8B model costs minutes and changes no decode cost, so the engine's
static cache is written directly: random codes with plausible parameters in each method's packed storage
(:func:`fill_storage`), normal windows and kept tokens, token counts as the method's flush policy leaves them
(:func:`fill`). :func:`decode_cell` times the engine's own decode loop over it (``DecodeEngine.decode``: what
``generate`` runs after the prefill), :func:`largest_batch` finds the largest batch that fits.
"""

from __future__ import annotations

import logging
import time

import torch

from benchmarks.harness import bench_method, peak_gib, prepare_fresh, reset_peak, sync

log = logging.getLogger("benchmarks")

#: bytes left free on each GPU when sizing the largest batch (activations, logits, the captured graph's pool)
HEADROOM = 6 * 2**30
#: bytes per sequence beside its cache when sizing the largest batch (the step's activations)
PER_SEQUENCE = 256 * 2**20


def fill_storage(method: str, keys: dict, values: dict, bits: int, zero_point: str | None = None) -> None:
    """Random codes and plausible parameters in a method's packed storage (kernels.ops.empty_storage): scales of a few
    hundredths, zeros that are group minima (float zero point: KIVI's default) or integer codes, TurboQuant+'s fp16
    corrected norms near 1, OScaR's fp32 token norms of real keys."""
    zero_point = zero_point or ("float" if method == "kivi" else "int")
    for store in (keys, values):
        store["codes"].random_(0, 256)
        if "scale" in store:
            store["scale"].uniform_(0.002, 0.05)
            if zero_point == "float":
                store["zero"].uniform_(-0.1, 0.0)  # the group min
            else:
                store["zero"].random_(0, 2**bits)
        else:
            store["norm"].uniform_(0.5, 2.0)
    if method == "oscar":
        keys["norm"].uniform_(1.0, 20.0)


def fill(engine, batch: int, context: int, capacity: int):
    """A slot of ``engine`` whose cache holds ``context`` tokens per row after a prefill, written directly (the
    module docstring), so no prompt-sized transient limits the batch. Each layer's storage on its layer's device (a
    model split over GPUs: oscar.placement)."""
    from kernels.backend import CupyKVCache
    from oscar.placement import layer_devices
    from oscar.row_groups import CountedRowGroup

    c = engine.model.config.get_text_config()
    dtype = next(engine.model.parameters()).dtype
    slot = engine._slot([0] * batch, capacity)
    cache, method = slot.cache, engine.method
    keys_packed, values_packed = method.flush_policy.packed(context)
    devices = layer_devices(engine.model)
    for layer, device in zip(cache.layers, devices, strict=True):
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
    for device in set(devices):
        cache.lengths_on(device).fill_(context)
    cache.decoding = True
    sync(devices[0])
    return slot


def time_decode(engine, slot, steps: int) -> dict:
    """``steps`` greedy steps of the engine's decode loop after a warm-up that also captures the graph:
    ``ms_per_token`` (wall clock of the loop: host bookkeeping, flushes and the EOS check included) and
    ``tokens_per_s``; in graph mode ``step_ms``, the GPU time of one replay alone (CUDA events)."""
    b = len(slot.ids)
    device = slot.ids.device
    first = torch.randint(0, engine.model.config.get_text_config().vocab_size, (b,), device=device)
    engine.decode(slot, first, 3, eos_token_ids=set())  # warm-up: an eager step, the capture (graph mode)
    sync(device)
    start = time.perf_counter()
    engine.decode(slot, first, steps + 1, eos_token_ids=set())  # steps decode steps
    sync(device)
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
        row["step_ms"] = sum(begin.elapsed_time(end) for begin, end in events) / steps
    return row


def decode_cell(model, method_name: str, backend_name: str, mode: str, batch: int, context: int,
                steps: int) -> dict | None:
    """One decode cell over a filled cache, or None if the batch does not fit: the row of :func:`time_decode` with
    ``kv_bytes`` (the cache's real stored bytes, ``nbytes``; NaN for a mirror method: its packed chunks are not
    written by the fill), ``allocated_bytes`` (what its storage holds) and ``peak_gib`` (the fullest GPU's)."""
    from oscar.backend import build_backend
    from oscar.engine import DecodeEngine

    method, backend = bench_method(method_name, model), build_backend(backend_name)
    engine = DecodeEngine(model, method, backend, mode)
    prepare_fresh(model, method)  # as KVModel does, on the weights as built
    backend.attach(model, method)
    device = next(model.parameters()).device
    reset_peak(device)
    try:
        slot = fill(engine, batch, context, engine.capacity(context, 3 * steps + 8))
        row = time_decode(engine, slot, steps)
        mirror = backend_name == "torch" and method_name != "fp16"
        row.update(kv_bytes=float("nan") if mirror else slot.cache.nbytes, allocated_bytes=slot.cache.allocated_bytes)
    except torch.OutOfMemoryError:
        return None
    finally:
        engine._slots.clear()
    row["peak_gib"] = peak_gib(device)
    reset_peak(device)
    return dict(method=method_name, backend=backend_name, decode=engine.mode, batch=batch, **row)


def allocated_per_sequence(model, method_name: str, backend_name: str, context: int, steps: int) -> int:
    """Bytes one sequence's static cache holds at ``context`` (+ the steps' tokens): a batch-1 cache, allocated and
    filled, not timed."""
    from oscar.backend import build_backend
    from oscar.engine import DecodeEngine

    method, backend = bench_method(method_name, model), build_backend(backend_name)
    engine = DecodeEngine(model, method, backend, "eager")
    prepare_fresh(model, method)
    backend.attach(model, method)
    try:
        return fill(engine, 1, context, engine.capacity(context, 3 * steps + 8)).cache.allocated_bytes
    finally:
        engine._slots.clear()
        reset_peak(next(model.parameters()).device)


def batch_estimate(model, per_sequence: int, memory: float | None = None) -> int:
    """The batch whose caches fit beside the model: on each GPU holding decoder layers, its free memory less
    :data:`HEADROOM` over its layers' share of a sequence's cache plus :data:`PER_SEQUENCE` (the GPU that fills
    first bounds it); or, given ``memory`` (bytes for the caches alone: a CPU has no free-memory count), that over a
    sequence's cache."""
    from collections import Counter

    from oscar.placement import layer_devices

    layers = Counter(layer_devices(model))
    total = sum(layers.values())
    fits = []
    for device, count in layers.items():
        if memory is not None:
            fits.append(int(memory // (per_sequence * count / total)))
            continue
        if device.type != "cuda":
            raise ValueError("the largest batch on a CPU needs the memory its caches may take (no free-memory count)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        free = (torch.cuda.mem_get_info(index)[0] + torch.cuda.memory_reserved(index)
                - torch.cuda.memory_allocated(index) - HEADROOM)
        fits.append(int(free // (per_sequence * count / total + PER_SEQUENCE)))
    return max(1, min(fits))


def largest_batch(model, method_name: str, backend_name: str, context: int, steps: int, memory: float | None = None,
                  mode: str = "graph") -> dict:
    """The largest batch whose filled cache and decode step fit: estimated from one sequence's allocated cache and the
    free memory (:func:`batch_estimate`), then verified by allocating and decoding (:func:`decode_cell`), stepping
    down (by 7%, or by one below 12) until it fits. Its decode row."""
    per_sequence = allocated_per_sequence(model, method_name, backend_name, context, steps)
    batch = batch_estimate(model, per_sequence, memory)
    log.info("%s/%s at %d tokens: %.2f GiB a sequence, batch %d estimated", method_name, backend_name, context,
             per_sequence / 2**30, batch)
    while batch >= 1:
        row = decode_cell(model, method_name, backend_name, mode, batch, context, steps)
        if row is not None:
            return row
        batch = int(batch * 0.93) if batch > 12 else batch - 1
    raise RuntimeError(f"{method_name}/{backend_name}: not even batch 1 fits at {context} tokens")
