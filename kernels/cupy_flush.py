"""CupyKVLayer's flushes (kernels.cupy_layer): what the flush policy packs when, for a prefill chunk
(``_append_prefill``), between decode steps (``_settle``) and a stage ahead for the streams flushed inside the step
(``_prepare``), each through the method's kernel variant (kernels.variant), the tokens it keeps exactly staged on the
way (its ``flush_keys``).
A mixin over the layer's attributes and its storage (kernels.cupy_storage)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from oscar.method import TokenSpan
from oscar.transfer import device_ints


class CupyFlushes:
    """The layer's flushes (see kernels.cupy_layer.CupyKVLayer)."""

    def assume_stored(self, tokens: int) -> None:
        """Benchmarks: every row holds ``tokens`` tokens, counted as the policy leaves them after a prefill; the
        contents of the storage, windows and exact slots are the caller's (benchmarks.filled writes them at
        random). A method that keeps tokens keeps each row's first ones, as many as its slots hold (its state set
        so: OTT's pool full, RotateKV's sinks, OSCAR's sink prefix; its kernel variant's assume_kept)."""
        b = self.batch
        keys, values = self.policy.packed(tokens)
        packed = self._packed_prefix(tokens)
        self.tokens, self.keys_packed, self.values_packed = [tokens] * b, [keys] * b, [values] * b
        self.n_packed = [packed] * b
        self.pads_left = [0] * b
        self.seq_len = tokens
        self.prepared = {stream: [-1] * b for stream in self.in_step}
        if self.kept is not None:
            self.kept.assume_first(self.kernels.assume_kept(self.method, self.state.tensors, keys))
        self._prepare(range(b))
        self._sync_counts()

    def _flush(self, stream: str, x: Tensor, rows: list[int], offsets: list[int], values: Tensor | None = None):
        """Quantize tokens x [len(rows), H, n, D] (as the window holds them) of ``rows`` at stream positions
        ``offsets`` into the packed storage by the method's hook. A method that keeps tokens gets each chunk's span
        (rows sharing a position share a call) and, for keys, stages its kept tokens (their values: ``values``,
        the same tokens' values as they came)."""
        m = self.method
        store = self._store_of(stream)
        hook = self.kernels.quantize_keys if stream == "keys" else self.kernels.quantize_values
        if not self.kernels.exact:
            hook(m, x, out=store, rows=rows, offsets=offsets)
            return
        for start, at in _by_offset(offsets).items():
            members = [rows[j] for j in at]
            span = TokenSpan(device_ints(members, self.device, torch.long), start, self.state.tensors)
            group_x, group_values = x, values  # every row at this offset: the tokens as they came
            if len(at) < len(rows):
                index = device_ints(at, self.device, torch.long)
                group_x, group_values = x[index], None if values is None else values[index]
            where = dict(out=store, rows=members, offsets=[start] * len(at))
            if stream == "keys":  # the tokens the keys keep staged on the way
                self.kernels.flush_keys(m, group_x, group_values, self.layer_idx, span, self.kept, **where)
            else:
                hook(m, group_x, self.layer_idx, span, **where)

    def _settle(self, rows: list[int]) -> None:
        """Host: flush what the policy packs for ``rows`` (their tokens already in the window), then move each
        window to start at the new P, the packed tokens still in it replaced by their dequantized values. Rows with
        the same plan relative to their P share every launch."""
        plans: dict[tuple, list[int]] = {}
        for i in rows:
            t, p = self.tokens[i], self.n_packed[i]
            kp_new, vp_new = self.policy.packed(t)
            p_new = self._packed_prefix(t)
            plan = (t, self.keys_packed[i], self.values_packed[i], kp_new, vp_new, p_new)
            plans.setdefault(tuple(x - p for x in plan), []).append(i)
        for (t, kp, vp, kp_new, vp_new, p_new), members in plans.items():  # token indices in the window
            base = [self.n_packed[i] for i in members]
            idx = device_ints(members, self.device, torch.long)
            if kp_new > kp:
                self._ensure_capacity(max(base) + kp_new)
                self._flush("keys", self.key_residual[idx, :, kp:kp_new], members, [p + kp for p in base],
                            values=self.value_residual[idx, :, kp:kp_new])
            if vp_new > vp:  # the block policy's values (the kivi policy's were flushed in the step)
                self._ensure_capacity(max(base) + vp_new)
                self._flush("values", self.value_residual[idx, :, vp:vp_new], members, [p + vp for p in base])
            keep = t - p_new
            if p_new and keep:
                for window in (self.key_residual, self.value_residual):
                    window[idx, :, :keep] = window[idx, :, p_new:t]
            for stream, old, new in (("keys", kp, kp_new), ("values", vp, vp_new)):
                start = max(old, p_new)
                if new > start:
                    self._window_of(stream)[idx, :, start - p_new:new - p_new] = self._dequantized(
                        stream, members, [p + start for p in base], new - start)
            for i, p in zip(members, base):
                self.keys_packed[i], self.values_packed[i] = p + kp_new, p + vp_new
                self.n_packed[i] = p + p_new

    def _append_prefill(self, keys: Tensor, values: Tensor) -> None:
        """Several new tokens [B, H, t, D] (keys as the window holds them): per row skip its pads, quantize what the
        policy packs, keep the rest (and packed tokens after P, dequantized) in the window. Rows with the same pads
        and counts (a batch without padding: all) share every launch."""
        t = keys.shape[2]
        plans: dict[tuple[int, ...], list[int]] = {}
        for i in range(self.batch):
            skip = min(self.pads_left[i], t)
            self.pads_left[i] -= skip
            if skip < t:
                plan = (skip, self.tokens[i], self.keys_packed[i], self.values_packed[i], self.n_packed[i])
                plans.setdefault(plan, []).append(i)
        for (skip, total, kp, vp, p), members in plans.items():
            idx, n = device_ints(members, self.device, torch.long), len(members)
            total_new = total + t - skip
            kp_new, vp_new = self.policy.packed(total_new)
            p_new = self._packed_prefix(total_new)
            # the unpacked tokens of each stream, from its first unpacked one
            k = torch.cat([self.key_residual[idx, :, kp - p:total - p], keys[idx, :, skip:]], dim=2)
            v = torch.cat([self.value_residual[idx, :, vp - p:total - p], values[idx, :, skip:]], dim=2)
            self._ensure_capacity(max(kp_new, vp_new))
            if kp_new > kp:
                self._flush("keys", k[:, :, :kp_new - kp], members, [kp] * n, values=v[:, :, kp - vp:kp_new - vp])
            if vp_new > vp:
                self._flush("values", v[:, :, :vp_new - vp], members, [vp] * n)
            window_k = torch.cat([self._dequantized("keys", members, [p_new] * n, kp_new - p_new),
                                  k[:, :, kp_new - kp:]], 2)
            window_v = torch.cat([self._dequantized("values", members, [p_new] * n, vp_new - p_new),
                                  v[:, :, vp_new - vp:]], 2)
            self.key_residual[idx, :, :total_new - p_new] = window_k
            self.value_residual[idx, :, :total_new - p_new] = window_v
            for i in members:
                self.tokens[i], self.keys_packed[i], self.values_packed[i] = total_new, kp_new, vp_new
                self.n_packed[i] = p_new
        self._prepare(range(self.batch))
        self._sync_counts()

    def _due_stage(self, stream: str, i: int) -> bool:
        """Whether row i's window holds its first stage (tokens P .. P + stage) of an in-step stream not prepared for
        this P (and, where the kept set grows at key flushes, whose keys are flushed)."""
        p = self.n_packed[i]
        covered = not self.kernels.kept_by_keys or self.keys_packed[i] >= p + self.stage
        return self.tokens[i] - p >= self.stage and self.prepared[stream][i] != p and covered

    def _prepare(self, rows) -> None:
        """Host, the in-step streams: for each of ``rows`` whose window holds its first stage not yet prepared
        (``_due_stage``), quantize the stage's tokens not yet packed (from the stream's packed count on) into the
        storage now (the bytes a flush at each one's turn would write; they count as packed only then) and keep
        their dequantized values (what the torch path attends: the stored bytes read back by the variant's
        dequantize kernel where it has one, its kept tokens as they came; else the method's own quantization) in
        ``restored`` for ``finish_step``. Runs after a prefill and every step, so a stage is prepared before its
        first token falls due: at T = R + 1 (P = 0) or T = P + R + 1 after P moved, R >= stage. Rows sharing
        packed - P share the launches."""
        for stream in self.in_step:
            counts = self.keys_packed if stream == "keys" else self.values_packed
            groups: dict[int, list[int]] = {}
            for i in rows:
                if self._due_stage(stream, i):
                    groups.setdefault(counts[i] - self.n_packed[i], []).append(i)
                    self.prepared[stream][i] = self.n_packed[i]
            for start, members in groups.items():
                idx = device_ints(members, self.device, torch.long)
                offsets = [self.n_packed[i] + start for i in members]
                raw = self._window_of(stream)[idx, :, start:self.stage]
                self._ensure_capacity(max(offsets) - start + self.stage)
                self._flush(stream, raw, members, offsets, values=self.value_residual[idx, :, start:self.stage])
                if self.kernels.reads_packed(stream):  # the bytes just stored, read back by one kernel
                    restored = self._restored(stream, raw, members, offsets)
                else:
                    restored = self._own_dequantized(stream, raw, members, offsets)
                self.restored[stream][idx, :, start:] = restored

    def _own_dequantized(self, stream: str, x: Tensor, rows: list[int], offsets: list[int]) -> Tensor:
        """The method's own quantization and dequantization of tokens x [len(rows), H, n, D] (as the window holds
        them) of ``rows`` at ``offsets``: what the torch path attends for them, in the model dtype. A method that
        keeps tokens quantizes each position's rows at their span (its kept tokens come back exact)."""
        own = self.kernels.own_quantizer(self.method, stream)
        if not self.kernels.exact:
            return self.method.dequantize(own(x, self.layer_idx)).to(self.dtype)
        out = torch.empty_like(x)
        for start, at in _by_offset(offsets).items():
            index = device_ints(at, self.device, torch.long)
            span = TokenSpan(device_ints([rows[j] for j in at], self.device, torch.long), start, self.state.tensors,
                             fixed_shapes=True)  # dequantized at once: no host read of the kept count
            packed = replace(own(x[index], self.layer_idx, span), start=start)
            out[index] = self.method.dequantize(packed).to(self.dtype)
        return out


def _by_offset(offsets: list[int]) -> dict[int, list[int]]:
    """Offset -> the indices of ``offsets`` that hold it."""
    groups: dict[int, list[int]] = {}
    for j, offset in enumerate(offsets):
        groups.setdefault(offset, []).append(j)
    return groups
