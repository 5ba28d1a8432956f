"""Static caches: what the decode engine (oscar.engine) generates over.

A static cache is allocated once for a batch's prompt + new tokens (``capacity`` tokens per row) and
written in place, so device pointers never move and the one-token decode step can be replayed from a
CUDA graph. Each decode step is split the same way for every backend:

- ``prepare_step()``  on the device, before the forward: masks from the per-row lengths;
- the model's forward: every layer's ``update`` writes the new token at its row's length and the
  attention reads the cache (``attend``);
- ``finish_step()``   on the device, after the forward: flushes that happen every step, lengths + 1;
- ``advance()``       on the host, between steps: the bookkeeping and the flushes whose timing or rows
  the host decides (a key window that reached R tokens, value windows of the ``block`` policy).

The graph holds the first three; ``advance`` runs between replays, eager or graph alike, so both modes
compute the same numbers.

Prefill writes each chunk straight into the static storage (no second copy of the prompt's K/V): the layer's
``update`` stores the chunk's real tokens at each row's count, its ``attend`` runs the chunk's queries over the
row's stored tokens (oscar.attention.stored_attention: SDPA's causal kernel for a whole unpadded prompt,
FlashAttention's variable-length kernel over a stored prefix on a GPU, causal and bottom-right aligned, no mask
materialized; the engine passes :meth:`StaticCache.prefill_mask`, a placeholder) and then flushes what the policy
packs. Attention thus sees the chunk in full precision and the rows' earlier
tokens as stored, as the reference cache with ``quantize_prefill=False`` does; ``begin_decode()`` is called once
after the prefill.

:class:`TorchStaticCache` is the torch backend's: per layer, the keys and values attention reads in the
method's space, [B, H, capacity, D] (each row's tokens from index 0: pads are never stored), holding the
dequantized mirror of the packed tokens followed by the full-precision recent ones. Flushes quantize with
the method exactly as ``oscar.cache.QuantizedKVCache`` does (same chunks, same per-sequence spans) and
overwrite the mirror with what ``dequantize`` returns; the packed buffers are kept and are what ``nbytes``
counts. Sliding-window layers keep every token (attention masks the ones outside the window): more is
quantized than the model's own cache would keep, and nothing the window sees differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar.attention import stored_attention
from oscar.cache import CacheStorageMixin, SeenTokensMixin, quantize_chunk
from oscar.exact import EXACT_BUFFERS
from oscar.method import KVMethod, SequenceState, TokenSpan
from oscar.row_groups import CountedRowGroup
from oscar.row_slots import GroupedSlotLayer, SlotCache
from oscar.transfer import shared_ints

#: a decode step's query [B, Hq, 1, D] and each row's new key (at ``lengths`` [B] in the token-major key cache
#: [B, H, capacity, D], in place) rotated by the plain Hadamard in one launch; returns the rotated query. A backend
#: with such a kernel offers it (oscar.backend.Backend.step_rotation); the torch transforms are used without one.
StepRotation = Callable[[Tensor, Tensor, Tensor], Tensor]


def round_capacity(tokens: int, multiple: int) -> int:
    """``tokens`` rounded up to a multiple of ``multiple`` (>= 1)."""
    multiple = max(1, multiple)
    return -(-max(tokens, 1) // multiple) * multiple


def sliding_windows(model) -> list[int | None]:
    """Per decoder layer, the sliding window of a sliding-attention layer, else None."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [window if kind == "sliding_attention" else None for kind in types]


class StaticCache(SlotCache, CacheStorageMixin, Cache):
    """Base of the engine's caches: per-row lengths on the device, the decode masks, the step protocol.

    ``lengths`` [B] int64: tokens stored per row, i.e. the position of the row's next token (read by the
    engine as position_ids). ``decode_mask()`` is what the step passes as attention_mask: a bool
    [B, 1, 1, capacity] tensor (True = attend), or per layer type a dict of them for models with sliding
    layers; both are rewritten in place by ``prepare_step``. A layer on another device than ``lengths`` (a model
    split over GPUs, oscar.placement) reads ``lengths_on(its device)``: a copy made at ``begin_decode`` and
    advanced by ``finish_step`` on that device, so a step never reads a tensor of another GPU. Rows are slots that
    continuous batching releases and refills while the others decode (oscar.row_slots: ``release``, ``adopt``).
    """

    def __init__(self, layers: list[CacheLayerMixin], pad_lengths: list[int], capacity: int, device,
                 windows: list[int | None]):
        super().__init__(layers=layers)
        self.capacity = capacity
        self.pad_lengths = list(pad_lengths)
        self.windows = windows
        self.lengths = torch.zeros(len(pad_lengths), dtype=torch.long, device=device)
        self._lengths_elsewhere: dict[torch.device, Tensor] = {}  # copies of lengths on the other layers' devices
        self._masks: dict[str, Tensor] | None = None  # allocated on first use
        self._pads_on: dict[torch.device, Tensor] = {}  # pad_lengths [B, 1] per device (real_tokens)
        self.decoding = False

    def _allocate_masks(self) -> dict[str, Tensor]:
        if self._masks is None:
            kinds = ["full_attention"] + (["sliding_attention"] if any(w is not None for w in self.windows) else [])
            shape = (self.batch_size, 1, 1, self.capacity)
            self._positions = torch.arange(self.capacity, device=self.lengths.device).view(1, 1, 1, self.capacity)
            self._masks = {kind: torch.zeros(shape, dtype=torch.bool, device=self.lengths.device) for kind in kinds}
        return self._masks

    @property
    def batch_size(self) -> int:
        return len(self.pad_lengths)

    # -- the step protocol ----------------------------------------------------------------------
    def begin_decode(self) -> None:
        """Host, once after prefill: lengths from the stored tokens; subclasses move prefill state in place."""
        stored = [self.layers[0].get_seq_length() - pad for pad in self.pad_lengths]
        if max(stored) + 1 > self.capacity:
            raise ValueError(f"the cache holds {max(stored)} tokens of capacity {self.capacity}: no room to decode")
        self.lengths.copy_(torch.tensor(stored))
        for copy in self._lengths_elsewhere.values():
            copy.copy_(self.lengths)
        for layer in self.layers:
            layer.begin_decode(self.lengths_on(getattr(layer, "device", self.lengths.device)))
        self.decoding = True

    def prefill_mask(self) -> Tensor:
        """The attention_mask the engine gives a prefill chunk: a [B, 1, 1, 1] placeholder that transformers passes
        through as it is (a 4D mask), so that no [B, 1, t, T] mask is built: each layer's ``attend`` derives the
        chunk's causal rule from its rows' counts (oscar.attention.stored_attention)."""
        if getattr(self, "_placeholder", None) is None:
            self._placeholder = torch.ones(self.batch_size, 1, 1, 1, dtype=torch.bool, device=self.lengths.device)
        return self._placeholder

    def real_tokens(self, t: int, device=None) -> Tensor:
        """[B, t] bool on ``device`` (default the CPU): which of the prompt's first ``t`` tokens are real (not left
        padding). The pads go to a device once per batch: a host copy per call would wait for the stream."""
        device = torch.device(device or "cpu")
        if device not in self._pads_on:
            self._pads_on[device] = torch.tensor(self.pad_lengths, device=device).view(-1, 1)
        return torch.arange(t, device=device).view(1, t) >= self._pads_on[device]

    def lengths_on(self, device) -> Tensor:
        """``lengths`` on ``device``: itself, or its copy there (kept equal by ``begin_decode`` and ``finish_step``)."""
        device = torch.device(device)
        if device == self.lengths.device:
            return self.lengths
        if device not in self._lengths_elsewhere:
            self._lengths_elsewhere[device] = self.lengths.to(device)
        return self._lengths_elsewhere[device]

    def decode_mask(self) -> Tensor | dict[str, Tensor]:
        masks = self._allocate_masks()
        return masks["full_attention"] if len(masks) == 1 else masks

    def prepare_step(self) -> None:
        """Device: attend to every stored token and the new one (index lengths[b]), within sliding windows."""
        masks = self._allocate_masks()
        upto = self.lengths.view(-1, 1, 1, 1)
        torch.le(self._positions, upto, out=masks["full_attention"])
        if "sliding_attention" in masks:
            window = next(w for w in self.windows if w is not None)
            torch.logical_and(masks["full_attention"], self._positions > upto - window,
                              out=masks["sliding_attention"])

    def finish_step(self) -> None:
        """Device: flushes that run every step (subclasses), then one more token per row."""
        self.lengths += 1
        for copy in self._lengths_elsewhere.values():
            copy += 1

    def advance(self) -> None:
        """Host, after each step (eager or replayed); parked rows back to length zero."""
        with shared_ints():  # each list of rows goes to the device once, not once per layer
            for layer in self.layers:
                layer.advance()
            self.reset_parked_lengths()

    def reset(self, pad_lengths: list[int]) -> None:
        """A new batch of the same size in the same storage (pointers kept, graphs stay valid)."""
        if len(pad_lengths) != self.batch_size:
            raise ValueError(f"the cache was built for {self.batch_size} sequences, got {len(pad_lengths)}")
        self.pad_lengths = list(pad_lengths)
        self._pads_on.clear()
        self.decoding = False
        self.parked, self._parked_index = (), None
        for layer in self.layers:
            layer.reset_rows(self.pad_lengths)

    # -- introspection (nbytes, allocated_bytes, token_counts: CacheStorageMixin) ----------------------
    def storage_pointers(self) -> list[int]:
        """Device addresses of every static buffer (they never change while a batch decodes)."""
        return [t.data_ptr() for layer in self.layers for t in layer.static_tensors()]


class TorchStaticLayer(GroupedSlotLayer, SeenTokensMixin, CacheLayerMixin):
    """One decoder layer of :class:`TorchStaticCache` (see the module docstring)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, method: KVMethod, layer_idx: int, pad_lengths: list[int], capacity: int,
                 window: int | None = None, step_rotation: StepRotation | None = None):
        super().__init__()
        self.method = method
        self.step_rotation = step_rotation
        self.policy = method.flush_policy
        self.layer_idx = layer_idx
        self.capacity = capacity
        self.window = window  # a sliding-attention layer's window (its own cache would keep only these tokens)
        self.quantized = (method.k_bits, method.v_bits) != (16, 16)
        #: values flushed one token per step inside the step (graph) rather than on the host: the ``kivi``
        #: policy's value window. With R = 0 a token's value would be flushed in the step before its key on the
        #: host, so a method whose values read state that its keys write (OTT's pool) flushes both on the host
        self.values_in_step = (self.quantized and self.policy.values_slide and not self.policy.keys_slide
                               and (method.residual_length > 0 or not method.keeps_state))
        self.state = SequenceState(method)  # kept across batches (reset in place): the captured step reads it
        self.reset_rows(pad_lengths)

    def reset_rows(self, pad_lengths: list[int]) -> None:
        self.state.reset()
        self.pad_lengths = list(pad_lengths)
        self.groups: list[CountedRowGroup] = []
        self.seq_len = 0
        self.decoding = False
        self.attending = None
        self._chunk: tuple[Tensor, list[int]] | None = None  # the prefill chunk's raw keys and per-group pads
        self.parked, self._parked_index = (), None
        if self.is_initialized:
            self._group_rows()

    def _group_rows(self) -> None:
        """One :class:`CountedRowGroup` per pad length (sorted), the count tensors of the step back to zero."""
        pads = self.pad_lengths
        if len(pads) != self.keys.shape[0]:
            raise ValueError(f"the cache was built for {self.keys.shape[0]} sequences, got {len(pads)}")
        self.groups = CountedRowGroup.by_pad_length(pads, self.device)
        self.key_window_fill.zero_()
        self.values_packed_count.zero_()

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        shape = (b, h, self.capacity, d)
        if getattr(self, "keys", None) is None or self.keys.shape != shape or self.keys.dtype != self.dtype:
            # stored token-major [B, capacity, H, D] (FlashAttention's layout), used as [B, H, capacity, D] views
            self.keys = torch.zeros(b, self.capacity, h, d, dtype=self.dtype, device=self.device).transpose(1, 2)
            self.values = torch.zeros(b, self.capacity, h, d, dtype=self.dtype, device=self.device).transpose(1, 2)
            self._cu_queries = torch.arange(b + 1, dtype=torch.int32, device=self.device)
            self._cu_keys = self._cu_queries * self.capacity
            # the raw keys of each row's window (what a key flush quantizes)
            self.key_window = torch.zeros(b, h, self.policy.key_window, d, dtype=self.dtype, device=self.device)
            self.key_window_fill = torch.zeros(b, dtype=torch.long, device=self.device)
            self.values_packed_count = torch.zeros(b, dtype=torch.long, device=self.device)
            self.all_rows = torch.arange(b, device=self.device)
            self.state.allocate(b, h, self.device)
            self.value_store = self._value_store(key_states) if self.values_in_step else {}
            #: the step's query and key Hadamards in one kernel (bit-equal to the method's transforms)
            self.fused_rotation = (self.step_rotation is not None and self.method.hadamard_space
                                   and self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16))
        self.is_initialized = True
        self._group_rows()

    def _value_store(self, like: Tensor) -> dict[str, Tensor]:
        """Static storage for the values flushed inside the step: every buffer of a one-token chunk, for all
        ``capacity`` tokens (token axis 2)."""
        probe = self.method.quantize_values(like[:, :, :1], self.layer_idx, span=self._step_span())
        return {name: torch.zeros(*buf.shape[:2], self.capacity, *buf.shape[3:], dtype=buf.dtype, device=buf.device)
                for name, buf in probe.buffers.items()}

    def _step_span(self) -> TokenSpan:
        """Every row, at the stream index of its oldest value not yet flushed (the in-step flush's chunk)."""
        return TokenSpan(self.all_rows, self.values_packed_count, self.state.tensors)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write new tokens [B, H, t, D] in place (keys in the method's space, values as they are) and return the
        static buffers: this layer's ``attend`` reads them (a prefill chunk, then flushes it; or the decode step)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.decoding:
            self._store_chunk(key_states, value_states)
            self.attending = self.keys
            return self.keys, self.values
        b = key_states.shape[0]
        at = self.cache_lengths.view(b, 1, 1, 1).expand(b, key_states.shape[1], 1, key_states.shape[3])
        key = key_states if self.fused_rotation else self.method.transform_key(key_states, self.layer_idx)
        self.keys.scatter_(2, at, key.to(self.dtype))  # rotated in place by attend's step_rotation when fused
        self.values.scatter_(2, at, value_states.to(self.dtype))
        if self.quantized:
            fill = self.key_window_fill.view(b, 1, 1, 1).expand_as(at)
            self.key_window.scatter_(2, fill, key_states.to(self.dtype))
        self.attending = self.keys  # the attention hook hands this layer the step's query (attend)
        return self.keys, self.values

    # -- prefill: chunks written in place, attended, then flushed by the policy --------------------
    def _store_chunk(self, keys: Tensor, values: Tensor) -> None:
        """A prefill chunk [B, H, t, D]: each group's real tokens (after its pads) at its stored count."""
        t = keys.shape[2]
        transformed = self.method.transform_key(keys, self.layer_idx).to(self.dtype)
        skips = []
        for g in self.groups:
            skip = g.skip_pads(t)
            skips.append(skip)
            at = g.tokens
            if at + t - skip > self.capacity:
                raise ValueError(f"a prompt of {at + t - skip} tokens does not fit the cache's {self.capacity}")
            self.keys[g.rows, :, at:at + t - skip] = transformed[g.rows, :, skip:]
            self.values[g.rows, :, at:at + t - skip] = values[g.rows, :, skip:].to(self.dtype)
        self.seq_len += t
        self._chunk = (keys, skips)

    def _prefill_attention(self, module, query: Tensor, scaling: float) -> Tensor:
        """The chunk's queries over each row's stored tokens (oscar.attention.stored_attention), then the flush."""
        keys, skips = self._chunk
        t = keys.shape[2]
        stored, new = [0] * len(self.pad_lengths), [0] * len(self.pad_lengths)
        for g, skip in zip(self.groups, skips):
            for row in g.members:
                stored[row], new[row] = g.tokens + t - skip, t - skip
        out = stored_attention(module, self.method.transform_query(query, self.layer_idx), self.keys, self.values,
                               stored, new, scaling, self.window)
        for g, skip in zip(self.groups, skips):
            if skip < t:
                self._flush_chunk(g, keys[g.rows, :, skip:].to(self.dtype))
        self._chunk = None
        return out

    def _flush_chunk(self, g: CountedRowGroup, raw_keys: Tensor) -> None:
        """The group's new tokens are in the buffers (raw keys [b, H, n, D] beside them): flush what the policy
        packs now, keep the raw keys of the window."""
        n = raw_keys.shape[2]
        g.keys_residual += n
        g.values_residual += n
        n_keys, n_values = g.due(self.policy)
        if not self.quantized:  # stored as they are: the policy only names the tokens "packed"
            g.count_packed(n_keys, n_values)
        else:
            window = torch.cat([self.key_window[g.rows, :, :g.keys_residual - n], raw_keys], dim=2)
            self._quantize_keys(g, window[:, :, :n_keys])
            self.key_window[g.rows, :, :g.keys_residual] = window[:, :, n_keys:]
            if n_values:
                self._flush_values(g, n_values)
        self.key_window_fill.index_fill_(0, g.rows, g.keys_residual)
        self.values_packed_count.index_fill_(0, g.rows, g.values_packed)

    def begin_decode(self, lengths: Tensor) -> None:
        """Host, once after the prefill: the step reads the rows' lengths from ``lengths`` (the cache's)."""
        if any(g.pads_left for g in self.groups):
            raise ValueError("the prompt's left padding was not consumed by the prefill")
        self.cache_lengths = lengths
        self.decoding = True

    # -- attention -------------------------------------------------------------------------------
    def attend(self, module, query: Tensor, attention_mask: Tensor, scaling: float) -> Tensor:
        """Attention over [mirror | recent]: query [B, Hq, t, D] as the model made it (the method's query transform
        is applied here) -> [B, t, Hq, D]. A prefill chunk: :func:`oscar.attention.stored_attention`, then the chunk
        is flushed. The decode step (t = 1): on a GPU in 16 bits, FlashAttention's variable-length kernel over each
        row's used tokens (``seqused_k``, grouped-query heads and sliding windows native, the keys split across
        blocks: as fast as attention over an unpadded cache, measured on the H200); elsewhere SDPA with the step's
        mask, the query heads of one KV head as the query rows of one call (no key or value repeated)."""
        if not self.decoding:
            return self._prefill_attention(module, query, scaling)
        if self.fused_rotation:
            query = self.step_rotation(query.to(self.dtype), self.keys, self.cache_lengths)
        else:
            query = self.method.transform_query(query, self.layer_idx)
        b, hq, _, d = query.shape
        hkv = self.keys.shape[1]
        if self.keys.is_cuda and self.dtype in (torch.bfloat16, torch.float16):
            used = (self.cache_lengths + 1).to(torch.int32)
            window = {} if self.window is None else dict(window_size_left=self.window - 1, window_size_right=0)
            out = torch.ops.aten._flash_attention_forward(
                query.reshape(b, hq, d).contiguous(), self.keys.transpose(1, 2).reshape(-1, hkv, d),
                self.values.transpose(1, 2).reshape(-1, hkv, d), self._cu_queries, self._cu_keys, 1, self.capacity,
                0.0, False, False, scale=scaling, seqused_k=used, **window)[0]
            return out.view(b, 1, hq, d)
        rows = query.reshape(b, hkv, hq // hkv, d)
        out = torch.nn.functional.scaled_dot_product_attention(rows, self.keys, self.values, attn_mask=attention_mask,
                                                               scale=scaling)
        return out.reshape(b, hq, 1, d).transpose(1, 2)

    # -- flushes -----------------------------------------------------------------------------------
    def finish_step(self) -> None:
        """Device: the ``kivi`` policy's value window slides by one token (rows whose window passed R)."""
        if not self.values_in_step:
            return
        b, h, _, d = self.values.shape
        due = (self.cache_lengths + 1 - self.values_packed_count) > self.method.residual_length  # [B]
        at = self.values_packed_count.view(b, 1, 1, 1)
        token = self.values.gather(2, at.expand(b, h, 1, d))
        packed = quantize_chunk(self.method.quantize_values, token, self.layer_idx, self._step_span())
        restored = self.method.dequantize(packed).to(self.dtype)
        self.values.scatter_(2, at.expand(b, h, 1, d), torch.where(due.view(b, 1, 1, 1), restored, token))
        for name, buf in packed.buffers.items():
            store = self.value_store[name]
            index = at.view(b, *([1] * (store.dim() - 1))).expand(*buf.shape)
            self.value_store[name].scatter_(2, index, buf)
        self.values_packed_count += due

    def advance(self) -> None:
        """Host: count the step's token, flush full key windows (and value windows the step did not)."""
        self.seq_len += 1
        self.key_window_fill += 1
        for g in self.groups:
            g.keys_residual += 1
            g.values_residual += 1
            n_keys, n_values = g.due(self.policy)
            if not self.quantized:  # stored as they are: the policy only names the tokens "packed"
                g.count_packed(n_keys, n_values)
                continue
            if n_keys:
                self._quantize_keys(g, self.key_window[g.rows, :, :n_keys])
                rest = self.key_window[g.rows, :, n_keys:n_keys + g.keys_residual]  # after the flushed ones
                self.key_window[g.rows, :, :g.keys_residual] = rest
                self.key_window_fill.index_fill_(0, g.rows, g.keys_residual)
            if n_values and self.values_in_step:  # flushed by finish_step: count it
                g.count_packed(0, n_values)
            elif n_values:
                self._flush_values(g, n_values)
        self.reset_parked()

    def _quantize_keys(self, g: CountedRowGroup, raw: Tensor) -> None:
        """The group's oldest unpacked keys, raw [b, H, n, D]: quantized, their dequantization into the mirror."""
        n = raw.shape[2]
        if n == 0:
            return
        span = TokenSpan(g.rows, g.keys_packed, self.state.tensors)
        chunk = quantize_chunk(self.method.quantize_keys, raw.contiguous(), self.layer_idx, span)
        self.keys[g.rows, :, g.keys_packed:g.keys_packed + n] = self.method.dequantize(chunk).to(self.dtype)
        g.key_chunks.append(chunk)
        g.count_packed(n, 0)

    def _flush_values(self, g: CountedRowGroup, n: int) -> None:
        start = g.values_packed
        raw = self.values[g.rows, :, start:start + n]
        span = TokenSpan(g.rows, start, self.state.tensors)
        chunk = quantize_chunk(self.method.quantize_values, raw, self.layer_idx, span)
        self.values[g.rows, :, start:start + n] = self.method.dequantize(chunk).to(self.dtype)
        g.value_chunks.append(chunk)
        g.count_packed(0, n)
        self.values_packed_count.index_fill_(0, g.rows, g.values_packed)

    # -- transformers API --------------------------------------------------------------------------
    def get_max_length(self) -> int:
        return self.capacity

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by the quantized KV cache (use greedy or sampling)")

    # -- introspection -----------------------------------------------------------------------------
    def static_tensors(self) -> list[Tensor]:
        return [self.keys, self.values, self.key_window, self.key_window_fill, self.values_packed_count,
                *self.value_store.values(), *self.state.tensors.values()]

    def token_counts(self) -> dict[str, int]:
        counts = dict(keys_packed=0, keys_residual=0, values_packed=0, values_residual=0)
        for g in self.groups:
            for name in counts:
                counts[name] += getattr(g, name) * len(g.rows)
        return counts

    @property
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        h, d = self.keys.shape[1], self.keys.shape[3]
        per_token = h * d * self.keys.element_size()  # one full-precision key or value token
        store = self.value_store
        # per token and row of the values flushed inside the step; kept-exact slots count only where the chunk
        # keeps a token (where the reference cache stores them: one-token chunks of the row group)
        in_step = sum(s[:1, :, :1].numel() * s.element_size() for n, s in store.items() if n not in EXACT_BUFFERS)
        exact_slot = sum(store[n][:1, :, :1].numel() * store[n].element_size() for n in EXACT_BUFFERS if n in store)
        total = 0
        for g in self.groups:
            rows = len(g.rows)
            total += sum(c.nbytes for c in g.key_chunks + g.value_chunks)
            # tokens outside the chunks: full precision, except the values flushed inside the step
            keys = g.keys_packed + g.keys_residual - sum(c.num_tokens for c in g.key_chunks)
            values = g.values_packed + g.values_residual - sum(c.num_tokens for c in g.value_chunks)
            in_step_tokens = values - g.values_residual if self.values_in_step else 0
            total += ((keys + values - in_step_tokens) * per_token + in_step_tokens * in_step) * rows
            if exact_slot and in_step_tokens:
                first = g.values_packed - in_step_tokens
                kept = (store["exact_pos"][g.rows, :, first:g.values_packed] >= 0).any(-1).any(1).any(0)
                total += int(kept.sum()) * exact_slot * rows
        return total

    @property
    def allocated_bytes(self) -> int:
        chunks = sum(c.nbytes for g in self.groups for c in g.key_chunks + g.value_chunks)
        return chunks + sum(t.numel() * t.element_size() for t in self.static_tensors())


class TorchStaticCache(StaticCache):
    """The torch backend's static cache (see the module docstring): any method, bit-identical numbers."""

    def __init__(self, method: KVMethod, num_layers: int, pad_lengths: list[int], capacity: int, device,
                 windows: list[int | None] | None = None, step_rotation: StepRotation | None = None):
        self.method = method
        windows = windows or [None] * num_layers
        layers = [TorchStaticLayer(method, i, pad_lengths, capacity, w, step_rotation) for i, w in enumerate(windows)]
        super().__init__(layers, pad_lengths, capacity, device, windows)

    @classmethod
    def for_model(cls, model, method: KVMethod, pad_lengths: list[int], capacity: int,
                  step_rotation: StepRotation | None = None) -> "TorchStaticCache":
        num_layers = model.config.get_text_config().num_hidden_layers
        device = next(model.parameters()).device
        return cls(method, num_layers, pad_lengths, capacity, device, sliding_windows(model), step_rotation)

    def finish_step(self) -> None:
        for layer in self.layers:
            layer.finish_step()
        super().finish_step()
