"""Where a measured time goes: the decode step split into its GPU time and the host's time between steps (CUDA
events), the lines that make the host wait for the GPU (torch.cuda's sync debug mode), a profiled step's GPU busy
time and its GPU time by what the kernels do, and the host's functions by their time (cProfile)."""

from __future__ import annotations

import cProfile
import io
import pstats
import re
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from oscar.paths import REPO_ROOT


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


def decode_profile(averages, steps: int, wall_ms: float, top: int) -> str:
    """``steps`` decode steps under torch.profiler: the GPU's busy time per step (every op's own device time:
    kernels and copies) against the wall clock's (the rest: the GPU idle, the tracer's own gaps included: the decode
    rows' step_ms and between_ms are the untraced split), and the ``top`` ops by their own GPU time."""
    busy = sum(e.self_device_time_total for e in averages) / steps / 1e3
    head = (f"decode steps: {wall_ms:.2f} ms/step wall, GPU busy {busy:.2f} ms/step "
            f"({busy / wall_ms:.0%}; idle {wall_ms - busy:.2f} ms/step)")
    return head + "\n" + averages.table(sort_by="self_device_time_total", row_limit=top)


#: a decode step's GPU operations by what they do, from the kernel's name (first match wins: FlashAttention's
#: ``splitkv`` kernels are attention, cuBLAS's ``splitKreduce`` a GEMM's; the rest is ``torch``: torch's own
#: elementwise ops, copies, reductions and the sampling). The names are this repository's kernels (kernels/*.cu),
#: cuBLAS / cuBLASLt's GEMMs and FlashAttention's.
STEP_PARTS = {"attention": re.compile(r"^(decode_attention|combine|rotatekv_scores)$|flash|fmha", re.I),
              "gemm": re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitKreduce", re.I),
              "cache": re.compile(r"^(append_residual|finish_step|hadamard_rows|hadamard_step|quantize_\w+|"
                                  r"dequantize\w*|rotatekv_(de)?quantize)$"),
              "layers": re.compile(r"^(rms_norm|add_rms_norm|rotary|silu_mul)$")}
#: every group of a step's split: STEP_PARTS', then ``torch``
STEP_GROUPS = (*STEP_PARTS, "torch")


def step_part(kernel: str) -> str:
    """The :data:`STEP_PARTS` group of a GPU operation's name, else ``torch``."""
    return next((part for part, pattern in STEP_PARTS.items() if pattern.search(kernel)), "torch")


def split_step(ops, steps: int) -> dict[str, float]:
    """GPU operations (objects with ``name`` and ``device_time_total`` in us) recorded over ``steps`` decode steps:
    ``kernels_per_step`` and, per :data:`STEP_PARTS` group and ``torch``, ``<group>_ms`` (its GPU time a step) and
    ``<group>_kernels`` (its operations a step)."""
    split = {"kernels_per_step": len(ops) / steps}
    for part in STEP_GROUPS:
        split[f"{part}_ms"] = split[f"{part}_kernels"] = 0.0
    for op in ops:
        part = step_part(op.name)
        split[f"{part}_ms"] += op.device_time_total / 1e3 / steps
        split[f"{part}_kernels"] += 1 / steps
    return split


class RecordedOp(NamedTuple):
    """One operation a profiler recorded: its name and its time in us (a GPU operation's is what torch's
    ``FunctionEvent.device_time_total`` gives it)."""

    name: str
    device_time_total: float


def recorded_ops(prof, device: str = "cuda") -> list[RecordedOp]:
    """The operations finished torch.profiler ``prof`` recorded on ``device`` ("cuda" or "cpu"), read from its raw
    events. ``prof.events()`` would parse each into a FunctionEvent first: about 40 us an event, a minute or more
    for an evaluation replay's million GPU operations, against a second for this."""
    from torch.autograd import DeviceType

    kind = {"cuda": DeviceType.CUDA, "cpu": DeviceType.CPU}[device]
    return [RecordedOp(e.name(), e.duration_ns() / 1e3) for e in prof.profiler.kineto_results.events()
            if e.device_type() == kind]


def step_breakdown(run_steps, steps: int) -> tuple[dict[str, float], list[RecordedOp]]:
    """``run_steps()`` (``steps`` decode steps) under torch.profiler: :func:`split_step` of its GPU operations (a CUDA
    graph's replay records each of its nodes: kernels, copies, memsets), and those operations."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps()
        torch.cuda.synchronize()
    ops = recorded_ops(prof)
    return split_step(ops, steps), ops


def top_kernels(ops, steps: int, top: int = 12) -> str:
    """The ``top`` GPU operations of :func:`step_breakdown` by their GPU time, one line each: ms and count a step,
    group and name (cut at 90 characters)."""
    time, count = Counter(), Counter()
    for op in ops:
        time[op.name] += op.device_time_total / 1e3 / steps
        count[op.name] += 1 / steps
    return "\n".join(f"{ms:8.3f} ms {count[name]:6.1f} x  {step_part(name):9s} {name[:90]}"
                     for name, ms in time.most_common(top))


def host_table(host: cProfile.Profile, top: int, sort: str = "tottime") -> str:
    """cProfile's ``top`` functions by their own time (or pstats' ``sort`` key; pstats' table, paths relative to the
    repository)."""
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats(sort).print_stats(top)
    return text.getvalue().replace(str(REPO_ROOT) + "/", "").strip()
