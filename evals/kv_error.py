"""KV diagnostics: how far a method's quantized K/V (and the attention they give) are from full
precision on real text, and the token-norm imbalance (TNI) that OScaR targets.

Algorithm (one window of ``length`` tokens of the WikiText-2 test text):
  1. one forward pass with a full-precision cache in the method's attention space (the model as
     the method prepared it: a value rotation folded into v_proj/o_proj is lossless; keys pass
     through ``method.transform_key``), recording per layer the raw K, V the model hands the cache
     ([1, H_kv, T, D], post-RoPE) and the queries the attention hook sees (after ``transform_query``);
  2. per layer, reference K_ref = transform_key(K), V_ref = V; quantized K_hat =
     dequantize(quantize_keys(K)), V_hat = dequantize(quantize_values(V)) over ALL T tokens (the
     residual window is ignored: every token is quantized, the worst case a cache reaches), each from
     the per-sequence state the prefill left (RotateKV's sinks; K and V quantized independently);
  3. relative Frobenius errors ||X_hat - X_ref|| / ||X_ref|| of K, V and of the attention output
     softmax(q K^T * scaling + causal) V (KV heads repeated for GQA; errors are unchanged by the
     orthogonal rotations, so comparing in the rotated space is the same as in the model's; plain
     causal attention: a sliding window or logit soft-capping of the model is not replayed);
  4. bits per stored value = 8 * PackedTensor.nbytes / number of K (or V) values;
  5. TNI on the raw (unrotated, unscaled) keys, token norm over all KV heads and channels:
     per group of G (the method's group size) consecutive tokens, max/min token norm (mean and max
     over groups); sink tokens = norm < ``sink_fraction`` x the layer's median token norm, and the
     full-precision attention mass they take (mean over query heads and query positions).
Figures: token-norm heatmap (layers x first tokens, norm / median) and per-layer errors.
Vision/omni models (a processor in ``lm.info``) run on a DocVQA page and/or the speech clip instead of
the text window (over the longest prefix that is a multiple of the group size), and add the key-norm
statistics split by modality (evals/modality.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm
from transformers.cache_utils import DynamicCache

from evals.base import Headline, Task, TaskResult, register_task
from evals.perplexity import DEFAULT_WIKITEXT, check_text_source, corpus_token_count, tokenize_corpus
from evals.tables import line_table, write_table
from oscar.attention import record_attention
from oscar.lm import KVModel, cache_argument
from oscar.method import KVMethod, SequenceState
from oscar.options import bounded
from oscar.paths import locate_data
from oscar.results import NUMBER, PredictionLog
from oscar.weights import attention_modules

log = logging.getLogger(__name__)

METRICS = ["k_rel_err", "v_rel_err", "attn_rel_err", "k_bits_per_value", "v_bits_per_value", "tni_ratio_mean",
           "tni_ratio_max", "sink_tokens", "sink_attention_mass"]
#: what a logged layer holds (a record without them is computed again)
LAYER_FIELDS = dict(layer=int, tokens=int, norm_over_median=list, **{metric: NUMBER for metric in METRICS})


class ReferenceCache(DynamicCache):
    """Full-precision cache in the method's attention space that keeps the raw K/V it was given, and the
    method's per-sequence state of each layer as the prefill leaves it (RotateKV's sinks)."""

    def __init__(self, method: KVMethod):
        super().__init__()
        self.method = method
        self.raw: dict[int, tuple[Tensor, Tensor]] = {}
        self.states: dict[int, SequenceState] = {}

    def sequence_state(self, layer_idx: int) -> SequenceState:
        return self.states.setdefault(layer_idx, SequenceState(self.method))

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        self.raw[layer_idx] = (key_states.detach(), value_states.detach())
        b, h = key_states.shape[:2]
        self.sequence_state(layer_idx).allocate(b, h, key_states.device)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return self.method.transform_key(keys, layer_idx), values


@dataclass
class Reference:
    """One full-precision prefill: per layer index the raw (K, V) [B, H_kv, T, D], the queries in the method's
    space [B, H_q, T, D] and the method's per-sequence state."""

    raw: dict[int, tuple[Tensor, Tensor]]
    queries: dict[int, Tensor]
    states: dict[int, SequenceState]


def relative_error(approx: Tensor, ref: Tensor) -> float:
    """||approx - ref||_F / ||ref||_F in float64."""
    ref = ref.double()
    return ((approx.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] (KV heads repeated for GQA), fp32 ->
    (probabilities [B, Hq, T, T], output [B, Hq, T, D])."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(repeat, dim=1), v.float().repeat_interleave(repeat, dim=1)
    scores = q.float() @ k.transpose(-1, -2) * scaling
    t = q.shape[2]
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return probs, probs @ v


def token_norms(k: Tensor) -> Tensor:
    """L2 norm of each token over all KV heads and channels: k [B, H, T, D] -> [B, T] fp32."""
    return k.float().square().sum(dim=(1, 3)).sqrt()


def tni_stats(norms: Tensor, group_size: int) -> tuple[float, float]:
    """Mean and max over groups of G consecutive tokens of (largest / smallest token norm); norms [B, T]."""
    b, t = norms.shape
    groups = norms[:, : t - t % group_size].reshape(b, -1, group_size)
    ratio = groups.amax(-1) / groups.amin(-1).clamp_min(1e-12)
    return ratio.mean().item(), ratio.max().item()


def layer_diagnostics(method: KVMethod, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scaling: float,
                      sink_fraction: float, heatmap_tokens: int, state: SequenceState | None = None) -> dict:
    """All metrics of one layer; q [1, Hq, T, D] in the method's space, k/v [1, Hkv, T, D] raw, ``state`` the
    method's per-sequence state after the prefill (None: a fresh one)."""
    spans = [None, None] if state is None else [state.span_from_start(k), state.span_from_start(v)]
    packed_k = method.quantize_keys(k, layer_idx, span=spans[0])
    packed_v = method.quantize_values(v, layer_idx, span=spans[1])
    k_ref, k_hat = method.transform_key(k, layer_idx), method.dequantize(packed_k)
    v_hat = method.dequantize(packed_v)
    probs, out_ref = causal_attention(q, k_ref, v, scaling)
    _, out_hat = causal_attention(q, k_hat, v_hat, scaling)

    norms = token_norms(k)
    median = norms.median()
    sinks = norms < sink_fraction * median  # [B, T]
    sink_mass = (probs * sinks[:, None, None, :]).sum(-1).mean()
    ratio_mean, ratio_max = tni_stats(norms, method.group_size)
    return dict(
        k_rel_err=relative_error(k_hat, k_ref),
        v_rel_err=relative_error(v_hat, v),
        attn_rel_err=relative_error(out_hat, out_ref),
        k_bits_per_value=8 * packed_k.nbytes / k.numel(),
        v_bits_per_value=8 * packed_v.nbytes / v.numel(),
        tni_ratio_mean=ratio_mean,
        tni_ratio_max=ratio_max,
        sink_tokens=int(sinks.sum()),
        sink_attention_mass=sink_mass.item(),
        sink_positions=sinks[0].nonzero().flatten().tolist()[:32],
        norm_over_median=(norms[0, :heatmap_tokens] / median).tolist(),
    )


@torch.no_grad()
def reference_pass(lm: KVModel, inputs: dict) -> Reference:
    """One full-precision forward of ``inputs`` (the model's keyword arguments: input_ids, multimodal features)."""
    cache = ReferenceCache(lm.method)
    with record_attention(lm.model) as records:
        lm.model(**inputs, **cache_argument(lm.model, cache))
    return Reference(cache.raw, {i: r[0]["query"] for i, r in records.items()}, cache.states)


@register_task("kv_error")
@dataclass
class KVError(Task):
    path: str | None = DEFAULT_WIKITEXT
    length: int = bounded(1024, ge=2)
    start: int = bounded(0, ge=0)
    sink_fraction: float = bounded(0.5, gt=0, lt=1)
    heatmap_tokens: int = bounded(64, ge=1)

    headline = tuple(Headline(metric, "mean", higher_is_better=False)
                     for metric in ("k_rel_err", "v_rel_err", "attn_rel_err"))

    def check(self) -> None:
        check_text_source(self.path)

    # -- tables -------------------------------------------------------------------------------
    @classmethod
    def sample_words(cls, row: dict) -> str:
        return f"{int(row['n']):,} tokens"

    @classmethod
    def shown(cls, row: dict) -> bool:
        """The means over layers (the per-layer values stay in the run folder's rows and figures)."""
        return row["subset"] == "mean"

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """tables/kv_error: per line the means over layers of every diagnostic."""
        header, body = line_table(rows, "kv_error", "mean", [
            ("k_bits_per_value", "K bits / value", 2), ("v_bits_per_value", "V bits / value", 2),
            ("k_rel_err", "K rel err", 3), ("v_rel_err", "V rel err", 3), ("attn_rel_err", "attn rel err", 3),
            ("tni_ratio_mean", "TNI mean", 2), ("tni_ratio_max", "TNI max", 2), ("sink_tokens", "sink tokens", 2),
            ("sink_attention_mass", "sink attention mass", 3)], "window")
        return write_table(out, "kv_error", header, body, "KV diagnostics, means over layers: stored bits, relative "
                                                           "errors, token-norm imbalance (TNI) and sink tokens") \
            if body else []

    def check_context(self, max_length: int) -> None:
        if self.length > max_length:
            raise ValueError(f"kv_error: length={self.length} exceeds the model's max_length {max_length} (task.length)")

    def check_method(self, method: KVMethod) -> None:
        """The window (``length`` cut to a multiple of the group size) holds at least one group of the method's."""
        if self.length < method.group_size:
            raise ValueError(f"kv_error: task.length={self.length} is shorter than one group of {method.group_size} "
                             f"tokens ({method.name}'s group_size): nothing would be quantized")

    def check_tokenizer(self, tokenizer) -> None:
        """The corpus holds ``start`` + ``length`` tokens."""
        needed = self.start + self.length
        tokens = corpus_token_count(tokenizer, self.path, needed)
        if tokens < needed:
            raise ValueError(f"kv_error: the corpus {self.path or 'wikitext-2 (hub)'} has {tokens} tokens of this "
                             f"model, task.start={self.start} + task.length={self.length} need {needed}")

    def data_files(self) -> list[Path]:
        return [] if self.path is None else [locate_data(self.path)]

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        if lm.info.get("processor") is not None:  # vision/omni model: a real image/audio prompt, split by modality
            return self.run_multimodal(lm, run_dir)
        method = lm.method
        self.check_method(method)
        length = self.length - self.length % method.group_size
        if length != self.length:
            log.warning("kv_error: length cut from %d to %d, a multiple of the group size", self.length, length)
        ids = tokenize_corpus(lm, self.path)
        if len(ids) < self.start + self.length:  # check_tokenizer's rule
            raise ValueError(f"kv_error: the corpus has only {len(ids)} tokens, task.start={self.start} + "
                             f"task.length={self.length} need {self.start + self.length}")
        ids = ids[self.start:self.start + length]
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        predictions = PredictionLog(Path(run_dir) / "predictions.jsonl", LAYER_FIELDS)
        layers = sorted(m.layer_idx for m in attention_modules(lm.model))
        per_layer = self.diagnose(lm, layers, lambda: reference_pass(lm, {"input_ids": ids[None].to(lm.device)}),
                                  length, predictions=predictions)
        return self.result(per_layer, length, Path(run_dir), method.name)

    def run_multimodal(self, lm: KVModel, run_dir: Path, sample=None) -> TaskResult:
        """The diagnostics on one real multimodal prompt (``sample``: evals.modality.default_sample), over the
        longest prefix that is a multiple of the group size, plus the modality split of the key norms."""
        from evals.modality import default_sample, layer_modality_stats, modality_rows, plot_modality_norms
        from oscar.multimodal import mm_inputs, reset_rope_deltas, token_modalities

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        method = lm.method
        enc = mm_inputs(lm, [sample or default_sample(lm)])
        reset_rope_deltas(lm.model)
        reference = reference_pass(lm, enc)
        modality = token_modalities(lm, enc["input_ids"])[0].cpu()
        length = len(modality) - len(modality) % method.group_size
        per_layer = self.diagnose(lm, sorted(reference.raw), lambda: reference, length, prefix=True)
        result = self.result(per_layer, length, run_dir, method.name)
        split = [dict(layer=i, **layer_modality_stats(method, i, reference.raw[i][0], modality, reference.states[i]))
                 for i in sorted(reference.raw)]
        rows = modality_rows(split)
        (run_dir / "modality_split.json").write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "norm_over_median"} for r in split], indent=2))
        figure = plot_modality_norms(split, modality, run_dir / "token_norms_by_modality.png", lm.name)
        metrics = dict(result.metrics)
        for r in rows:
            if r["subset"].startswith("mean/"):
                metrics[f"{r['metric']}/{r['subset'].removeprefix('mean/')}"] = r["value"]
        return TaskResult(metrics=metrics, rows=result.rows + rows, figures=result.figures + [figure])

    def diagnose(self, lm: KVModel, layers: list[int], reference: Callable[[], Reference], length: int,
                 prefix: bool = False, predictions: PredictionLog | None = None) -> list[dict]:
        """Per-layer statistics (:func:`layer_diagnostics`) of ``length`` tokens, the reference pass run only if a
        layer is missing from ``predictions`` (each layer logged there as it is done); ``prefix``: the first
        ``length`` tokens of longer recorded tensors."""
        method = lm.method
        done = predictions.done if predictions is not None else {}
        if any(f"layer{i}" not in done for i in layers):
            ref = reference()
            scaling = {m.layer_idx: getattr(m, "scaling", m.head_dim ** -0.5) for m in attention_modules(lm.model)}
            for i in tqdm(layers, desc=f"kv_error {method.name}", unit="layer"):
                if f"layer{i}" in done:
                    continue
                (k, v), q = ref.raw[i], ref.queries[i]
                if prefix:
                    k, v, q = k[:, :, :length].contiguous(), v[:, :, :length].contiguous(), q[:, :, :length]
                stats = layer_diagnostics(method, i, q, k, v, scaling[i], self.sink_fraction, self.heatmap_tokens,
                                          ref.states[i])
                record = dict(layer=i, tokens=length, **stats)
                if predictions is not None:
                    predictions.write(f"layer{i}", record)
                else:
                    done[f"layer{i}"] = record
        return [done[f"layer{i}"] for i in layers]

    def result(self, per_layer: list[dict], length: int, run_dir: Path, method_name: str) -> TaskResult:
        """Means over layers, tidy rows (per layer and ``mean``) and the two figures."""
        means = {m: sum(r[m] for r in per_layer) / len(per_layer) for m in METRICS}
        rows = [dict(subset=f"layer{r['layer']}", metric=m, value=r[m], n=length) for r in per_layer for m in METRICS]
        rows += [dict(subset="mean", metric=m, value=means[m], n=length) for m in METRICS]
        figures = [plot_token_norms(per_layer, run_dir / "token_norms.png", self.sink_fraction),
                   plot_layer_errors(per_layer, run_dir / "kv_error_per_layer.png", method_name)]
        metrics = {**means, "attn_rel_err_max": max(r["attn_rel_err"] for r in per_layer), "tokens": length}
        return TaskResult(metrics=metrics, rows=rows, figures=figures)


def plot_token_norms(per_layer: list[dict], path: Path, sink_fraction: float) -> Path:
    """Heatmap of key token norm / layer median: layers (rows) x first tokens (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    grid = torch.tensor([r["norm_over_median"] for r in per_layer]).clamp_min(1e-3)
    fig, ax = plt.subplots(figsize=(max(6.0, grid.shape[1] / 8), max(3.0, grid.shape[0] / 4)))
    image = ax.imshow(grid, aspect="auto", cmap="coolwarm", norm=LogNorm(vmin=0.1, vmax=10), interpolation="nearest")
    fig.colorbar(image, ax=ax, label="key token norm / layer median (log)")
    ax.set_xlabel("token position")
    ax.set_ylabel("layer")
    ax.set_title(f"Key token norms (sinks: < {sink_fraction:g} x median, blue)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_layer_errors(per_layer: list[dict], path: Path, method_name: str) -> Path:
    """Relative error of K, V and the attention output per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in per_layer]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for metric, label in [("k_rel_err", "K"), ("v_rel_err", "V"), ("attn_rel_err", "attention output")]:
        ax.plot(layers, [r[metric] for r in per_layer], marker="o", markersize=3, label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative Frobenius error")
    ax.set_title(f"{method_name}: error vs full precision")
    if all(r[m] > 0 for r in per_layer for m in ("k_rel_err", "v_rel_err", "attn_rel_err")):
        ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
