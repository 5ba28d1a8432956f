"""OTT on KIVI's kernels plus its outlier pool kept exactly: keys flush with the method's own quantizer (which admits
the pool's tokens in span.state), values through KIVI's value kernel (their packed part byte for byte); the pool's
tokens, key and value, sit in the exact slots (kernels.kept_tokens)."""

from __future__ import annotations

from kernels import ops
from kernels.variant import OwnQuantizer, first_kept, register_variant
from oscar.exact import positions_mask


@register_variant("ott")
class OTTVariant(OwnQuantizer):
    kernel = "ott"
    keys_per_channel = True
    exact = True
    kept_by_keys = True
    dequantize_layouts = {"keys": "channel_keys", "values": "value_tiles"}  # KIVI's, then the pool written over

    def quantize_values(self, m, values, layer_idx, span, **where):
        return ops.quantize_values(values, m.v_bits, m.group_size, decode_layout=True, zero_point=m.zero_point,
                                   **where)

    def attention(self, m, head_dim, device, **layer):
        return dict(method="ott", zero_point=m.zero_point)

    def kept(self, m, state, rows, start, n):
        return positions_mask(state["pool"][rows], start, n)  # the pool its key flushes write

    def slots(self, m):
        return m.pool_size

    def kept_values(self, m):
        return m.keep_values

    def assume_kept(self, m, state, packed):
        return first_kept(state, "pool", min(m.pool_size, packed))
