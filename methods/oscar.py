"""OScaR: the Occam's razor for extreme KV-cache quantization.

Algorithm (per layer, keys post-RoPE / post-QK-norm):
  1. Canalized Rotation:  K <- H_D K per head (and Q <- H_D Q online, so q.k is unchanged);
  2. Omni-Token Scaling:  n_t = ||K_t|| over all KV heads and channels of token t (fp32, kept),
                          K_t <- K_t / n_t, so every token shares one scale;
  3. KIVI-style per-channel quantization of K in groups of G tokens, integer zero point;
  4. at attention the norm is multiplied back: k_t ~ n_t * dequant(K_hat_t);
  5. values: H_D folded offline into v_proj / o_proj, then per-token groups of G channels.
Scaling alone creates new channel outliers (the scaled-up low-norm tokens) and rotation alone
leaves the token-norm imbalance: ``rotate`` and ``scale`` switch each off for the ablation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from oscar.method import FlushPolicy, KVMethod, register_method
from oscar.quant import PackedTensor, ZeroPoint, dequantize_groups, hadamard, quantize_groups
from oscar.weights import fold_value_hadamard


def token_norm(k: Tensor, scope: Literal["token", "head"]) -> Tensor:
    """L2 norm of each token in fp32, a zero norm read as 1.

    scope="token": over all KV heads and channels -> [B, 1, T, 1];
    scope="head": per head over channels -> [B, H, T, 1].
    """
    k = k.float()
    if scope == "token":
        norm = k.square().sum(dim=(1, 3), keepdim=True).sqrt()
    elif scope == "head":
        norm = k.square().sum(dim=3, keepdim=True).sqrt()
    else:
        raise ValueError(f"norm_scope must be 'token' or 'head', got {scope!r}")
    return torch.where(norm == 0, torch.ones_like(norm), norm)


@register_method("oscar")
@dataclass
class OScaR(KVMethod):
    """Rotate keys per head, divide each token by its norm, quantize per channel (paper Alg. 1)."""

    keys_per_channel = True
    uses_hadamard = True

    flush: FlushPolicy = "block"
    rotate: bool = True
    scale: bool = True
    norm_scope: Literal["token", "head"] = "token"
    zero_point: ZeroPoint = "int"
    #: rotate values too (folded into v_proj/o_proj); part of the method, a switch for ablations
    rotate_values: bool = True

    def prepare_model(self, model: torch.nn.Module) -> None:
        if self.rotate_values:
            fold_value_hadamard(model)

    @property
    def hadamard_space(self) -> bool:
        return self.rotate

    def transform_query(self, q: Tensor, layer_idx: int) -> Tensor:
        return hadamard(q) if self.rotate else q

    def transform_key(self, k: Tensor, layer_idx: int) -> Tensor:
        return hadamard(k) if self.rotate else k

    def quantize_keys(self, k: Tensor, layer_idx: int) -> PackedTensor:
        k = self.transform_key(k, layer_idx)
        if not self.scale or self.k_bits == 16:  # 16 bits store the rotated keys as they are: nothing to scale for
            return quantize_groups(k, self.k_bits, self.group_size, "channel", self.zero_point)
        norm = token_norm(k, self.norm_scope)
        packed = quantize_groups((k.float() / norm).to(k.dtype), self.k_bits, self.group_size, "channel",
                                 self.zero_point)
        return packed.with_buffers(norm=norm)

    def quantize_values(self, v: Tensor, layer_idx: int) -> PackedTensor:
        return quantize_groups(v, self.v_bits, self.group_size, "token", self.zero_point)

    def dequantize(self, packed: PackedTensor) -> Tensor:
        if "norm" not in packed.buffers:
            return dequantize_groups(packed)
        return (dequantize_groups(packed, torch.float32) * packed.buffers["norm"]).to(packed.dtype)
