"""RotateKV on its kernels: keys flush with the method's own quantizer (RoPE undone at their positions, rotated,
permuted), stored with their codes in the channel order kernels/rotatekv.cu rebuilds them in (RoPE from the model's
table per layer and capacity); values through the value kernel; its attention sinks (the state its prefill hook
writes) kept exactly."""

from __future__ import annotations

import torch

from kernels import method_layouts, ops
from kernels.variant import OwnQuantizer, first_kept, register_variant
from oscar.exact import positions_mask


@register_variant("rotatekv")
class RotateKVVariant(OwnQuantizer):
    kernel = "rotatekv"
    exact = True

    def quantize_values(self, m, values, layer_idx, span, **where):
        return ops.quantize_values(values, m.v_bits, m.group_size, decode_layout=True, zero_point="int",
                                   clip_ratio=m.clip(m.v_bits), **where)

    def attention(self, m, head_dim, device, layer_idx=0, capacity=0, heads=1):
        """Its channel order's key groups, head group, and the model's RoPE every ROPE_RUN positions up to
        ``capacity`` (plus the one-position step)."""
        anchors = m.rope_at(layer_idx, torch.arange(0, max(capacity, 1), ops.ROPE_RUN), head_dim)
        first = m.rope_at(layer_idx, torch.arange(2), head_dim)
        rope = method_layouts.rotatekv_rope(*(t.to(device) for t in (*anchors, *first)))
        order = m.channel_order(layer_idx, heads * head_dim).to(device)
        return dict(method="rotatekv", rope=method_layouts.rotatekv_tables(order, m.group_size, m.grouped_heads, rope))

    def channel_order(self, m, layer_idx, channels):
        return m.channel_order(layer_idx, channels)

    def missing(self, m):
        problems = [] if not (m.reorder and m.reorder_first) else [
            "reorder_first=true (the kernel undoes the permutation before the Hadamard: the released code's order, "
            "reorder_first=false)"]
        return problems + super().missing(m)

    def kept(self, m, state, rows, start, n):
        return positions_mask(state["sinks"][rows], start, n)

    def slots(self, m):
        return m.num_sinks

    def assume_kept(self, m, state, packed):
        return first_kept(state, "sinks", min(m.num_sinks, packed))
