"""KIVI on the kernels: per-channel keys, per-token values, its zero point; keys as they came in the window."""

from __future__ import annotations

from kernels import ops
from kernels.variant import KernelVariant, register_variant


@register_variant("kivi")
class KIVIVariant(KernelVariant):
    kernel = "kivi"
    keys_per_channel = True
    dequantize_layouts = {"keys": "channel_keys", "values": "value_tiles"}

    def quantize_keys(self, m, keys, **where):
        return ops.quantize_channel_keys(keys, m.k_bits, m.group_size, m.zero_point, decode_layout=True, **where)

    def quantize_values(self, m, values, **where):
        return ops.quantize_values(values, m.v_bits, m.group_size, decode_layout=True, zero_point=m.zero_point,
                                   **where)

    def attention(self, m, head_dim, device, **layer):
        return dict(method=self.kernel, zero_point=m.zero_point)
