"""Rows as slots: a static cache's rows released and refilled while its other rows decode (continuous batching,
oscar.continuous says when and why).

A static cache (oscar.static_cache) holds B rows of ``capacity`` tokens at addresses that never move, so that a
captured decode step stays valid. Its rows are slots:

- ``release(rows)``: the rows' samples are done. Their host bookkeeping goes (the torch cache's row groups and
  packed chunks, the CuPy cache's per-row counts), so ``nbytes`` and ``token_counts`` no longer count them, and they
  are *parked*: the decode step still computes every row (fixed shapes), and a parked row's counts stay zero (its
  length, its key window's fill, its values' packed count: the torch layer's ``advance`` sets them back after each
  step, the CuPy layer's step does not count a parked row's token), so that its writes land at the start of its own
  storage and never past a window or the capacity. Nothing reads what a parked row holds.
- ``adopt(rows, source, source_rows)``: samples prefilled in another cache of the same class, batch layout and
  capacity (a *staging* cache: the new samples prefilled exactly as a batch of their own) move into parked rows,
  row for row: every static tensor (storage, windows, the counts the step reads, the method's per-sequence state:
  OTT's pools, RotateKV's sinks), in place; then the host bookkeeping (row groups with their packed chunks,
  renumbered; per-row counts) and each row's length, i.e. the position of its next token. A row keeps its own
  positions and pads: nothing of it depends on the rows beside it.

:class:`SlotLayer` is what every static cache layer shares (the parked rows, the copy of the static tensors);
:class:`GroupedSlotLayer` adds the torch static layer's row groups (oscar.row_groups); the CuPy layer adds its
per-row counts itself (kernels.cupy_layer). :class:`SlotCache` is the cache's side (lengths, pads, parked rows).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from oscar.row_groups import CountedRowGroup
from oscar.transfer import device_ints, shared_ints


class SlotLayer:
    """A static cache layer's slot operations over its ``static_tensors()`` (each with the batch row on dim 0)."""

    parked: tuple[int, ...] = ()

    def initialize_like(self, source, batch: int) -> None:
        """Allocate this (uninitialized) layer for ``batch`` rows with ``source``'s heads, head dim, dtype, device."""
        raise NotImplementedError

    def _copy_rows(self, rows: list[int], source, source_rows: list[int]) -> None:
        """Every static tensor's ``source_rows`` of ``source`` into ``rows`` of this layer, in place."""
        if not self.is_initialized:  # a cache filled by adopt only: storage like the source's, every row parked
            self.initialize_like(source, len(self.pad_lengths))
            self.release_rows(list(range(len(self.pad_lengths))))
        mine, theirs = self.static_tensors(), source.static_tensors()
        if [t.shape[1:] for t in mine] != [t.shape[1:] for t in theirs]:
            raise ValueError("adopt: the source cache's layer has another layout (capacity, heads or method)")
        # one call for every tensor's rows (the views' copies: no index tensors, no gather then scatter per tensor)
        pairs = [(dst[i], src[j]) for dst, src in zip(mine, theirs) for i, j in zip(rows, source_rows)]
        torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
        self.seq_len = max(self.seq_len, source.seq_len)  # not a fresh cache: prefill hooks leave it alone
        self.parked = tuple(r for r in self.parked if r not in rows)
        self._parked_index = None

    def release_rows(self, rows: list[int]) -> None:
        raise NotImplementedError

    def _park(self, rows: list[int]) -> None:
        self.parked = tuple(sorted(set(self.parked) | set(rows)))
        self._parked_index = None

    def parked_index(self) -> Tensor:
        """The parked rows as a long tensor on the layer's device (made once per change)."""
        if getattr(self, "_parked_index", None) is None:
            self._parked_index = device_ints(list(self.parked), self.device, torch.long)
        return self._parked_index


class GroupedSlotLayer(SlotLayer):
    """The torch static layer's slots: its rows live in :class:`CountedRowGroup` s (rows of one pad length and count),
    which a released row leaves and an adopted row joins with its source group (packed chunks and counts)."""

    groups: list[CountedRowGroup]

    def initialize_like(self, source, batch: int) -> None:
        _, h, _, d = source.keys.shape
        like = torch.zeros(batch, h, 1, d, dtype=source.dtype, device=source.device)
        self.lazy_initialization(like, like)

    def release_rows(self, rows: list[int]) -> None:
        """Drop ``rows`` from their groups (their packed chunks' rows with them) and park them."""
        self._park(rows)
        if not self.is_initialized:
            return
        gone = set(rows)
        kept_groups = []
        for g in self.groups:
            stay = [i for i, row in enumerate(g.members) if row not in gone]
            if len(stay) == len(g.members):
                kept_groups.append(g)
            elif stay:
                index = device_ints(stay, self.device, torch.long)
                g.key_chunks = [_select_rows(c, index, len(g.members)) for c in g.key_chunks]
                g.value_chunks = [_select_rows(c, index, len(g.members)) for c in g.value_chunks]
                g.members = tuple(g.members[i] for i in stay)
                g.rows = device_ints(g.members, self.device, torch.long)
                kept_groups.append(g)
        self.groups = kept_groups
        self.reset_parked()

    def adopt_rows(self, rows: list[int], source, source_rows: list[int]) -> None:
        """``source_rows`` of ``source`` (a layer of the same layout, every row of its groups among them) into
        ``rows``: static tensors copied, the source's groups moved over with their rows renumbered."""
        self._copy_rows(rows, source, source_rows)
        where = dict(zip(source_rows, rows))
        for g in source.groups:
            if not set(g.members) <= where.keys():
                raise ValueError("adopt: a row group of the source is adopted only in part")
            members = tuple(where[row] for row in g.members)
            self.groups.append(CountedRowGroup(device_ints(members, self.device, torch.long), 0, members,
                                               g.keys_packed, g.keys_residual, g.values_packed, g.values_residual,
                                               g.key_chunks, g.value_chunks))
        source.groups = []  # the chunks now belong here

    def reset_parked(self) -> None:
        """Device: the parked rows' key-window fill and values' packed count back to zero (after every step)."""
        if self.parked and self.is_initialized:
            index = self.parked_index()
            self.key_window_fill.index_fill_(0, index, 0)
            self.values_packed_count.index_fill_(0, index, 0)


def _select_rows(chunk, index: Tensor, rows: int):
    """The chunk's buffers for the batch rows ``index`` (of ``rows``); a buffer shared by the rows (batch dim 1)
    stays as it is."""
    buffers = {name: buf[index] if buf.shape[0] == rows else buf for name, buf in chunk.buffers.items()}
    return replace(chunk, buffers=buffers, shape=(len(index), *chunk.shape[1:]))


class SlotCache:
    """The cache's side of the slots (a mixin of oscar.static_cache.StaticCache): lengths and pads per row, the
    parked rows, and the layers' ``adopt_rows`` / ``release_rows``."""

    parked: tuple[int, ...] = ()

    def release(self, rows: list[int]) -> None:
        """The samples in ``rows`` are done: their bookkeeping goes and the rows are parked (module docstring)."""
        if not rows:
            return
        with shared_ints():  # each list of rows goes to the device once, not once per layer
            for layer in self.layers:
                layer.release_rows(rows)
            for row in rows:
                self.pad_lengths[row] = 0
            self.parked = tuple(sorted(set(self.parked) | set(rows)))
            self._parked_index = None
            self.reset_parked_lengths()

    def adopt(self, rows: list[int], source, source_rows: list[int]) -> None:
        """Move ``source_rows`` of ``source`` (a cache of the same class and capacity, after its prefill and
        ``begin_decode``) into the parked ``rows`` of this one (module docstring); this cache decodes from then on."""
        busy = sorted(set(rows) - set(self.parked))
        if busy or len(rows) != len(source_rows):
            raise ValueError(f"adopt: rows {busy} are not free" if busy else "adopt: rows and source_rows differ")
        if source.capacity != self.capacity or not source.decoding:
            raise ValueError("adopt: the source must be a prefilled cache of the same capacity")
        with shared_ints():  # each list of rows goes to the device once, not once per layer
            for layer, src in zip(self.layers, source.layers):
                layer.adopt_rows(rows, src, source_rows)
            into = device_ints(rows, self.lengths.device, torch.long)
            self.lengths[into] = source.lengths[device_ints(source_rows, source.lengths.device, torch.long)].to(
                self.lengths.device)
            for copy in self._lengths_elsewhere.values():
                copy.copy_(self.lengths)
            for row in rows:
                self.pad_lengths[row] = 0
            self._pads_on.clear()
            self.parked = tuple(r for r in self.parked if r not in rows)
            self._parked_index = None
            if not self.decoding:
                for layer in self.layers:
                    layer.begin_decode(self.lengths_on(getattr(layer, "device", self.lengths.device)))
                self.decoding = True

    def open_slots(self) -> None:
        """Every row parked: the cache is then filled by :meth:`adopt` only."""
        self.release(list(range(self.batch_size)))

    def reset_parked_lengths(self) -> None:
        """Device: the parked rows' lengths back to zero (after every step)."""
        if self.parked:
            if getattr(self, "_parked_index", None) is None:
                self._parked_index = device_ints(list(self.parked), self.lengths.device, torch.long)
            self.lengths.index_fill_(0, self._parked_index, 0)
            for copy in self._lengths_elsewhere.values():
                copy.copy_(self.lengths)
