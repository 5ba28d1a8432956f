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

Choices the paper leaves open, each a switch (defaults = the paper's reading above):
  - ``norm_scope``: the divisor n_t over all KV heads of the layer ("token", one norm per token and layer) or
    per KV head ("head"; the same on a model with one KV head). A norm over every layer is not available: a
    layer's keys are stored before the next layer computes its own.
  - the target norm: any target constant over a quantization group (1, the group's median norm, a per-head or
    per-layer mean) changes no code, since a per-channel group scaled by a constant keeps its codes (tested).
    What changes the codes is a divisor that is not proportional to the norm: ``norm_floor="group_median"``
    divides each token by max(n_t, the median n of its group of G tokens), so tokens above the median get unit
    norm and the low-norm ones (the sinks) keep their smaller size instead of being scaled up into new channel
    outliers (the paper's Scaling-Induced Outlier Artifact).
  - ``rotation`` (with ``rotate``): the Walsh-Hadamard H_D ("hadamard"); H_D after seeded +-1 signs drawn per
    layer ("signed_hadamard": x -> H_D(s_l * x)); or a seeded random orthogonal matrix per layer ("orthogonal":
    QR of a Gaussian, x -> x Q_l). Queries get the same transform. Seeds from ``rotation_seed`` and the layer.
  - ``rotate_values``: the value path's folded Hadamard on or off (the key rotation's choice does not touch it).
At 1 bit the quantizer is the same formula with two levels: with the integer zero point one of them is 0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from oscar.method import FlushPolicy, KVMethod, register_method
from oscar.quant import PackedTensor, ZeroPoint, dequantize_groups, hadamard, l2_norm, quantize_groups
from oscar.weights import fold_value_hadamard

Rotation = Literal["hadamard", "signed_hadamard", "orthogonal"]


def token_norm(k: Tensor, scope: Literal["token", "head"]) -> Tensor:
    """L2 norm of each token in fp32 (finite for any finite keys: oscar.quant.l2_norm), a zero norm read as 1.

    scope="token": over all KV heads and channels -> [B, 1, T, 1];
    scope="head": per head over channels -> [B, H, T, 1].
    """
    if scope not in ("token", "head"):
        raise ValueError(f"norm_scope must be 'token' or 'head', got {scope!r}")
    norm = l2_norm(k.float(), (1, 3) if scope == "token" else 3)
    return torch.where(norm == 0, torch.ones_like(norm), norm)


def floor_at_group_median(norm: Tensor, group_size: int) -> Tensor:
    """max(norm, the median norm of its group of G consecutive tokens): norm [B, m, T, 1] -> same shape
    (T a multiple of G; the lower median of an even group, as torch.median)."""
    b, m, t, _ = norm.shape
    groups = norm.view(b, m, t // group_size, group_size)
    median = groups.median(dim=-1, keepdim=True).values
    return torch.maximum(groups, median).view(b, m, t, 1)


@functools.cache
def _rotation_matrix(kind: Rotation, seed: int, layer_idx: int, d: int, device: torch.device) -> Tensor:
    """The per-layer constant of a rotation: the +-1 signs [d] ("signed_hadamard") or Q [d, d] ("orthogonal"),
    float32, made once per device (a decode step replayed from a CUDA graph cannot copy it in)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer_idx)
    if kind == "signed_hadamard":
        return (torch.randint(0, 2, (d,), generator=gen) * 2 - 1).float().to(device)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float().to(device)  # sign fix: Haar-distributed


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
    #: "group_median": divide each token by max(its norm, its G-token group's median norm) instead of its norm
    norm_floor: Literal["none", "group_median"] = "none"
    zero_point: ZeroPoint = "int"
    #: the key rotation when ``rotate``: H_D (paper), H_D after seeded per-layer signs, or a seeded orthogonal Q_l
    rotation: Rotation = "hadamard"
    rotation_seed: int = 0
    #: rotate values too (folded into v_proj/o_proj); part of the method, a switch for ablations
    rotate_values: bool = True

    def prepare_model(self, model: torch.nn.Module) -> None:
        if self.rotate_values:
            fold_value_hadamard(model)

    @property
    def hadamard_space(self) -> bool:
        return self.rotate and self.rotation == "hadamard"

    def _rotate(self, x: Tensor, layer_idx: int) -> Tensor:
        """x [B, H, T, D] -> the key space (the same map for queries and keys; orthogonal, so q.k is kept)."""
        if not self.rotate:
            return x
        if self.rotation == "hadamard":
            return hadamard(x)
        constant = _rotation_matrix(self.rotation, self.rotation_seed, layer_idx, x.shape[-1], x.device)
        if self.rotation == "signed_hadamard":
            return hadamard((x.float() * constant).to(x.dtype))
        return (x.float() @ constant).to(x.dtype)

    def transform_query(self, q: Tensor, layer_idx: int) -> Tensor:
        return self._rotate(q, layer_idx)

    def transform_key(self, k: Tensor, layer_idx: int) -> Tensor:
        return self._rotate(k, layer_idx)

    def quantize_keys(self, k: Tensor, layer_idx: int) -> PackedTensor:
        k = self.transform_key(k, layer_idx)
        if not self.scale or self.k_bits == 16:  # 16 bits store the rotated keys as they are: nothing to scale for
            return quantize_groups(k, self.k_bits, self.group_size, "channel", self.zero_point)
        norm = token_norm(k, self.norm_scope)
        if self.norm_floor == "group_median":
            norm = floor_at_group_median(norm, self.group_size)
        packed = quantize_groups((k.float() / norm).to(k.dtype), self.k_bits, self.group_size, "channel",
                                 self.zero_point)
        return packed.with_buffers(norm=norm)

    def quantize_values(self, v: Tensor, layer_idx: int) -> PackedTensor:
        return quantize_groups(v, self.v_bits, self.group_size, "token", self.zero_point)

    def dequantize(self, packed: PackedTensor) -> Tensor:
        if "norm" not in packed.buffers:
            return dequantize_groups(packed)
        return (dequantize_groups(packed, torch.float32) * packed.buffers["norm"]).to(packed.dtype)
