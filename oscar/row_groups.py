"""Row groups: the batch rows of a cache that share a left-pad length, stored and flushed together.

Pad tokens are never stored, so rows of one pad length hold their tokens at the same stream indices (per-channel key
groups start at every row's first real token) and flush at the same times. Every cache keeps one group per distinct
pad length: :class:`RowGroup` is what each group has; the reference cache (oscar.cache) adds its key and value
streams, the torch static cache (oscar.static_cache) its token counts and packed chunks (:class:`CountedRowGroup`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from oscar.flush import Flush
from oscar.quant import PackedTensor
from oscar.transfer import device_ints


@dataclass
class RowGroup:
    """Batch rows that share a pad length, hence token positions and every flush."""

    rows: Tensor  # long indices into the batch, on the cache's device
    pads_left: int  # pad tokens of the prompt not yet seen (the prefill may come in chunks)
    members: tuple[int, ...] = ()  # the same indices on the host (reading ``rows`` back would wait for the GPU)

    @classmethod
    def by_pad_length(cls, pad_lengths: list[int], device) -> list:
        """One group per distinct pad length of the batch, in ascending order."""
        groups = []
        for pad in sorted(set(pad_lengths)):
            members = tuple(i for i, p in enumerate(pad_lengths) if p == pad)
            groups.append(cls(device_ints(members, device, torch.long), pad, members))
        return groups

    def skip_pads(self, tokens: int) -> int:
        """How many of a prefill chunk's ``tokens`` are this group's pads (consumed now)."""
        skip = min(self.pads_left, tokens)
        self.pads_left -= skip
        return skip


@dataclass
class CountedRowGroup(RowGroup):
    """A row group of the torch static cache: host bookkeeping of its token counts and its packed chunks."""

    keys_packed: int = 0
    keys_residual: int = 0
    values_packed: int = 0
    values_residual: int = 0
    key_chunks: list[PackedTensor] = field(default_factory=list)
    value_chunks: list[PackedTensor] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.keys_packed + self.keys_residual

    def due(self, policy: Flush) -> tuple[int, int]:
        """(keys, values) the policy packs now that are not packed yet."""
        keys, values = policy.packed(self.tokens)
        return keys - self.keys_packed, values - self.values_packed

    def count_packed(self, keys: int, values: int) -> None:
        """Count ``keys`` and ``values`` more tokens as packed (flushed, or named so: unquantized tokens)."""
        self.keys_packed, self.keys_residual = self.keys_packed + keys, self.keys_residual - keys
        self.values_packed, self.values_residual = self.values_packed + values, self.values_residual - values
