"""OTT: KIVI plus Outlier Tokens Tracing (Su et al., ACL 2025, arXiv 2505.10938).

Observation: inside KIVI's per-channel key groups, a few tokens have abnormally small keys (the
attention sinks among them). They stretch the min/max of every outlier channel of their group, and
2-bit precision collapses for the whole group.

Algorithm, on top of KIVI (keys per channel in groups of G tokens, values per token, float zero,
recent R tokens in full precision with the ``kivi`` flush policy):
  1. when a block of keys is quantized, score each token of each G-token group by the L2 norm of its
     key (``scope="head"``: per KV head, so each head traces its own outliers; ``"token"``: one norm
     over all heads, the token is kept for every head);
  2. the ``outliers_per_group`` tokens with the smallest norm of each group are candidates;
  3. a candidate enters the outlier pool of its sequence (per layer, and per head for
     scope="head") while the pool holds fewer than ``pool_size`` tokens, in token order;
  4. pooled tokens are excluded from their group's min/max (their slot is filled with the mean of
     the group's other tokens before quantization) and kept in full precision, key and value
     (``keep_values``); attention reads them exactly.
What is ours: the paper's method section could not be consulted offline, so the pool size, the
per-group candidate count and the admission rule above are our reading of the public summaries,
each a switch. Admission is first come, first kept: the cache never re-quantizes a stored token,
so a full pool cannot evict an older outlier back into an already quantized group.

Storage per quantized chunk: KIVI's codes/scale/zero (the pooled tokens' codes are kept too:
quantized as the group's mean, never read) plus ``exact`` (the pooled tokens, model dtype,
[B, H, S, D]) and ``exact_pos`` (their stream indices, int32 [B, m, S, 1]; S = the most outliers of
any row/head in the chunk, shorter rows padded with -1); nbytes counts them all.
The pool's per-sequence occupancy lives on the method (keyed by layer and batch row, reset when a
row's stream starts): one cache at a time per method instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from methods.kivi import KIVI
from oscar.method import FlushPolicy, TokenSpan, register_method
from oscar.options import bounded
from oscar.quant import PackedTensor, dequantize_groups, quantize_groups


# ----------------------------------------------------------------------------- exact tokens


def keep_exact(x: Tensor, mask: Tensor, start: int = 0) -> dict[str, Tensor]:
    """Buffers that keep the masked tokens of a chunk x [B, H, T, D] exactly; mask [B, m, T] bool, m in {1, H}.

    exact [B, H, S, D] (x.dtype, the masked tokens in token order, zero padding) and exact_pos
    [B, m, S, 1] (int32 stream index = start + position in the chunk, -1 for padding); S = the
    largest count over (row, m), so a chunk without such tokens stores nothing.
    """
    b, h, t, d = x.shape
    counts = mask.sum(-1)
    s = int(counts.max()) if mask.numel() else 0
    first = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :s]  # masked positions first
    valid = torch.arange(s, device=x.device) < counts.unsqueeze(-1)  # [B, m, S]
    exact = x.gather(2, first.unsqueeze(-1).expand(b, h, s, d)) * valid.unsqueeze(-1)
    pos = torch.where(valid, first + start, torch.full_like(first, -1))
    return {"exact": exact.to(x.dtype), "exact_pos": pos.unsqueeze(-1).to(torch.int32)}


def restore_exact(x_hat: Tensor, buffers: dict[str, Tensor], start: int = 0) -> Tensor:
    """Put the tokens kept by :func:`keep_exact` (chunks concatenated) back into x_hat [B, H, T, D], whose
    first token has stream index ``start``."""
    b, h, t, d = x_hat.shape
    pos = buffers["exact_pos"].squeeze(-1).long() - start
    if pos.shape[-1] == 0:
        return x_hat
    pos = torch.where(pos < 0, torch.full_like(pos, t), pos).expand(b, h, -1)  # padding (-1 - start) -> a spare slot
    spare = torch.cat([x_hat, x_hat.new_zeros(b, h, 1, d)], dim=2)
    exact = buffers["exact"].to(x_hat.dtype)
    return spare.scatter(2, pos.unsqueeze(-1).expand(b, h, -1, d), exact)[:, :, :t]


# ----------------------------------------------------------------------------- the method


@register_method("ott")
@dataclass
class OTT(KIVI):
    wants_token_span = True

    flush: FlushPolicy = "kivi"
    #: most tokens one sequence keeps in full precision per layer (and per head with scope="head")
    pool_size: int = bounded(64, ge=0)
    #: smallest-norm candidates taken from each group of G key tokens (fewer than G)
    outliers_per_group: int = bounded(1, ge=0)
    scope: Literal["head", "token"] = "head"
    #: keep the pooled tokens' values in full precision too (the paper keeps the whole KV pair)
    keep_values: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._pools: dict[tuple[int, int], dict] = {}  # (layer, batch row) -> pool occupancy
        if self.outliers_per_group >= self.group_size:
            raise ValueError(f"ott: outliers_per_group must be < group_size={self.group_size}, got {self.outliers_per_group}")

    def outlier_mask(self, k: Tensor, used: Tensor) -> Tensor:
        """Pooled tokens of a key chunk k [B, H, T, D] given the pools' occupancy ``used`` [B, m]: [B, m, T] bool."""
        b, h, t, d = k.shape
        g = self.group_size
        norm = k.float().norm(dim=-1) if self.scope == "head" else k.float().norm(dim=(1, 3)).unsqueeze(1)
        m = norm.shape[1]
        groups = norm.view(b, m, t // g, g)
        candidate = torch.zeros_like(groups, dtype=torch.bool)
        if self.outliers_per_group:
            smallest = groups.topk(self.outliers_per_group, dim=-1, largest=False).indices
            candidate.scatter_(-1, smallest, True)
        candidate = candidate.view(b, m, t)
        admitted = used.unsqueeze(-1) + candidate.cumsum(-1) <= self.pool_size
        return candidate & admitted

    def quantize_keys(self, k: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        b, h, t, d = k.shape
        m = h if self.scope == "head" else 1
        pools = [self._pool(layer_idx, span, i, m, k.device) for i in range(b)]
        mask = self.outlier_mask(k, torch.stack([p["used"] for p in pools]))
        for pool, row_mask in zip(pools, mask):
            pool["used"] = pool["used"] + row_mask.sum(-1)
            pool["mask"] = torch.cat([pool["mask"], row_mask], dim=-1)
        # exclude pooled tokens from their group's range: fill their slot with the others' mean
        g = self.group_size
        kf = k.float().view(b, h, t // g, g, d)
        excl = mask.view(b, m, t // g, g, 1).expand(b, h, t // g, g, 1)
        others = (~excl).float()
        mean = (kf * others).sum(3, keepdim=True) / others.sum(3, keepdim=True)
        filled = torch.where(excl, mean, kf).view(b, h, t, d).to(k.dtype)
        packed = quantize_groups(filled, self.k_bits, self.group_size, "channel", self.zero_point)
        return packed.with_buffers(**keep_exact(k, mask, 0 if span is None else span.start))

    def quantize_values(self, v: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        packed = quantize_groups(v, self.v_bits, self.group_size, "token", self.zero_point)
        if not self.keep_values:
            return packed
        b, h, t, d = v.shape
        m = h if self.scope == "head" else 1
        mask = torch.zeros(b, m, t, dtype=torch.bool, device=v.device)
        if span is not None:
            for i, row in enumerate(span.rows.tolist()):
                pool = self._pools.get((layer_idx, row))
                if pool is not None:
                    known = pool["mask"][:, span.start:span.start + t]
                    mask[i, :, :known.shape[-1]] = known
        return packed.with_buffers(**keep_exact(v, mask, 0 if span is None else span.start))

    def dequantize(self, packed: PackedTensor) -> Tensor:
        x_hat = dequantize_groups(packed)
        return restore_exact(x_hat, packed.buffers, packed.start)

    def _pool(self, layer_idx: int, span: TokenSpan | None, i: int, m: int, device) -> dict:
        """The pool of chunk row i: used [m] and per-token mask [m, T_seen]; a row's stream start resets it."""
        fresh = {"used": torch.zeros(m, dtype=torch.long, device=device),
                 "mask": torch.zeros(m, 0, dtype=torch.bool, device=device)}
        if span is None:
            return fresh
        key = (layer_idx, int(span.rows[i]))
        if span.start == 0 or key not in self._pools:
            self._pools[key] = fresh
        return self._pools[key]
