"""OTT on KIVI's kernels plus its outlier pool kept exactly: a key flush admits the chunk's outliers to the pool
(span.state), stages them in the exact slots and fills their places in the chunk (kernels.ott_pool: OTT.pool_outliers
and the stage on the device), then KIVI's key kernel quantizes the filled chunk (the method's own quantizer's bytes:
it is KIVI's quantizer on that chunk); values go through KIVI's value kernel; the pool's tokens, key and value, sit
in the exact slots (kernels.kept_tokens)."""

from __future__ import annotations

from kernels import ops
from kernels.variant import KernelVariant, first_kept, register_variant


@register_variant("ott")
class OTTVariant(KernelVariant):
    kernel = "ott"
    keys_per_channel = True
    exact = True
    kept_by_keys = True
    dequantize_layouts = {"keys": "channel_keys", "values": "value_tiles"}  # KIVI's, then the pool written over

    def quantize_keys(self, m, keys, layer_idx, span, **where):
        """KIVI's key kernel: on the chunk flush_keys filled, or as it came where nothing is pooled (outliers_per_group
        or pool_size 0)."""
        return ops.quantize_channel_keys(keys, m.k_bits, m.group_size, m.zero_point, decode_layout=True, **where)

    def flush_keys(self, m, keys, values, layer_idx, span, kept, **where):
        if not m.outliers_per_group or not m.pool_size:
            return self.quantize_keys(m, keys, layer_idx, span, **where)
        value_map = self.value_map(m, layer_idx)
        staged_values = values if value_map is None else value_map(values).to(keys.dtype)
        filled = ops.pool_outliers(keys, staged_values, span.state["pool"], span.rows, span.start, kept,
                                   m.group_size, m.outliers_per_group)
        return self.quantize_keys(m, filled, layer_idx, span, **where)

    def quantize_values(self, m, values, layer_idx, span, **where):
        return ops.quantize_values(values, m.v_bits, m.group_size, decode_layout=True, zero_point=m.zero_point,
                                   **where)

    def attention(self, m, head_dim, device, **layer):
        return dict(method="ott", zero_point=m.zero_point)

    def kept_positions(self, m, state, device):
        return state["pool"]  # what its key flushes write

    def slots(self, m):
        return m.pool_size

    def kept_values(self, m):
        return m.keep_values

    def assume_kept(self, m, state, packed):
        return first_kept(state, "pool", min(m.pool_size, packed))
