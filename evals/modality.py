"""Key-norm statistics split by modality (text, image, audio tokens) for multimodal models.

In vision-language and omni models the token-norm imbalance takes new forms: the key norm jumps
where the sequence switches modality, and image or audio runs can sit at a very different norm than
the text around them. Algorithm, on one real multimodal prompt (a DocVQA page and/or the speech clip
from the data folder's mm/, with a question):
  1. one full-precision prefill that records, per layer, the raw post-RoPE keys [1, H_kv, T, D], the
     values, and the queries (kv_error's reference pass, with the processor's multimodal inputs;
     ``KVError.run_multimodal`` runs it and calls the functions here);
  2. per token t: key norm n_t over all KV heads and channels, and its modality (from the
     placeholder token ids: image / audio / video pad tokens, everything else text);
  3. per layer and modality: token count, mean / median / min / max norm, median over the text
     median (``over_text``), and the method's per-token key error ||k_hat_t - k_t|| / ||k_t||
     (every token quantized, over the longest prefix that is a multiple of the group size);
  4. jumps: at every boundary between two modality runs, |log2| of (median norm of the 8 tokens
     after / the 8 before); reported as the mean and max per layer, beside the same statistic at
     every within-run position (the baseline a jump is compared to).
Figure: token norms / layer median (layers x all tokens) under a strip coloured by modality, with
the boundaries marked.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from oscar.lm import KVModel
from oscar.method import KVMethod, SequenceState
from oscar.multimodal import AUDIO, IMAGE, MODALITY_NAMES, TEXT, MMSample, load_audio, load_image, supports
from oscar.paths import data_file

DEFAULT_IMAGE = "mm/docvqa/documents/ffbg0227_2.png"  # names in the data folder (oscar.paths)
DEFAULT_AUDIO = "mm/audio/jfk.flac"
JUMP_WINDOW = 8
MODALITY_COLORS = {TEXT: "#9e9e9e", IMAGE: "#f28e2b", AUDIO: "#59a14f", 3: "#b07aa1"}


def default_sample(lm: KVModel, image: str | Path | None = None, audio: str | Path | None = None) -> MMSample:
    """A real prompt with every modality ``lm`` takes: the page image and/or the speech clip."""
    images = [load_image(image or data_file(DEFAULT_IMAGE))] if supports(lm, "image") else []
    audios = [load_audio(audio or data_file(DEFAULT_AUDIO))] if supports(lm, "audio") else []
    return MMSample("Describe what you see and hear, then answer: what is the page number?", images, audios)


def modality_runs(modality: Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of one modality: [(code, start, end)] with end exclusive; modality [T]."""
    runs, start = [], 0
    codes = modality.tolist()
    for t in range(1, len(codes) + 1):
        if t == len(codes) or codes[t] != codes[start]:
            runs.append((codes[start], start, t))
            start = t
    return runs


def _log2_step(norms: Tensor, t: int, window: int) -> float:
    before, after = norms[max(0, t - window):t], norms[t:t + window]
    return abs(torch.log2(after.median() / before.median().clamp_min(1e-12)).item())


def norm_jumps(norms: Tensor, modality: Tensor, window: int = JUMP_WINDOW) -> dict[str, float]:
    """|log2| median-norm steps at modality boundaries vs inside runs; norms, modality [T]."""
    boundaries = [start for _, start, _ in modality_runs(modality)[1:]]
    inside = [t for t in range(window, len(norms) - window + 1) if t not in boundaries]
    at = [_log2_step(norms, t, window) for t in boundaries]
    within = [_log2_step(norms, t, window) for t in inside]
    return dict(jump_mean=sum(at) / len(at) if at else 0.0, jump_max=max(at, default=0.0),
                within_mean=sum(within) / len(within) if within else 0.0, boundaries=len(boundaries))


def per_token_key_error(method: KVMethod, k: Tensor, layer_idx: int, state: SequenceState | None = None) -> Tensor:
    """||k_hat_t - k_t|| / ||k_t|| per token (all tokens quantized, method space, from the prefill's per-sequence
    ``state``): k [1, H, T, D] -> [T'], T' = T cut to a multiple of the group size."""
    t = k.shape[2] - k.shape[2] % method.group_size
    k = k[:, :, :t].contiguous()
    ref = method.transform_key(k, layer_idx).float()
    span = None if state is None else state.span_from_start(k)
    approx = method.dequantize(method.quantize_keys(k, layer_idx, span=span)).float()
    return ((approx - ref).square().sum((1, 3)).sqrt() / ref.square().sum((1, 3)).sqrt().clamp_min(1e-12))[0]


def layer_modality_stats(method: KVMethod, layer_idx: int, k: Tensor, modality: Tensor,
                         state: SequenceState | None = None) -> dict:
    """Per-modality key-norm statistics and key error of one layer; k [1, H, T, D] raw, modality [T]."""
    norms = k.float().square().sum((1, 3)).sqrt()[0].cpu()
    errors = per_token_key_error(method, k, layer_idx, state).cpu()
    text_median = norms[modality == TEXT].median() if (modality == TEXT).any() else norms.median()
    stats = {}
    for code in sorted(set(modality.tolist())):
        mask = modality == code
        part = norms[mask]
        err = errors[mask[:len(errors)]]
        stats[MODALITY_NAMES[code]] = dict(
            tokens=int(mask.sum()), mean=part.mean().item(), median=part.median().item(), min=part.min().item(),
            max=part.max().item(), over_text=(part.median() / text_median).item(),
            k_rel_err=err.mean().item() if len(err) else float("nan"))
    return dict(modalities=stats, **norm_jumps(norms, modality),
                norm_over_median=(norms / norms.median()).tolist())


def modality_rows(per_layer: list[dict]) -> list[dict]:
    """Tidy rows: per layer and modality (``layer<i>/<modality>``), jumps per layer, means over layers
    (``mean/<modality>``); no ``k_rel_err`` row for a modality none of whose tokens is in the quantized prefix
    (its error is not measured: NaN would make the run an error)."""
    rows = []
    for r in per_layer:
        for name, s in r["modalities"].items():
            rows += [dict(subset=f"layer{r['layer']}/{name}", metric=f"key_norm_{m}", value=s[m], n=s["tokens"])
                     for m in ("mean", "median", "over_text")]
            if not math.isnan(s["k_rel_err"]):  # NaN: none of the modality's tokens is in the quantized prefix
                rows.append(dict(subset=f"layer{r['layer']}/{name}", metric="k_rel_err", value=s["k_rel_err"],
                                 n=s["tokens"]))
        rows += [dict(subset=f"layer{r['layer']}", metric=m, value=r[m], n=r["boundaries"])
                 for m in ("jump_mean", "jump_max", "within_mean")]
    for name in per_layer[0]["modalities"]:
        for m, metric in (("median", "key_norm_median"), ("over_text", "key_norm_over_text"), ("k_rel_err", "k_rel_err")):
            values = [v for r in per_layer if not math.isnan(v := r["modalities"][name][m])]
            if not values:
                continue
            rows.append(dict(subset=f"mean/{name}", metric=metric, value=sum(values) / len(values),
                             n=per_layer[0]["modalities"][name]["tokens"]))
    for m in ("jump_mean", "within_mean"):
        rows.append(dict(subset="mean", metric=m, value=sum(r[m] for r in per_layer) / len(per_layer),
                         n=per_layer[0]["boundaries"]))
    return rows


def plot_modality_norms(per_layer: list[dict], modality: Tensor, path: Path, title: str) -> Path:
    """Key token norm / layer median (log colour) for every layer and token, under a modality strip."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.patches import Patch

    grid = torch.tensor([r["norm_over_median"] for r in per_layer]).clamp_min(1e-3)
    codes = sorted(set(modality.tolist()))
    fig, (strip, ax) = plt.subplots(2, 1, figsize=(10, 1.2 + 0.35 * len(per_layer)), sharex=True,
                                    gridspec_kw={"height_ratios": [1, max(3, len(per_layer))]})
    strip.imshow(modality[None].numpy(), aspect="auto", interpolation="nearest",
                 cmap=ListedColormap([MODALITY_COLORS[c] for c in range(max(codes) + 1)]), vmin=0, vmax=max(codes))
    strip.set_yticks([])
    strip.legend(handles=[Patch(color=MODALITY_COLORS[c], label=MODALITY_NAMES[c]) for c in codes],
                 loc="center left", ncol=len(codes), fontsize=7, bbox_to_anchor=(0.0, 1.9), frameon=False)
    span = max(1.25, float(torch.exp(grid.log().abs().quantile(0.99))))  # colour range symmetric around 1
    image = ax.imshow(grid, aspect="auto", cmap="coolwarm", norm=LogNorm(vmin=1 / span, vmax=span),
                      interpolation="nearest")
    for _, start, _ in modality_runs(modality)[1:]:
        ax.axvline(start - 0.5, color="black", linewidth=0.6, linestyle="--")
    fig.colorbar(image, ax=[strip, ax], label="key token norm / layer median (log)")
    ax.set_xlabel("token position")
    ax.set_ylabel("layer")
    strip.set_title(f"{title}: key token norms by modality (dashed: modality boundaries)", fontsize=9, loc="right")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
