"""backend=cupy's cache layer: packed GPU storage read by the fused decode kernel, for every method with a kernel
variant (kernels.variant: OScaR, KIVI, QuaRot, TurboQuant+, OTT, RotateKV, OSCAR).

Per layer, keys and values each have a packed part (``kernels.ops.empty_storage`` of the method, in the kernels'
decode layouts, allocated for the batch's capacity and written in place) and a full-precision window
[B, H, rcap, D] of recent tokens (keys in the attention space: rotated for OScaR and QuaRot, by the layer's matrix
for OSCAR). What a method calls (its quantizers, its decode-attention keywords, the configurations its kernels take,
the tokens it keeps exactly) is its kernel variant (kernels/variants/<method>.py); nothing here names a method.
The layer's jobs sit in three modules: this one (the transformers API, attention and the step protocol),
kernels.cupy_flush (what is flushed when) and kernels.cupy_storage (allocation, counts, read-back, bytes).

Flush policies (``method.flush_policy``, oscar.flush), per row after T stored tokens, as ``oscar.cache`` keeps them:
keys packed k_p, values v_p (``kivi``: k_p = T - T mod R, v_p = max(0, T - R); ``block``: both T - T mod R;
``window``: both max(0, T - R)). Tokens are never re-quantized. The kernel takes one packed length per row,
P = min(k_p, v_p) rounded down to its stages (``ops.stage_tokens``), so the window holds tokens P..T-1: those
already packed as their dequantized values in the model dtype (what the torch path attends to), the others as they
came. For OScaR (block, R a multiple of G) P = k_p = v_p and the window holds unquantized tokens only.

Tokens kept exactly (OTT's outlier pool, RotateKV's attention sinks, OSCAR's first sink_tokens: the variant's ``kept``)
live in kernels.kept_tokens.KeptTokens: staged when their key is quantized, attended from there by the kernel once
P passes them (their packed copies skipped), from the window before; the window and every dequantization of packed
tokens hold them exact, as the torch path does. The methods' per-sequence state (``state``: OTT's pools that its key
flushes write, RotateKV's sinks that its prefill hook writes) is the layer's, as in oscar.cache.

Decoding (one query token) runs ``kernels.ops.decode_attention`` on the packed bytes; a prefill chunk (several query
tokens) attends in full precision over [stored tokens dequantized by the method | the chunk] exactly like the torch
path (oscar.attention.stored_attention: FlashAttention's variable-length kernel on the GPU), then is quantized into the
packed storage, so quantization affects decoding only (quantize_prefill=False) and a prompt prefilled in chunks is
never held in BF16 beyond one layer's chunk and the transient dequantization of its prefix (read straight from the
storage by the variant's dequantize kernel where it has one, KernelVariant.dequantize: bit for bit the method's
dequantize; by the method's dequantize of the reference layout for the others). Left-padded batches: pad
tokens are never stored; each row keeps its own counts, which the kernel takes as per-sequence lengths.

Two ways to drive the cache: the decode engine (oscar.engine) makes it with its capacity and runs the step protocol
of oscar.static_cache: in the step (a CUDA graph) ``update`` appends the token to the window, ``attend`` runs the
kernel and ``finish_step`` flushes the oldest unpacked token of each stream that leaves the window one token at a
time (the kivi policy's values, the window policy's keys and values) for each row whose window passed R (it puts
the token's dequantization in the window: one launch, ``ops.finish_step``); between steps ``advance`` quantizes
full key windows (and the ``block`` policy's values), moves the window when P passes a stage and, once per stage,
quantizes the stage's tokens of those streams and dequantizes them ahead of their flush (they are in the window a
stage before: R >= stage), with the kernel's split plan fixed by the capacity.
transformers' generate (multimodal prompts) uses a cache made by ``new_cache``, which grows by doubling and runs
the same flushes inside its own attention calls. fp16 runs on the torch backend's static mirror (dense BF16 and
FlashAttention), so ``backend=cupy method=fp16,oscar,kivi`` compares engine against engine.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kernels import ops
from kernels.cupy_flush import CupyFlushes
from kernels.cupy_storage import CupyStorage
from kernels.kept_tokens import KeptTokens
from kernels.variant import KERNELS, storage_granule
from oscar.attention import stored_attention
from oscar.cache import SeenTokensMixin, batch_mismatch
from oscar.method import KVMethod, SequenceState, TokenSpan
from oscar.row_slots import SlotLayer
from oscar.transfer import device_ints


class CupyKVLayer(SlotLayer, CupyFlushes, CupyStorage, SeenTokensMixin, CacheLayerMixin):
    """One decoder layer: packed keys/values on the GPU plus a full-precision window per row (module docstring).

    Host counts per row: ``tokens`` (T), ``keys_packed``, ``values_packed``, ``n_packed`` (P, what the kernel
    reads packed) and ``n_res`` (T - P, what it reads from the window); the kernel's copies live on the device.
    ``engine``: driven by the decode engine (flushes in ``finish_step``/``advance``, kernel splits planned for
    ``capacity``); otherwise it flushes inside its own calls and grows its storage by doubling. ``state``: the
    method's per-sequence state (OTT's pools, RotateKV's sinks: oscar.method.SequenceState); ``kept``: the tokens
    kept exactly (kernels.kept_tokens.KeptTokens) of the methods that keep some.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, method: KVMethod, layer_idx: int, pad_lengths: list[int] | None = None, capacity: int = 0,
                 engine: bool = False):
        super().__init__()
        self.method = method
        self.kernels = KERNELS[method.name]
        self.layer_idx = layer_idx
        self.capacity = capacity
        self.engine = engine
        r = method.residual_length
        self.policy = method.flush_policy
        self.stage = ops.stage_tokens(self.kernels.kernel, method.group_size)
        #: the streams that leave the window one token per step, on the device (finish_step): the values of the
        #: kivi policy, keys and values of the window policy
        self.in_step = tuple(s for s, slides in (("keys", self.policy.keys_slide),
                                                 ("values", self.policy.values_slide)) if slides)
        #: tokens a window holds at most: R (+ 1 stage where packed tokens wait in it for P to pass a stage)
        self.window = r if not self.in_step and r and r % self.stage == 0 else r + self.stage
        self.state = SequenceState(method)  # kept across batches (reset in place): the captured step reads it
        self.kept: KeptTokens | None = None
        self.reset_rows(pad_lengths)

    def reset_rows(self, pad_lengths: list[int] | None) -> None:
        """A new batch in the same storage (the engine reuses a slot's cache)."""
        self.pad_lengths = pad_lengths
        self.seq_len = 0
        self.decoding = False
        self.attending = None
        self._chunk: tuple[Tensor, Tensor] | None = None  # a prefill chunk between update and attend
        self.parked, self._parked_index = (), None
        self.state.reset()
        if self.is_initialized:
            self._reset_counts()

    def _reset_counts(self) -> None:
        b = self.batch
        self.pads_left = list(self.pad_lengths) if self.pad_lengths is not None else [0] * b
        if len(self.pads_left) != b:
            raise ValueError(batch_mismatch(len(self.pads_left), b))
        self.tokens, self.keys_packed, self.values_packed = [0] * b, [0] * b, [0] * b
        self.n_packed = [0] * b
        self.prepared = {stream: [-1] * b for stream in self.in_step}  # the P whose stage was prepared
        if self.kept is not None:
            self.kept.reset()
        self.live_dev.fill_(1)
        self._sync_counts()

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        m = self.method
        self.device, self.dtype = key_states.device, key_states.dtype
        b, h, _, d = key_states.shape
        self.batch, self.heads, self.head_dim = b, h, d
        self.group_size = self.kernels.group(m, d)
        self.key_residual = torch.zeros(b, h, self.window, d, dtype=self.dtype, device=self.device)
        self.value_residual = torch.zeros(b, h, self.window, d, dtype=self.dtype, device=self.device)
        # the counts the kernels read, rows of one tensor: the host's counts reach them in one copy (_sync_counts)
        self.counts_dev = torch.zeros(4, b, dtype=torch.int32, device=self.device)
        self.n_packed_dev, self.n_res_dev, self.keys_packed_dev, self.values_packed_dev = self.counts_dev.unbind(0)
        #: 1 for a row that holds a sample, 0 for a parked one (oscar.row_slots): the step's window fill grows by it,
        #: so a parked row's counts stay zero on the device with no copy from the host
        self.live_dev = torch.ones(b, dtype=torch.int32, device=self.device)
        #: the next tokens of each in-step stream to flush (window indices 0 .. stage), dequantized ahead of time
        self.restored = {stream: torch.zeros(b, h, self.stage, d, dtype=self.dtype, device=self.device)
                         for stream in self.in_step}
        self.state.allocate(b, h, self.device)
        # the layouts method.dequantize reads (what the method's own quantizers return); a fresh state and fixed
        # shapes: no host read of a kept count at every layer's set-up
        probe = torch.ones(1, h, m.group_size, d, dtype=self.dtype, device=self.device)
        span = TokenSpan(torch.zeros(1, dtype=torch.long, device=self.device), 0, m.new_state(1, h, self.device),
                         fixed_shapes=True)
        self.key_like = self.kernels.own_quantizer(m, "keys")(probe, self.layer_idx, span)
        self.value_like = self.kernels.own_quantizer(m, "values")(probe, self.layer_idx, span)
        granule = storage_granule(m)
        self.keys_store = None
        self._allocate(max(granule, math.ceil(self.capacity / granule) * granule))
        if self.kernels.exact:
            self.kept = KeptTokens(b, h, self.kernels.slots(m), d, self.capacity, self.dtype, self.device)
            self._allocated_bytes = None  # the kept tokens' buffers count too
        self.is_initialized = True
        self._reset_counts()

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store new tokens [B, H, t, D]; this layer's ``attend`` then computes their attention. One decode token
        goes to the window (the kernel reads the packed storage and the window); a prefill chunk (keys in the
        attention space) waits for ``attend``, which attends it over the stored tokens and then flushes it. Returns
        the tokens as the attention space holds them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        if self.decoding or (not self.engine and t == 1 and not any(self.pads_left)):
            if self.kernels.transforms:  # one token: the variant's decode-step transform (OSCAR's: one launch)
                key_states = self.kernels.transform_token(self.method, key_states, self.layer_idx)
            ops.append_residual(key_states, value_states, self.key_residual, self.value_residual, self.n_res_dev,
                                self.live_dev, rotate=self.kernels.rotated_keys)  # n_res += live in the launch
            self.attending = key_states
            self._chunk = None
            return key_states, value_states
        if self.kernels.transforms:
            key_states = self.method.transform_key(key_states, self.layer_idx)
        keys = ops.hadamard(key_states) if self.kernels.rotated_keys else key_states
        self._chunk = (keys, value_states)
        self.seq_len += t
        self.attending = keys
        return keys, value_states

    def attend(self, module, query: Tensor, attention_mask, scaling: float) -> Tensor:
        """Attention of the tokens ``update`` was given: query [B, Hq, t, D] as the model made it -> [B, t, Hq, D].

        A prefill chunk: :func:`oscar.attention.stored_attention` over each row's stored tokens as the torch path
        attends them (the packed ones dequantized by the method into a transient buffer of this layer, the window,
        then the chunk in full precision), then the chunk is flushed into the packed storage; the prompt's K/V are
        never held beyond one layer's chunk and its transient. The decode step: the fused kernel over the packed
        storage, the exact tokens and the window (it applies OScaR's and QuaRot's query transform; OSCAR's runs
        first, the variant's transform_token). Under the engine the kernel's split plan covers the whole capacity
        (fixed across steps, so the step can be replayed); otherwise the longest stored row, and the step's flushes
        follow."""
        if self._chunk is not None:
            return self._prefill_attention(module, query, scaling)
        m = self.method
        if self.kernels.transforms:
            query = self.kernels.transform_token(m, query, self.layer_idx)
        max_packed = self.capacity if self.engine else max(self.n_packed)
        exact = {} if self.kept is None else dict(exact=self.kept.buffers)
        out = ops.decode_attention(query, self.keys_store, self.values_store, self.key_residual, self.value_residual,
                                   self.n_packed_dev, self.n_res_dev, k_bits=m.k_bits, v_bits=m.v_bits,
                                   group_size=self.group_size, scaling=scaling, max_packed=max_packed,
                                   **self.attention_kwargs, **exact)
        if not self.engine:
            self.finish_step()
            self.advance()
        return out.transpose(1, 2)

    def _prefill_attention(self, module, query: Tensor, scaling: float) -> Tensor:
        keys, values = self._chunk
        self._chunk = None
        t = keys.shape[2]
        new = [t - min(pads, t) for pads in self.pads_left]
        stored = [tokens + n for tokens, n in zip(self.tokens, new)]
        stored_keys, stored_values = self._stored_tokens(keys, values, new, max(stored))
        # the query in the keys' space: H_D by the kernel (bit for bit oscar.quant.hadamard) where the keys are
        # rotated so, else the method's own transform
        query = ops.hadamard(query) if self.kernels.rotated_keys else self.method.transform_query(query,
                                                                                                   self.layer_idx)
        out = stored_attention(module, query, stored_keys, stored_values, stored, new, scaling)
        self._append_prefill(keys, values)
        return out

    def _stored_tokens(self, keys: Tensor, values: Tensor, new: list[int], width: int) -> tuple[Tensor, Tensor]:
        """Each row's stored tokens followed by the chunk's real ones, as the torch path attends them: [B, H, width,
        D] views of token-major [B, width, H, D] buffers (FlashAttention's layout), row b's tokens from index 0
        (the packed ones dequantized by the method, their kept tokens exact, rows with one packed count sharing the
        calls)."""
        b, h, t, d = keys.shape
        counts = [tokens + n for tokens, n in zip(self.tokens, new)]
        make = torch.empty if min(counts) == width else torch.zeros  # no stale values past a shorter row
        out_k = make(b, width, h, d, dtype=self.dtype, device=self.device).transpose(1, 2)
        out_v = make(b, width, h, d, dtype=self.dtype, device=self.device).transpose(1, 2)
        by_packed: dict[int, list[int]] = {}
        for i, p in enumerate(self.n_packed):
            by_packed.setdefault(p, []).append(i)
        for p, members in by_packed.items():
            if not p:
                continue
            idx = None if len(members) == b else device_ints(members, self.device, torch.long)
            for stream, buf in (("keys", out_k), ("values", out_v)):
                if idx is None:  # every row: straight into the buffer
                    self._dequantized(stream, members, [0] * b, p, out=buf[:, :, :p])
                else:
                    buf[idx, :, :p] = self._dequantized(stream, members, [0] * len(members), p)
        for i, (tokens, p, n) in enumerate(zip(self.tokens, self.n_packed, new)):
            out_k[i, :, p:tokens] = self.key_residual[i, :, :tokens - p]
            out_v[i, :, p:tokens] = self.value_residual[i, :, :tokens - p]
            out_k[i, :, tokens:tokens + n] = keys[i, :, t - n:]
            out_v[i, :, tokens:tokens + n] = values[i, :, t - n:]
        return out_k, out_v

    def reset(self) -> None:
        self.reset_rows(self.pad_lengths)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by the quantized KV cache (use greedy or sampling)")

    def begin_decode(self, lengths: Tensor) -> None:
        """Host, once after the prefill (the kernel takes its lengths from the layer's own counts)."""
        if any(self.pads_left):
            raise ValueError("the prompt's left padding was not consumed by the prefill")
        self.decoding = True

    def finish_step(self) -> None:
        """Device, after the step's attention: each in-step stream keeps exactly R tokens unpacked (the ``kivi``
        policy's values, the ``window`` policy's keys and values). Each row whose window passed R gets its oldest
        unpacked token of the stream (window index packed - P) replaced by its dequantization, which ``_prepare``
        computed (and whose bytes it stored) when the token's stage filled; the stream's packed count advances.
        One launch for every stream (``ops.finish_step``)."""
        if self.in_step:
            ops.finish_step({stream: self._window_of(stream) for stream in self.in_step}, self.restored,
                            self.counts_dev, self.method.residual_length)

    def advance(self) -> None:
        """Host, between steps: count the step's token; rows whose keys fill a window (or whose P passes a stage)
        are flushed and their windows moved; a stage of the in-step streams that filled is prepared."""
        self.seq_len += 1
        parked = set(self.parked)  # released rows (oscar.row_slots): their counts stay at zero
        self.tokens = [t + (i not in parked) for i, t in enumerate(self.tokens)]
        due = []
        for i, t in enumerate(self.tokens):
            if i in parked:
                continue
            keys, values = self.policy.packed(t)
            if "keys" in self.in_step:  # flushed on the device: count them
                self.keys_packed[i] = keys
            if "values" in self.in_step:
                self.values_packed[i] = values
            moved = keys != self.keys_packed[i] or values != self.values_packed[i]
            if moved or self._packed_prefix(t) != self.n_packed[i]:
                due.append(i)
        if due:
            self._settle(due)
        self._prepare(range(self.batch))
        if due:
            self._sync_counts()

    # -- rows as slots (oscar.row_slots) ----------------------------------------------------------
    def initialize_like(self, source: "CupyKVLayer", batch: int) -> None:
        like = torch.zeros(batch, source.heads, 1, source.head_dim, dtype=source.dtype, device=source.device)
        self.lazy_initialization(like, like)

    def release_rows(self, rows: list[int]) -> None:
        """Park ``rows``: their host counts (and the device copies the kernels read) back to zero, and kept there: the
        step no longer counts their tokens (``live_dev``)."""
        self._park(rows)
        if not self.is_initialized:
            return
        for i in rows:
            self.tokens[i] = self.keys_packed[i] = self.values_packed[i] = self.n_packed[i] = self.pads_left[i] = 0
            for stream in self.in_step:
                self.prepared[stream][i] = -1
        # index_fill_, not an indexed assignment (which waits for the GPU); adopt copies the source row's 1 back
        self.live_dev.index_fill_(0, device_ints(rows, self.device, torch.long), 0)
        self._sync_counts()

    def adopt_rows(self, rows: list[int], source: "CupyKVLayer", source_rows: list[int]) -> None:
        """``source_rows`` of ``source`` (a layer of the same layout) into ``rows``: static tensors and host counts."""
        self._copy_rows(rows, source, source_rows)
        for i, j in zip(rows, source_rows):
            self.tokens[i], self.keys_packed[i], self.values_packed[i] = (source.tokens[j], source.keys_packed[j],
                                                                          source.values_packed[j])
            self.n_packed[i], self.pads_left[i] = source.n_packed[j], 0
            for stream in self.in_step:
                self.prepared[stream][i] = source.prepared[stream][j]
        self._sync_counts()
