"""OSCAR (method ``spectral``) on its kernels: per-token groups of min(G, head_dim) with fp32 scale/zero, quantized by
its uniform quantizer's kernel (the Lloyd-Max switch: the method's own quantizer, decoded through the kernel's
affine code map) and read back by ops.dequantize (fp32 parameters; the Lloyd-Max levels); keys and queries rotated by
the layer's matrix (a decode token's by ops.rotate_rows, a prefill chunk's in torch); its first sink_tokens kept
exactly; its window policy flushes keys and values one token a step (CupyKVLayer's in-step streams)."""

from __future__ import annotations

import functools

import torch

from kernels import ops, runtime
from kernels.variant import OwnQuantizer, register_variant


@register_variant("spectral")
class SpectralVariant(OwnQuantizer):
    kernel = "spectral"
    transforms = True
    exact = True
    dequantize_layouts = {"keys": "token_keys", "values": "value_tiles"}  # both codebooks store there

    def transform_token(self, m, x, layer_idx):
        """x R_K by one ops.rotate_rows launch where the kernel takes x (16-bit, on the kernels' device), else in torch
        (the method's transform_key)."""
        if runtime.accepts(x):
            return ops.rotate_rows(x, m.key_rotation(layer_idx).to(x.device))
        return m.transform_key(x, layer_idx)

    def own_quantizer(self, m, stream):
        if stream == "keys":  # the window holds keys rotated by the layer's matrix
            return lambda x, layer_idx, span=None: m.quantize_rotated_keys(x, span)
        return super().own_quantizer(m, stream)

    def _quantize(self, m, stream, x, layer_idx, span, **where):
        if m.codebook != "uniform":
            return self.store_own(m, stream, x, layer_idx, span, **where)
        bits, clip = (m.k_bits, m.k_clip_ratio) if stream == "keys" else (m.v_bits, m.v_clip_ratio)
        return ops.quantize_spectral(x, bits, m.group(x.shape[-1]), clip, decode_layout=stream, **where)

    def quantize_keys(self, m, keys, layer_idx, span, **where):
        return self._quantize(m, "keys", keys, layer_idx, span, **where)

    def quantize_values(self, m, values, layer_idx, span, **where):
        return self._quantize(m, "values", values, layer_idx, span, **where)

    def attention(self, m, head_dim, device, **layer):
        affine = ops.affine_levels(m.reconstruction_levels().tolist()) if m.codebook == "lloyd_max" else (0.0, 1.0)
        return dict(method="spectral", affine=affine)

    def code_map(self, m, stream):
        """x = code * scale + min, or Lloyd-Max's mean + std * level[code] (fp32 parameters either way)."""
        levels = m.reconstruction_levels().tolist() if m.codebook == "lloyd_max" else None
        return dict(zero_point="float", levels=levels)

    def group(self, m, head_dim):
        return m.group(head_dim)

    def missing(self, m):
        problems = []
        if m.codebook == "lloyd_max":
            try:
                ops.affine_levels(m.reconstruction_levels().tolist())
            except ValueError:
                problems.append("lloyd_max_levels=exact (the kernel maps codes affinely: the released levels)")
        if m.residual_length < ops.STAGE_TOKENS:
            problems.append(f"residual_length={m.residual_length} (the window keeps at least a "
                            f"{ops.STAGE_TOKENS}-token stage)")
        return problems + self.bits(m) + self.groups(m)

    def kept_positions(self, m, state, device):
        """The first sink_tokens positions of every sequence (one list for every row and head)."""
        return _first_positions(m.sink_tokens, torch.device(device))

    def kept_limit(self, m):
        return m.sink_tokens

    def slots(self, m):
        return m.sink_tokens

    def assume_kept(self, m, state, packed):
        return min(m.sink_tokens, packed)


@functools.cache
def _first_positions(n: int, device: torch.device) -> torch.Tensor:
    """Stream positions 0 .. n - 1 as int64 [1, 1, n] on ``device``, made once."""
    return torch.arange(n, device=device).view(1, 1, n)
