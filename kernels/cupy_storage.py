"""CupyKVLayer's storage (kernels.cupy_layer): allocation, the counts the kernels read, reading packed tokens back
into the method's layout, and byte accounting. A mixin over the layer's attributes (set by its lazy_initialization:
keys_store/values_store, key_residual/value_residual, the host counts tokens/keys_packed/values_packed/n_packed and
their device copies, kept)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kernels import method_layouts, ops
from kernels.variant import storage_granule
from oscar.quant import PackedTensor
from oscar.transfer import device_ints


class CupyStorage:
    """The layer's packed storage, windows and counts (see kernels.cupy_layer.CupyKVLayer)."""

    _allocated_bytes: int | None = None  # allocated_bytes, once summed; None again whenever a buffer is allocated

    def _window_of(self, stream: str) -> Tensor:
        return self.key_residual if stream == "keys" else self.value_residual

    def _allocate(self, capacity: int) -> None:
        m = self.method
        keys, values = ops.empty_storage(self.kernels.kernel, self.batch, self.heads, capacity, self.head_dim,
                                         k_bits=m.k_bits, v_bits=m.v_bits, group_size=self.group_size,
                                         dtype=self.dtype, device=self.device)
        if self.keys_store is not None:  # growing: every entry of the old storage (whole value tiles) moves over
            for new, old in ((keys, self.keys_store), (values, self.values_store)):
                for name in new:
                    new[name][:, :, :old[name].shape[2]] = old[name]
        self.keys_store, self.values_store, self.capacity = keys, values, capacity
        self._allocated_bytes = None  # summed again on the next read
        self._entry_bytes = {stream: self._token_entries(store) for stream, store in (("keys", keys),
                                                                                      ("values", values))}
        if self.kept is not None:
            self.kept.grow(capacity)
        self.attention_kwargs = self.kernels.attention(m, self.head_dim, self.device, layer_idx=self.layer_idx,
                                                       capacity=capacity, heads=self.heads)

    def _ensure_capacity(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        if self.engine:
            raise RuntimeError(f"the static cache of capacity {self.capacity} is full")
        granule = storage_granule(self.method)
        self._allocate(math.ceil(max(tokens, 2 * self.capacity) / granule) * granule)

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` packed tokens per row (benchmarks preallocate; decoding grows by doubling)."""
        self._ensure_capacity(tokens)

    @property
    def n_res(self) -> list[int]:
        """Tokens each row's kernel reads from the window: T - P."""
        return [t - p for t, p in zip(self.tokens, self.n_packed)]

    def _sync_counts(self) -> None:
        """Host counts -> the device tensors the kernels read (rows of ``counts_dev``, in place: their addresses never
        change), in one copy."""
        counts = self.n_packed + self.n_res + self.keys_packed + self.values_packed
        self.counts_dev.copy_(device_ints(counts, self.device).view(4, -1))
        if self.kept is not None:
            self.kept.sync_counts(self.n_packed)

    def _packed_prefix(self, tokens: int) -> int:
        """P after ``tokens`` tokens: the tokens whose keys and values are both packed, in whole kernel stages."""
        return min(self.policy.packed(tokens)) // self.stage * self.stage

    def packed(self, stream: str, rows: list[int], start: int, n: int) -> PackedTensor:
        """Packed tokens start .. start + n of ``rows`` ("keys" or "values") read back from the storage into the
        reference layout: the PackedTensor the method's own quantizer returns for them (what ``dequantize`` reads),
        with the tokens it keeps exactly among them (from the exact slots; their exact_pos padded with -1 per row
        and head, so the buffers differ in layout from the torch path's concatenated chunks, not in content)."""
        m, g, stop = self.method, self.method.group_size, start + n
        idx = device_ints(rows, self.device, torch.long)
        if self.kernels.exact:
            like = self.key_like if stream == "keys" else self.value_like
            store = self._store_of(stream)
            order = self.kernels.channel_order(m, self.layer_idx, self.heads * self.head_dim)
            packed = method_layouts.load_packed(self.kernels.kernel, stream, store, rows, start, n, like, order)
            if self._keeps_exact(stream):
                packed = packed.with_buffers(**self.kept.restore(stream, rows, start, n))
            return packed
        if stream == "keys":
            if self.kernels.keys_per_channel:  # parameters per group of G tokens
                chosen = {name: buf[idx, :, start // g:stop // g] if name in ("scale", "zero") else
                          buf[idx, :, start:stop] for name, buf in self.keys_store.items()}
                buffers = ops.key_decode_layout(chosen, m.k_bits, inverse=True)
            else:
                chosen = {name: buf[idx, :, start:stop] for name, buf in self.keys_store.items()}
                buffers = ops.token_key_decode_layout(chosen, m.k_bits, inverse=True)
            meta = self.key_like.meta
        else:  # whole 16-token tiles, then the tokens asked for
            lo, hi = start // 16 * 16, -(-stop // 16) * 16
            tiles = ops.value_decode_layout({name: buf[idx, :, lo:hi] for name, buf in self.values_store.items()},
                                            m.v_bits, g, inverse=True)
            buffers = {name: x[:, :, start - lo:stop - lo] for name, x in tiles.items()}
            meta = self.value_like.meta
        return PackedTensor(buffers, (len(rows), self.heads, n, self.head_dim), self.dtype, meta)

    def _dequantized(self, stream: str, rows: list[int], starts: list[int], n: int,
                     out: Tensor | None = None) -> Tensor:
        """Packed tokens starts[i] .. starts[i] + n of each of ``rows`` dequantized by the method, in its attention
        space (kept tokens exact): [len(rows), H, n, D] in the model dtype, written into ``out`` where given. Read by
        the variant's kernel straight from the storage where it has one (KernelVariant.dequantize: bit for bit the
        method's dequantize), else through the method's dequantize of :meth:`packed`."""
        if n <= 0:
            return torch.empty(len(rows), self.heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        if len(set(starts)) > 1:
            parts = torch.cat([self._dequantized(stream, [i], [start], n) for i, start in zip(rows, starts)])
            return parts if out is None else out.copy_(parts)
        if not self.kernels.reads_packed(stream):
            x = self.method.dequantize(self.packed(stream, rows, starts[0], n)).to(self.dtype)
            return x if out is None else out.copy_(x)
        if out is None:
            out = torch.empty(len(rows), self.heads, n, self.head_dim, dtype=self.dtype, device=self.device)
        self.kernels.dequantize(self.method, stream, self._store_of(stream), device_ints(rows, self.device),
                                starts[0], n, out, self.layer_idx)
        if self._keeps_exact(stream) and self.kernels.may_keep(self.method, starts[0]):
            self.kept.write(stream, rows, starts[0], n, out)
        return out

    def _restored(self, stream: str, raw: Tensor, rows: list[int], offsets: list[int]) -> Tensor:
        """Tokens of ``rows`` just flushed from the window (raw [len(rows), H, n, D] as it holds them) at ``offsets``,
        read back by the variant's kernel, as the torch path attends them: the tokens the method keeps exactly as
        they came. Keys need nothing more: their flush staged their kept tokens, which the read-back wrote over their
        places; so do values where the kept set grows at key flushes (OTT: a value stage waits for its keys' flush).
        Elsewhere a kept value whose key flushes later (the kivi policy) has no slot yet: values take them from raw."""
        out = self._dequantized(stream, rows, offsets, raw.shape[2])
        if stream == "keys" or self.kernels.kept_by_keys or not self._keeps_exact(stream):
            return out
        by_offset: dict[int, list[int]] = {}
        for j, offset in enumerate(offsets):
            by_offset.setdefault(offset, []).append(j)
        for start, at in by_offset.items():
            if not self.kernels.may_keep(self.method, start):
                continue
            index = device_ints(at, self.device, torch.long)
            mask = self.kernels.kept(self.method, self.state.tensors, device_ints([rows[j] for j in at], self.device,
                                                                                torch.long), start, raw.shape[2])
            out[index] = torch.where(mask.unsqueeze(-1), raw[index], out[index])
        return out

    def _keeps_exact(self, stream: str) -> bool:
        """Whether the kept tokens of ``stream`` are exact in its slots (keys always; values unless the method
        stages their dequantization: OTT's keep_values=false)."""
        return self.kernels.exact and (stream == "keys" or self.kernels.kept_values(self.method))

    def _store_of(self, stream: str) -> dict[str, Tensor]:
        """The packed storage of ``stream`` ("keys" or "values"): its buffers by name."""
        return self.keys_store if stream == "keys" else self.values_store

    def static_tensors(self) -> list[Tensor]:
        kept = [] if self.kept is None else [*self.kept.buffers.values(), self.kept.slot_positions]
        return [*self.keys_store.values(), *self.values_store.values(), self.key_residual, self.value_residual,
                self.n_packed_dev, self.n_res_dev, self.keys_packed_dev, self.values_packed_dev, self.live_dev,
                *self.restored.values(), *kept, *self.state.tensors.values()]

    def token_counts(self) -> dict[str, int]:
        return dict(keys_packed=sum(self.keys_packed), keys_residual=sum(self.tokens) - sum(self.keys_packed),
                    values_packed=sum(self.values_packed),
                    values_residual=sum(self.tokens) - sum(self.values_packed))

    @staticmethod
    def _token_entries(store: dict[str, Tensor]) -> tuple[int, tuple[tuple[int, int], ...]]:
        """The storage's capacity in tokens and, per buffer, (entries along the token axis, bytes of one entry of
        one row): what :meth:`_packed_bytes` counts with, read once per allocation (``nbytes`` runs per row and
        layer every time a sample of a continuous batch ends: tensor views there cost the GPU its idle time)."""
        return store["codes"].shape[2], tuple((buf.shape[2], buf[0, :, 0].numel() * buf.element_size())
                                              for buf in store.values())

    def _packed_bytes(self, stream: str, tokens: int) -> int:
        """Real bytes of ``tokens`` packed tokens of one row of ``stream``: every buffer's entries for them (one per
        token, or one per group of G tokens for per-channel parameters) times an entry's bytes."""
        capacity, entries = self._entry_bytes[stream]
        return sum(tokens * length // capacity * entry for length, entry in entries)

    @property
    def kept_nbytes(self) -> int:
        """Real bytes of the tokens kept exactly (kernels.kept_tokens.KeptTokens.nbytes); 0 for the other methods."""
        kept = self.stored_bytes()[1]
        return 0 if kept is None else int(kept)

    @property
    def nbytes(self) -> int:
        """Real stored bytes of the held tokens (what ``QuantizedKVCache.nbytes`` counts): the packed ones in the
        storage (kept tokens' unread codes included, as the torch path counts them), the unpacked ones at full
        precision (the window's dequantized copies of packed tokens are not counted), and ``kept_nbytes``: each kept
        token's key and value once they are packed (in its exact slot; before, as the window's unpacked token)."""
        counted, kept = self.stored_bytes()
        return counted + (0 if kept is None else int(kept))

    def stored_bytes(self) -> tuple[int, Tensor | None]:
        """``nbytes`` in two parts, the second not read from the device: the bytes the host counts, and the kept
        tokens' (a 0-dim int64 tensor on the device; None where the method keeps none)."""
        if not self.is_initialized:
            return 0, None
        per_token = self.heads * self.head_dim * self.dtype.itemsize
        packed = sum(self._packed_bytes("keys", kp) + self._packed_bytes("values", vp)
                     + (2 * t - kp - vp) * per_token for t, kp, vp in zip(self.tokens, self.keys_packed,
                                                                          self.values_packed))
        kept = None if self.kept is None else self.kept.nbytes(self.keys_packed, self.values_packed, self.n_packed)
        return packed, kept

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every static buffer; summed once per storage (read at every step of a scheduled evaluation)."""
        if self._allocated_bytes is None:
            self._allocated_bytes = sum(t.numel() * t.element_size() for t in self.static_tensors())
        return self._allocated_bytes
