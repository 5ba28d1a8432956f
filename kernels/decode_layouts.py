"""The decode layouts: the quantizers' bytes permuted so that decode_attention loads ready tensor-core operands.

``key_decode_layout`` (per-channel key scale/zero), ``token_key_decode_layout`` (per-token key codes) and
``value_decode_layout`` (16-token value tiles) convert packed buffers from the reference layout (what the methods'
torch quantizers write) to the decode layout, or back with ``inverse``; the orders are those of common.cuh.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from oscar.quant import pack_bits, unpack_bits


def check_value_decode_layout(head_dim: int, bits: int, group_size: int) -> None:
    """Raise unless values of this shape have a decode layout (whole 16-token tiles, 8+ code bytes per group)."""
    if group_size % 16 or group_size * bits % 64 or head_dim % group_size:
        raise ValueError(f"the decode layout of values needs G a multiple of 16 with G * bits a multiple of 64 "
                         f"dividing head_dim; got G={group_size}, bits={bits}, head_dim={head_dim}")


def _value_tile_order(head_dim: int, bits: int, group_size: int) -> tuple[Tensor, Tensor]:
    """Reference-layout index of every element of a 16-token tile in the decode layout (common.cuh):
    (codes [16 * D*bits/8], scale/zero [16 * D/G])."""
    check_value_decode_layout(head_dim, bits, group_size)
    bpt, groups, bpg = head_dim * bits // 8, head_dim // group_size, group_size * bits // 8
    nbg = bpg // 8
    codes, params = torch.empty(16 * bpt, dtype=torch.long), torch.empty(16 * groups, dtype=torch.long)
    for t in range(16):
        q, code_slot, param_slot = (t & 7) >> 1, ((t & 1) << 1) | (t >> 3), (t & 1) | ((t >> 3) << 1)
        for cb in range(bpt):
            g, w = divmod(cb, bpg)
            codes[((w // nbg) * 4 + q) * (bpt // 2) + (g * nbg + w % nbg) * 4 + code_slot] = t * bpt + cb
        for g in range(groups):
            params[(q * groups + g) * 4 + param_slot] = t * groups + g
    return codes, params


def _key_param_order(head_dim: int, bits: int) -> Tensor:
    """Reference channel of every scale/zero entry of a key row [D] in the decode layout (common.cuh)."""
    cpb = 8 // bits
    order = torch.empty(head_dim, dtype=torch.long)
    for c in range(head_dim):
        i = c % (4 * cpb)
        hb, p = divmod(i, cpb)
        order[c - i + 4 * p + 2 * (hb % 2) + hb // 2] = c
    return order


@functools.cache
def _placed(order: Callable[..., Tensor | tuple[Tensor, ...]], args: tuple, inverse: bool,
            device: torch.device) -> Tensor | tuple[Tensor, ...]:
    """The index tensor(s) ``order(*args)`` makes on the host (their argsort with ``inverse``) on ``device``, made
    once per device: a copy from the host at every call would make the host wait for the stream."""
    made = order(*args)
    placed = tuple((torch.argsort(x) if inverse else x).to(device) for x in (made if isinstance(made, tuple) else
                                                                              (made,)))
    return placed if isinstance(made, tuple) else placed[0]


def key_decode_layout(keys: dict[str, Tensor], bits: int, inverse: bool = False) -> dict[str, Tensor]:
    """Packed keys from the reference layout to the decode layout that ``decode_attention`` reads (or back with
    ``inverse``): scale/zero [..., D] permuted inside each code word's channels; codes and norms unchanged."""
    order = _placed(_key_param_order, (keys["scale"].shape[-1], bits), inverse, keys["scale"].device)
    return {name: x[..., order] if name in ("scale", "zero") else x for name, x in keys.items()}


def _token_key_slot_order(head_dim: int, bits: int) -> Tensor:
    """Reference channel of every code slot (byte * 8/bits + position) of a token row in the per-token key decode
    layout (common.cuh, token_key_code_byte)."""
    cpb, bpt = 8 // bits, head_dim * bits // 8
    order = torch.empty(head_dim, dtype=torch.long)
    for c in range(head_dim):
        ks, k = divmod(c, 16)
        byte = ((k & 7) >> 1) * (bpt // 4) + 4 * (ks // cpb) + (((k & 1) << 1) | (k >> 3))
        order[byte * cpb + ks % cpb] = c
    return order


def token_key_decode_layout(keys: dict[str, Tensor], bits: int, inverse: bool = False) -> dict[str, Tensor]:
    """Per-token packed keys (codes [..., D*bits/8]) from the reference layout to the decode layout that
    ``decode_attention`` reads for QuaRot and TurboQuant+ (or back with ``inverse``): the codes of every token row
    permuted so that each tensor-core k-step covers 16 consecutive channels; the other buffers unchanged."""
    codes = keys["codes"]
    d = codes.shape[-1] * 8 // bits
    order = _placed(_token_key_slot_order, (d, bits), inverse, codes.device)
    moved = pack_bits(unpack_bits(codes, bits, d)[..., order], bits)
    return {**keys, "codes": moved}


def _permute_tiles(x: Tensor, order: Tensor) -> Tensor:
    """x [..., T, F] with T a multiple of 16: every 16-token tile's T*F elements gathered by order [16 * F] (on x's
    device)."""
    *lead, t, f = x.shape
    if t % 16:
        raise ValueError(f"the decode layout permutes whole 16-token tiles, got {t} tokens")
    tiles = x.reshape(*lead, t // 16, 16 * f)
    return tiles[..., order].reshape(x.shape)


def value_decode_layout(values: dict[str, Tensor], bits: int, group_size: int,
                        inverse: bool = False) -> dict[str, Tensor]:
    """Packed values (codes [..., T, D*bits/8] and per-token group parameters [..., T, D/G]: scale/zero, or
    TurboQuant+'s norm; T a multiple of 16) from the reference layout to the decode layout that
    ``decode_attention`` reads (or back with ``inverse``)."""
    head_dim = values["codes"].shape[-1] * 8 // bits
    device = values["codes"].device
    codes, params = _placed(_value_tile_order, (head_dim, bits, group_size), inverse, device)
    return {name: _permute_tiles(x, codes if name == "codes" else params) for name, x in values.items()}
