"""The tokens a CuPy cache layer keeps exactly (OTT's outlier pool, RotateKV's sinks, OSCAR's sink prefix).

Storage: kernels.method_layouts.empty_exact (keys/values [B, H, slots, D], count [B, H], skip [B, H, ceil(cap / 32)]).
A kept token is staged when its key is quantized (a flush, or the stage of keys a window policy quantizes ahead):
its key and value (as the window holds them; a value the method does not keep exactly: its dequantization) go to
the next free slot of its (row, head), in stream order, and the skip bit of its packed copy is set. The kernel reads
the first ``count`` slots, those below the row's packed count P (``attend_below``); a staged token at or after P is
still read from the window, which holds it as the torch path attends it. So each token is attended once.

Host bookkeeping (pure lists, no device reads): ``positions[row][head]``, the stream positions of the staged tokens
in slot order (ascending), mirrored on the device in ``slot_positions`` [B, H, slots] (int32, -1 = free; not read by
the kernel) so that reading a range back (``restore``, ``write``) builds its indices there from a few host counts:
no host loop over tokens, no host sync. Staging the same position again changes nothing (a chunk re-quantized after
a stage quantized ahead).
"""

from __future__ import annotations

import bisect

import torch
from torch import Tensor

from kernels.method_layouts import empty_exact
from kernels.runtime import device_ints


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
        self.positions: list[list[list[int]]] = [[[] for _ in range(heads)] for _ in range(batch)]
        self.slot_positions = torch.full((batch, heads, self.slots), -1, dtype=torch.int32, device=device)

    @property
    def batch(self) -> int:
        return len(self.positions)

    @property
    def heads(self) -> int:
        return len(self.positions[0])

    def reset(self) -> None:
        """Nothing kept (a new batch in the same storage: buffers zeroed in place)."""
        self.positions = [[[] for _ in range(self.heads)] for _ in range(self.batch)]
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
        self.positions = [[list(range(n)) for _ in range(self.heads)] for _ in range(self.batch)]
        self.slot_positions[:, :, :n] = torch.arange(n, dtype=torch.int32, device=self.slot_positions.device)
        words = [skip_word(list(range(n)), w) for w in range(-(-n // 32))]
        if words:
            skip = self.buffers["skip"]
            skip[:, :, :len(words)] = torch.tensor(words, dtype=torch.int32, device=skip.device)

    # -- bookkeeping ---------------------------------------------------------------------------
    def add(self, row: int, head: int, position: int) -> int | None:
        """Record a kept token: its slot, or None if it is staged already."""
        kept = self.positions[row][head]
        if kept and position <= kept[-1]:
            if position in kept:
                return None
            raise ValueError(f"kept tokens are staged in stream order: {position} after {kept[-1]} (row {row})")
        if len(kept) == self.slots:
            raise RuntimeError(f"row {row} head {head} keeps more than its {self.slots} exact slots")
        kept.append(position)
        return len(kept) - 1

    def attended(self, n_packed: list[int]) -> list[list[int]]:
        """Per row and head, the slots the kernel reads: the staged tokens below the row's packed count P."""
        return [[bisect.bisect_left(kept, p) for kept in row] for row, p in zip(self.positions, n_packed)]

    def in_range(self, row: int, head: int, start: int, stop: int) -> tuple[int, int]:
        """Slots lo .. hi of (row, head) hold its kept tokens at positions [start, stop)."""
        kept = self.positions[row][head]
        return bisect.bisect_left(kept, start), bisect.bisect_left(kept, stop)

    def kept_below(self, row: int, stop: int) -> int:
        """Kept (head, token) pairs of ``row`` at positions below ``stop``."""
        return sum(bisect.bisect_left(kept, stop) for kept in self.positions[row])

    # -- device writes -------------------------------------------------------------------------
    def stage(self, rows: list[int], start: int, hits: list[list[int]], keys: Tensor, values: Tensor) -> None:
        """Stage the tokens ``hits`` names ([i, head, t] each: ``mask.nonzero().tolist()`` of a [b, H, n] mask) of a
        chunk of ``rows`` from stream position ``start``: keys, values [b, H, n, D] as the kernel attends them."""
        where, touched = [], set()
        for i, head, t in hits:
            slot = self.add(rows[i], head, start + t)
            if slot is not None:
                where.append((i, head, t, rows[i], slot, start + t))
                touched.add((rows[i], head, (start + t) // 32))
        if not where:
            return
        device = self.buffers["keys"].device
        i, head, t, row, slot, position = device_ints(list(zip(*where)), device, torch.long)
        self.buffers["keys"][row, head, slot] = keys[i, head, t].to(self.buffers["keys"].dtype)
        self.buffers["values"][row, head, slot] = values[i, head, t].to(self.buffers["values"].dtype)
        self.slot_positions[row, head, slot] = position.to(torch.int32)
        row_w, head_w, word = zip(*sorted(touched))
        bits = [skip_word(self.positions[r][h], w) for r, h, w in zip(row_w, head_w, word)]
        index = tuple(device_ints(c, device, torch.long) for c in (row_w, head_w, word))
        self.buffers["skip"][index] = device_ints(bits, device)

    def sync_counts(self, n_packed: list[int]) -> None:
        """The kernel's count per (row, head): the slots below each row's P (host -> device, in place)."""
        self.buffers["count"].copy_(device_ints(self.attended(n_packed), self.buffers["count"].device))

    def _kept_index(self, rows: list[int], start: int, n: int) -> tuple[tuple[Tensor, ...], int] | None:
        """Device indices of the kept tokens of ``rows`` at positions [start, start + n): (i, row, head, j, slot,
        position), long [N] each (i the row's place in ``rows``, j the token's among its (row, head)'s), and S the
        most any (row, head) keeps there; None if no token. From each (row, head)'s slot range (two bisects on the
        host: its kept tokens there take consecutive slots) and ``slot_positions``."""
        spans = [self.in_range(r, h, start, start + n) for r in rows for h in range(self.heads)]
        counts = [hi - lo for lo, hi in spans]
        total = sum(counts)
        if not total:
            return None
        device = self.slot_positions.device
        flat = device_ints([lo for lo, _ in spans] + counts + list(rows), device, torch.long)  # one copy
        first, count, row_of = flat.split([len(spans), len(spans), len(rows)])
        pair = torch.repeat_interleave(torch.arange(len(spans), device=device), count, output_size=total)
        j = torch.arange(total, device=device) - (count.cumsum(0) - count)[pair]
        i, head = pair // self.heads, pair % self.heads
        row, slot = row_of[i], first[pair] + j
        return (i, row, head, j, slot, self.slot_positions[row, head, slot].long()), max(counts)

    def restore(self, stream: str, rows: list[int], start: int, n: int) -> dict[str, Tensor]:
        """The ``exact``/``exact_pos`` buffers (oscar.exact) of the kept tokens of ``rows`` at positions
        [start, start + n): [b, H, S, D] from the slots of ``stream`` ("keys" or "values") and int32 [b, H, S, 1]
        (-1: padding), S the most any (row, head) keeps there."""
        store = self.buffers[stream]
        found = self._kept_index(rows, start, n)
        s = 0 if found is None else found[1]
        exact = store.new_zeros(len(rows), self.heads, s, store.shape[3])
        pos = torch.full((len(rows), self.heads, s), -1, dtype=torch.int32, device=store.device)
        if found is not None:
            i, row, head, j, slot, position = found[0]
            exact[i, head, j] = store[row, head, slot]
            pos[i, head, j] = position.to(torch.int32)
        return {"exact": exact, "exact_pos": pos.unsqueeze(-1)}

    def write(self, stream: str, rows: list[int], start: int, n: int, out: Tensor) -> Tensor:
        """The kept tokens of ``rows`` at positions [start, start + n) of ``stream`` written over their place in
        ``out`` [b, H, n, D] (in place, any strides), as oscar.exact.restore_exact puts them back."""
        found = self._kept_index(rows, start, n)
        if found is not None:
            i, row, head, _, slot, position = found[0]
            out[i, head, position - start] = self.buffers[stream][row, head, slot].to(out.dtype)
        return out

    def nbytes(self, keys_packed: list[int], values_packed: list[int], n_packed: list[int]) -> int:
        """Real bytes of the kept tokens: a slot's key once its key is packed (before, it is the window's full
        precision token), its value once its value is packed; per (row, head) the kernel's count (int32) and the
        skip words covering the P packed tokens it reads (a bit per token)."""
        keys = self.buffers["keys"]
        per_slot = keys.shape[3] * keys.element_size()
        total = 0
        for r, (kp, vp, p) in enumerate(zip(keys_packed, values_packed, n_packed)):
            total += (self.kept_below(r, kp) + self.kept_below(r, vp)) * per_slot
            total += self.heads * (4 + 4 * -(-p // 32))
        return total
