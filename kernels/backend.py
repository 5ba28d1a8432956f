"""backend=cupy: OScaR's cache as real packed GPU tensors, decode attention through the fused kernel.

Per layer, keys and values each have a packed part (``kernels.ops`` storage in the kernels' decode layouts,
allocated for the batch's capacity and written in place) and a full-precision residual window of up to R
tokens (keys stored already rotated); a window that reaches R tokens is quantized by the kernels and
appended, never re-quantized (OScaR's ``block`` policy).
Decoding (one query token) runs ``kernels.ops.decode_attention`` on the packed bytes; prefill (several query
tokens) attends in full precision over [stored tokens dequantized by the reference | new tokens] exactly like
the torch path, so quantization affects decoding only (quantize_prefill=False).

Left-padded batches: pad tokens are never stored; each row keeps its own token counts, which the kernel
takes as per-sequence lengths.

Two ways to drive the cache: the decode engine (oscar.engine) makes it with its capacity and runs the step
protocol of oscar.static_cache (the residual append and the attention in the step, the flushes in
``advance`` between steps, the kernel's split plan fixed by the capacity so the step can be a CUDA graph);
transformers' generate (multimodal prompts) uses a cache made by ``new_cache``, which grows by doubling and
flushes inside its own update/attention calls. fp16 runs on the torch backend's static mirror (dense BF16
and SDPA), so ``backend=cupy method=fp16,oscar`` compares engine against engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kernels import ops
from oscar.attention import bind_cache
from oscar.backend import Backend, register_backend
from oscar.cache import QuantizedKVCache, left_pad_lengths
from oscar.method import KVMethod
from oscar.quant import PackedTensor, dequantize_groups
from oscar.static_cache import MirrorCache, StaticCache, sliding_windows


def missing(method: KVMethod) -> list[str]:
    """What of this method configuration the fused kernels do not implement."""
    if method.name == "fp16":
        return []  # the static BF16 mirror, no kernel
    if method.name != "oscar":
        return [f"method={method.name}"]
    problems = []
    if not (method.rotate and method.scale and method.norm_scope == "token" and method.zero_point == "int"
            and method.rotate_values):
        problems.append("an OScaR ablation (rotate/scale/norm_scope/zero_point/rotate_values)")
    if method.flush != "block":
        problems.append(f"flush={method.flush}")
    if method.k_bits not in ops.SUPPORTED_BITS or method.v_bits not in ops.SUPPORTED_BITS:
        problems.append(f"k_bits={method.k_bits}, v_bits={method.v_bits} (the kernels pack {ops.SUPPORTED_BITS})")
    if (method.residual_length < method.group_size or method.group_size % 16 or method.group_size > 128
            or method.group_size * method.v_bits % 64):
        problems.append(f"residual_length={method.residual_length}, group_size={method.group_size} (G a multiple "
                        "of 16 up to 128 with G * v_bits a multiple of 64, R >= G)")
    return problems


@register_backend("cupy")
@dataclass
class CupyBackend(Backend):
    """Fused CUDA kernels on packed storage (OScaR); fp16 on the static BF16 mirror."""

    def missing(self, method: KVMethod) -> list[str]:
        return missing(method)

    def check_model(self, config) -> None:
        text = config.get_text_config()
        if any(kind == "sliding_attention" for kind in getattr(text, "layer_types", None) or []):
            raise ValueError("backend=cupy: the decode kernel attends over every stored token and has no "
                             "sliding-window layers; use backend=torch for this model")
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if head_dim not in ops.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"backend=cupy: head_dim {head_dim} is not one of {ops.SUPPORTED_HEAD_DIMS}")

    def check_available(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("backend=cupy needs a CUDA GPU; use backend=torch on this machine")
        ops._cupy()

    def new_cache(self, model, method, attention_mask=None, quantize_prefill=False):
        if method.name == "fp16":
            return QuantizedKVCache.for_model(model, method, attention_mask, quantize_prefill)
        if quantize_prefill:
            raise ValueError("backend=cupy quantizes decode tokens only (quantize_prefill=false); use backend=torch")
        pads = None if attention_mask is None else left_pad_lengths(attention_mask)
        return CupyKVCache.for_model(model, method, pads)

    def static_cache(self, model, method, pad_lengths, capacity) -> StaticCache:
        if method.name == "fp16":
            return MirrorCache.for_model(model, method, pad_lengths, capacity)
        return CupyKVCache.for_model(model, method, pad_lengths, capacity, engine=True)

    def capacity_multiple(self, method: KVMethod) -> int:
        return max(method.residual_length, method.group_size, 16)  # whole windows, groups and value tiles


def check_method(method: KVMethod) -> None:
    """Raise ValueError unless the fused kernels implement this method configuration."""
    CupyBackend().check(method)


class CupyKVLayer(CacheLayerMixin):
    """One decoder layer: packed keys/values on the GPU plus a full-precision residual window per row.

    ``engine``: driven by the decode engine (flushes in ``advance``, kernel splits planned for ``capacity``);
    otherwise it flushes inside its own calls and grows its storage by doubling.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, method: KVMethod, layer_idx: int, pad_lengths: list[int] | None = None, capacity: int = 0,
                 engine: bool = False):
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self.capacity = capacity
        self.engine = engine
        self.reset_rows(pad_lengths)

    def reset_rows(self, pad_lengths: list[int] | None) -> None:
        """A new batch in the same storage (the engine reuses a slot's cache)."""
        self.pad_lengths = pad_lengths
        self.seq_len = 0
        self.decoding = False
        self.attending = None
        if self.is_initialized:
            self.pads_left = list(pad_lengths) if pad_lengths is not None else [0] * self.batch
            self.n_packed = [0] * self.batch
            self.n_res = [0] * self.batch
            self._sync_counts()

    # -- transformers API ---------------------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        m = self.method
        self.device, self.dtype = key_states.device, key_states.dtype
        b, h, _, d = key_states.shape
        self.batch, self.heads, self.head_dim = b, h, d
        self.pads_left = list(self.pad_lengths) if self.pad_lengths is not None else [0] * b
        if len(self.pads_left) != b:
            raise ValueError(f"the cache was built for {len(self.pads_left)} sequences, the model sent {b}")
        r = m.residual_length
        self.key_residual = torch.zeros(b, h, r, d, dtype=self.dtype, device=self.device)
        self.value_residual = torch.zeros(b, h, r, d, dtype=self.dtype, device=self.device)
        self.n_packed = [0] * b
        self.n_res = [0] * b
        self.n_packed_dev = torch.zeros(b, dtype=torch.int32, device=self.device)
        self.n_res_dev = torch.zeros(b, dtype=torch.int32, device=self.device)
        self._allocate(max(r, math.ceil(self.capacity / r) * r))
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store new tokens [B, H, T, D]. Returns what prefill attention uses: [B, H, seq_len, D] with the
        stored tokens dequantized (keys rotated) and the new ones in full precision; for one new token the
        attention reads the packed storage instead (``attend``) and the returned tensors are the token as given."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        if self.decoding or (not self.engine and t == 1 and not any(self.pads_left)):
            if not self.engine:
                self.seq_len += 1
                self.flush_full_windows()
                self.n_res = [n + 1 for n in self.n_res]
            ops.append_residual(key_states, value_states, self.key_residual, self.value_residual, self.n_res_dev,
                                rotate=True)
            self.n_res_dev += 1
            self.attending = key_states
            return key_states, value_states
        self.attending = None
        rotated = ops.hadamard(key_states)
        old_k, old_v = self._dense_old()
        self.seq_len += t
        self._append_prefill(rotated, value_states)
        if old_k is None:
            return rotated, value_states
        return torch.cat([old_k, rotated], dim=2), torch.cat([old_v, value_states], dim=2)

    def attend(self, module, query: Tensor, attention_mask, scaling: float) -> Tensor:
        """The fused decode kernel over this layer's packed + residual storage: query [B, Hq, 1, D] (not rotated:
        the kernel rotates it) -> [B, 1, Hq, D]. Under the engine the split plan covers the whole capacity
        (fixed across steps, so the step can be replayed); otherwise the longest stored row."""
        m = self.method
        max_packed = self.capacity if self.engine else max(self.n_packed)
        out = ops.decode_attention(query, self.keys_store, self.values_store, self.key_residual, self.value_residual,
                                   self.n_packed_dev, self.n_res_dev, k_bits=m.k_bits, v_bits=m.v_bits,
                                   group_size=m.group_size, scaling=scaling, rotate_query=True, max_packed=max_packed)
        if not self.engine:
            self.flush_full_windows()
        return out.transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.reset_rows(self.pad_lengths)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by the quantized KV cache (use greedy or sampling)")

    # -- the engine's step protocol (oscar.static_cache) ----------------------------------------
    def begin_decode(self, lengths: Tensor) -> None:
        """Host, once after the prefill (the kernel takes its lengths from the layer's own counts)."""
        if any(self.pads_left):
            raise ValueError("the prompt's left padding was not consumed by the prefill")
        self.decoding = True

    def finish_step(self) -> None:
        pass

    def advance(self) -> None:
        """Host: count the step's token, quantize the windows that reached R tokens."""
        self.seq_len += 1
        self.n_res = [n + 1 for n in self.n_res]
        self.flush_full_windows()

    # -- storage ------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        m, b, h, d = self.method, self.batch, self.heads, self.head_dim
        keys = ops.empty_keys(b, h, capacity, d, m.k_bits, m.group_size, self.dtype, self.device)
        values = ops.empty_values(b, h, capacity, d, m.v_bits, m.group_size, self.dtype, self.device)
        if getattr(self, "keys_store", None) is not None:
            used = max(self.n_packed)
            for new, old in ((keys, self.keys_store), (values, self.values_store)):
                for name in new:
                    n = used // m.group_size if (name in ("scale", "zero") and new is keys) else used
                    new[name][:, :, :n] = old[name][:, :, :n]
        self.keys_store, self.values_store, self.capacity = keys, values, capacity

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` packed tokens per row (benchmarks preallocate; decoding grows by doubling)."""
        r = self.method.residual_length
        if tokens > self.capacity:
            self._allocate(math.ceil(tokens / r) * r)

    def _sync_counts(self) -> None:
        """Host counts -> the device tensors the kernels read (in place: their addresses never change)."""
        self.n_packed_dev.copy_(torch.tensor(self.n_packed, dtype=torch.int32))
        self.n_res_dev.copy_(torch.tensor(self.n_res, dtype=torch.int32))

    def _flush_rows(self, rows: list[int], keys: Tensor, values: Tensor) -> None:
        """Quantize keys/values [len(rows), H, n, D] (n a multiple of R, keys rotated) into rows' packed parts."""
        m, n = self.method, keys.shape[2]
        need = max(self.n_packed[i] for i in rows) + n
        if need > self.capacity:
            if self.engine:
                raise RuntimeError(f"the static cache of capacity {self.capacity} is full")
            self._allocate(max(need, 2 * self.capacity))
        offsets = [self.n_packed[i] for i in rows]
        ops.quantize_keys(keys, m.k_bits, m.group_size, rotate=False, out=self.keys_store, rows=rows, offsets=offsets,
                          decode_layout=True)
        ops.quantize_values(values, m.v_bits, m.group_size, out=self.values_store, rows=rows, offsets=offsets,
                            decode_layout=True)
        for i in rows:
            self.n_packed[i] += n

    def flush_full_windows(self) -> None:
        """Quantize every residual window that holds R tokens (after the attention that saw them)."""
        r = self.method.residual_length
        full = [i for i, n in enumerate(self.n_res) if n == r]
        if not full:
            return
        idx = torch.tensor(full, device=self.device)
        self._flush_rows(full, self.key_residual[idx], self.value_residual[idx])
        for i in full:
            self.n_res[i] = 0
        self._sync_counts()

    def _append_prefill(self, rotated: Tensor, values: Tensor) -> None:
        """Several new tokens: per row skip its pads, flush whole windows, keep the rest as residual."""
        r, t = self.method.residual_length, rotated.shape[2]
        self.flush_full_windows()
        for i in range(self.batch):
            skip = min(self.pads_left[i], t)
            self.pads_left[i] -= skip
            n_old = self.n_res[i]
            k = torch.cat([self.key_residual[i:i + 1, :, :n_old], rotated[i:i + 1, :, skip:]], dim=2)
            v = torch.cat([self.value_residual[i:i + 1, :, :n_old], values[i:i + 1, :, skip:]], dim=2)
            n_flush = k.shape[2] - k.shape[2] % r
            if n_flush:
                self._flush_rows([i], k[:, :, :n_flush], v[:, :, :n_flush])
            rest = k.shape[2] - n_flush
            self.key_residual[i, :, :rest] = k[0, :, n_flush:]
            self.value_residual[i, :, :rest] = v[0, :, n_flush:]
            self.n_res[i] = rest
        self._sync_counts()

    def _dense_old(self) -> tuple[Tensor | None, Tensor | None]:
        """Stored tokens as [B, H, seq_len, D] (pads as zeros on the left), dequantized by the reference."""
        if self.seq_len == 0:
            return None, None
        m, g = self.method, self.method.group_size
        shape = (self.batch, self.heads, self.seq_len, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i in range(self.batch):
            n_p, n_r = self.n_packed[i], self.n_res[i]
            parts_k, parts_v = [], []
            if n_p:
                ks, vs = self.keys_store, self.values_store
                kmeta = dict(bits=m.k_bits, group_size=g, axis="channel", zero_point="int")
                vmeta = dict(bits=m.v_bits, group_size=g, axis="token", zero_point="int")
                stored_k = dict(codes=ks["codes"][i:i + 1, :, :n_p], scale=ks["scale"][i:i + 1, :, :n_p // g],
                                zero=ks["zero"][i:i + 1, :, :n_p // g], norm=ks["norm"][i:i + 1, :, :n_p])
                pk = PackedTensor(ops.key_decode_layout(stored_k, m.k_bits, inverse=True),
                                  (1, self.heads, n_p, self.head_dim), self.dtype, kmeta)
                stored_v = {name: vs[name][i:i + 1, :, :n_p] for name in ("codes", "scale", "zero")}
                pv = PackedTensor(ops.value_decode_layout(stored_v, m.v_bits, g, inverse=True),
                                  (1, self.heads, n_p, self.head_dim), self.dtype, vmeta)
                parts_k.append(m.dequantize(pk))
                parts_v.append(dequantize_groups(pv))
            parts_k.append(self.key_residual[i:i + 1, :, :n_r])
            parts_v.append(self.value_residual[i:i + 1, :, :n_r])
            n = n_p + n_r
            if n:
                keys[i:i + 1, :, self.seq_len - n:] = torch.cat(parts_k, dim=2)
                values[i:i + 1, :, self.seq_len - n:] = torch.cat(parts_v, dim=2)
        return keys, values

    # -- introspection ------------------------------------------------------------------------
    def static_tensors(self) -> list[Tensor]:
        return [*self.keys_store.values(), *self.values_store.values(), self.key_residual, self.value_residual,
                self.n_packed_dev, self.n_res_dev]

    def token_counts(self) -> dict[str, int]:
        return dict(keys_packed=sum(self.n_packed), keys_residual=sum(self.n_res),
                    values_packed=sum(self.n_packed), values_residual=sum(self.n_res))

    @property
    def nbytes(self) -> int:
        """Real stored bytes of the used tokens (what ``QuantizedKVCache.nbytes`` counts)."""
        if not self.is_initialized:
            return 0
        m, h, d, g = self.method, self.heads, self.head_dim, self.method.group_size
        el = torch.empty((), dtype=self.dtype).element_size()
        per_packed = h * (d * m.k_bits // 8 + d * m.v_bits // 8 + 2 * (d // g) * el) + 4  # codes, V params, norm
        per_group = h * 2 * d * el                                                          # K scale and zero
        per_residual = 2 * h * d * el
        return sum(n * per_packed + n // g * per_group for n in self.n_packed) + per_residual * sum(self.n_res)

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.static_tensors())


class CupyKVCache(StaticCache):
    """A transformers Cache whose layers hold packed GPU storage read by the fused decode kernel."""

    def __init__(self, method: KVMethod, num_layers: int, pad_lengths: list[int], capacity: int = 0,
                 device=None, engine: bool = False):
        check_method(method)
        self.method = method
        layers = [CupyKVLayer(method, i, pad_lengths, capacity, engine) for i in range(num_layers)]
        super().__init__(layers, pad_lengths, capacity, device, [None] * num_layers)

    @classmethod
    def for_model(cls, model, method: KVMethod, pad_lengths: list[int] | None = None, capacity: int = 0,
                  engine: bool = False, batch: int = 1) -> "CupyKVCache":
        """A cache for ``model``, bound to it (its attention reads this cache's layers)."""
        num_layers = model.config.get_text_config().num_hidden_layers
        device = next(model.parameters()).device
        cache = cls(method, num_layers, pad_lengths if pad_lengths is not None else [0] * batch, capacity, device,
                    engine)
        bind_cache(model, cache)
        return cache

    # the kernel reads per-row lengths itself: no masks to build (a constant stands in for HF's mask)
    def decode_mask(self) -> Tensor:
        if self._masks is None:
            self._masks = {"full_attention": torch.ones(self.batch_size, 1, 1, 1, dtype=torch.bool,
                                                        device=self.lengths.device)}
        return self._masks["full_attention"]

    def prepare_step(self) -> None:
        pass
