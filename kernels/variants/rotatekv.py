"""RotateKV on its kernels: keys flushed and read back by kernels/rotatekv_keys.cu (RoPE undone at their positions,
rotated, permuted, quantized; the prefix read turning them back), bit for bit the method's own torch code, stored
with their codes in the channel order kernels/rotatekv.cu rebuilds them in for the decode logits (RoPE from the
model's table per layer and capacity); values through the value kernel and read back by ops.dequantize; its
attention sinks (the state its prefill hook writes) kept exactly."""

from __future__ import annotations

import math

import torch

from kernels import method_layouts, ops
from kernels.variant import KernelVariant, first_kept, register_variant

#: a method whose layers' RoPE types it does not expose (see RotateKVVariant.tables)
_UNKNOWN = object()


@register_variant("rotatekv")
class RotateKVVariant(KernelVariant):
    kernel = "rotatekv"
    exact = True
    dequantize_layouts = {"values": "value_tiles"}  # the keys: their own kernel (reads_packed, dequantize)

    def quantize_keys(self, m, keys, layer_idx, span, out, rows, offsets):
        b, h, _, d = keys.shape
        tables = self.tables(m, layer_idx, d, h, keys.device, out["codes"].shape[2])
        return ops.quantize_rotatekv_keys(keys, m.k_bits, m.group_size, m.grouped_heads, m.clip(m.k_bits),
                                          tables["z_index"], tables["positions"], out, rows, offsets)

    def quantize_values(self, m, values, layer_idx, span, **where):
        return ops.quantize_values(values, m.v_bits, m.group_size, decode_layout=True, zero_point="int",
                                   clip_ratio=m.clip(m.v_bits), **where)

    def reads_packed(self, stream):
        return True

    def dequantize(self, m, stream, store, rows, start, n, out, layer_idx):
        if stream == "values":
            return super().dequantize(m, stream, store, rows, start, n, out, layer_idx)
        _, h, _, d = out.shape
        tables = self.tables(m, layer_idx, d, h, out.device, store["codes"].shape[2])
        return ops.dequantize_rotatekv_keys(store, m.k_bits, m.group_size, m.grouped_heads, tables["z_index"],
                                            tables["positions"], rows, start, n, out)

    def code_map(self, m, stream):
        return dict(zero_point="int")

    def attention(self, m, head_dim, device, layer_idx=0, capacity=0, heads=1):
        return dict(method="rotatekv", rope=self.tables(m, layer_idx, head_dim, heads, device, capacity)["logits"])

    def tables(self, m, layer_idx: int, head_dim: int, heads: int, device, capacity: int) -> dict:
        """The layer's tables for ``capacity`` stored tokens, made once per layer and device for the prepared model
        (``m.kernel_tables``; again for a larger capacity only): their checks and copies, at every allocation, would
        make each prefill's layers wait for the stream. ``logits``: rotatekv.cu's (its channel order's key groups,
        head group, the model's RoPE every ROPE_RUN positions and at positions 0 .. ROPE_RUN - 1); ``z_index``: where
        each channel sits after the order (method_layouts.rotatekv_z_index); ``positions``: the model's RoPE at every
        position below the capacity (method_layouts.rotatekv_rope_positions), one table for the layers of one RoPE
        type."""
        device = torch.device(device)
        key, anchors = (layer_idx, head_dim, heads, device), math.ceil(max(capacity, 1) / ops.ROPE_RUN)
        tables = m.kernel_tables.get(key)
        if tables is None or tables["logits"]["anchors"].shape[0] < anchors:
            positions = torch.arange(0, anchors * ops.ROPE_RUN, ops.ROPE_RUN, device=device)
            first = torch.arange(ops.ROPE_RUN, device=device)
            rope = method_layouts.rotatekv_rope(*m.rope_at(layer_idx, positions, head_dim),
                                                *m.rope_at(layer_idx, first, head_dim))
            order = m.channel_order(layer_idx, heads * head_dim).to(device)
            logits = method_layouts.rotatekv_tables(order, m.group_size, m.grouped_heads,
                                                    {name: t.to(device) for name, t in rope.items()})
            tables = dict(logits=logits, z_index=method_layouts.rotatekv_z_index(order))
            m.kernel_tables[key] = tables
        tables["positions"] = self._positions(m, layer_idx, head_dim, device, anchors * ops.ROPE_RUN)
        return tables

    @staticmethod
    def _positions(m, layer_idx: int, head_dim: int, device: torch.device, count: int):
        """The model's RoPE at positions 0 .. >= count of the layer's RoPE type ([count, D / 2, 2] fp32), shared by
        the layers of that type (per layer where the method does not say the types)."""
        types = getattr(m, "_layer_types", _UNKNOWN)
        rope_type = None if types is None else layer_idx if types is _UNKNOWN else types[layer_idx]
        key = ("positions", rope_type, head_dim, device)
        table = m.kernel_tables.get(key)
        if table is None or table.shape[0] < count:
            cos, sin = m.rope_at(layer_idx, torch.arange(count, device=device), head_dim)
            table = m.kernel_tables[key] = method_layouts.rotatekv_rope_positions(cos.to(device), sin.to(device))
        return table

    def channel_order(self, m, layer_idx, channels):
        return m.channel_order(layer_idx, channels)

    def missing(self, m):
        problems = [] if not (m.reorder and m.reorder_first) else [
            "reorder_first=true (the kernel undoes the permutation before the Hadamard: the released code's order, "
            "reorder_first=false)"]
        return problems + super().missing(m)

    def kept_positions(self, m, state, device):
        return state["sinks"]

    def slots(self, m):
        return m.num_sinks

    def assume_kept(self, m, state, packed):
        return first_kept(state, "sinks", min(m.num_sinks, packed))
