"""RotateKV's keys between the model's space and the packed storage (kernels/rotatekv_keys.cu), bit for bit the
method's own torch code as CUDA torch runs it (kernels.reference.rotatekv_quantize_keys / rotatekv_dequantize_keys
on any device):

    quantize_rotatekv_keys(k, bits, G, head_group, clip, index, rope)  <-> methods.rotatekv.RotateKV.quantize_keys
    dequantize_rotatekv_keys(store, bits, G, head_group, index, rope, rows, start, n, out)
                                                                       <-> methods.rotatekv.RotateKV.dequantize

``index`` [H * D] int16 is kernels.method_layouts.rotatekv_z_index of the layer's channel order (where each of x's
channels sits in z); ``rope`` [positions, D / 2, 2] fp32 is kernels.method_layouts.rotatekv_rope_positions of the
model's own table, read at each token's stream position (storage token s is stream position s). The storage is
kernels.storage.empty_storage("rotatekv")'s keys: codes in x's channel order (kernels.method_layouts
.rotatekv_key_layout), scale/zero of z's groups.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from kernels import runtime
from kernels.runtime import dtype_define, inv, targets
from oscar.quant import PackedTensor

HEAD_GROUPS = (1, 2, 4, 8)


def _check(name: str, h: int, d: int, bits: int, group_size: int, head_group: int, index: Tensor, rope: Tensor,
           positions: int, device) -> None:
    """ValueError naming what of a RotateKV key kernel's arguments does not fit."""
    if bits not in runtime.SUPPORTED_BITS or d % group_size or group_size % 8:
        raise ValueError(f"{name}: {bits}-bit codes in groups of {group_size} channels dividing head_dim {d} "
                         f"(bits {runtime.SUPPORTED_BITS}, G a multiple of 8)")
    if head_group not in HEAD_GROUPS or h % head_group or h // head_group > 32:
        raise ValueError(f"{name}: head groups of {head_group} KV heads must divide {h} KV heads ({HEAD_GROUPS}, at "
                         "most 32 groups)")
    if index.shape != (h * d,) or index.dtype != torch.int16 or index.device != torch.device(device):
        raise ValueError(f"{name}: the z index must be int16 [H * D] = [{h * d}] on {device}")
    if rope.dim() != 3 or rope.shape[0] < positions or rope.shape[1:] != (d // 2, 2) or rope.dtype != torch.float32 \
            or not rope.is_contiguous() or rope.device != torch.device(device):
        raise ValueError(f"{name}: rope must be contiguous fp32 [>= {positions} positions, D / 2, 2] on {device}, got "
                         f"{tuple(rope.shape)}")


def quantize_rotatekv_keys(k: Tensor, bits: int, group_size: int, head_group: int, clip_ratio: float, index: Tensor,
                           rope: Tensor, out: dict, rows=None, offsets=None) -> PackedTensor:
    """Post-RoPE keys k [B, H, T, D] of stream positions offsets[i] + t quantized as RotateKV.quantize_keys does
    (RoPE undone, H_g over ``head_group`` heads, the channel order, per-token groups with an integer zero and the
    clip ratio; its kept tokens aside: their codes are stored too) into ``out`` (empty_storage("rotatekv")'s keys)
    at ``rows``/``offsets``. Returns the storage as a PackedTensor (decode layout)."""
    runtime.check_input(k, "k", 4)
    b, h, t, d = k.shape
    codes = out["codes"]
    cap = codes.shape[2]
    last = max(offsets) + t if offsets is not None else t
    _check("quantize_rotatekv_keys", h, d, bits, group_size, head_group, index, rope, last, k.device)
    if codes.shape[1] != h or codes.shape[3] * 8 != d * bits or last > cap or not 0 <= clip_ratio <= 1:
        raise ValueError(f"quantize_rotatekv_keys: storage [*, {h}, >= {last}, {d * bits // 8}] and a clip ratio in "
                         f"[0, 1], got {tuple(codes.shape)} and {clip_ratio}")
    k = k.contiguous()
    out_rows, out_off = targets(b, rows, offsets, k.device)
    if b * t:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, HEAD_GROUP=head_group, HKV=h,
                       IS_BF16=dtype_define(k.dtype))
        blocks = min(b * t, 16 * runtime.multiprocessors(runtime.device_index(k.device)))
        runtime.launch("rotatekv_keys.cu", "rotatekv_quantize", defines, (blocks,), (32 * (h // head_group),),
                       (k, rope, index, np.int32(t), np.int64(b * t), inv(math.sqrt(head_group * d)),
                        np.float32(clip_ratio), inv(2**bits - 1), codes, out["scale"], out["zero"], np.int32(cap),
                        out_rows, out_off), k.device, 5 * h * d)
    meta = dict(bits=bits, group_size=group_size, axis="token", zero_point="int", layout="decode")
    return PackedTensor(dict(out), (codes.shape[0], h, cap, d), k.dtype, meta)


def dequantize_rotatekv_keys(store: dict, bits: int, group_size: int, head_group: int, index: Tensor, rope: Tensor,
                             rows: Tensor, start: int, n: int, out: Tensor) -> Tensor:
    """Keys start .. start + n of storage rows ``rows`` (int32 [b] on the device) as RotateKV.dequantize gives them
    (k = RoPE_s(H_g P^T z_hat) at each token's position s, in the model dtype, its kept tokens aside), written into
    ``out`` [b, H, n, D] (the last dim contiguous) and returned."""
    runtime.check_input(out, "out", 4)
    b, h, _, d = out.shape
    codes = store["codes"]
    cap = codes.shape[2]
    _check("dequantize_rotatekv_keys", h, d, bits, group_size, head_group, index, rope, start + n, out.device)
    if out.shape[2] != n or out.stride(-1) != 1 or codes.shape[1] != h or codes.shape[3] * 8 != d * bits:
        raise ValueError(f"dequantize_rotatekv_keys: out must be [rows, H, n, D] with a contiguous last dim for "
                         f"storage of shape {tuple(codes.shape)} at {bits} bits, got {tuple(out.shape)}")
    if rows.dtype != torch.int32 or rows.shape != (b,) or not 0 <= start <= start + n <= cap:
        raise ValueError(f"rows: int32 [{b}] on the device, tokens {start}..{start + n} within the capacity {cap}")
    tasks = b * (h // head_group) * n  # one warp each: a token's head group
    if tasks:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, HEAD_GROUP=head_group, IS_BF16=dtype_define(out.dtype))
        blocks = min(math.ceil(tasks / 8), 8 * runtime.multiprocessors(runtime.device_index(out.device)))
        runtime.launch("rotatekv_keys.cu", "rotatekv_dequantize", defines, (blocks,), (256,),
                       (codes, store["scale"], store["zero"], index, rope, np.int32(h), np.int32(cap), rows,
                        np.int32(start), np.int32(n), np.int64(tasks), inv(math.sqrt(head_group * d)), out,
                        np.int64(out.stride(0)), np.int64(out.stride(1)), np.int64(out.stride(2))), out.device)
    return out
