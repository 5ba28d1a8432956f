"""The tokens a CuPy cache layer keeps exactly (OTT's outlier pool, RotateKV's sinks, OSCAR's sink prefix).

Storage: kernels.method_layouts.empty_exact (keys/values [B, H, slots, D], count [B, H], skip [B, H, ceil(cap / 32)]).
A kept token is staged when its key is quantized (a flush, or the stage of keys a window policy quantizes ahead):
its key and value (as the window holds them; a value the method does not keep exactly: its dequantization) go to
the next free slot of its (row, head), in stream order, and the skip bit of its packed copy is set. The kernel reads
the first ``count`` slots, those below the row's packed count P (``attend_below``); a staged token at or after P is
still read from the window, which holds it as the torch path attends it. So each token is attended once.

All of it lives on the device, bookkeeping included: ``slot_positions`` [B, H, slots] (int32, -1 = free; not read
by the kernel) holds the stream positions of the staged tokens in slot order (ascending). Staging, the kernel's
counts and reading a range back (``restore``; ``write``: one launch, kernels/kept_tokens.cu) are fixed-shape device
work over it: no host read, so a chunked prefill's host runs ahead of the GPU. A position at or before a (row,
head)'s last staged one counts as staged already: staging it again changes nothing (a chunk quantized again after
a stage quantized ahead). A (row, head) never has more kept tokens than its slots: each method's kept set is a state
of that size (OTT's pool of pool_size, RotateKV's num_sinks, OSCAR's sink_tokens: the variant's ``slots``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import runtime
from kernels.method_layouts import empty_exact, skip_words
from kernels.runtime import dtype_define
from oscar.transfer import device_ints


def skip_word(positions: list[int], word: int) -> int:
    """The int32 skip word ``word`` of sorted ``positions``: bit p % 32 set for each p in [32 word, 32 word + 32)."""
    lo, hi = bisect.bisect_left(positions, 32 * word), bisect.bisect_left(positions, 32 * word + 32)
    bits = sum(1 << (p % 32) for p in positions[lo:hi])
    return bits - (1 << 32) if bits >= 1 << 31 else bits


class KeptTokens:
    """The exact-token storage of one layer and its bookkeeping (module docstring)."""

    def __init__(self, batch: int, heads: int, slots: int, head_dim: int, packed_capacity: int, dtype, device):
        self.slots = max(slots, 1)
        self.buffers = empty_exact(batch, heads, self.slots, head_dim, packed_capacity, dtype, device)
        self.slot_positions = torch.full((batch, heads, self.slots), -1, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.slot_positions.device

    def reset(self) -> None:
        """Nothing kept (a new batch in the same storage: buffers zeroed in place)."""
        self.buffers["count"].zero_()
        self.buffers["skip"].zero_()
        self.slot_positions.fill_(-1)

    def grow(self, packed_capacity: int) -> None:
        """Skip words for a larger packed capacity (the storage grew), the old ones kept."""
        old = self.buffers["skip"]
        words = -(-packed_capacity // 32)
        if words > old.shape[2]:
            self.buffers["skip"] = torch.zeros(*old.shape[:2], words, dtype=old.dtype, device=old.device)
            self.buffers["skip"][:, :, :old.shape[2]] = old

    def assume_first(self, n: int) -> None:
        """Benchmarks: every (row, head) keeps its first ``n`` tokens (slots 0 .. n - 1; their contents the
        caller's)."""
        self.reset()
        self.slot_positions[:, :, :n] = torch.arange(n, dtype=torch.int32, device=self.device)
        words = [skip_word(list(range(n)), w) for w in range(-(-n // 32))]
        if words:
            skip = self.buffers["skip"]
            skip[:, :, :len(words)] = torch.tensor(words, dtype=torch.int32, device=skip.device)

    # -- device writes -------------------------------------------------------------------------
    def stage(self, rows: Tensor, start: int, mask: Tensor, keys: Tensor, values: Tensor,
              value_map: Callable[[Tensor], Tensor] | None = None) -> None:
        """Stage the tokens ``mask`` [b, 1 or H, n] (bool) names in a chunk of ``rows`` (long [b], distinct) from
        stream position ``start``: keys, values [b, H, n, D] as the kernel attends them (``value_map``: the staged
        values [b, H, slots, D] -> what the slots hold, e.g. their dequantization; per token). Slot s of a (row,
        head) that had ``used`` staged takes the chunk's (s - used + 1)-th new token (a searchsorted over the
        running count of new tokens), so every write is a fixed-shape [b, H, slots] select. The reference of
        :meth:`stage_positions`' kernel (about 35 small torch operations where it launches once)."""
        b, h, n, _ = keys.shape
        held = self.slot_positions[rows]  # [b, H, S]
        used = (held >= 0).sum(-1, keepdim=True)
        stream = torch.arange(start, start + n, device=self.device)
        new = mask.expand(b, h, n) & (stream > held.amax(-1, keepdim=True))  # after the last staged position
        running = new.cumsum(-1)  # [b, H, n]: new tokens up to each
        nth = torch.arange(self.slots, device=self.device) - used + 1  # [b, H, S]: which new token a slot takes
        fills = (nth >= 1) & (nth <= running[..., -1:])
        token = torch.searchsorted(running, nth).clamp(max=n - 1)
        for name, x in (("keys", keys), ("values", values)):
            picked = x.gather(2, token.unsqueeze(-1).expand(b, h, self.slots, x.shape[3]))
            if name == "values" and value_map is not None:
                picked = value_map(picked)
            store = self.buffers[name]
            store[rows] = torch.where(fills.unsqueeze(-1), picked.to(store.dtype), store[rows])
        self.slot_positions[rows] = torch.where(fills, (token + start).to(torch.int32), held)
        first = start // 32  # the skip words the chunk touches, the new tokens' bits OR'd in
        words = skip_words(F.pad(new, (start - 32 * first, 0)))
        skip = self.buffers["skip"]
        skip[rows, :, first:first + words.shape[2]] |= words

    def stage_positions(self, rows: Tensor, start: int, positions: Tensor, keys: Tensor, values: Tensor,
                        value_map: Callable[[Tensor], Tensor] | None = None) -> None:
        """:meth:`stage` of the tokens at ``positions`` in one launch (kernels/kept_tokens.cu), bit for bit
        ``stage(rows, start, positions_mask(positions[rows], start, n), keys, values, value_map)``: ``positions``
        [B or 1, 1 or H, K] int64 stream positions, -1 = none (one row: every row's; one head: every head's),
        ``rows`` int64 [b] on the slots' device, keys and values [b, H, n, D] in the slots' dtype with contiguous
        channels. ``value_map`` (per token) maps the whole chunk's values first."""
        store = self.buffers
        b, h, n, d = keys.shape
        storage_rows = store["keys"].shape[0]
        if value_map is not None:
            values = value_map(values).to(store["values"].dtype)
        problems = []
        if values.shape != keys.shape or keys.dtype != values.dtype or keys.dtype != store["keys"].dtype:
            problems.append(f"keys {tuple(keys.shape)} {keys.dtype} and values {tuple(values.shape)} {values.dtype} "
                            f"of one shape in the slots' {store['keys'].dtype}")
        if keys.stride(3) != 1 or values.stride(3) != 1 or (h, d) != tuple(store["keys"].shape[1::2]):
            problems.append(f"[b, {store['keys'].shape[1]}, n, {store['keys'].shape[3]}] chunks with contiguous "
                            "channels")
        if positions.dim() != 3 or positions.dtype != torch.long or positions.shape[0] not in (1, storage_rows) \
                or positions.shape[1] not in (1, h) or not positions.is_contiguous():
            problems.append(f"contiguous int64 positions [1 or {storage_rows}, 1 or {h}, K], got "
                            f"{tuple(positions.shape)} {positions.dtype}")
        if rows.shape != (b,) or rows.dtype != torch.long or start + n > 32 * store["skip"].shape[2]:
            problems.append(f"int64 rows [{b}] and positions up to {start + n} within the skip words' "
                            f"{32 * store['skip'].shape[2]}")
        if problems:
            raise ValueError("stage_positions: " + "; ".join(problems))
        if not b * n or not positions.shape[2]:
            return
        k = positions.shape[2]
        runtime.launch("kept_tokens.cu", "stage_kept", dict(HEAD_DIM=d, IS_BF16=dtype_define(keys.dtype)), (b * h,),
                       (128,), (keys, *map(np.int64, keys.stride()[:3]), values, *map(np.int64, values.stride()[:3]),
                                np.int32(h), rows, np.int64(start), np.int32(n), positions,
                                np.int64(0 if positions.shape[0] == 1 else positions.stride(0)),
                                np.int32(positions.shape[1]), np.int32(k), store["keys"], store["values"],
                                self.slot_positions, np.int32(self.slots), store["skip"],
                                np.int32(store["skip"].shape[2])), keys.device, 4 * (2 * k + 1))

    def sync_counts(self, n_packed: list[int]) -> None:
        """The kernel's count per (row, head): the slots below each row's P (in place)."""
        self.buffers["count"].copy_(self._below(n_packed).sum(-1))

    def _below(self, stops: list[int]) -> Tensor:
        """Which slots hold a token below its row's ``stops`` entry: bool [B, H, S]."""
        stop = device_ints(stops, self.device).view(-1, 1, 1)
        return (self.slot_positions >= 0) & (self.slot_positions < stop)

    # -- reading back --------------------------------------------------------------------------
    def _in_range(self, rows: list[int], start: int, n: int) -> tuple[Tensor, Tensor]:
        """The slot positions of ``rows`` [b, H, S] and which of them lie in [start, start + n)."""
        held = self.slot_positions[device_ints(rows, self.device, torch.long)]
        return held, (held >= start) & (held < start + n)

    def restore(self, stream: str, rows: list[int], start: int, n: int) -> dict[str, Tensor]:
        """The ``exact``/``exact_pos`` buffers (oscar.exact) of the kept tokens of ``rows`` at positions
        [start, start + n): [b, H, S, D] from the slots of ``stream`` ("keys" or "values", zero where out of the
        range) and int32 [b, H, S, 1] (-1 there), S the slots."""
        held, inside = self._in_range(rows, start, n)
        store = self.buffers[stream][device_ints(rows, self.device, torch.long)]
        exact = torch.where(inside.unsqueeze(-1), store, torch.zeros_like(store))
        return {"exact": exact, "exact_pos": torch.where(inside, held, -1).unsqueeze(-1)}

    def write(self, stream: str, rows: list[int], start: int, n: int, out: Tensor) -> Tensor:
        """The kept tokens of ``rows`` at positions [start, start + n) of ``stream`` written over their place in
        ``out`` [b, H, n, D] (in place, any strides but the channels'; the slots' dtype), in one launch
        (kernels/kept_tokens.cu): oscar.exact.restore_exact of :meth:`restore` is its reference."""
        store = self.buffers[stream]
        b, h, _, d = out.shape
        if out.dtype != store.dtype or out.stride(3) != 1 or (h, d) != (store.shape[1], store.shape[3]):
            raise ValueError(f"write: out [b, {store.shape[1]}, n, {store.shape[3]}] {store.dtype} with contiguous "
                             f"channels, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
        if b * n:
            runtime.launch("kept_tokens.cu", "write_kept", dict(HEAD_DIM=d, IS_BF16=dtype_define(out.dtype)),
                           (b * h,), (128,), (store, self.slot_positions, np.int32(h), np.int32(self.slots),
                                              device_ints(rows, self.device), np.int64(start), np.int32(n), out,
                                              *map(np.int64, out.stride()[:3])), out.device)
        return out

    def kept_below(self, stops: list[int]) -> list[int]:
        """Per row, the kept (head, token) pairs at positions below its ``stops`` entry (a host read: for tests and
        inspection; :meth:`nbytes` counts them on the device)."""
        return self._below(stops).sum((1, 2)).tolist()

    def staged(self) -> list[list[list[int]]]:
        """The staged positions per row and head, in slot order (a host read: for tests and inspection)."""
        return [[[p for p in head if p >= 0] for head in row] for row in self.slot_positions.tolist()]

    def nbytes(self, keys_packed: list[int], values_packed: list[int], n_packed: list[int]) -> Tensor:
        """Real bytes of the kept tokens: a slot's key once its key is packed (before, it is the window's full
        precision token), its value once its value is packed; per (row, head) the kernel's count (int32) and the
        skip words covering the P packed tokens it reads (a bit per token). A 0-dim int64 tensor on the device, not
        read here: a cache sums its layers' before one host read (oscar.cache.CacheStorageMixin.nbytes)."""
        keys = self.buffers["keys"]
        per_slot = keys.shape[3] * keys.element_size()
        heads = keys.shape[1]
        slots = self._below(keys_packed).sum() + self._below(values_packed).sum()
        return slots * per_slot + sum(heads * (4 + 4 * -(-p // 32)) for p in n_packed)
