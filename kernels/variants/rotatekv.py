"""RotateKV on its kernels: keys flush with the method's own quantizer (RoPE undone at their positions, rotated,
permuted), stored with their codes in the channel order kernels/rotatekv.cu rebuilds them in (RoPE from the model's
table per layer and capacity); values through the value kernel; its attention sinks (the state its prefill hook
writes) kept exactly."""

from __future__ import annotations

import math

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
        """Its channel order's key groups, head group, and the model's RoPE every ROPE_RUN positions for at least
        ``capacity`` tokens (plus the one-position step). Made once per layer and device for the prepared model
        (``m.kernel_tables``; again for a larger capacity only): their checks and copies, at every allocation,
        would make each prefill's layers wait for the stream."""
        device = torch.device(device)
        key, anchors = (layer_idx, head_dim, heads, device), math.ceil(max(capacity, 1) / ops.ROPE_RUN)
        tables = m.kernel_tables.get(key)
        if tables is None or tables["anchors"].shape[0] < anchors:
            positions = torch.arange(0, anchors * ops.ROPE_RUN, ops.ROPE_RUN, device=device)
            first = torch.arange(2, device=device)
            rope = method_layouts.rotatekv_rope(*m.rope_at(layer_idx, positions, head_dim),
                                                *m.rope_at(layer_idx, first, head_dim))
            order = m.channel_order(layer_idx, heads * head_dim).to(device)
            tables = method_layouts.rotatekv_tables(order, m.group_size, m.grouped_heads,
                                                    {name: t.to(device) for name, t in rope.items()})
            m.kernel_tables[key] = tables
        return dict(method="rotatekv", rope=tables)

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
