"""Tokens kept in full precision beside a quantized chunk (OTT's outlier pool, RotateKV's attention sinks).

A chunk x [B, H, T, D] keeps some of its tokens exactly in two buffers stored with its packed codes:
``exact`` [B, H, S, D] (x.dtype: the kept tokens in token order, zero padding) and ``exact_pos`` [B, m, S, 1]
(int32 stream index of each, -1 for padding; m = H when heads keep their own tokens, 1 when a token is kept for
every head). Their axis 2 is token-like, so chunks flushed at different times concatenate (PackedTensor.cat) and
:func:`restore_exact` puts every kept token back after dequantization. Which tokens a sequence keeps is per-sequence
state (oscar.method.SequenceState): position lists [B, m, P] (stream indices, -1 = empty), read with
:func:`positions_mask` and grown with :func:`add_positions`.

``start`` (the stream index of a chunk's first token) is an int, or a [B] tensor where each row starts elsewhere
(a one-token flush inside the decode step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from oscar.method import TokenSpan
    from oscar.quant import PackedTensor

#: the PackedTensor buffers of kept tokens (a chunk that keeps none stores S = 0 slots of them)
EXACT_BUFFERS = ("exact", "exact_pos")


def _per_row(start: int | Tensor) -> int | Tensor:
    """``start`` broadcastable against [B, m, n] tensors."""
    return start.view(-1, 1, 1) if isinstance(start, Tensor) else start


def keep_exact(x: Tensor, mask: Tensor, start: int | Tensor = 0, fixed: bool = False) -> dict[str, Tensor]:
    """The buffers that keep the masked tokens of x [B, H, T, D] exactly; mask [B, m, T] bool, m in {1, H}.

    S = the largest count over (row, m), so a chunk keeping no token stores nothing (reading the count is a host
    sync); with ``fixed``, S = T (fixed shapes, no sync: a chunk quantized inside a captured decode step).
    """
    b, h, t, d = x.shape
    counts = mask.sum(-1)
    s = t if fixed else (int(counts.max()) if mask.numel() else 0)
    first = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :s]  # masked positions first
    valid = torch.arange(s, device=x.device) < counts.unsqueeze(-1)  # [B, m, S]
    exact = x.gather(2, first.unsqueeze(-1).expand(b, h, s, d)) * valid.unsqueeze(-1)
    pos = torch.where(valid, first + _per_row(start), torch.full_like(first, -1))
    return {"exact": exact.to(x.dtype), "exact_pos": pos.unsqueeze(-1).to(torch.int32)}


def with_kept(packed: PackedTensor, x: Tensor, mask: Tensor, span: TokenSpan | None) -> PackedTensor:
    """``packed`` (a chunk x [B, H, T, D] quantized) with the masked tokens kept exactly (:func:`keep_exact` from the
    span's start; fixed shapes inside the decode step or where the span asks for them); as it is where
    ``span.kept_elsewhere`` (the caller stores them)."""
    if span is None:
        return packed.with_buffers(**keep_exact(x, mask))
    if span.kept_elsewhere:
        return packed
    return packed.with_buffers(**keep_exact(x, mask, span.start, span.in_step or span.fixed_shapes))


def restore_exact(x_hat: Tensor, buffers: dict[str, Tensor], start: int | Tensor = 0) -> Tensor:
    """Put the tokens kept by :func:`keep_exact` (chunks concatenated) back into x_hat [B, H, T, D], whose
    first token has stream index ``start``."""
    b, h, t, d = x_hat.shape
    pos = buffers["exact_pos"].squeeze(-1).long() - _per_row(start)
    if pos.shape[-1] == 0:
        return x_hat
    pos = torch.where(pos < 0, torch.full_like(pos, t), pos).expand(b, h, -1)  # padding -> a spare slot
    spare = torch.cat([x_hat, x_hat.new_zeros(b, h, 1, d)], dim=2)
    exact = buffers["exact"].to(x_hat.dtype)
    return spare.scatter(2, pos.unsqueeze(-1).expand(b, h, -1, d), exact)[:, :, :t]


def positions_mask(positions: Tensor, start: int | Tensor, t: int) -> Tensor:
    """Which tokens of a chunk of ``t`` tokens from stream index ``start`` are in ``positions`` [B, m, P] (stream
    indices, -1 = empty): [B, m, t] bool."""
    b, m, _ = positions.shape
    local = positions - _per_row(start)
    inside = (positions >= 0) & (local >= 0) & (local < t)
    index = torch.where(inside, local, torch.full_like(local, t))  # outside the chunk -> a spare slot
    mask = torch.zeros(b, m, t + 1, dtype=torch.bool, device=positions.device)
    return mask.scatter_(-1, index, True)[..., :t]


def add_positions(positions: Tensor, mask: Tensor, start: int | Tensor) -> Tensor:
    """``positions`` [B, m, P] with the stream indices of the masked tokens of a chunk (mask [B, m, T] bool, first
    token at ``start``) appended after the entries in use, in token order; a token that finds no free entry is
    dropped (callers admit at most the free entries)."""
    b, m, p = positions.shape
    t = mask.shape[-1]
    used = (positions >= 0).sum(-1, keepdim=True)
    slot = torch.where(mask, used + mask.cumsum(-1) - 1, torch.full_like(used, p)).clamp(max=p)  # p: a spare entry
    stream = torch.arange(t, device=mask.device) + _per_row(start)
    values = torch.where(mask, stream.expand(b, m, t), torch.full_like(slot, -1))
    grown = torch.cat([positions, positions.new_full((b, m, 1), -1)], dim=-1)
    return grown.scatter(-1, slot, values)[..., :p]
