"""backend=cupy: a KV cache of real packed GPU tensors and decode attention through the fused kernel.

The cache mirrors ``oscar.cache.QuantizedKVCache`` with the ``block`` flush policy (OScaR's reference):
per layer, keys and values each have a packed part (``kernels.ops`` storage in the kernels' decode layouts,
preallocated and grown by doubling, written in place) and a full-precision residual window of up to R
tokens (keys stored already rotated); a window that reaches R tokens is quantized by the kernels and
appended, never re-quantized.
Decoding (one query token) calls ``kernels.ops.decode_attention`` on the packed bytes; prefill (several
query tokens) attends in full precision over [stored tokens dequantized by the reference | new tokens]
exactly like the torch path, so quantization affects decoding only (quantize_prefill=False).

Left-padded batches: pad tokens are never stored; each row keeps its own token counts, which the
kernel takes as per-sequence lengths.

Use: ``enable(lm)`` on a ``KVModel`` (what run.py does for backend=cupy), or by hand
``attach(model, method)`` and ``CupyKVCache.for_model(model, method, attention_mask)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kernels import ops
from oscar.attention import attach as attach_reference
from oscar.attention import kv_method_attention
from oscar.method import KVMethod
from oscar.quant import PackedTensor, dequantize_groups

ATTENTION_NAME = "oscar_kv_cupy"

#: the layer whose update() ran last for each layer index: the attention call that follows reads its storage
_PENDING: dict[int, "CupyKVLayer"] = {}


def check_method(method: KVMethod) -> None:
    """Raise ValueError unless the fused kernels implement this method configuration."""
    problems = []
    if method.name != "oscar":
        problems.append(f"method={method.name}")
    else:
        if not (method.rotate and method.scale and method.norm_scope == "token" and method.zero_point == "int"):
            problems.append("an OScaR ablation (rotate/scale/norm_scope/zero_point)")
        if method.flush != "block":
            problems.append(f"flush={method.flush}")
        if method.k_bits not in ops.SUPPORTED_BITS or method.v_bits not in ops.SUPPORTED_BITS:
            problems.append(f"k_bits={method.k_bits}, v_bits={method.v_bits}")
        if (method.residual_length < method.group_size or method.group_size % 16 or method.group_size > 128
                or method.group_size * method.v_bits % 64):
            problems.append(f"residual_length={method.residual_length}, group_size={method.group_size}")
    if problems:
        raise ValueError("backend=cupy implements method=oscar (rotate, scale, norm_scope=token, zero_point=int, "
                         "flush=block, 2 or 4 bits, G a multiple of 16 up to 128 with G * v_bits a multiple of 64, "
                         "R >= G); got " + ", ".join(problems) + ". Use backend=torch for the others.")


def check_available() -> None:
    """Raise before any model is loaded if the fast path cannot run here."""
    if not torch.cuda.is_available():
        raise RuntimeError("backend=cupy needs a CUDA GPU; use backend=torch on this machine")
    ops._cupy()


class CupyKVLayer(CacheLayerMixin):
    """One decoder layer: packed keys/values on the GPU plus a full-precision residual window per row."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, method: KVMethod, layer_idx: int, pad_lengths: list[int] | None = None, capacity: int = 0):
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self.pad_lengths = pad_lengths
        self.capacity = capacity
        self.seq_len = 0

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
        self._allocate(max(r, math.ceil(self.capacity / r) * r))
        self._sync_counts()
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store new tokens [B, H, T, D]. Returns what prefill attention uses: [B, H, seq_len, D] with the
        stored tokens dequantized (keys rotated) and the new ones in full precision; for one new token the
        attention reads the packed storage instead and the returned tensors are the new token as given."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        _PENDING[self.layer_idx] = self
        if t == 1 and not any(self.pads_left):
            self.seq_len += 1
            self._append_decode(key_states, value_states)
            return key_states, value_states
        rotated = ops.hadamard(key_states)
        old_k, old_v = self._dense_old()
        self.seq_len += t
        self._append_prefill(rotated, value_states)
        if old_k is None:
            return rotated, value_states
        return torch.cat([old_k, rotated], dim=2), torch.cat([old_v, value_states], dim=2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seq_len = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by the quantized KV cache (use greedy or sampling)")

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
        self.n_packed_dev = torch.tensor(self.n_packed, dtype=torch.int32, device=self.device)
        self.n_res_dev = torch.tensor(self.n_res, dtype=torch.int32, device=self.device)

    def _flush_rows(self, rows: list[int], keys: Tensor, values: Tensor) -> None:
        """Quantize keys/values [len(rows), H, n, D] (n a multiple of R, keys rotated) into rows' packed parts."""
        m, n = self.method, keys.shape[2]
        need = max(self.n_packed[i] for i in rows) + n
        if need > self.capacity:
            self._allocate(max(need, 2 * self.capacity))
        offsets = [self.n_packed[i] for i in rows]
        ops.quantize_keys(keys, m.k_bits, m.group_size, rotate=False, out=self.keys_store, rows=rows, offsets=offsets,
                          decode_layout=True)
        ops.quantize_values(values, m.v_bits, m.group_size, out=self.values_store, rows=rows, offsets=offsets,
                            decode_layout=True)
        for i in rows:
            self.n_packed[i] += n

    def _append_decode(self, keys: Tensor, values: Tensor) -> None:
        self.flush_full_windows()
        ops.append_residual(keys, values, self.key_residual, self.value_residual, self.n_res_dev, rotate=True)
        self.n_res = [n + 1 for n in self.n_res]
        self.n_res_dev += 1

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
        stores = list(self.keys_store.values()) + list(self.values_store.values())
        return sum(t.numel() * t.element_size() for t in stores + [self.key_residual, self.value_residual])


class CupyKVCache(Cache):
    """A transformers Cache whose layers hold packed GPU storage read by the fused decode kernel."""

    def __init__(self, method: KVMethod, num_layers: int, pad_lengths: list[int] | None = None, capacity: int = 0):
        check_method(method)
        self.method = method
        super().__init__(layers=[CupyKVLayer(method, i, pad_lengths, capacity) for i in range(num_layers)])

    @classmethod
    def for_model(cls, model, method: KVMethod, attention_mask: Tensor | None = None,
                  capacity: int = 0) -> "CupyKVCache":
        from oscar.cache import left_pad_lengths

        num_layers = model.config.get_text_config().num_hidden_layers
        pads = None if attention_mask is None else left_pad_lengths(attention_mask)
        return cls(method, num_layers, pads, capacity)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def token_counts(self, layer_idx: int = 0) -> dict[str, int]:
        return self.layers[layer_idx].token_counts()


def cupy_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs):
    """The attention function for backend=cupy: fused kernel for one query token, reference path otherwise."""
    layer = _PENDING.pop(module.layer_idx, None)
    if query.shape[2] != 1 or layer is None or key.shape[2] != 1:
        return kv_method_attention(module, query, key, value, attention_mask, **kwargs)
    m = layer.method
    scaling = kwargs.get("scaling") or module.scaling
    out = ops.decode_attention(query, layer.keys_store, layer.values_store, layer.key_residual, layer.value_residual,
                               layer.n_packed_dev, layer.n_res_dev, k_bits=m.k_bits, v_bits=m.v_bits,
                               group_size=m.group_size, scaling=scaling, rotate_query=True,
                               max_packed=max(layer.n_packed))
    layer.flush_full_windows()
    return out.transpose(1, 2), None


def attach(model, method: KVMethod) -> None:
    """Route every attention module of ``model`` through the cupy attention function."""
    check_method(method)
    attach_reference(model, method)
    AttentionInterface.register(ATTENTION_NAME, cupy_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder.set_attn_implementation(ATTENTION_NAME)


def enable(lm) -> None:
    """Switch a ``KVModel`` to the fast path: kernel attention and a packed GPU cache per batch."""
    check_method(lm.method)
    attach(lm.model, lm.method)

    def new_cache(attention_mask: Tensor | None = None, quantize_prefill: bool = False) -> CupyKVCache:
        if quantize_prefill:
            raise ValueError("backend=cupy quantizes decode tokens only (quantize_prefill=false); use backend=torch")
        return CupyKVCache.for_model(lm.model, lm.method, attention_mask)

    lm.new_cache = new_cache
