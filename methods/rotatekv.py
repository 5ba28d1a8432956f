"""RotateKV (Su et al., IJCAI 2025, arXiv 2501.16383): outlier-aware adaptive rotations.

Algorithm, per layer:
  1. Pre-RoPE Grouped-Head Rotation: the key before RoPE (after QK-norm where the model has one),
     heads taken in groups of ``head_group`` consecutive KV heads, each group's g*D channels rotated
     by one Walsh-Hadamard transform H_{gD} (smooths outliers across channels and heads; done
     before RoPE because RoPE's position-dependent pair rotations would reshuffle them);
  2. Outlier-Aware Rotation: a calibrated permutation P of all H*D channels (ascending order of the
     channels' summed rotated key over a calibration text, computed once per model by
     scripts/calibrate_rotatekv.py) so that channels of similar range share quantization groups;
  3. per-token asymmetric quantization (integer zero) of z = P H_g k in groups of G channels, range
     clipped by ``clip_ratio`` (0.8 at 2 bits);
  4. Attention-Sink-Aware Quantization: in prefill, the tokens holding the largest-magnitude entries
     of the decoder layer's input hidden states (massive activations) are attention sinks: their
     keys and values are kept in full precision (``num_sinks``: 20 entries, as in the released code);
  5. values: a per-head Hadamard folded offline into v_proj / o_proj, then per-token quantization;
  6. at attention, k = RoPE(H_g^T P^T z_hat): keys are dequantized back to the model's space.
Where the paper leaves room, our choices (each a switch):
  - RoPE sits between k_proj and the cache, and P H_g does not commute with it (RoPE rotates channel
    pairs by position-dependent angles), so nothing is fused into k_proj: the cache hands us post-RoPE
    keys, we undo RoPE with the model's own rotary embedding at the chunk's positions (the cache's
    TokenSpan gives the stream index), rotate, quantize, and at dequantization rotate back and
    re-apply RoPE. The stored codes are exactly those of P H_g k_pre. Positions are stream indices
    (0 = first real token), which is what ``generate`` passes; a prefill whose position ids disagree
    is refused with a clear error.
  - ``head_group`` falls back to the largest power of two <= 4 that divides the KV heads (1 on
    SmolLM2's 3 KV heads), logged.
  - order of 1 and 2: the released code rotates, then permutes (``reorder_first=False``).
  - sinks: ``sink_select="elements"`` takes the tokens of the ``num_sinks`` largest |h| entries (the
    released code: usually a handful of tokens); ``"tokens"`` takes the ``num_sinks`` tokens of
    largest max|h|. Only the first forward call on a fresh cache (prefill) selects sinks.
  - the most recent R tokens stay in full precision with the ``kivi`` policy (the paper quantizes
    everything; ``residual_length=0``), for a fair comparison.
A chunk quantized without a TokenSpan (direct calls, e.g. the KV diagnostics) is taken as the start
of the streams of batch rows 0..B-1: positions from 0, the latest prefill's sinks.
Stored per chunk: codes / scale / zero of z, plus the sinks' post-RoPE K (and V) in the model dtype
with their int32 stream indices; nbytes counts them all. The per-model permutation is a constant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from methods.ott import keep_exact, restore_exact
from oscar.method import FlushPolicy, KVMethod, TokenSpan, register_method
from oscar.options import bounded
from oscar.paths import REPO_ROOT
from oscar.quant import PackedTensor, dequantize_groups, hadamard, quantize_groups
from oscar.weights import attention_modules, fold_value_hadamard

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------- transforms


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the rotate-half convention (Llama, Qwen3): x [B, H, T, D], cos/sin [T, D]."""
    return x * cos + rotate_half(x) * sin


def undo_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Exact inverse of :func:`apply_rope` (also with an attention scaling folded into cos/sin)."""
    return (x * cos - rotate_half(x) * sin) / (cos.square() + sin.square())


def grouped_head_hadamard(x: Tensor, group: int) -> Tensor:
    """Walsh-Hadamard over groups of ``group`` consecutive heads: x [B, H, T, D] -> same shape.

    Self-inverse (the normalized transform is symmetric and orthogonal).
    """
    b, h, t, d = x.shape
    y = x.transpose(1, 2).reshape(b, t, h // group, group * d)
    return hadamard(y).reshape(b, t, h, d).transpose(1, 2)


def permute_channels(x: Tensor, order: Tensor) -> Tensor:
    """Channel j of the result is channel order[j] of x, over all heads: x [B, H, T, D], order [H*D]."""
    b, h, t, d = x.shape
    flat = x.transpose(1, 2).reshape(b, t, h * d)
    return flat[..., order].reshape(b, t, h, d).transpose(1, 2)


def effective_head_group(requested: int, num_kv_heads: int) -> int:
    """The largest power of two <= requested that divides num_kv_heads."""
    g = 1
    while g * 2 <= requested and num_kv_heads % (g * 2) == 0:
        g *= 2
    return g


def rotary_module(model: nn.Module) -> nn.Module:
    """The model's one rotary embedding module: rotary(x, position_ids) -> cos, sin, or with a third
    argument, the layer type, where the model has one RoPE per layer type (Gemma 3: sliding / full)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")
             and (hasattr(m, "inv_freq") or per_layer_type(m))]
    multi_axis = sorted(type(m).__name__ for m in found if _multi_axis_rope(m))
    if multi_axis:
        raise ValueError(f"rotatekv cannot run on {type(model).__name__}: its rotary embedding "
                         f"({', '.join(multi_axis)}) takes multi-axis (M-RoPE) positions, and the inverse RoPE "
                         f"rotatekv applies assumes 1-D positions; use another method (kivi, quarot, turboquant, "
                         f"ott or oscar)")
    if len(found) != 1:
        raise ValueError(f"rotatekv needs exactly one rotary embedding module, found {len(found)} "
                         f"({', '.join(sorted({type(m).__name__ for m in found})) or 'none'})")
    return found[0]


def _multi_axis_rope(rotary: nn.Module) -> bool:
    """Whether the rotary embedding takes multi-axis positions (M-RoPE: temporal, height, width), as Qwen3-VL/Omni."""
    config = getattr(rotary, "config", None)
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)) if config else None
    return hasattr(rotary, "mrope_section") or "mrope_section" in (rope or {})


def per_layer_type(rotary: nn.Module) -> bool:
    """Whether the rotary embedding holds one RoPE per layer type (called with the layer type)."""
    return not hasattr(rotary, "inv_freq") and bool(getattr(rotary, "layer_types", None))


def layer_types(model: nn.Module) -> list[str] | None:
    """The decoder's per-layer attention types (``sliding_attention`` / ``full_attention``), if it has them."""
    return getattr(model.config.get_text_config(), "layer_types", None)


def rope_tables(rotary: nn.Module, positions: Tensor, head_dim: int,
                layer_type: str | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [T, D] in float32 for the given positions [T] (at ``layer_type`` where RoPE depends on it)."""
    probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
    if per_layer_type(rotary):
        if layer_type is None:
            raise ValueError(f"{type(rotary).__name__} has one RoPE per layer type: pass the layer's type")
        cos, sin = rotary(probe, positions.unsqueeze(0), layer_type)
    else:
        cos, sin = rotary(probe, positions.unsqueeze(0))
    cos, sin = cos[0].float(), sin[0].float()
    if cos.shape[-1] != head_dim:
        raise ValueError(f"rotatekv: the rotary embedding covers {cos.shape[-1]} of {head_dim} channels (partial RoPE is not supported)")
    return cos, sin


def decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer_idx, decoder layer) for every decoder layer whose ``self_attn`` is an attention module."""
    attn = {id(m): m for m in attention_modules(model)}
    return [(m.self_attn.layer_idx, m) for m in model.modules() if id(getattr(m, "self_attn", None)) in attn]


# ----------------------------------------------------------------------------- the method


@register_method("rotatekv")
@dataclass
class RotateKV(KVMethod):
    uses_hadamard = True
    wants_token_span = True

    flush: FlushPolicy = "kivi"
    #: min/max of each group multiplied by this; None = 0.8 at <= 2 bits (paper), 1.0 above
    clip_ratio: float | None = bounded(None, gt=0, le=1)
    #: KV heads rotated together before RoPE (paper: 4; falls back to a power of two dividing H_kv)
    head_group: int = bounded(4, ge=1)
    #: calibrated channel permutation; False keeps the natural order (ablation)
    reorder: bool = True
    #: False: Hadamard then permutation (released code); True: permutation then Hadamard
    reorder_first: bool = False
    #: the file scripts/calibrate_rotatekv.py writes (relative paths: from the repository root)
    calibration: str | None = None
    num_sinks: int = bounded(20, ge=0)
    sink_select: Literal["elements", "tokens"] = "elements"
    rotate_values: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._rotary: nn.Module | None = None
        self._layer_types: list[str] | None = None
        self._group = 1
        self._orders: list[Tensor] | None = None  # per layer [H*D], on the layer's device
        self._sinks: dict[int, dict[int, Tensor]] = {}  # layer -> batch row -> sink stream indices
        self._hooks: list = []

    def clip(self, bits: int) -> float:
        if self.clip_ratio is not None:
            return self.clip_ratio
        return 0.8 if bits <= 2 else 1.0

    # -- offline -----------------------------------------------------------------------------
    def check_model(self, head_dim: int, num_kv_heads: int) -> None:
        super().check_model(head_dim, num_kv_heads)
        if self.reorder:
            self.calibration_path()  # a missing file fails here, before the model is loaded

    def calibration_path(self) -> Path:
        if not self.calibration:
            raise ValueError("rotatekv: reorder=true needs `calibration`, the file written by "
                             "scripts/calibrate_rotatekv.py (or reorder=false for the natural channel order)")
        path = Path(self.calibration)
        path = path if path.is_absolute() else REPO_ROOT / path
        if not path.exists():
            model = path.stem.removeprefix("rotatekv_") if path.stem.startswith("rotatekv_") else "<model>"
            raise FileNotFoundError(f"rotatekv: calibration file {path} not found; make it with "
                                    f"`python scripts/calibrate_rotatekv.py --model {model} --out {self.calibration}` "
                                    f"(or run with method.reorder=false)")
        return path

    def prepare_model(self, model: nn.Module) -> None:
        """Fold the value Hadamard, find RoPE, load the calibrated permutation, hook the sink detector."""
        config = model.config.get_text_config()
        num_kv, head_dim = config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.check_model(head_dim, num_kv)
        self._rotary = rotary_module(model)
        self._layer_types = layer_types(model)
        self._group = effective_head_group(self.head_group, num_kv)
        if self._group != self.head_group:
            log.warning("rotatekv: %d KV heads, rotating groups of %d heads instead of %d", num_kv, self._group, self.head_group)
        if self.reorder:  # each layer's order on that layer's device
            orders = self.load_calibration(model, num_kv * head_dim)
            devices = {m.layer_idx: m.v_proj.weight.device for m in attention_modules(model)}
            self._orders = [order.to(devices.get(i, order.device)) for i, order in enumerate(orders)]
        if self.rotate_values:
            fold_value_hadamard(model)
        for handle in self._hooks:
            handle.remove()
        self._hooks = [layer.register_forward_pre_hook(self._sink_hook(idx), with_kwargs=True)
                       for idx, layer in decoder_layers(model)]
        if not self._hooks:
            raise ValueError("rotatekv: found no decoder layer with a self_attn module to detect attention sinks")

    def load_calibration(self, model: nn.Module, channels: int) -> Tensor:
        path = self.calibration_path()
        calib = torch.load(path, map_location="cpu")
        key = "order_before_rotation" if self.reorder_first else "order_after_rotation"
        orders = calib[key]
        num_layers = model.config.get_text_config().num_hidden_layers
        if orders.shape != (num_layers, channels) or calib["head_group"] != self._group:
            raise ValueError(f"rotatekv: {path} holds orders {tuple(orders.shape)} for head_group={calib['head_group']}, "
                             f"the model needs ({num_layers}, {channels}) for head_group={self._group}")
        return orders.long()

    # -- sink detection (prefill) ------------------------------------------------------------
    def _sink_hook(self, layer_idx: int):
        def hook(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is None or cache.get_seq_length(layer_idx) != 0:
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            real = _real_tokens(kwargs.get("attention_mask"), hidden.shape[:2])
            _check_positions(kwargs.get("position_ids"), real)
            self._sinks[layer_idx] = self.select_sinks(hidden, real)
        return hook

    def select_sinks(self, hidden: Tensor, real: Tensor) -> dict[int, Tensor]:
        """Sink stream indices per batch row from a layer's input hidden [B, T, C] (real [B, T] bool)."""
        sinks = {}
        for row in range(hidden.shape[0]):
            h = hidden[row, real[row]].float().abs()  # [n, C], stream order
            if self.num_sinks == 0 or h.numel() == 0:
                sinks[row] = torch.zeros(0, dtype=torch.long, device=hidden.device)
            elif self.sink_select == "elements":
                top = h.flatten().topk(min(self.num_sinks, h.numel())).indices
                sinks[row] = torch.unique(top // h.shape[1])
            else:
                sinks[row] = torch.sort(h.amax(-1).topk(min(self.num_sinks, h.shape[0])).indices).values
        return sinks

    def _sink_mask(self, layer_idx: int, span: TokenSpan | None, b: int, t: int, device) -> Tensor:
        """[B, 1, T] bool: the chunk's tokens that the latest prefill marked as sinks."""
        mask = torch.zeros(b, 1, t, dtype=torch.bool, device=device)
        span = span or TokenSpan(torch.arange(b), 0)
        for i, row in enumerate(span.rows.tolist()):
            pos = self._sinks.get(layer_idx, {}).get(row)
            if pos is not None:  # found on the layer's input, which may sit on the previous layer's device
                local = pos[(pos >= span.start) & (pos < span.start + t)] - span.start
                mask[i, 0, local.to(device)] = True
        return mask

    # -- the key transform -------------------------------------------------------------------
    def _rope(self, layer_idx: int, start: int, t: int, head_dim: int, device) -> tuple[Tensor, Tensor]:
        if self._rotary is None:
            raise RuntimeError("rotatekv: call prepare_model(model) first (RoPE and the calibrated order come from the model)")
        home = next(self._rotary.buffers()).device  # the rotary embedding's device (a split model's: one of them)
        layer_type = None if self._layer_types is None else self._layer_types[layer_idx]
        cos, sin = rope_tables(self._rotary, torch.arange(start, start + t, device=home), head_dim, layer_type)
        return cos.to(device), sin.to(device)

    def to_rotated(self, k_pre: Tensor, layer_idx: int) -> Tensor:
        """z = P H_g k_pre (or H_g P k_pre with reorder_first) in float32: [B, H, T, D]."""
        x = k_pre.float()
        order = None if self._orders is None else self._orders[layer_idx].to(x.device)
        if order is not None and self.reorder_first:
            x = permute_channels(x, order)
        x = grouped_head_hadamard(x, self._group)
        if order is not None and not self.reorder_first:
            x = permute_channels(x, order)
        return x

    def from_rotated(self, z: Tensor, layer_idx: int) -> Tensor:
        """Inverse of :meth:`to_rotated`."""
        x = z.float()
        order = None if self._orders is None else self._orders[layer_idx].to(x.device)
        inverse = None if order is None else torch.argsort(order)
        if inverse is not None and not self.reorder_first:
            x = permute_channels(x, inverse)
        x = grouped_head_hadamard(x, self._group)
        if inverse is not None and self.reorder_first:
            x = permute_channels(x, inverse)
        return x

    # -- online ------------------------------------------------------------------------------
    def quantize_keys(self, k: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        b, h, t, d = k.shape
        start = 0 if span is None else span.start
        cos, sin = self._rope(layer_idx, start, t, d, k.device)
        z = self.to_rotated(undo_rope(k.float(), cos, sin), layer_idx)
        packed = quantize_groups(z.to(k.dtype), self.k_bits, self.group_size, "token", "int", self.clip(self.k_bits))
        packed.meta = {**packed.meta, "kind": "keys", "layer": layer_idx}
        sinks = self._sink_mask(layer_idx, span, b, t, k.device)
        return packed.with_buffers(**keep_exact(k, sinks, start))

    def quantize_values(self, v: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        b, h, t, d = v.shape
        packed = quantize_groups(v, self.v_bits, self.group_size, "token", "int", self.clip(self.v_bits))
        packed.meta = {**packed.meta, "kind": "values", "layer": layer_idx}
        sinks = self._sink_mask(layer_idx, span, b, t, v.device)
        return packed.with_buffers(**keep_exact(v, sinks, 0 if span is None else span.start))

    def dequantize(self, packed: PackedTensor) -> Tensor:
        x = dequantize_groups(packed, torch.float32)
        if packed.meta["kind"] == "keys":
            t, d = packed.shape[2], packed.shape[3]
            cos, sin = self._rope(packed.meta["layer"], packed.start, t, d, x.device)  # the chunk's stream positions
            x = apply_rope(self.from_rotated(x, packed.meta["layer"]), cos, sin)
        return restore_exact(x.to(packed.dtype), packed.buffers, packed.start)


def _real_tokens(mask: Tensor | None, shape: tuple[int, int]) -> Tensor:
    """Which tokens of the call are real (not left padding), from the 4D mask the layer gets: [B, T] bool."""
    b, t = shape
    if mask is None:
        return torch.ones(b, t, dtype=torch.bool)
    # a real token attends itself, a pad token nothing: the diagonal (causal and sliding-window masks alike)
    idx = torch.arange(t, device=mask.device)
    diagonal = mask[:, 0, idx.clamp(max=mask.shape[2] - 1), mask.shape[-1] - t + idx]
    real = diagonal if diagonal.dtype == torch.bool else diagonal > torch.finfo(diagonal.dtype).min
    return real.expand(b, t).cpu()


def _check_positions(position_ids: Tensor | None, real: Tensor) -> None:
    """Stream index = position: refuse a prefill whose real tokens' positions are not 0, 1, 2, ..."""
    if position_ids is None:
        return
    expected = real.long().cumsum(-1) - 1
    pos = position_ids.cpu().expand_as(expected)
    if not torch.equal(pos[real], expected[real]):
        raise ValueError("rotatekv re-applies RoPE at stream positions (0 = first real token): pass position_ids "
                         "counting real tokens from 0, as generate() does, for left-padded forward calls")
