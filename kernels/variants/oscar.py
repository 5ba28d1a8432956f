"""OScaR on its own kernels: per-channel keys with token norms (rotated in the window), the query rotated by the
kernel; its reference configuration only (no ablation, the block policy)."""

from __future__ import annotations

from kernels import ops
from kernels.variant import KernelVariant, register_variant


@register_variant("oscar")
class OScaRVariant(KernelVariant):
    kernel = "oscar"
    keys_per_channel = True
    rotated_keys = True
    dequantize_layouts = {"keys": "channel_keys", "values": "value_tiles"}

    def quantize_keys(self, m, keys, **where):
        return ops.quantize_keys(keys, m.k_bits, m.group_size, rotate=False, decode_layout=True, **where)

    def quantize_values(self, m, values, **where):
        return ops.quantize_values(values, m.v_bits, m.group_size, decode_layout=True, **where)

    def attention(self, m, head_dim, device, **layer):
        return dict(method="oscar", rotate_query=True)

    def missing(self, m):
        problems = []
        if not (m.rotate and m.scale and m.norm_scope == "token" and m.zero_point == "int" and m.rotate_values):
            problems.append("an OScaR ablation (rotate/scale/norm_scope/zero_point/rotate_values)")
        if m.rotation != "hadamard":
            problems.append(f"rotation={m.rotation} (the kernels rotate with H_D only)")
        if m.norm_floor != "none":
            problems.append(f"norm_floor={m.norm_floor} (the kernels divide each token by its own norm)")
        if m.flush != "block":
            problems.append(f"flush={m.flush} (OScaR's kernels follow its reference policy, block)")
        return problems + self.bits(m) + self.groups(m)
