"""The quantized KV cache: a transformers 5.x ``Cache`` whose layers store packed K/V.

Each layer keeps, for keys and for values, a packed (quantized) part and a full-precision
residual window of the most recent tokens, and flushes the window into the packed part by the
method's policy (``oscar.flush``: ``kivi``, ``block``, ``window``; what is packed after T tokens).

Already-quantized tokens are never re-quantized. What attention sees:

- ``quantize_prefill=False`` (default, as in KIVI / OScaR): the tokens of the current call in full
  precision plus the older tokens as stored; the flush happens after (the KIVI convention).
  Prefill attention is therefore unquantized and quantization affects decoding only.
- ``quantize_prefill=True``: exactly what is stored after the flush (perplexity needs this).

The dequantized mirror (``mirror=True``): each stream also keeps what ``method.dequantize`` returns for
its packed part, filled once per flush with the new chunk alone (stored tokens are never re-quantized, so
it only grows), and attention reads [mirror | residual] instead of dequantizing the whole packed part at
every step. The numbers are the same bit for bit (tests/test_engine.py); memory figures (``nbytes``) still
come from the packed buffers alone, ``allocated_bytes`` adds the mirror.

Per-sequence method state (OTT's outlier pools, RotateKV's sinks): each layer owns one
``oscar.method.SequenceState`` for its batch and hands it, with the chunk's rows and stream index, to every
quantize call (``TokenSpan``); ``sequence_state(layer_idx)`` finds it (RotateKV's prefill hook writes there).

Left-padded batches: pad tokens are never stored. Rows are grouped by pad length (oscar.row_groups) and each group
keeps its own storage, so per-channel token groups start at every sample's first real token and a
sample gives the same result alone or inside a padded batch. Positions of pads in the returned
tensors are zeros (the attention mask hides them).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar.attention import check_prepared
from oscar.method import KVMethod, SequenceState, TokenSpan
from oscar.quant import PackedTensor
from oscar.row_groups import RowGroup


@dataclass
class _Stream:
    """Keys or values of one group of batch rows: packed part + full-precision residual window."""

    packed: PackedTensor | None = None
    residual: Tensor | None = None  # [b, H, r, D], model dtype, untransformed
    mirror: Tensor | None = None  # [b, H, num_packed, D]: method.dequantize(packed), when the cache keeps one

    @property
    def num_packed(self) -> int:
        return 0 if self.packed is None else self.packed.num_tokens

    @property
    def num_residual(self) -> int:
        return 0 if self.residual is None else self.residual.shape[2]

    @property
    def nbytes(self) -> int:
        res = 0 if self.residual is None else self.residual.numel() * self.residual.element_size()
        return res + (0 if self.packed is None else self.packed.nbytes)


@dataclass
class _StreamRowGroup(RowGroup):
    """A row group (oscar.row_groups) of the reference cache, with its key and value streams."""

    keys: _Stream = field(default_factory=_Stream)
    values: _Stream = field(default_factory=_Stream)


class SeenTokensMixin:
    """transformers' length queries of a cache layer that counts the tokens it has seen in ``seq_len`` (pads
    included: transformers' convention for left-padded batches); no fixed maximum unless the layer has one."""

    seq_len: int

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1


class QuantizedKVLayer(SeenTokensMixin, CacheLayerMixin):
    """One decoder layer's quantized K/V (see the module docstring for the policies)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, method: KVMethod, layer_idx: int, quantize_prefill: bool = False,
                 pad_lengths: list[int] | None = None, mirror: bool = False, state: SequenceState | None = None):
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self.quantize_prefill = quantize_prefill
        self.pad_lengths = pad_lengths
        self.mirror = mirror
        self.state = state if state is not None else SequenceState(method)  # the method's per-sequence state
        self.seq_len = 0
        self.groups: list[_StreamRowGroup] = []

    # -- transformers API ---------------------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        batch = key_states.shape[0]
        pads = self.pad_lengths if self.pad_lengths is not None else [0] * batch
        if len(pads) != batch:
            raise ValueError(batch_mismatch(len(pads), batch))
        self.groups = _StreamRowGroup.by_pad_length(pads, self.device)
        self.state.allocate(batch, key_states.shape[1], self.device)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store new tokens [B, H, T, D]; return the keys/values attention uses, [B, H, seq_len, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seq_len += key_states.shape[2]
        single = len(self.groups) == 1 and self.groups[0].pads_left == 0
        outputs = []
        for group in self.groups:
            if single:
                k, v = key_states, value_states
            else:
                skip = group.skip_pads(key_states.shape[2])
                k, v = key_states[group.rows, :, skip:], value_states[group.rows, :, skip:]
            if self.quantize_prefill:
                self._append(group, k, v)
                outputs.append((self._attention_keys(group.keys), self._attention_values(group.values)))
            else:
                old_k, old_v = self._attention_keys(group.keys), self._attention_values(group.values)
                new_k = self.method.transform_key(k, self.layer_idx)
                outputs.append((_cat(old_k, new_k), _cat(old_v, v)))
                self._append(group, k, v)
        if single:
            return outputs[0]
        return (self._scatter([k for k, _ in outputs], key_states),
                self._scatter([v for _, v in outputs], value_states))

    def reset(self) -> None:
        self.seq_len = 0
        self.groups = []
        self.state.reset()
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by the quantized KV cache (use greedy or sampling)")

    # -- storage ------------------------------------------------------------------------------
    def _append(self, group: _StreamRowGroup, k: Tensor, v: Tensor) -> None:
        group.keys.residual = _cat(group.keys.residual, k)
        group.values.residual = _cat(group.values.residual, v)
        keys, values = self.method.flush_policy.packed(group.keys.num_packed + group.keys.num_residual)
        self._flush(group, group.keys, keys - group.keys.num_packed, self.method.quantize_keys)
        self._flush(group, group.values, values - group.values.num_packed, self.method.quantize_values)

    def _flush(self, group: _StreamRowGroup, stream: _Stream, n: int, quantize) -> None:
        """Quantize the oldest n residual tokens and append them to the packed part."""
        if n <= 0 or stream.residual is None:
            return
        tokens = stream.residual[:, :, :n].contiguous()
        span = TokenSpan(group.rows, stream.num_packed, self.state.tensors)
        chunk = quantize_chunk(quantize, tokens, self.layer_idx, span)
        stream.packed = chunk if stream.packed is None else PackedTensor.cat([stream.packed, chunk])
        stream.residual = stream.residual[:, :, n:]
        if self.mirror:
            stream.mirror = _cat(stream.mirror, self.method.dequantize(chunk))

    def _dequantized(self, stream: _Stream) -> Tensor | None:
        if stream.packed is None:
            return None
        return stream.mirror if self.mirror else self.method.dequantize(stream.packed)

    def _attention_keys(self, stream: _Stream) -> Tensor | None:
        residual = None if stream.residual is None else self.method.transform_key(stream.residual, self.layer_idx)
        return _cat(self._dequantized(stream), residual)

    def _attention_values(self, stream: _Stream) -> Tensor | None:
        return _cat(self._dequantized(stream), stream.residual)

    def _scatter(self, per_group: list[Tensor | None], like: Tensor) -> Tensor:
        """Right-align each group's tokens in a [B, H, seq_len, D] tensor of zeros (pads on the left)."""
        b, h, _, d = like.shape
        out = torch.zeros(b, h, self.seq_len, d, dtype=like.dtype, device=like.device)
        for group, x in zip(self.groups, per_group):
            if x is not None and x.shape[2]:
                out[group.rows, :, self.seq_len - x.shape[2]:] = x.to(like.dtype)
        return out

    # -- introspection ------------------------------------------------------------------------
    def token_counts(self) -> dict[str, int]:
        """Tokens per storage kind, summed over row groups (one count per sequence)."""
        counts = dict(keys_packed=0, keys_residual=0, values_packed=0, values_residual=0)
        for g in self.groups:
            rows = len(g.rows)
            counts["keys_packed"] += g.keys.num_packed * rows
            counts["keys_residual"] += g.keys.num_residual * rows
            counts["values_packed"] += g.values.num_packed * rows
            counts["values_residual"] += g.values.num_residual * rows
        return counts

    @property
    def nbytes(self) -> int:
        return sum(g.keys.nbytes + g.values.nbytes for g in self.groups)

    @property
    def allocated_bytes(self) -> int:
        """What the layer holds: ``nbytes`` plus the dequantized mirror."""
        mirrors = [s.mirror for g in self.groups for s in (g.keys, g.values) if s.mirror is not None]
        return self.nbytes + sum(m.numel() * m.element_size() for m in mirrors)


def quantize_chunk(quantize: Callable[..., PackedTensor], tokens: Tensor, layer_idx: int,
                   span: TokenSpan) -> PackedTensor:
    """``quantize`` (the method's quantize_keys or quantize_values) of a chunk [b, H, n, D] at ``span``; the result
    carries the span's start."""
    return replace(quantize(tokens, layer_idx, span=span), start=span.start)


def _cat(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None or a.shape[2] == 0:
        return b
    if b is None or b.shape[2] == 0:
        return a
    return torch.cat([a, b.to(a.dtype)], dim=2)


def cache_keyword(model) -> str:
    """The forward/generate keyword of a cache: ``cache`` since transformers 5.2x, ``past_key_values`` before (where
    ``cache=`` would be silently ignored and the model would build its own cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_argument(model, cache) -> dict:
    """The forward/generate keywords that hand ``model`` a cache (:func:`cache_keyword`)."""
    return {cache_keyword(model): cache, "use_cache": True}


def batch_mismatch(made: int, sent: int) -> str:
    """The error of a forward of ``sent`` rows into a cache made for ``made``."""
    def rows(n: int) -> str:
        return f"{n} row{'' if n == 1 else 's'}"

    return (f"the cache was made for a batch of {rows(made)} and the forward sends {rows(sent)}: make one cache per "
            "batch from its own inputs. (generate's num_return_sequences and num_beams repeat each prompt's row: for "
            "several samples per prompt make the cache from the repeated batch, or pass no cache, and one is made per "
            "forward; beam search is not supported)")


def left_pad_lengths(attention_mask: Tensor) -> list[int]:
    """Leading zeros per row of a [B, T] attention mask; raises unless the padding is on the left."""
    mask = attention_mask.bool()
    pads = (~mask).int().cumprod(-1).sum(-1)
    real = mask.sum(-1)
    if not torch.equal(pads + real, torch.full_like(pads, mask.shape[-1])):
        raise ValueError("the quantized cache needs left padding (tokenizer.padding_side = 'left')")
    return pads.tolist()


class CacheStorageMixin:
    """What the project's caches (:class:`QuantizedKVCache`, oscar.static_cache.StaticCache and its subclasses)
    report about their storage, read from their ``layers``: each layer has ``nbytes``, ``allocated_bytes`` and
    ``token_counts()`` (and ``state``, its :class:`SequenceState`); the cache sums the bytes over its layers and
    hands one layer's token counts and state. A layer whose bytes are partly counted on the device has
    ``stored_bytes()`` too (the host's part, the device's as a 0-dim tensor or None): the cache reads those once per
    device, not once per layer (a continuous batch reads ``nbytes`` each time a sample ends)."""

    @property
    def nbytes(self) -> int:
        """Real stored bytes: packed buffers plus full-precision residual windows, all layers."""
        total, on_device = 0, {}
        for layer in self.layers:
            if not hasattr(layer, "stored_bytes"):
                total += layer.nbytes
                continue
            counted, kept = layer.stored_bytes()
            total += counted
            if kept is not None:
                on_device.setdefault(kept.device, []).append(kept)
        return total + sum(int(torch.stack(parts).sum()) for parts in on_device.values())

    @property
    def allocated_bytes(self) -> int:
        """Bytes the storage holds: ``nbytes`` plus what a layer keeps beside it (a mirror, spare capacity)."""
        return sum(layer.allocated_bytes for layer in self.layers)

    def token_counts(self, layer_idx: int = 0) -> dict[str, int]:
        return self.layers[layer_idx].token_counts()

    def sequence_state(self, layer_idx: int) -> SequenceState | None:
        """The method's per-sequence state of layer ``layer_idx`` (oscar.method.layer_state)."""
        return getattr(self.layers[layer_idx], "state", None)


class QuantizedKVCache(CacheStorageMixin, Cache):
    """A transformers Cache that stores every layer's K/V through a KV method, for one batch.

    Only correct on a model prepared for that method object (its weights folded, its attention routed through the
    method: ``oscar.apply`` or ``KVModel`` do it), which the first forward checks (oscar.attention.check_prepared).
    Make caches from the model's preparation, one per batch: ``with oscar.apply(model, method) as make_cache:
    model.generate(**inputs, cache=make_cache(inputs))``, or ``KVModel.new_cache``.
    """

    def __init__(self, method: KVMethod, num_layers: int, quantize_prefill: bool = False,
                 pad_lengths: list[int] | None = None, mirror: bool = False, model=None):
        self.method = method
        self.quantize_prefill = quantize_prefill
        self.mirror = mirror
        self.pad_lengths = pad_lengths
        self._model = None if model is None else weakref.ref(model)  # checked at the first forward, never kept alive
        self._checked = False
        super().__init__(layers=[QuantizedKVLayer(method, i, quantize_prefill, pad_lengths, mirror)
                                 for i in range(num_layers)])

    @classmethod
    def for_model(cls, model, method: KVMethod, attention_mask: Tensor | None = None,
                  quantize_prefill: bool = False, mirror: bool = False) -> "QuantizedKVCache":
        """A cache of ``method`` for ``model`` and the batch of ``attention_mask`` [B, T] (left padding; None: no
        padding)."""
        num_layers = model.config.get_text_config().num_hidden_layers
        pads = None if attention_mask is None else left_pad_lengths(attention_mask)
        return cls(method, num_layers, quantize_prefill, pads, mirror, model)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if not self._checked:  # the first forward: the model must be prepared for this method object
            check_prepared(None if self._model is None else self._model(), self.method)
            self._checked = True
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def _is_user_defined(self) -> bool:
        """transformers' generate sets this on the cache it is handed, at the start of each call: a cache that
        already holds tokens then is refused (it would silently continue an earlier sequence with another prompt's
        tail)."""
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if value and self.get_seq_length() > 0:
            raise ValueError(f"this cache holds {self.get_seq_length()} tokens of an earlier generate call: make one "
                             "cache per call (make_cache(inputs)), a conversation's turns in one prompt")
        self.__dict__["_user_defined"] = value

    def check_batch(self, attention_mask: Tensor | None, new_tokens: int) -> None:
        """Raise ValueError unless a forward of ``new_tokens`` tokens per row under ``attention_mask`` [B, T] (None:
        not known) continues this cache: at the first forward, the mask's left padding is the one the cache was made
        for; after it, the mask covers the tokens stored and the new ones (a cache serves one generate call)."""
        if attention_mask is None:
            return
        stored = self.get_seq_length()
        if self.pad_lengths is not None and len(self.pad_lengths) != attention_mask.shape[0]:
            raise ValueError(batch_mismatch(len(self.pad_lengths), attention_mask.shape[0]))
        if stored == 0:
            pads = left_pad_lengths(attention_mask)
            made = self.pad_lengths if self.pad_lengths is not None else [0] * len(pads)
            if pads != made:
                raise ValueError(f"this cache was made for a batch padded {made}, the forward's attention mask pads "
                                 f"{pads}: make one cache per batch from its attention mask (make_cache(inputs))")
        elif attention_mask.shape[-1] != stored + new_tokens:
            raise ValueError(f"this cache holds {stored} tokens of an earlier sequence, and the forward's attention "
                             f"mask covers {attention_mask.shape[-1]} tokens with {new_tokens} new: a fresh cache per "
                             "generate call (make_cache(inputs))")

