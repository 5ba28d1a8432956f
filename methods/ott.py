"""OTT: KIVI plus Outlier Tokens Tracing (Su et al., ACL 2025, arXiv 2505.10938).

Observation: inside KIVI's per-channel key groups, a few tokens have abnormally small keys (the
attention sinks among them). They stretch the min/max of every outlier channel of their group, and
2-bit precision collapses for the whole group.

Algorithm, on top of KIVI (keys per channel in groups of G tokens, values per token, float zero,
recent R tokens in full precision with the ``kivi`` flush policy; at any width b, 2^b levels):
  1. when a block of keys is quantized, score each token of each G-token group by the L2 norm of its
     key (``scope="head"``: per KV head, so each head traces its own outliers; ``"token"``: one norm
     over all heads, the token is kept for every head);
  2. the ``outliers_per_group`` tokens with the smallest norm of each group are candidates;
  3. a candidate enters the outlier pool of its sequence (per layer, and per head for
     scope="head") while the pool holds fewer than ``pool_size`` tokens, in token order;
  4. pooled tokens are excluded from their group's min/max (before quantization their slot holds a
     copy of the group's first token not pooled: inside the others' range) and kept in full
     precision, key and value (``keep_values``); attention reads them exactly.
What is ours: the paper's method section could not be consulted offline, so the pool size, the
per-group candidate count and the admission rule above are our reading of the public summaries,
each a switch; equal norms go to the earlier token; the pooled slot's filler is ours too (any value
in the others' range gives the same scales, zeros and read codes: a copy needs no arithmetic, so
the CUDA kernel writes the same bytes). Admission is first come, first kept: the cache never
re-quantizes a stored token, so a full pool cannot evict an older outlier back into an already
quantized group.

Storage per quantized chunk: KIVI's codes/scale/zero (the pooled tokens' codes are kept too:
quantized as the copy in their slot, never read) plus ``exact`` (the pooled tokens, model dtype,
[B, H, S, D]) and ``exact_pos`` (their stream indices, int32 [B, m, S, 1]; S = the most outliers of
any row/head in the chunk, shorter rows padded with -1; oscar.exact); nbytes counts them all.
The pool is per-sequence state the cache owns (``new_state``: the pooled tokens' stream indices
[B, m, pool_size], -1 = free), so values read which of their tokens the keys pooled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from methods.kivi import KIVI
from oscar.exact import add_positions, positions_mask, restore_exact, with_kept
from oscar.method import FlushPolicy, TokenSpan, register_method
from oscar.options import bounded
from oscar.quant import PackedTensor, dequantize_groups, norm_scale, quantize_groups


# ----------------------------------------------------------------------------- the method


@register_method("ott")
@dataclass
class OTT(KIVI):
    uses_span = True  # the outlier pool is per sequence (span.state) and its positions are stream indices

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
        if self.outliers_per_group >= self.group_size:
            raise ValueError(f"ott: outliers_per_group must be < group_size={self.group_size}, got {self.outliers_per_group}")

    def new_state(self, batch: int, num_kv_heads: int, device) -> dict[str, Tensor]:
        """The outlier pool of each sequence: stream indices of its pooled tokens [B, m, pool_size], -1 = free."""
        m = num_kv_heads if self.scope == "head" else 1
        return {"pool": torch.full((batch, m, self.pool_size), -1, dtype=torch.long, device=device)}

    def outlier_mask(self, k: Tensor, used: Tensor) -> Tensor:
        """Pooled tokens of a key chunk k [B, H, T, D] given the pools' occupancy ``used`` [B, m]: [B, m, T] bool."""
        b, h, t, d = k.shape
        g = self.group_size
        dims = -1 if self.scope == "head" else (1, 3)
        scale = norm_scale(k.float(), dims)  # 1 but for huge (tiny) keys, whose squares would overflow (underflow)
        norm = ((k.float() / scale).norm(dim=dims, keepdim=True) * scale).squeeze(-1)
        m = norm.shape[1]
        groups = norm.view(b, m, t // g, g)
        candidate = torch.zeros_like(groups, dtype=torch.bool)
        if self.outliers_per_group:  # a stable sort: equal norms go to the earlier token
            smallest = groups.sort(dim=-1, stable=True).indices[..., :self.outliers_per_group]
            candidate.scatter_(-1, smallest, True)
        candidate = candidate.view(b, m, t)
        admitted = used.unsqueeze(-1) + candidate.cumsum(-1) <= self.pool_size
        return candidate & admitted

    def pool_outliers(self, k: Tensor, span: TokenSpan) -> tuple[Tensor, Tensor]:
        """Steps 1-4 before KIVI's quantizer: admit the outliers of a key chunk k [B, H, T, D] to its rows' pools
        (``span.state``) and fill each pooled token's slot with a copy of its group's first token not pooled.
        Returns the filled chunk (what KIVI's per-channel quantizer takes) and the pooled mask [B, m, T]."""
        b, h, t, d = k.shape
        pool = span.state["pool"][span.rows]
        mask = self.outlier_mask(k, (pool >= 0).sum(-1))
        span.state["pool"][span.rows] = add_positions(pool, mask, span.start)
        g, m = self.group_size, mask.shape[1]
        groups = k.reshape(b, h, t // g, g, d)
        excl = mask.view(b, m, t // g, g, 1).expand(b, h, t // g, g, 1)
        first = (~excl).to(torch.uint8).argmax(3, keepdim=True)  # the group's first token not pooled
        donor = groups.gather(3, first.expand(b, h, t // g, 1, d))
        return torch.where(excl, donor, groups).view(b, h, t, d), mask

    def quantize_keys(self, k: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        span = self.chunk_span(k, span)
        filled, mask = self.pool_outliers(k, span)
        packed = quantize_groups(filled, self.k_bits, self.group_size, "channel", self.zero_point)
        return with_kept(packed, k, mask, span)

    def quantize_values(self, v: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        packed = quantize_groups(v, self.v_bits, self.group_size, "token", self.zero_point)
        if not self.keep_values:
            return packed
        span = self.chunk_span(v, span)  # on its own: an empty pool, nothing kept
        mask = positions_mask(span.state["pool"][span.rows], span.start, v.shape[2])
        return with_kept(packed, v, mask, span)

    def dequantize(self, packed: PackedTensor) -> Tensor:
        x_hat = dequantize_groups(packed)
        if "exact_pos" not in packed.buffers:  # values with keep_values=false keep no token
            return x_hat
        return restore_exact(x_hat, packed.buffers, packed.start)
