"""The attention hook: applies the method's query transform, then attends over the cache's K/V.

Registered once under the name ``oscar_kv`` in transformers' ``AttentionInterface`` (and the sdpa
mask function under the same name in ``AttentionMaskInterface``, without which chunked prefill with
a cache silently gets no mask). Model files are never forked: :func:`attach` points every
attention module at the method and switches the model's attention implementation.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar.method import KVMethod, interchangeable, prepared_method, prepares_some_model
from oscar.transfer import device_ints
from oscar.weights import attention_modules

ATTENTION_NAME = "oscar_kv"


def kv_method_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs):
    """query [B, H_q, T, D]; key/value [B, H_kv, S, D] as returned by the cache (already in the
    method's space). Same signature and outputs as transformers' sdpa attention.

    When the cache bound to the model (:func:`bind_cache`) returned ``key`` from a layer that attends over its
    own storage (a decode step of a backend's cache: packed bytes read by a kernel, the torch static cache), that
    layer computes the attention from the untransformed query; otherwise SDPA over key/value.
    """
    bound = getattr(module, "kv_cache", None)
    cache = bound() if bound is not None else None
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if layer is not None and getattr(layer, "attending", None) is key:  # the query as the model made it
        return layer.attend(module, query, attention_mask, kwargs.get("scaling") or module.scaling), None
    method: KVMethod | None = getattr(module, "kv_method", None)
    if method is not None:
        query = method.transform_query(query, module.layer_idx)
    out, weights = masked_blocks_attention(module, query, key, value, attention_mask, **kwargs)
    records = getattr(module, "kv_records", None)
    if records is not None:
        records.append(dict(query=query.detach(), key=key.detach(), value=value.detach(), output=out.detach()))
    return out, weights


#: queries per block of :func:`masked_blocks_attention` (a prompt of at least two blocks is split)
QUERY_BLOCK = 1024


def masked_blocks_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, **kwargs):
    """SDPA that, on a CPU, skips the keys a boolean mask hides from a whole block of queries.

    A long prefill on a CPU attends densely under its mask: a causal mask wastes half the products, a sliding
    window (Gemma 3's local layers) almost all of them. Here the queries go in blocks of ``QUERY_BLOCK``, each
    over the span of keys its mask rows allow (first to last allowed key), so every allowed product is computed
    and none of the others: the same result up to the order of the sums. Blocks with a row that allows no key,
    non-boolean masks, short queries and GPUs take plain SDPA. Returns (output [B, T, H, D], None).
    """
    t = query.shape[2]
    if (query.device.type != "cpu" or attention_mask is None or attention_mask.dtype != torch.bool
            or t < 2 * QUERY_BLOCK or attention_mask.shape[-2:] != (t, key.shape[2])):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for start in range(0, t, QUERY_BLOCK):
        rows = attention_mask[..., start:start + QUERY_BLOCK, :]
        lo, hi = 0, key.shape[2]
        if rows.any(-1).all():  # every query row allows a key: drop the keys no row allows at either end
            allowed = rows.flatten(0, -2).any(0).nonzero()
            lo, hi = int(allowed[0]), int(allowed[-1]) + 1
        out, _ = sdpa_attention_forward(module, query[:, :, start:start + QUERY_BLOCK], key[:, :, lo:hi],
                                        value[:, :, lo:hi], rows[..., lo:hi], **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def stored_attention(module: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     stored: list[int], new: list[int], scaling: float, window: int | None = None) -> torch.Tensor:
    """Prefill attention of a chunk over each row's stored tokens, as the engine's static caches lay them out.

    query [B, Hq, t, D]: the chunk's queries (in the keys' space); row b's last ``new[b]`` are real, the ones before
    are left padding. keys/values [B, H, S, D]: row b's tokens at 0 .. stored[b] - 1 (pads are never stored), the
    chunk's real tokens the last new[b] of them; query i of row b (i >= t - new[b]) sits at stream index
    stored[b] - t + i and attends causally (bottom-right aligned) to the keys up to it, within ``window`` tokens for
    a sliding-window layer. Returns [B, t, Hq, D] in the query dtype (pad queries' outputs are zeros).

    A whole unpadded prompt (no row has a prefix or padding, the window covers the chunk): SDPA with is_causal, as
    transformers' own mask function would decide (on a GPU its fastest causal kernel). On a GPU in 16 bits, a chunk
    without padding over one prefix length for every row (batch 1, or equal prompts) and no window cutting it:
    :func:`prefix_chunk_attention` (cuDNN, head_dim <= 128). Otherwise, on a GPU in 16 bits with token-major storage
    (keys.transpose(1, 2) contiguous, [B, S, H, D]: the static caches' layout): FlashAttention's variable-length
    kernel over the real queries, each row's keys read in place (``seqused_k``), grouped-query heads native, no mask
    materialized; elsewhere SDPA with a boolean mask of the same rule (:func:`masked_blocks_attention` on a CPU).
    """
    b, hq, t, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    dev = query.device
    if min(new) < 0 or max(new) > t or any(n > k for n, k in zip(new, stored)) or max(stored) > s:
        raise ValueError(f"stored_attention: rows of {stored} stored tokens (capacity {s}) with {new} of {t} new")
    if max(new) == 0:  # every row's part of the chunk is padding
        return torch.zeros(b, t, hq, d, dtype=query.dtype, device=dev)
    flat_keys = keys.transpose(1, 2)
    causal_only = all(k == t for k in stored) and min(new) == t and (window is None or t <= window)
    if causal_only:  # a whole unpadded prompt: SDPA's causal kernels (cuDNN's on a Hopper GPU), as transformers' own
        keys, values = keys[:, :, :t], values[:, :, :t]
        if query.is_cuda:
            keys, values = keys.contiguous(), values.contiguous()
        return masked_blocks_attention(module, query, keys, values, None, scaling=scaling, dropout=0.0)[0]
    sixteen_bits = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
    if (sixteen_bits and d <= 128 and torch.backends.cuda.cudnn_sdp_enabled() and len(set(stored)) == 1
            and min(new) == t and (window is None or stored[0] <= window)):
        return prefix_chunk_attention(query, keys[:, :, :stored[0]], values[:, :, :stored[0]], scaling)
    if sixteen_bits and flat_keys.is_contiguous():
        real = torch.arange(t, device=dev) >= device_ints([t - n for n in new], dev, torch.long).view(b, 1)  # [B, t]
        q = query.transpose(1, 2)
        q = q.reshape(b * t, hq, d) if min(new) == t else q[real]  # [N, Hq, D], the real queries only
        counts = device_ints([0] + new, dev)
        window_args = {} if window is None else dict(window_size_left=window - 1, window_size_right=0)
        out = torch.ops.aten._flash_attention_forward(
            q.contiguous(), flat_keys.reshape(b * s, hkv, d), values.transpose(1, 2).reshape(b * s, hkv, d),
            counts.cumsum(0, dtype=torch.int32), torch.arange(b + 1, device=dev, dtype=torch.int32) * s,
            max(new), max(stored), 0.0, True, False, scale=scaling,
            seqused_k=device_ints(stored, dev), **window_args)[0]
        if min(new) == t:
            return out.view(b, t, hq, d)
        full = torch.zeros(b, t, hq, d, dtype=out.dtype, device=dev)
        full[real] = out
        return full
    width = max(stored)
    mask = _stored_mask(stored, new, t, width, window, dev)
    return masked_blocks_attention(module, query, keys[:, :, :width], values[:, :, :width], mask, scaling=scaling,
                                   dropout=0.0)[0]


def prefix_chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           scaling: float) -> torch.Tensor:
    """A chunk's attention over a stored prefix and itself, without a mask: query [B, Hq, t, D]; keys/values
    [B, H, P + t, D] (any strides: the static caches' token-major views), the chunk's own the last t. Two calls of
    :func:`partial_attention`, the chunk over the prefix (every key visible) and over itself (causal), merged by
    their log-sum-exps: softmax over both key sets is the two outputs weighted by sigmoid(lse_prefix - lse_chunk).
    On the H200 the engine's fp16 prefill of 128K tokens in 8K chunks takes 1.03x its whole-prompt prefill this
    way (results/efficiency/user_path_cudnn_prefill.csv), 1.47x through FlashAttention's variable-length kernel
    (user_path.csv).
    Returns [B, t, Hq, D] in the query dtype."""
    t = query.shape[2]
    prefix = keys.shape[2] - t
    out, lse = partial_attention(query, keys[:, :, prefix:], values[:, :, prefix:], True, scaling)
    if prefix:
        out_prefix, lse_prefix = partial_attention(query, keys[:, :, :prefix], values[:, :, :prefix], False, scaling)
        weight = torch.sigmoid(lse_prefix - lse).unsqueeze(-1)  # the prefix's share of each query's softmax mass
        out = torch.lerp(out.float(), out_prefix.float(), weight)
    return out.to(query.dtype).transpose(1, 2)


def partial_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query [B, Hq, t, D] over keys/values [B, H, S, D] (causal: top-left aligned, S == t) with the
    log-sum-exp of each query's scores: (out [B, Hq, t, D], lse [B, Hq, t] float32). cuDNN's kernel on a GPU
    (grouped-query heads native), PyTorch's flash kernel for the CPU elsewhere (the heads repeated)."""
    b, hq, t, _ = query.shape
    if query.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(query, keys, values, None, True, 0.0, causal,
                                                                       False, scale=scaling)[:2]
    else:
        groups = hq // keys.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1), 0.0, causal, scale=scaling)
    return out, lse.reshape(b, hq, t).float()


def _stored_mask(stored: list[int], new: list[int], t: int, width: int, window: int | None, device) -> torch.Tensor:
    """[B, 1, t, width] bool: query i of row b sees key j iff j <= p = stored[b] - t + i (and j > p - window); a pad
    query (i < t - new[b]) sees key 0 only, so that no softmax row is empty (its output is never used)."""
    i = torch.arange(t, device=device).view(1, t, 1)
    j = torch.arange(width, device=device).view(1, 1, width)
    position = device_ints(stored, device, torch.long).view(-1, 1, 1) - t + i
    mask = j <= position
    if window is not None:
        mask &= j > position - window
    pad = i < device_ints([t - n for n in new], device, torch.long).view(-1, 1, 1)
    return torch.where(pad, j == 0, mask).unsqueeze(1)


def register_attention() -> None:
    """Idempotent registration of the hook and its mask function."""
    AttentionInterface.register(ATTENTION_NAME, kv_method_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def attach(model: nn.Module, method: KVMethod) -> None:
    """Route every attention module of ``model`` through the hook with ``method``."""
    register_attention()
    modules = list(attention_modules(model))
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention module with v_proj/o_proj/head_dim")
    for m in modules:
        m.kv_method = method
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder.set_attn_implementation(ATTENTION_NAME)


def detach(model: nn.Module) -> None:
    """Undo :func:`attach` and :func:`bind_cache` on the attention modules (the implementation is the caller's to
    put back: oscar.preparation keeps what it was)."""
    for m in attention_modules(model):
        for name in ("kv_method", "kv_cache"):
            m.__dict__.pop(name, None)
    model.__dict__.pop(BOUND_CACHE, None)


def routed_method(model: nn.Module) -> KVMethod | None:
    """The method object the attention of ``model`` goes through (:func:`attach`), or None: not through the hook."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if getattr(decoder.config, "_attn_implementation", None) != ATTENTION_NAME:
        return None
    methods = {id(m.__dict__.get("kv_method")): m.__dict__.get("kv_method") for m in attention_modules(model)}
    return next(iter(methods.values())) if len(methods) == 1 else None


#: what a user whose model is not prepared for a method does instead
PREPARE_FIX = ("prepare it with `with oscar.apply(model, method) as make_cache:` and pass `cache=make_cache(inputs)` "
               "(or use oscar.lm.KVModel)")


def check_prepared(model: nn.Module | None, method: KVMethod) -> None:
    """Raise ValueError (one line, naming the fix) unless a cache of ``method`` may serve ``model`` (None: a cache
    made without its model): the model prepared for (oscar.method.prepared_method) and routed through (:func:`attach`)
    no other method object, and, for a method that needs it (``needs_prepared_model``: folded weights, a query
    transform), prepared for and routed through this one. A cache made without its model passes unless its method,
    needing a prepared model, has prepared none."""
    if model is None:
        if method.needs_prepared_model and not prepares_some_model(method):
            raise ValueError(f"{method.name}'s cache needs a model prepared for its method object, and none is: "
                             f"{PREPARE_FIX}")
        return
    for other, how in ((prepared_method(model), "is prepared for"), (routed_method(model), "attends through")):
        if other is not None and not interchangeable(other, method):
            which = f"another {other.name} method object" if other.name == method.name else other.name
            raise ValueError(f"this {type(model).__name__} {how} {which}, and the cache is {method.name}'s: make "
                             "caches from the model's own method (the make_cache of its oscar.apply block, or "
                             "KVModel.new_cache), or prepare it for this one")
    if method.needs_prepared_model and routed_method(model) is not method:
        raise ValueError(f"{method.name}'s cache needs the model prepared for it (its weights folded, its queries "
                         f"transformed in attention), and this {type(model).__name__} is not: {PREPARE_FIX}")
    if type(method).prepare_model is not KVMethod.prepare_model and prepared_method(model) is not method:
        raise ValueError(f"{method.name}'s cache needs the model prepared for it (method.prepare_model), and this "
                         f"{type(model).__name__} only attends through it: {PREPARE_FIX}")


#: the model's attribute holding what :func:`bind_cache` last bound: (weak reference to the cache, its modules)
BOUND_CACHE = "_oscar_bound_cache"


def bind_cache(model: nn.Module, cache) -> None:
    """Let the attention of ``model`` find ``cache``'s layers (the cache a backend made for the batch). The model
    keeps a weak reference: binding never keeps a cache's storage alive. Binding again the cache every attention
    module already holds costs microseconds, not a walk over the model's modules (continuous batching binds its
    slot before every step); the modules checked are those the last walk found (:func:`detach` forgets them)."""
    memo = model.__dict__.get(BOUND_CACHE)
    if memo is not None:
        ref, modules = memo
        if ref() is cache and all(m.__dict__.get("kv_cache") is ref for m in modules):
            return
    ref, modules = weakref.ref(cache), list(attention_modules(model))
    for m in modules:
        m.kv_cache = ref
    model.__dict__[BOUND_CACHE] = (ref, modules)


@contextlib.contextmanager
def record_attention(model: nn.Module) -> Iterator[dict[int, list[dict]]]:
    """Record (query, key, value, output) of every attention call, per layer index.

    Query is in the method's space (after transform_query); key/value are what the cache returned.
    Used by the KV diagnostics; needs :func:`attach` to have been called.
    """
    records: dict[int, list[dict]] = {}
    modules = list(attention_modules(model))
    for m in modules:
        m.kv_records = records.setdefault(m.layer_idx, [])
    try:
        yield records
    finally:
        for m in modules:
            del m.kv_records
