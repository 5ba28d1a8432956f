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
     clipped by ``clip_ratio`` (0.8 at 2 bits; ours: also at 1 bit, 1.0 above 2; any width 1-8 has 2^b levels);
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
  - ``k_bits=16`` stores the post-RoPE keys as they are: the rotations serve the quantizer, and undoing
    and re-applying RoPE around an unquantized store would only round the keys.
The sinks are per-sequence state the cache owns (``new_state``: stream indices [B, 1, num_sinks]),
written by a hook on each decoder layer at prefill and read by every flush of that layer, on the host or,
for one-token value flushes, inside the decode step. A chunk quantized on its own (no span) is taken
as the start of the streams of batch rows 0..B-1 (positions from 0) with no sinks; keys are always
flushed on the host (one start for the chunk's rows).
Stored per chunk: codes / scale / zero of z, plus the sinks' post-RoPE K (and V) in the model dtype
with their int32 stream indices; nbytes counts them all. The per-model permutation is a constant.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from oscar.exact import positions_mask, restore_exact, with_kept
from oscar.method import (FlushPolicy, KVMethod, ServedModels, TokenSpan, attention_shape, check_calibrated_model,
                          layer_state,
                          read_calibration, register_method)
from oscar.options import bounded
from oscar.paths import calibration_command, calibration_file, calibration_location
from oscar.quant import PackedTensor, dequantize_groups, hadamard, quantize_groups
from oscar.rope import apply_rope, layer_types, rope_tables, rotary_module, undo_rope
from oscar.weights import attention_modules, fold_value_hadamard

log = logging.getLogger(__name__)

#: what a model whose RoPE rotatekv cannot invert runs instead: the methods that quantize post-RoPE keys
OTHER_METHODS = "kivi, quarot, turboquant, ott, oscar or spectral"


# ----------------------------------------------------------------------------- transforms


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


def decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer_idx, decoder layer) for every decoder layer whose ``self_attn`` is an attention module."""
    attn = {id(m): m for m in attention_modules(model)}
    return [(m.self_attn.layer_idx, m) for m in model.modules() if id(getattr(m, "self_attn", None)) in attn]


# ----------------------------------------------------------------------------- the method


@register_method("rotatekv")
@dataclass
class RotateKV(KVMethod):
    uses_hadamard = True
    uses_span = True  # keys rotate by their RoPE positions and the sinks are per sequence (span.start, span.state)

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
        self._num_kv_heads = 0
        self._orders: list[Tensor] | None = None  # per layer [H*D], on the layer's device
        #: each prepared model's sink hooks (one per decoder layer), weakly keyed by the model
        self._hooks: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()
        #: the models the RoPE, orders and kernel tables above serve (one shape, RoPE and placement)
        self._served = ServedModels()
        #: what kernels derive from the prepared model, by their own keys (kernels/variants/rotatekv.py); emptied when
        #: prepare_model builds the state above anew
        self.kernel_tables: dict = {}

    def clip(self, bits: int) -> float:
        if self.clip_ratio is not None:
            return self.clip_ratio
        return 0.8 if bits <= 2 else 1.0

    # -- offline -----------------------------------------------------------------------------
    def check_model(self, head_dim: int, num_kv_heads: int) -> None:
        super().check_model(head_dim, num_kv_heads)
        if self.reorder:
            self.calibration_path()  # a missing file fails here, before the model is loaded

    def check_config(self, config, model: str | None = None) -> None:
        """Also the calibration file: opened and its orders checked against the model, before the weights load."""
        super().check_config(config, model)
        if self.reorder:
            head_dim, num_kv = attention_shape(config)
            self.load_calibration(config.get_text_config().num_hidden_layers, num_kv * head_dim,
                                  effective_head_group(self.head_group, num_kv), model)

    def calibration_path(self, model: str | None = None) -> Path:
        if not self.calibration:
            raise ValueError("rotatekv: reorder=true needs `calibration`, the file written by "
                             "scripts/calibrate_rotatekv.py (or reorder=false for the natural channel order)")
        return calibration_file("rotatekv", self.calibration, model or self._calibrated_model(),
                                " (or run with method.reorder=false)")

    def data_files(self) -> list[Path]:
        """The calibration file, read when ``reorder`` (its contents are part of a run's identity)."""
        return [calibration_location(self.calibration)] if self.reorder and self.calibration else []

    def _calibrated_model(self) -> str:
        """The model a calibration file is for, by its name (results/calibration/rotatekv_<model>.pt)."""
        stem = Path(self.calibration).stem
        return stem.removeprefix("rotatekv_") if stem.startswith("rotatekv_") else "<model>"

    def prepare_model(self, model: nn.Module) -> None:
        """Find RoPE and load the calibrated permutation (once for every model of one shape, RoPE and placement this
        object serves: :class:`ServedModels`), fold the value Hadamard, hook the sink detector (per model: preparing
        another model leaves this one's hooks)."""
        config = model.config.get_text_config()
        num_kv, head_dim = config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.check_model(head_dim, num_kv)
        rotary = rotary_module(model, "rotatekv", OTHER_METHODS)
        group = effective_head_group(self.head_group, num_kv)
        devices = {m.layer_idx: m.v_proj.weight.device for m in attention_modules(model)}
        types = layer_types(model)
        signature = (config.num_hidden_layers, num_kv, head_dim, group, tuple(types or ()),
                     tuple(sorted((i, str(d)) for i, d in devices.items())), _rope_signature(rotary, head_dim, types))
        layers = list(decoder_layers(model))
        if not layers:
            raise ValueError("rotatekv: found no decoder layer with a self_attn module to detect attention sinks")
        if self._served.admit(self, model, signature):
            self._rotary, self._layer_types, self._num_kv_heads, self._group = rotary, types, num_kv, group
            self.kernel_tables = {}
            if group != self.head_group:
                log.warning("rotatekv: %d KV heads, rotating groups of %d heads instead of %d", num_kv, group,
                            self.head_group)
            if self.reorder:  # each layer's order on that layer's device
                orders = self.load_calibration(config.num_hidden_layers, num_kv * head_dim, group)
                self._orders = [order.to(devices.get(i, order.device)) for i, order in enumerate(orders)]
        if self.rotate_values:
            fold_value_hadamard(model)
        for handle in self._hooks.pop(model, []):
            handle.remove()
        self._hooks[model] = [layer.register_forward_pre_hook(self._sink_hook(idx, check=i == 0), with_kwargs=True)
                              for i, (idx, layer) in enumerate(layers)]

    def release_model(self, model: nn.Module) -> None:
        """Remove the model's sink hooks; the state its prepare_model built stays for the other models it serves."""
        for handle in self._hooks.pop(model, []):
            handle.remove()
        self._served.discard(model)

    def load_calibration(self, num_layers: int, channels: int, group: int, model: str | None = None) -> Tensor:
        """The calibrated channel orders [num_layers, channels] for Hadamard groups of ``group`` heads, from the file
        (``model``: the run's model, named in the errors); a file that cannot be read or was made for another model
        shape is a ValueError naming it and the command that makes the right one."""
        path = self.calibration_path(model)
        fix = calibration_command("rotatekv", self.calibration, model or self._calibrated_model())
        key = "order_before_rotation" if self.reorder_first else "order_after_rotation"
        calib = read_calibration("rotatekv", path, fix, (key, "head_group"))
        orders = calib[key]
        if getattr(orders, "shape", None) != (num_layers, channels) or calib["head_group"] != group:
            made_for = f" (made for {calib['model']})" if "model" in calib else ""
            remake = calibration_command("rotatekv", None, model or "<model>")  # its default file, not this one
            raise ValueError(f"rotatekv: {path}{made_for} holds orders {tuple(getattr(orders, 'shape', ()))} for "
                             f"head_group={calib['head_group']}, the model{'' if model is None else ' ' + model} "
                             f"needs ({num_layers}, {channels}) for head_group={group}; point method.calibration at "
                             f"its file, or make it with {remake}")
        check_calibrated_model("rotatekv", path, calib, model)
        return orders.long()

    # -- sink detection (prefill) ------------------------------------------------------------
    def new_state(self, batch: int, num_kv_heads: int, device) -> dict[str, Tensor]:
        """The sinks of each sequence: their stream indices [B, 1, num_sinks], -1 = none."""
        return {"sinks": torch.full((batch, 1, self.num_sinks), -1, dtype=torch.long, device=device)}

    def _sink_hook(self, layer_idx: int, check: bool):
        """The prefill hook of one decoder layer; ``check``: the first layer's also checks the call's positions (the
        same for every layer: a host read per layer would stall the stream at each)."""
        def hook(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is None or cache.get_seq_length(layer_idx) != 0:
                return
            state = layer_state(cache, layer_idx)  # None: a cache that quantizes nothing (a reference pass)
            if state is not None and state.method is not self:  # another method's cache on a model this one hooked
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            # the engine's static caches know their rows' padding (their prefill mask is a placeholder)
            real = (cache.real_tokens(hidden.shape[1], hidden.device) if hasattr(cache, "real_tokens")
                    else _real_tokens(kwargs.get("attention_mask"), hidden.shape[:2]))
            if check:
                _check_positions(kwargs.get("position_ids"), real)
            if state is not None:  # on the layer's device (its input may sit on the previous layer's)
                device = next(module.self_attn.parameters()).device
                sinks = state.allocate(hidden.shape[0], self._num_kv_heads, device)["sinks"]
                sinks.copy_(self.select_sinks(hidden, real))
        return hook

    def select_sinks(self, hidden: Tensor, real: Tensor) -> Tensor:
        """Sink stream indices per batch row from a layer's input hidden [B, T, C] (real [B, T] bool):
        [B, 1, num_sinks] long on hidden's device, ascending, -1 after the row's sinks. The whole batch at once on
        the device (pad tokens score -1, below any |h|): no host read."""
        b, t, c = hidden.shape
        sinks = torch.full((b, 1, self.num_sinks), -1, dtype=torch.long, device=hidden.device)
        if self.num_sinks == 0 or t == 0:
            return sinks
        real = real.to(hidden.device)
        if self.sink_select == "elements":  # the tokens of the top num_sinks entries of |h|, each once
            score = hidden.abs().masked_fill(~real.unsqueeze(-1), -1).flatten(1)
            top, where = score.topk(min(self.num_sinks, t * c), dim=-1)
            tokens = torch.div(where, c, rounding_mode="floor")
        else:  # the num_sinks tokens of largest max |h|
            top, tokens = hidden.abs().amax(-1).masked_fill(~real, -1).topk(min(self.num_sinks, t), dim=-1)
        tokens = torch.where(top >= 0, tokens, t).sort(-1).values  # pads (and a short row's rest) last
        repeated = torch.cat([torch.zeros_like(tokens[:, :1], dtype=torch.bool), tokens[:, 1:] == tokens[:, :-1]], 1)
        tokens = torch.where(repeated, t, tokens).sort(-1).values
        stream = real.long().cumsum(-1) - 1  # stream index = position among the row's real tokens
        found = torch.where(tokens < t, stream.gather(1, tokens.clamp(max=t - 1)), -1)
        sinks[:, 0, :found.shape[1]] = found
        return sinks

    # -- the key transform -------------------------------------------------------------------
    def _rope(self, layer_idx: int, start: int, t: int, head_dim: int, device) -> tuple[Tensor, Tensor]:
        if self._rotary is None:
            raise RuntimeError("rotatekv: call prepare_model(model) first (RoPE and the calibrated order come from the model)")
        home = next(self._rotary.buffers()).device  # the rotary embedding's device (a split model's: one of them)
        layer_type = None if self._layer_types is None else self._layer_types[layer_idx]
        cos, sin = rope_tables(self._rotary, torch.arange(start, start + t, device=home), head_dim, layer_type)
        return cos.to(device), sin.to(device)

    def channel_order(self, layer_idx: int, channels: int) -> Tensor:
        """The calibrated permutation P of the layer's H * D key channels (z_j = x_order[j]); the identity without
        reorder (one tensor per width: the kernels' layouts cache their index per order)."""
        if self._orders is None:
            return _identity_order(channels)
        return self._orders[layer_idx]

    @property
    def grouped_heads(self) -> int:
        """KV heads per Hadamard group, as prepare_model settled it for the model."""
        return self._group

    def rope_at(self, layer_idx: int, positions: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
        """The model's RoPE cos, sin [T, D] (fp32) at the stream positions [T] (a kernel's tables)."""
        if self._rotary is None:
            raise RuntimeError("rotatekv: call prepare_model(model) first (RoPE comes from the model)")
        home = next(self._rotary.buffers()).device
        layer_type = None if self._layer_types is None else self._layer_types[layer_idx]
        return rope_tables(self._rotary, positions.to(home), head_dim, layer_type)

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
        span = self.chunk_span(k, span)  # on its own: from position 0, no sinks
        if self.k_bits == 16:  # stored as they are (post-RoPE): rotating them would only round them
            packed = quantize_groups(k, 16, self.group_size, "token")
        else:
            cos, sin = self._rope(layer_idx, span.start, t, d, k.device)
            z = self.to_rotated(undo_rope(k.float(), cos, sin), layer_idx)
            packed = quantize_groups(z.to(k.dtype), self.k_bits, self.group_size, "token", "int",
                                     self.clip(self.k_bits))
        packed.meta = {**packed.meta, "kind": "keys", "layer": layer_idx}
        sinks = positions_mask(span.state["sinks"][span.rows], span.start, t)
        return with_kept(packed, k, sinks, span)

    def quantize_values(self, v: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        span = self.chunk_span(v, span)
        packed = quantize_groups(v, self.v_bits, self.group_size, "token", "int", self.clip(self.v_bits))
        packed.meta = {**packed.meta, "kind": "values", "layer": layer_idx}
        sinks = positions_mask(span.state["sinks"][span.rows], span.start, v.shape[2])
        return with_kept(packed, v, sinks, span)

    def dequantize(self, packed: PackedTensor) -> Tensor:
        x = dequantize_groups(packed, torch.float32)
        if packed.meta["kind"] == "keys" and packed.meta["bits"] < 16:
            t, d = packed.shape[2], packed.shape[3]
            cos, sin = self._rope(packed.meta["layer"], packed.start, t, d, x.device)  # the chunk's stream positions
            x = apply_rope(self.from_rotated(x, packed.meta["layer"]), cos, sin)
        return restore_exact(x.to(packed.dtype), packed.buffers, packed.start)


def _rope_signature(rotary: nn.Module, head_dim: int, types: list[str] | None) -> tuple:
    """What RoPE gives at a few positions, per layer type (its cos and sin as numbers): equal for two models
    whose keys rotatekv rotates alike."""
    positions = torch.tensor([0, 1, 7, 1000], device=next(rotary.buffers()).device)
    tables = [rope_tables(rotary, positions, head_dim, kind) for kind in sorted(set(types or [None]), key=str)]
    return tuple(tuple(torch.cat([cos, sin]).flatten().tolist()) for cos, sin in tables)


@functools.cache
def _identity_order(channels: int) -> Tensor:
    """The identity channel order of ``channels`` channels (shared: never written to)."""
    return torch.arange(channels)


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
    real = real.cpu()
    expected = real.long().cumsum(-1) - 1
    pos = position_ids.cpu().expand_as(expected)
    if not torch.equal(pos[real], expected[real]):
        raise ValueError("rotatekv re-applies RoPE at stream positions (0 = first real token): pass position_ids "
                         "counting real tokens from 0, as generate() does, for left-padded forward calls")
