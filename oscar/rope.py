"""Rotary position embeddings (RoPE) of a loaded model, for methods that work on pre-RoPE keys.

The rotate-half convention of Llama / Qwen3 / Mistral: x_rope = x * cos + rotate_half(x) * sin with cos, sin
[T, D] from the model's own rotary embedding at the given positions (so its scaling variants come along).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the rotate-half convention (Llama, Qwen3): x [B, H, T, D], cos/sin [T, D]."""
    return x * cos + rotate_half(x) * sin


def undo_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Exact inverse of :func:`apply_rope` (also with an attention scaling folded into cos/sin)."""
    return (x * cos - rotate_half(x) * sin) / (cos.square() + sin.square())


def rotary_module(model: nn.Module, user: str, instead: str) -> nn.Module:
    """The model's one rotary embedding module: rotary(x, position_ids) -> cos, sin, or with a third argument, the
    layer type, where the model has one RoPE per layer type (Gemma 3: sliding / full). The refusal of a model it
    cannot serve names ``user`` (a method) and what to use ``instead``."""
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")
             and (hasattr(m, "inv_freq") or per_layer_type(m))]
    multi_axis = sorted(type(m).__name__ for m in found if _multi_axis_rope(m))
    if multi_axis:
        raise ValueError(f"{user} cannot run on {type(model).__name__}: its rotary embedding "
                         f"({', '.join(multi_axis)}) takes multi-axis (M-RoPE) positions, and the inverse RoPE "
                         f"{user} applies assumes 1-D positions; use another method ({instead})")
    if len(found) != 1:
        raise ValueError(f"{user} needs exactly one rotary embedding module, found {len(found)} "
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
        raise ValueError(f"the rotary embedding covers {cos.shape[-1]} of {head_dim} channels (partial RoPE is not supported)")
    return cos, sin
