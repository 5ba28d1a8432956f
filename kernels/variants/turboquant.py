"""TurboQuant+ (turbo2) on the kernels: its random signs and 2-bit codebook, keys and values alike."""

from __future__ import annotations

from kernels import ops
from kernels.variant import KernelVariant, register_variant


@register_variant("turboquant")
class TurboQuantVariant(KernelVariant):
    kernel = "turboquant"

    def _constants(self, m, x):
        d = x.shape[-1]
        return m.signs(d, x.device), m.codebook(2, d).tolist()

    def quantize_keys(self, m, keys, **where):
        return ops.quantize_turboquant(keys, m.group_size, *self._constants(m, keys), decode_layout="keys", **where)

    def quantize_values(self, m, values, **where):
        return ops.quantize_turboquant(values, m.group_size, *self._constants(m, values), decode_layout="values",
                                       **where)

    def reads_packed(self, stream):
        return True

    def dequantize(self, m, stream, store, rows, start, n, out, layer_idx):
        return ops.dequantize_turboquant(store, stream, m.group_size, *self._constants(m, out), rows, start, n, out)

    def attention(self, m, head_dim, device, **layer):
        return dict(method="turboquant", signs=m.signs(head_dim, device), codebook=m.codebook(2, head_dim).tolist())

    def missing(self, m):
        return self.bits(m, (2,)) + self.groups(m) + self.window(m)
