"""End-to-end decode benchmark: BF16 + SDPA vs OScaR INT2 on the fused kernels, 8B architectures.

    python scripts/bench_e2e.py [--out results/efficiency] [--models llama-3.1-8b qwen3-8b]
                                [--contexts 32768 65536 131072] [--steps 10]

Llama-3.1-8B and Qwen3-8B are built from their configs with random bf16 weights on the GPU (decode speed
does not depend on the weight values). Prefilling 128K tokens through an 8B model would cost minutes per
cell, so each cache is filled directly with random contents of the right size and layout (BF16: K/V
tensors; OScaR: packed codes, scales, zeros, norms) and the timed work is the model's real decode step:
one token per sequence through every layer, reading the whole cache, timed eagerly (host overhead of
the Python forward included) and as replays of a CUDA graph of the step (GPU time). Per model and context:
  - latency per token at batch 1 and at the largest batch BF16 fits, for both;
  - the largest batch that fits each (found by allocating and running a step) and its throughput;
  - KV bytes (BF16: tensors; OScaR: CupyKVCache.nbytes, real buffers) and peak GPU memory.
BF16 attention is the faster, per cell and per timing, of two SDPA forms (no repeated K/V in either): the query
heads of each KV head as query rows limited to FlashAttention / memory-efficient (cuDNN re-plans at every new
length eagerly), and SDPA's own choice with enable_gqa (cuDNN here, fast under graph replay); the `attention`
column says which form each number came from.
Writes e2e.csv under --out (after every model). No hydra; needs torch, transformers, cupy.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

sys.path.insert(0, str(REPO_ROOT))

from kernels.backend import CupyKVCache  # noqa: E402
from oscar import build_method  # noqa: E402
from oscar.attention import attach, bind_cache  # noqa: E402

log = logging.getLogger("bench_e2e")

#: the architectures of the hub checkpoints (meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-8B); RoPE scaling
#: is left out (it changes no shape and no cost)
CONFIGS = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=262144, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=262144, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
}
BF16_ATTENTION = "bf16_decode"
#: the forms of BF16 decode attention; every BF16 cell is measured with each and keeps the faster per timing
#: (eager, graph), so the baseline is the best SDPA this stack offers at that shape
BF16_FORMS = ("flash_rows", "sdpa_gqa")
BF16_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
HEADROOM = 2 * 2**30  # bytes kept free when sizing the largest batch
_bf16_form = [BF16_FORMS[0]]  # the form bf16_decode runs now


def bf16_decode(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """BF16 decode attention in the form ``_bf16_form[0]``:
    flash_rows: the query heads of one KV head as query rows of one SDPA call, FlashAttention / memory-efficient
        only (cuDNN re-plans at every new cache length: 15 ms of host time per eager call);
    sdpa_gqa: SDPA's own backend choice with enable_gqa (cuDNN on this stack; under CUDA-graph replay it keeps
        its plan, and at large batches it beats FlashAttention's unsplit kernel, e.g. 32 x 32K: 1.6x)."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    if t != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if _bf16_form[0] == "sdpa_gqa":
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    q = query.reshape(b, hkv, hq // hkv, d)
    with sdpa_kernel(BF16_BACKENDS):
        out = F.scaled_dot_product_attention(q, key, value, scale=scaling)
    return out.reshape(b, hq, 1, d).transpose(1, 2), None


class BF16Layer(CacheLayerMixin):
    """Preallocated BF16 K/V written in place (no concatenation per step)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.keys, self.values, self.length, self.is_initialized = keys, values, length, True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        t = key_states.shape[2]
        self.keys[:, :, self.length:self.length + t] = key_states
        self.values[:, :, self.length:self.length + t] = value_states
        self.length += t
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def build_model(name: str):
    config = AutoConfig.for_model(**CONFIGS[name])
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.eval()


def random_spectral_calibration(model) -> str:
    """An OSCAR calibration file for ``model``'s shape holding random orthogonal rotations (K and V) [L, D, D], in a
    temporary folder: what a benchmark of a random-weight model (or a test on a machine without text to calibrate
    on) gives ``build_method("spectral", calibration=...)``. Any orthogonal rotation is one the method may hold:
    the time per token and what the caches store and attend for it do not depend on which."""
    import tempfile

    text = model.config.get_text_config()
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    rotations = [torch.linalg.qr(torch.randn(text.num_hidden_layers, d, d, generator=gen, dtype=torch.float64))[0]
                 .float() for _ in range(2)]
    path = Path(tempfile.mkdtemp(prefix="spectral-random-")) / "spectral.pt"
    torch.save(dict(k_rotation=rotations[0], v_rotation=rotations[1], model="random rotations"), path)
    return str(path)


def prepare_fresh(model, method) -> None:
    """``method.prepare_model(model)`` on the value and output projections as the model was built: a benchmark times
    several methods on one random-weight model, and the methods that fold a value rotation into them (OScaR, QuaRot,
    RotateKV: a Hadamard; OSCAR: its calibrated rotation) refuse a fold already there or stack on it. The first call
    keeps a copy of those weights, each later one puts it back first (oscar.weights.restore_unfolded)."""
    from oscar.weights import restore_unfolded, value_output_parameters

    saved = model.__dict__.get("_bench_unfolded_weights")
    if saved is None:
        model._bench_unfolded_weights = {k: p.detach().clone() for k, p in value_output_parameters(model).items()}
    else:
        restore_unfolded(model, saved)
    method.prepare_model(model)


def bf16_cache(model, batch: int, context: int, extra: int) -> tuple[Cache, int]:
    c = model.config
    layers = []
    for _ in range(c.num_hidden_layers):
        shape = (batch, c.num_key_value_heads, context + extra, c.head_dim)
        keys = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
        values = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_()
        layers.append(BF16Layer(keys, values, context))
    kv_bytes = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * context * c.head_dim * 2
    return Cache(layers=layers), kv_bytes


def oscar_cache(model, method, batch: int, context: int, extra: int) -> tuple[Cache, int]:
    """A CupyKVCache holding `context` packed tokens per sequence (random codes, plausible parameters)."""
    c = model.config
    cache = CupyKVCache(method, c.num_hidden_layers, [0] * batch, device="cuda")
    bind_cache(model, cache)  # the model's attention reads this cache's packed storage
    dummy = torch.empty(batch, c.num_key_value_heads, 1, c.head_dim, dtype=torch.bfloat16, device="cuda")
    for layer in cache.layers:
        layer.lazy_initialization(dummy, dummy)
        layer.reserve(context + extra)
        for store in (layer.keys_store, layer.values_store):
            store["codes"].random_(0, 256)
            store["scale"].uniform_(0.002, 0.05)
            store["zero"].random_(0, 4)
        layer.keys_store["norm"].uniform_(1.0, 20.0)
        layer.n_packed = [context] * batch
        layer.n_res = [0] * batch
        layer.seq_len = context
        layer._sync_counts()
    return cache, cache.nbytes


@torch.no_grad()
def time_decode(model, cache, batch: int, context: int, steps: int, warmup: int = 3) -> float:
    """Milliseconds per decode step (one token per sequence), host overhead included."""
    ids = torch.randint(0, model.config.vocab_size, (batch, warmup + steps), device="cuda")
    pos = context
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        position_ids = torch.full((batch, 1), pos, device="cuda")
        model(input_ids=ids[:, i:i + 1], position_ids=position_ids, past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        pos += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


@torch.no_grad()
def time_decode_graph(model, cache, batch: int, context: int, steps: int) -> float:
    """GPU milliseconds per decode step: one step captured in a CUDA graph, replays timed with events.

    Replays write the next cache slot on the device (BF16: the same slot; OScaR: the residual count is a
    device tensor) and read a cache of the same size, so every replay costs what a decode step costs,
    without the host overhead of the eager Python forward.
    """
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device="cuda")
    position_ids = torch.full((batch, 1), context, device="cuda")
    return graph_ms(lambda: model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                                  logits_to_keep=1), steps)


def graph_ms(fn, replays: int) -> float:
    """GPU milliseconds per replay of ``fn()`` captured in a CUDA graph (run once on a side stream first, as
    torch.cuda.graph asks, and replayed once untimed), timed with events over ``replays`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def profile_step(model, cache, batch: int, context: int, label: str) -> None:
    """Log the top host and device costs of one eager decode step."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device="cuda")
    position_ids = torch.full((batch, 1), context, device="cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
    log.info("profile %s (2 steps):\n%s", label, prof.key_averages().table(sort_by="cpu_time_total", row_limit=14))
    log.info("profile %s by device time:\n%s", label, prof.key_averages().table(sort_by="cuda_time_total",
                                                                               row_limit=8))


def measure(model, make_cache, batch: int, context: int, steps: int) -> dict | None:
    """One cell, or None if it does not fit in memory."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cache = None
    try:
        cache, kv_bytes = make_cache(batch, context, 2 * steps + 16)
        ms = time_decode(model, cache, batch, context, steps)
        try:
            gpu_ms = time_decode_graph(model, cache, batch, context, steps)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a forward that cannot be captured: keep the eager number
            log.warning("CUDA graph capture failed (%s: %s)", type(e).__name__, e)
            gpu_ms = float("nan")
    except torch.OutOfMemoryError:
        return None
    finally:
        del cache
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    return dict(batch=batch, ms_per_token=ms, tokens_per_s=batch / ms * 1e3, gpu_ms_per_token=gpu_ms,
                gpu_tokens_per_s=batch / gpu_ms * 1e3, kv_bytes=kv_bytes, peak_gib=peak / 2**30,
                attention="oscar decode kernel")


def measure_bf16(model, make_cache, batch: int, context: int, steps: int) -> dict | None:
    """One BF16 cell in every form of BF16_FORMS: the faster form's numbers, per timing (eager / graph)."""
    rows = {}
    for form in BF16_FORMS:
        _bf16_form[0] = form
        rows[form] = measure(model, make_cache, batch, context, steps)
        if rows[form] is None:
            return None

    def fastest(key):  # a form whose graph capture failed (nan) never wins
        return min(BF16_FORMS, key=lambda f: (math.isnan(rows[f][key]), rows[f][key]))

    eager, graph = fastest("ms_per_token"), fastest("gpu_ms_per_token")
    return dict(rows[graph], ms_per_token=rows[eager]["ms_per_token"], tokens_per_s=rows[eager]["tokens_per_s"],
                attention=f"eager {eager}, graph {graph}")


def largest_batch(model, make_cache, context: int, steps: int, per_seq: float,
                  measure_cell=measure) -> dict:
    """The largest batch whose cache and decode step fit (measured by ``measure_cell``), searched down from
    the memory estimate."""
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    batch = max(1, int((free - HEADROOM) // per_seq))
    while batch >= 1:
        row = measure_cell(model, make_cache, batch, context, steps)
        if row is not None:
            return row
        batch = int(batch * 0.95) if batch > 20 else batch - 1
    raise RuntimeError("not even batch 1 fits")


def run_model(name: str, contexts: list[int], steps: int, profile: bool = False) -> list[dict]:
    model = build_model(name)
    method = build_method("oscar", k_bits=2, v_bits=2, group_size=32, residual_length=128)
    AttentionInterface.register(BF16_ATTENTION, bf16_decode)
    AttentionMaskInterface.register(BF16_ATTENTION, sdpa_mask)
    rows = []
    for context in contexts:
        cells = {}
        for label in ("bf16", "oscar"):
            if label == "bf16":
                model.get_decoder().set_attn_implementation(BF16_ATTENTION)
                make = lambda b, t, extra: bf16_cache(model, b, t, extra)  # noqa: E731
            else:
                attach(model, method)
                make = lambda b, t, extra: oscar_cache(model, method, b, t, extra)  # noqa: E731
            if profile and context == contexts[0]:
                cache, _ = make(1, context, 8)
                try:
                    profile_step(model, cache, 1, context, f"{name} {label} B=1 T={context}")
                except Exception as e:  # the profiler is a diagnostic, never a reason to stop
                    log.warning("profiler failed: %s", e)
                del cache
            cell = measure_bf16 if label == "bf16" else measure
            one = cell(model, make, 1, context, steps)
            per_seq = one["kv_bytes"] + 64 * 2**20
            top = largest_batch(model, make, context, steps, per_seq, cell)
            cells[label] = dict(one=one, top=top, make=make)
        bf16_top = cells["bf16"]["top"]["batch"]
        attach(model, method)
        same = measure(model, cells["oscar"]["make"], bf16_top, context, steps)
        for label, kind, row in (("bf16", "batch1", cells["bf16"]["one"]), ("bf16", "max_batch", cells["bf16"]["top"]),
                                 ("oscar_int2", "batch1", cells["oscar"]["one"]),
                                 ("oscar_int2", "bf16_max_batch", same),
                                 ("oscar_int2", "max_batch", cells["oscar"]["top"])):
            rows.append(dict(model=name, context=context, method=label, cell=kind, **row))
            log.info("%-13s T=%-6d %-10s %-15s B=%-4d eager %7.2f ms/token %8.1f tok/s | graph %7.2f ms/token "
                     "%8.1f tok/s | KV %.2f GiB  peak %.1f GiB", name, context, label, kind, row["batch"],
                     row["ms_per_token"], row["tokens_per_s"], row["gpu_ms_per_token"], row["gpu_tokens_per_s"],
                     row["kv_bytes"] / 2**30, row["peak_gib"])
        b1, o1 = cells["bf16"]["one"], cells["oscar"]["one"]
        for key, tput, what in (("ms_per_token", "tokens_per_s", "eager"), ("gpu_ms_per_token", "gpu_tokens_per_s",
                                                                              "graph")):
            log.info("  -> %s: speedup at batch 1 %.2fx, at batch %d %.2fx, KV memory %.2fx, throughput %.2fx", what,
                     b1[key] / o1[key], bf16_top, cells["bf16"]["top"][key] / same[key],
                     b1["kv_bytes"] / o1["kv_bytes"], cells["oscar"]["top"][tput] / cells["bf16"]["top"][tput])
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/efficiency"))
    parser.add_argument("--models", nargs="+", default=list(CONFIGS))
    parser.add_argument("--contexts", nargs="+", type=int, default=[32768, 65536, 131072])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="log a profiler table of one step per method")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name in tqdm(args.models, desc="bench_e2e", unit="model"):
        rows += run_model(name, args.contexts, args.steps, args.profile)
        with (args.out / "e2e.csv").open("w", newline="") as f:  # after every model: a cut-short run keeps them
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        log.info("wrote %s (%d rows)", args.out / "e2e.csv", len(rows))
    log.info("bench_e2e: outputs in %s", args.out / "e2e.csv" if rows else "(none: no model measured)")


if __name__ == "__main__":
    main()
