"""OTT's key flush before KIVI's key quantizer, on the device (kernels/ott_pool.cu), bit for bit:

    pool_outliers(k, values, pool, rows, start, kept, G, per_group)
        <-> methods.ott.OTT.pool_outliers (steps 1-4: the pool's admission, each pooled slot filled from its group)
            then kernels.kept_tokens.KeptTokens.stage of the pooled tokens (the cache's exact slots)

Two launches whatever the chunk: the candidates of every group in parallel (a warp a group, which also copies the
chunk), then a block per (row, pool) that admits in token order and stages; the torch path's ~70 small operations of
a flush (norms, top-k, cumsums, scatters, the stage's gathers and skip words) are the reference.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from kernels import runtime
from kernels.runtime import dtype_define

#: warps of a block (ott_pool.cu's NWARPS)
WARPS = 4


def pool_outliers(k: Tensor, values: Tensor, pool: Tensor, rows: Tensor, start: int, kept,
                  group_size: int, per_group: int, out: Tensor | None = None) -> Tensor:
    """Admit the outliers of a key chunk k [b, H, T, D] (stream positions start .. start + T of the cache rows
    ``rows``, int64 [b] on k's device: TokenSpan.rows) to the pools ``pool`` [B, m, pool_size] (int64 stream
    positions, -1 = free; m = H: per head, 1: per token over every head), in place, and stage them in ``kept`` (a
    kernels.kept_tokens.KeptTokens; keys as k holds them, values from ``values`` [b, H, T, D], the slots' dtype).
    Returns the filled chunk [b, H, T, D]: each pooled token's slot holds its group's first token not pooled (what
    KIVI's per-channel quantizer takes), in ``out`` where given."""
    runtime.check_input(k, "k", 4)
    b, h, t, d = k.shape
    m, pool_size = pool.shape[1], pool.shape[2]
    slots = kept.buffers["keys"]
    if values.shape != k.shape or values.dtype != slots.dtype or k.dtype != slots.dtype:
        raise ValueError(f"pool_outliers: values {tuple(values.shape)} {values.dtype} must match k {tuple(k.shape)} "
                         f"and the slots' dtype {slots.dtype}")
    if t % group_size or group_size % 8 or not 0 < per_group < group_size or m not in (1, h) \
            or pool.dtype != torch.long:
        raise ValueError(f"pool_outliers: {t} tokens in groups of {group_size} (a multiple of 8), 1 .. G - 1 "
                         f"candidates per group (got {per_group}), int64 pools of 1 or {h} heads (got "
                         f"{tuple(pool.shape)} {pool.dtype})")
    if rows.shape != (b,) or rows.dtype != torch.long or rows.device != k.device:
        raise ValueError(f"pool_outliers: rows must be int64 [{b}] on {k.device}, got {tuple(rows.shape)} {rows.dtype}")
    if kept.slots < pool_size or not pool.is_contiguous():
        raise ValueError(f"pool_outliers: {kept.slots} exact slots for a contiguous pool of {pool_size}")
    if start + t > 32 * kept.buffers["skip"].shape[2]:
        raise ValueError(f"pool_outliers: positions up to {start + t} past the skip words' "
                         f"{32 * kept.buffers['skip'].shape[2]}")
    k, values = k.contiguous(), values.contiguous()
    filled = torch.empty_like(k) if out is None else out
    if filled.shape != k.shape or filled.dtype != k.dtype or not filled.is_contiguous():
        raise ValueError(f"pool_outliers: out must be contiguous {tuple(k.shape)} {k.dtype}")
    if not b * t:
        return filled
    groups = t // group_size
    defines = dict(HEAD_DIM=d, GROUP=group_size, IS_BF16=dtype_define(k.dtype), HPP=h // m, OPG=per_group)
    cand = torch.empty(b, m, groups * per_group, dtype=torch.int32, device=k.device)
    runtime.launch("ott_pool.cu", "ott_candidates", defines, (b * m, -(-groups // WARPS)), (32 * WARPS,),
                   (k, filled, np.int32(h), np.int32(t), np.int32(m), cand), k.device, WARPS * group_size * 4)
    store = kept.buffers
    runtime.launch("ott_pool.cu", "ott_admit", defines, (b * m,), (32 * WARPS,),
                   (k, values, filled, np.int32(h), np.int32(t), np.int32(m), cand, rows,
                    np.int64(start), pool, np.int32(pool_size), store["keys"], store["values"], kept.slot_positions,
                    np.int32(kept.slots), store["skip"], np.int32(store["skip"].shape[2])), k.device,
                   4 * ((2 * (h // m) + 1) * pool_size + 2))
    return filled
