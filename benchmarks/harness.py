"""What every benchmark needs once: the models, a method ready to time, timing, a time budget, where and on what
code it ran, and one row schema written atomically.

- Models: :data:`ARCHITECTURES` (Llama-3.1-8B and Qwen3-8B as their hub configs declare them) built with random bf16
  weights on the GPU (a decode or prefill costs what it costs whatever the weights hold), or a registry model
  (tiny-llama, ...) with its seeded random weights in float32 on the CPU: :func:`build_model`.
- Methods: :func:`bench_method` (the paper's defaults; calibrated methods without their files: RotateKV's identity
  channel order, OSCAR's random rotations) and :func:`prepare_fresh` (a method's weight folds on the weights as built,
  so that several methods are timed on one model one after another).
- Timing: :func:`captured_ms` (a call captured in a CUDA graph, each replay timed by CUDA events; each call timed by
  ``perf_counter`` on a CPU), :func:`wall_seconds`, :class:`Budget` (cells that would start after it are skipped).
- Provenance: :class:`Run` measures the device's name and copy bandwidth once, reads the code version once
  (:func:`code_version`), and writes every row as :data:`HEAD` (question, GPU, date, code version, the command's
  arguments) followed by the question's measured fields, after the rows earlier runs left in the CSV; the whole CSV
  rewritten atomically after each row, so that a run cut short keeps what it measured and what was there.
"""

from __future__ import annotations

import argparse
import csv
import functools
import logging
import math
import platform
import shlex
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

import torch

from oscar.atomic import atomic_open, torch_save
from oscar.provenance import code_version as provenance_code_version
from oscar.paths import REPO_ROOT

log = logging.getLogger("benchmarks")

#: the columns every row starts with: what was asked, on what, when, on which code, with which arguments
HEAD = ("question", "gpu", "date", "code_version", "arguments")
#: a benchmark's results folder: one CSV per question
RESULTS = REPO_ROOT / "results" / "efficiency"

#: the architectures of the hub checkpoints (meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-8B); RoPE scaling is left
#: out (it changes no shape and no cost)
ARCHITECTURES = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=262144, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=262144, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
}


# ----------------------------------------------------------------------------- models and methods


def build_model(name: str, positions: int | None = None, **overrides) -> torch.nn.Module:
    """An architecture of :data:`ARCHITECTURES` with random bf16 weights on the GPU (``positions``: its RoPE tables
    made that long; ``overrides``: other config fields; one line and exit without a GPU), or a registry model's seeded
    random weights in float32 on the CPU. Eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in ARCHITECTURES:
        from oscar.models import build_config, load_spec

        spec = load_spec(name)  # an unknown name: ValueError listing the registry's models
        spec.config = {**spec.config, **overrides, **({"max_position_embeddings": positions} if positions else {})}
        torch.manual_seed(spec.seed)
        return AutoModelForCausalLM.from_config(build_config(spec), dtype=torch.float32).eval()
    if not torch.cuda.is_available():
        raise SystemExit(f"{name}: the random-weight 8B architectures are built on a GPU and this machine has none; "
                         "a registry tiny model runs on a CPU (e.g. --model tiny-llama)")
    fields = {**ARCHITECTURES[name], **overrides}
    if positions:
        fields["max_position_embeddings"] = max(positions, fields["max_position_embeddings"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.bfloat16).eval()


def model_name(text: str) -> str:
    """argparse type: an architecture of :data:`ARCHITECTURES` or a registry model, checked before anything loads."""
    if text not in ARCHITECTURES:
        from oscar.models import load_spec

        try:
            load_spec(text)
        except (ValueError, FileNotFoundError) as e:
            raise argparse.ArgumentTypeError(f"{text!r} is neither an architecture ({', '.join(ARCHITECTURES)}) "
                                             f"nor a registry model: {e}") from None
    return text


def method_name(text: str) -> str:
    """argparse type: a registered KV method (or fp16), checked before any model is built."""
    from oscar import method_class

    try:
        method_class(text)
    except ValueError as e:  # its message lists the known names
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def random_spectral_calibration(model) -> str:
    """An OSCAR calibration file for ``model``'s shape holding random orthogonal rotations (K and V) [L, D, D], in a
    temporary folder: what a benchmark of a random-weight model (or a test without text to calibrate on) gives
    ``build_method("spectral", calibration=...)``. Any orthogonal rotation is one the method may hold: the time per
    token and what the caches store for it do not depend on which."""
    text = model.config.get_text_config()
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    rotations = [torch.linalg.qr(torch.randn(text.num_hidden_layers, d, d, generator=gen, dtype=torch.float64))[0]
                 .float() for _ in range(2)]
    path = Path(tempfile.mkdtemp(prefix="spectral-random-")) / "spectral.pt"
    torch_save(dict(k_rotation=rotations[0], v_rotation=rotations[1], model="random rotations"), path)
    return str(path)


def bench_method(name: str, model=None):
    """The method at the paper's defaults (2 bits, G=32, R=128) without calibration files: RotateKV with its identity
    channel order (``reorder=False``), OSCAR with random rotations of ``model``'s shape."""
    from oscar import build_method

    if name == "spectral":
        if model is None:
            raise ValueError("spectral: the benchmark's random rotations need the model (its layers and head_dim)")
        return build_method(name, calibration=random_spectral_calibration(model))
    return build_method(name, **({"reorder": False} if name == "rotatekv" else {}))


def prepare_fresh(model, method) -> None:
    """``method.prepare_model(model)`` on the value and output projections as the model was built: a benchmark times
    several methods on one random-weight model, and the methods that fold a value rotation into them (OScaR, QuaRot,
    RotateKV: a Hadamard; OSCAR: its rotation) refuse a fold already there or stack on it. The first call keeps a
    copy of those weights, each later one puts it back first (oscar.weights.restore_unfolded)."""
    from oscar.weights import restore_unfolded, value_output_parameters

    saved = model.__dict__.get("_bench_unfolded_weights")
    if saved is None:
        model._bench_unfolded_weights = {k: p.detach().clone() for k, p in value_output_parameters(model).items()}
    else:
        restore_unfolded(model, saved)
    method.prepare_model(model)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


# ----------------------------------------------------------------------------- timing


def devices_of(device) -> list[torch.device]:
    """The devices to wait for: every GPU for a CUDA device (a model split over GPUs queues work on each)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [device]
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def sync(device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    for d in devices_of(device):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def reset_peak(device) -> None:
    """Free the allocator's cached blocks and restart the peak-memory count (GPU; nothing on a CPU)."""
    for d in devices_of(device):
        if d.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d)


def peak_gib(device) -> float:
    """The fullest GPU's peak allocation since :func:`reset_peak`, GiB (NaN on a CPU)."""
    peaks = [torch.cuda.max_memory_allocated(d) / 2**30 for d in devices_of(device) if d.type == "cuda"]
    return max(peaks, default=float("nan"))


def wall_seconds(fn: Callable[[], object], device) -> float:
    """Seconds of one call of ``fn``, the device's queued work finished before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def call_ms(fn: Callable[[], object], device, calls: int = 20) -> float:
    """Median milliseconds of one plain call of ``fn`` (the host's launches included), the device's queued work
    finished before and after each, after one warm-up call."""
    fn()
    return statistics.median(wall_seconds(fn, device) * 1e3 for _ in range(calls))


def captured_ms(fn: Callable[[], object], device, replays: int = 20, flush_l2: bool = False) -> float:
    """Median milliseconds of ``fn()``. On a GPU one call is captured in a CUDA graph (after a warm-up call on the
    current stream and one on a side stream, as torch.cuda.graph asks) and each of ``replays`` replays is timed by a
    pair of CUDA events, so the host's launch overhead is left out; ``flush_l2``: a 256 MiB buffer is written before
    each replay, so no replay finds its inputs in the L2 cache. On a CPU each call is timed by ``perf_counter``."""
    device = torch.device(device)
    if device.type != "cuda":
        return call_ms(fn, device, replays)
    fn()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    flush = torch.empty(2**28, dtype=torch.int8, device=device) if flush_l2 else None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for begin, end in events:
        if flush is not None:
            flush.zero_()
        begin.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(begin.elapsed_time(end) for begin, end in events)


class Budget:
    """A run's time budget: a cell that would start after ``seconds`` is skipped (and logged)."""

    def __init__(self, seconds: float = math.inf):
        self.seconds = seconds
        self.started = time.perf_counter()

    def allows(self, what: str) -> bool:
        if time.perf_counter() - self.started > self.seconds:
            log.info("budget (%.0f s) spent: skipped %s", self.seconds, what)
            return False
        return True


# ----------------------------------------------------------------------------- where and on what code it ran


def device_name(device) -> str:
    """The GPU's name (torch's), or the CPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def copy_bandwidth(device, nbytes: int | None = None) -> float:
    """GB/s of a device-to-device copy, bytes read plus bytes written (the ceiling of a kernel that streams its
    inputs once): the best of 10 copies of ``nbytes`` (1 GiB on a GPU, timed by CUDA events; 64 MiB on a CPU)."""
    device = torch.device(device)
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**26)
    x = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    y = torch.empty_like(x)
    y.copy_(x)
    best = math.inf
    for _ in range(10):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            y.copy_(x)
            end.record()
            torch.cuda.synchronize(device)
            seconds = begin.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            y.copy_(x)
            seconds = time.perf_counter() - start
        best = min(best, seconds)
    return 2 * nbytes / best / 1e9


def code_version(root: Path = REPO_ROOT) -> str:
    """The code a row was measured with: oscar.provenance.code_version (``$OSCAR_CODE_VERSION`` where set, else the
    commit, ``+dirty`` for uncommitted changes), "unknown" where neither is there."""
    return provenance_code_version(root) or "unknown"


def recorded_arguments(argv: Iterable[str]) -> str:
    """The command's arguments as a row records them: where it wrote (``--out``) is not what it measured."""
    argv, kept = list(argv), []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return shlex.join(kept)


def field_mismatch(row: dict, header: list[str]) -> str | None:
    """What is wrong with a ``csv.DictReader`` row whose fields do not match the ``header`` (a line cut short, or two
    lines run together: DictReader keeps extra fields under None and sets missing ones to None); None if they match."""
    if None not in row and None not in row.values():
        return None
    fields = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None, []))
    return f"{fields} fields where the header has {len(header)}"


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """A benchmark CSV as written: its columns and its rows (text); ([], []) where there is no file. ValueError naming
    ``path:line`` for a row whose fields do not match the header (:func:`field_mismatch`)."""
    if not path.exists():
        return [], []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = []
        for row in reader:
            problem = field_mismatch(row, reader.fieldnames)
            if problem:
                raise ValueError(f"{path}:{reader.line_num}: {problem}")
            rows.append(row)
        return list(reader.fieldnames or []), rows


class Run:
    """One run of a question: its device, provenance and rows. ``add`` appends a row (:data:`HEAD`, then the
    measured fields) and rewrites ``<out>/<table>.csv`` (``table`` defaults to the question) atomically: the rows
    earlier runs wrote there first, as they were, then this run's. The columns are the file's (a new file's: HEAD,
    then those of ``fields`` that a row holds, in order), then any other measured field in the order first seen.
    ``derive``, if given, maps this run's rows of a table to the rows written (columns computed across rows, e.g.
    ratios against a baseline of the same run).
    An ``out`` that is a file, or a question's CSV there with a malformed row, is refused (SystemExit, one line)
    before anything is measured: a run never drops what is there."""

    def __init__(self, question: str, argv: Iterable[str] = (), out: Path = RESULTS, fields: Iterable[str] = (),
                 budget: float = math.inf, device=None, derive: Callable[[list[dict]], list[dict]] | None = None):
        self.question, self.out, self.fields, self.derive = question, Path(out), list(fields), derive
        if self.out.exists() and not self.out.is_dir():
            raise SystemExit(f"{question}: --out {self.out} is a file; it names the folder of {question}.csv")
        self.earlier: dict[str, tuple[list[str], list[dict[str, str]]]] = {}  # per table: what other runs wrote
        self._earlier(question)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.budget = Budget(budget)
        self.provenance = dict(question=question, gpu=device_name(self.device),
                               date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                               code_version=code_version(), arguments=recorded_arguments(argv))
        self.tables: dict[str, list[dict]] = {}

    @functools.cached_property
    def copy_gbs(self) -> float:
        """The device's copy bandwidth (:func:`copy_bandwidth`), measured once in the run, on first use."""
        gbs = copy_bandwidth(self.device)
        log.info("%s: copy bandwidth %.0f GB/s (read + write)", self.provenance["gpu"], gbs)
        return gbs

    def require_gpu(self) -> None:
        """Exit with one line unless this machine has a CUDA GPU and CuPy (the kernels' questions)."""
        from kernels.runtime import cupy_available

        if not cupy_available():
            raise SystemExit(f"{self.question}: needs a CUDA GPU and CuPy (the kernels); this machine has "
                             f"{'no GPU' if not torch.cuda.is_available() else 'no CuPy'}")

    def add(self, row: dict, table: str | None = None) -> dict:
        """Append ``row`` (its measured fields) to the table and rewrite the table's CSV; the full row."""
        full = {**self.provenance, **row}
        rows = self.tables.setdefault(table or self.question, [])
        rows.append(full)
        self.write(table or self.question)
        return full

    def path(self, table: str | None = None) -> Path:
        return self.out / f"{table or self.question}.csv"

    def _earlier(self, table: str) -> tuple[list[str], list[dict[str, str]]]:
        """The columns and rows of ``<out>/<table>.csv`` before this run (read once; SystemExit if malformed)."""
        if table not in self.earlier:
            try:
                self.earlier[table] = read_csv(self.path(table))
            except ValueError as e:
                raise SystemExit(f"{self.question}: {e}; mend or move the file (a run adds its rows to those "
                                 "there)") from None
        return self.earlier[table]

    def write(self, table: str) -> Path:
        rows = [dict(r) for r in self.tables[table]]
        if self.derive is not None and table == self.question:
            rows = self.derive(rows)
        earlier_columns, earlier_rows = self._earlier(table)
        present = {k for r in rows for k in r}
        first = earlier_columns or [*HEAD, *(f for f in self.fields if f in present)]  # the file's order kept
        columns = list(dict.fromkeys([*first, *(k for r in rows for k in r)]))
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.path(table)
        with atomic_open(path, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(earlier_rows + rows)
        return path
