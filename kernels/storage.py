"""Packed storage of the kernels: the buffers each method's quantizers write and decode_attention reads.

Every dict holds the buffers of a ``PackedTensor`` ([B, H, capacity, ...], token axis 2); the quantizers write into
them at ``rows``/``offsets`` (kernels.quantizers), in the decode layouts (kernels.decode_layouts).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.plans import METHODS


def empty_keys(batch: int, heads: int, capacity: int, head_dim: int, bits: int, group_size: int,
               dtype: torch.dtype, device, norm: bool = True) -> dict[str, Tensor]:
    """Storage for per-channel packed keys: codes [B,H,cap,D*b/8], scale/zero [B,H,cap/G,D], and OScaR's token
    norm [B,1,cap,1] fp32 (without ``norm``: KIVI's keys)."""
    store = dict(codes=torch.empty(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
                 scale=torch.empty(batch, heads, capacity // group_size, head_dim, dtype=dtype, device=device),
                 zero=torch.empty(batch, heads, capacity // group_size, head_dim, dtype=dtype, device=device))
    if norm:
        store["norm"] = torch.empty(batch, 1, capacity, 1, dtype=torch.float32, device=device)
    return store


def empty_values(batch: int, heads: int, capacity: int, head_dim: int, bits: int, group_size: int,
                 dtype: torch.dtype, device) -> dict[str, Tensor]:
    """Storage for packed values: codes [B,H,cap,D*b/8], scale/zero [B,H,cap,D/G]."""
    return dict(codes=torch.empty(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
                scale=torch.empty(batch, heads, capacity, head_dim // group_size, dtype=dtype, device=device),
                zero=torch.empty(batch, heads, capacity, head_dim // group_size, dtype=dtype, device=device))


def empty_turboquant(batch: int, heads: int, capacity: int, head_dim: int, bits: int, group_size: int,
                     device) -> dict[str, Tensor]:
    """Storage for TurboQuant+ keys or values: codes [B,H,cap,D*b/8], corrected norms [B,H,cap,D/G] fp16."""
    return dict(codes=torch.empty(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
                norm=torch.empty(batch, heads, capacity, head_dim // group_size, dtype=torch.float16, device=device))


def empty_storage(method: str, batch: int, heads: int, capacity: int, head_dim: int, *, k_bits: int, v_bits: int,
                  group_size: int, dtype: torch.dtype, device) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(keys, values) storage dicts of ``method`` for ``decode_attention``: per-channel keys (OScaR with its token
    norms, KIVI and OTT without) as :func:`empty_keys`, per-token keys (QuaRot, RotateKV, OSCAR) and every method's
    values as :func:`empty_values` (OSCAR's scale/zero in fp32: its (scale, zero) or Lloyd-Max (std, mean)),
    TurboQuant+'s as :func:`empty_turboquant`. OTT, RotateKV and OSCAR also keep exact tokens
    (kernels.method_layouts.empty_exact)."""
    shape = (batch, heads, capacity, head_dim)
    if method == "turboquant":
        return (empty_turboquant(*shape, k_bits, group_size, device),
                empty_turboquant(*shape, v_bits, group_size, device))
    if method == "spectral":
        return (empty_values(*shape, k_bits, group_size, torch.float32, device),
                empty_values(*shape, v_bits, group_size, torch.float32, device))
    values = empty_values(*shape, v_bits, group_size, dtype, device)
    if method in ("oscar", "kivi", "ott"):
        return empty_keys(*shape, k_bits, group_size, dtype, device, norm=method == "oscar"), values
    if method in ("quarot", "rotatekv"):
        return empty_values(*shape, k_bits, group_size, dtype, device), values
    raise ValueError(f"no kernel storage for method={method!r}; kernels exist for {sorted(METHODS)}")
