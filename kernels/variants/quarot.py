"""QuaRot on the kernels: per-token keys and values after the Hadamard (rotated keys in the window, the query rotated
by the kernel), its zero point and clip ratio."""

from __future__ import annotations

from kernels import ops
from kernels.variant import KernelVariant, register_variant


@register_variant("quarot")
class QuaRotVariant(KernelVariant):
    kernel = "quarot"
    rotated_keys = True
    dequantize_layouts = {"keys": "token_keys", "values": "value_tiles"}

    def quantize_keys(self, m, keys, **where):
        return ops.quantize_token_keys(keys, m.k_bits, m.group_size, decode_layout=True, zero_point=m.zero_point,
                                       clip_ratio=m.clip_ratio, rotate=False, **where)

    def quantize_values(self, m, values, **where):
        return ops.quantize_values(values, m.v_bits, m.group_size, decode_layout=True, zero_point=m.zero_point,
                                   clip_ratio=m.clip_ratio, **where)

    def attention(self, m, head_dim, device, **layer):
        return dict(method="quarot", zero_point=m.zero_point)

    def missing(self, m):
        # keys flushed inside the step come back as the method's own dequantization of the window's tokens, and a
        # window of Hadamard-rotated keys is not what its own quantizer takes
        window = ["flush=window (QuaRot's window holds rotated keys: use kivi or block)"] if m.flush == "window" else []
        return super().missing(m) + window
