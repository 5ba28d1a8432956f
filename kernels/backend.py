"""backend=cupy: packed GPU caches read by the fused decode kernel, for OScaR, KIVI, QuaRot, TurboQuant+, OTT and
RotateKV (OSCAR, method ``spectral``, has its row and is refused until its cache's GPU test passes).

Per layer, keys and values each have a packed part (``kernels.ops.empty_storage`` of the method, in the kernels'
decode layouts, allocated for the batch's capacity and written in place) and a full-precision window
[B, H, rcap, D] of recent tokens (keys in the attention space: rotated for OScaR and QuaRot, by the layer's matrix
for OSCAR). What a method calls (its quantizers, its decode-attention keywords, the configurations its kernels take,
the tokens it keeps exactly) is its row of :data:`KERNELS`; nothing else here names a method.

Flush policies (``method.flush_policy``, oscar.flush), per row after T stored tokens, as ``oscar.cache`` keeps them:
keys packed k_p, values v_p (``kivi``: k_p = T - T mod R, v_p = max(0, T - R); ``block``: both T - T mod R;
``window``: both max(0, T - R)). Tokens are never re-quantized. The kernel takes one packed length per row,
P = min(k_p, v_p) rounded down to its stages (``ops.stage_tokens``), so the window holds tokens P..T-1: those
already packed as their dequantized values in the model dtype (what the torch path attends to), the others as they
came. For OScaR (block, R a multiple of G) P = k_p = v_p and the window holds unquantized tokens only.

Tokens kept exactly (OTT's outlier pool, RotateKV's attention sinks, OSCAR's first sink_tokens: the row's ``kept``)
live in kernels.kept_tokens.KeptTokens: staged when their key is quantized, attended from there by the kernel once
P passes them (their packed copies skipped), from the window before; the window and every dequantization of packed
tokens hold them exact, as the torch path does. The methods' per-sequence state (``state``: OTT's pools that its key
flushes write, RotateKV's sinks that its prefill hook writes) is the layer's, as in oscar.cache.

Decoding (one query token) runs ``kernels.ops.decode_attention`` on the packed bytes; a prefill chunk (several query
tokens) attends in full precision over [stored tokens dequantized by the method | the chunk] exactly like the torch
path (oscar.attention.stored_attention: FlashAttention's variable-length kernel on the GPU), then is quantized into the
packed storage, so quantization affects decoding only (quantize_prefill=False) and a prompt prefilled in chunks is
never held in BF16 beyond one layer's chunk and the transient dequantization of its prefix. Left-padded batches: pad
tokens are never stored; each row keeps its own counts, which the kernel takes as per-sequence lengths.

Two ways to drive the cache: the decode engine (oscar.engine) makes it with its capacity and runs the step protocol
of oscar.static_cache: in the step (a CUDA graph) ``update`` appends the token to the window, ``attend`` runs the
kernel and ``finish_step`` flushes the oldest unpacked token of each stream that leaves the window one token at a
time (the kivi policy's values, the window policy's keys and values) for each row whose window passed R (it puts
the token's dequantization in the window: a gather, a select and a scatter); between steps ``advance`` quantizes
full key windows (and the ``block`` policy's values), moves the window when P passes a stage and, once per stage,
quantizes the stage's tokens of those streams and dequantizes them ahead of their flush (they are in the window a
stage before: R >= stage), with the kernel's split plan fixed by the capacity.
transformers' generate (multimodal prompts) uses a cache made by ``new_cache``, which grows by doubling and runs
the same flushes inside its own attention calls. fp16 runs on the torch backend's static mirror (dense BF16 and
FlashAttention), so ``backend=cupy method=fp16,oscar,kivi`` compares engine against engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kernels import method_layouts, ops
from kernels.kept_tokens import KeptTokens
from oscar.attention import bind_cache, stored_attention
from oscar.backend import Backend, register_backend
from oscar.cache import QuantizedKVCache, left_pad_lengths
from oscar.exact import positions_mask
from oscar.method import KVMethod, SequenceState, TokenSpan
from oscar.quant import PackedTensor
from oscar.static_cache import StaticCache, TorchStaticCache

# ----------------------------------------------------------------------------- what each method's kernels take


def _bits(m: KVMethod, allowed: tuple[int, ...] = ops.SUPPORTED_BITS) -> list[str]:
    if m.k_bits in allowed and m.v_bits in allowed:
        return []
    return [f"k_bits={m.k_bits}, v_bits={m.v_bits} (the kernels pack {' or '.join(map(str, allowed))} bits)"]


def _groups(m: KVMethod) -> list[str]:
    """G of the value tiles (and of per-token key k-steps): a multiple of 16 up to 128, G * v_bits a multiple of 64."""
    g = m.group_size
    if g % 16 or g > 128 or g * m.v_bits % 64:
        return [f"group_size={g} (G a multiple of 16 up to 128 with G * v_bits a multiple of 64)"]
    return []


def _oscar_missing(m: KVMethod) -> list[str]:
    problems = []
    if not (m.rotate and m.scale and m.norm_scope == "token" and m.zero_point == "int" and m.rotate_values):
        problems.append("an OScaR ablation (rotate/scale/norm_scope/zero_point/rotate_values)")
    if m.rotation != "hadamard":
        problems.append(f"rotation={m.rotation} (the kernels rotate with H_D only)")
    if m.norm_floor != "none":
        problems.append(f"norm_floor={m.norm_floor} (the kernels divide each token by its own norm)")
    if m.flush != "block":
        problems.append(f"flush={m.flush} (OScaR's kernels follow its reference policy, block)")
    return problems + _bits(m) + _groups(m)


def _window(m: KVMethod) -> list[str]:
    """The tokens that leave the window one at a time (the kivi policy's values, the window policy's keys and values)
    are prepared a kernel stage ahead (CupyKVLayer): the window must hold a stage."""
    stage = ops.stage_tokens(m.name, m.group_size)
    if m.flush_policy.values_slide and m.residual_length < stage:
        return [f"residual_length={m.residual_length} with flush={m.flush} (the kernel path needs R >= {stage})"]
    return []


def _rotated_window(m: KVMethod) -> list[str]:
    """Keys flushed inside the step come back as the method's own dequantization of the window's tokens, and a
    window of Hadamard-rotated keys (QuaRot's) is not what its own quantizer takes."""
    return ["flush=window (QuaRot's window holds rotated keys: use kivi or block)"] if m.flush == "window" else []


def _turboquant_missing(m: KVMethod) -> list[str]:
    return _bits(m, (2,)) + _groups(m) + _window(m)


def _turboquant_constants(m: KVMethod, x: Tensor) -> tuple[Tensor, list[float]]:
    d = x.shape[-1]
    return m.signs(d, x.device), m.codebook(2, d).tolist()


# -- OTT, RotateKV, OSCAR: the methods' own quantizers on the flush path, exact tokens beside the window


def _method_quantizer(m: KVMethod, stream: str) -> Callable[..., PackedTensor]:
    """The method's own quantizer of ``stream`` over tokens as the window holds them: (x, layer_idx, span)."""
    own = m.quantize_keys if stream == "keys" else m.quantize_values
    return lambda x, layer_idx, span=None: own(x, layer_idx, span=span)


def _rotated_quantizer(m: KVMethod, stream: str) -> Callable[..., PackedTensor]:
    """OSCAR's: its window holds keys rotated by the layer's matrix (quantize_rotated_keys)."""
    if stream == "keys":
        return lambda x, layer_idx, span=None: m.quantize_rotated_keys(x, span)
    return _method_quantizer(m, stream)


def _store_own(stream: str, own: Callable[[KVMethod, str], Callable] = _method_quantizer):
    """The hook of an exact-token method: its own quantizer over [b, H, n, D] tokens of the window (OSCAR's keys
    already rotated) at ``span``, the chunk written into the decode layouts (method_layouts.store_packed at ``rows``/
    ``offsets`` of ``out``); returns the method's PackedTensor, whose exact/exact_pos name the tokens it keeps.
    The methods' own quantizers carry their bookkeeping (OTT's pool, RotateKV's sinks and positions, OSCAR's prefix
    and quantile clip) and write the torch path's bytes by construction."""
    def store(m: KVMethod, x: Tensor, layer_idx: int, span, out: dict, rows, offsets) -> PackedTensor:
        packed = own(m, stream)(x, layer_idx, span)
        order = m.channel_order(layer_idx, x.shape[1] * x.shape[3]) if m.name == "rotatekv" else None
        method_layouts.store_packed(m.name, stream, packed, out, rows, offsets, order)
        return packed
    return store


def _rotatekv_attention(m: KVMethod, d: int, device, layer_idx: int = 0, capacity: int = 0, heads: int = 1) -> dict:
    """RotateKV's decode_attention keywords for one layer of ``heads`` KV heads: its channel order's key groups, head
    group, and the model's RoPE every ROPE_RUN positions up to ``capacity`` (plus the one-position step)."""
    anchors = m.rope_at(layer_idx, torch.arange(0, max(capacity, 1), ops.ROPE_RUN), d)
    first = m.rope_at(layer_idx, torch.arange(2), d)
    rope = method_layouts.rotatekv_rope(*(t.to(device) for t in (*anchors, *first)))
    order = m.channel_order(layer_idx, heads * d).to(device)
    return dict(method="rotatekv", rope=method_layouts.rotatekv_tables(order, m.group_size, m.grouped_heads, rope))


def _rotatekv_missing(m: KVMethod) -> list[str]:
    problems = [] if not (m.reorder and m.reorder_first) else [
        "reorder_first=true (the kernel undoes the permutation before the Hadamard: the released code's order, "
        "reorder_first=false)"]
    return problems + _bits(m) + _groups(m) + _window(m)


#: why backend=cupy refuses OSCAR for now: its kernels pass their GPU tests (tests/test_kernels_exact_methods.py) and
#: the tiny models decode through the cache like the torch path, but the cache's own GPU test does not pass yet
SPECTRAL_CACHE_OPEN = ("method=spectral on the cupy cache (the H200 run of tests/test_cupy_methods_gpu.py finds its "
                       "kept sink tokens and Lloyd-Max parameters off the torch path's; issue 22)")


def _spectral_missing(m: KVMethod) -> list[str]:
    problems = [SPECTRAL_CACHE_OPEN]
    if m.codebook == "lloyd_max":
        try:
            ops.affine_levels(m.reconstruction_levels().tolist())
        except ValueError:
            problems.append("lloyd_max_levels=exact (the kernel maps codes affinely: the released levels)")
    if m.residual_length < ops.STAGE_TOKENS:
        problems.append(f"residual_length={m.residual_length} (the window keeps at least a {ops.STAGE_TOKENS}-token "
                        "stage)")
    return problems + _bits(m) + _groups(m)


def _spectral_quantizer(stream: str):
    """OSCAR's flush hook: the uniform quantizer's kernel (ops.quantize_spectral; keys as the window holds them,
    rotated), the method's own for the Lloyd-Max switch."""
    own = _store_own(stream, _rotated_quantizer)

    def store(m: KVMethod, x: Tensor, layer_idx: int, span, **where):
        if m.codebook != "uniform":
            return own(m, x, layer_idx, span, **where)
        bits, clip = (m.k_bits, m.k_clip_ratio) if stream == "keys" else (m.v_bits, m.v_clip_ratio)
        return ops.quantize_spectral(x, bits, m.group(x.shape[-1]), clip, decode_layout=stream, **where)
    return store


def _spectral_attention(m: KVMethod, d: int, device, **layer) -> dict:
    affine = ops.affine_levels(m.reconstruction_levels().tolist()) if m.codebook == "lloyd_max" else (0.0, 1.0)
    return dict(method="spectral", affine=affine)


# which tokens of a chunk (rows [b], stream positions start .. start + n) a method keeps: [b, 1 or H, n] bool


def _pool_kept(m: KVMethod, state: dict, rows: Tensor, start: int, n: int) -> Tensor:
    """OTT: its outlier pool (the state its key flushes write)."""
    return positions_mask(state["pool"][rows], start, n)


def _sinks_kept(m: KVMethod, state: dict, rows: Tensor, start: int, n: int) -> Tensor:
    """RotateKV: its attention sinks (the state its prefill hook writes)."""
    return positions_mask(state["sinks"][rows], start, n)


def _prefix_kept(m: KVMethod, state: dict, rows: Tensor, start: int, n: int) -> Tensor:
    """OSCAR: the first sink_tokens positions of every sequence (on the host: no device read)."""
    return (torch.arange(start, start + n) < m.sink_tokens).view(1, 1, n).expand(len(rows), 1, n)


def _first_kept(field: str, slots: str):
    """Benchmarks (CupyKVLayer.assume_stored): the method's state as if each row's first tokens were kept (OTT's
    pool full with tokens 0 .. pool_size - 1, RotateKV's sinks the first num_sinks tokens, OSCAR's prefix by its
    rule), among ``packed`` packed keys: returns how many per (row, head)."""
    def assume(m: KVMethod, state: dict, packed: int) -> int:
        n = min(getattr(m, slots), packed)
        if field:
            state[field].fill_(-1)
            state[field][..., :n] = torch.arange(n, device=state[field].device)
        return n
    return assume


@dataclass(frozen=True)
class MethodKernels:
    """One method on the kernels of kernels.ops (its docstring's table): ``quantize_keys(method, keys, **where)``
    and ``quantize_values(method, values, **where)`` write [b, H, n, D] tokens (keys as the window holds them) into
    the storage in the decode layouts (``where``: out, rows, offsets); ``attention(method, head_dim, device,
    layer_idx=, capacity=, heads=)`` gives the method's keywords of ops.decode_attention (for its layer, packed
    capacity and KV heads); ``missing(method)`` what of a configuration the kernels lack.
    A method with ``kept`` (OTT, RotateKV, OSCAR) keeps tokens exactly (kernels.kept_tokens): its hooks also take the
    layer and the chunk's TokenSpan (``quantize_keys(method, keys, layer_idx, span, **where)``: OTT's keys update the
    outlier pool in span.state), and ``kept(method, state, rows, start, n)`` says which tokens of a chunk it keeps
    (OTT's pool, RotateKV's sinks, OSCAR's first sink_tokens), at most ``slots(method)`` per row and head."""

    #: keys in per-channel groups of G tokens (key_decode_layout), else per token (token_key_decode_layout)
    keys_per_channel: bool
    #: the window holds keys rotated as ops.append_residual(rotate=True) writes them (the kernel rotates the query)
    rotated_keys: bool
    quantize_keys: Callable[..., object]
    quantize_values: Callable[..., object]
    attention: Callable[..., dict]
    missing: Callable[[KVMethod], list[str]]
    #: the method's transform_query / transform_key run in torch before the kernel and the window (OSCAR's matrix)
    transforms: bool = False
    #: the method's own quantizer over the window's tokens, (method, stream) -> (x, layer_idx, span) -> PackedTensor:
    #: the dequantized copies a stage flushed inside the step swaps in (CupyKVLayer.finish_step)
    own_quantizer: Callable[[KVMethod, str], Callable] = _method_quantizer
    #: the tokens kept exactly (None: none); the exact slots per (row, head); whether their values are kept exactly
    #: too (else the slot holds the value's dequantization); whether the kept set grows at key flushes (OTT's pool:
    #: a stage of values is prepared only once its keys are flushed)
    kept: Callable[..., Tensor] | None = None
    slots: Callable[[KVMethod], int] = lambda m: 0
    kept_values: Callable[[KVMethod], bool] = lambda m: True
    kept_by_keys: bool = False
    assume_kept: Callable[[KVMethod, dict, int], int] = lambda m, state, packed: 0
    #: the channels per quantization group at a head dim (OSCAR's: group_size, or the head dim if smaller)
    group: Callable[[KVMethod, int], int] = lambda m, head_dim: m.group_size

    @property
    def exact(self) -> bool:
        """Tokens kept exactly beside the window (kernels.method_layouts.empty_exact), skipped in the packed part."""
        return self.kept is not None


KERNELS: dict[str, MethodKernels] = dict(
    oscar=MethodKernels(
        keys_per_channel=True, rotated_keys=True,
        quantize_keys=lambda m, k, **where: ops.quantize_keys(k, m.k_bits, m.group_size, rotate=False,
                                                              decode_layout=True, **where),
        quantize_values=lambda m, v, **where: ops.quantize_values(v, m.v_bits, m.group_size, decode_layout=True,
                                                                  **where),
        attention=lambda m, d, device, **layer: dict(method="oscar", rotate_query=True),
        missing=_oscar_missing),
    kivi=MethodKernels(
        keys_per_channel=True, rotated_keys=False,
        quantize_keys=lambda m, k, **where: ops.quantize_channel_keys(k, m.k_bits, m.group_size, m.zero_point,
                                                                      decode_layout=True, **where),
        quantize_values=lambda m, v, **where: ops.quantize_values(v, m.v_bits, m.group_size, decode_layout=True,
                                                                  zero_point=m.zero_point, **where),
        attention=lambda m, d, device, **layer: dict(method="kivi", zero_point=m.zero_point),
        missing=lambda m: _bits(m) + _groups(m) + _window(m)),
    quarot=MethodKernels(
        keys_per_channel=False, rotated_keys=True,
        quantize_keys=lambda m, k, **where: ops.quantize_token_keys(
            k, m.k_bits, m.group_size, decode_layout=True, zero_point=m.zero_point, clip_ratio=m.clip_ratio,
            rotate=False, **where),
        quantize_values=lambda m, v, **where: ops.quantize_values(
            v, m.v_bits, m.group_size, decode_layout=True, zero_point=m.zero_point, clip_ratio=m.clip_ratio, **where),
        attention=lambda m, d, device, **layer: dict(method="quarot", zero_point=m.zero_point),
        missing=lambda m: _bits(m) + _groups(m) + _window(m) + _rotated_window(m)),
    turboquant=MethodKernels(
        keys_per_channel=False, rotated_keys=False,
        quantize_keys=lambda m, k, **where: ops.quantize_turboquant(k, m.group_size, *_turboquant_constants(m, k),
                                                                    decode_layout="keys", **where),
        quantize_values=lambda m, v, **where: ops.quantize_turboquant(v, m.group_size, *_turboquant_constants(m, v),
                                                                      decode_layout="values", **where),
        attention=lambda m, d, device, **layer: dict(method="turboquant", signs=m.signs(d, device),
                                                     codebook=m.codebook(2, d).tolist()),
        missing=_turboquant_missing),
    # OTT's and RotateKV's values: KIVI's / QuaRot's value kernel (their packed part, byte for byte); the values they
    # keep exactly are those of OTT's pool (its state after the keys' flush) or RotateKV's sinks, from the window
    ott=MethodKernels(
        keys_per_channel=True, rotated_keys=False, quantize_keys=_store_own("keys"),
        quantize_values=lambda m, v, layer_idx, span, **where: ops.quantize_values(
            v, m.v_bits, m.group_size, decode_layout=True, zero_point=m.zero_point, **where),
        attention=lambda m, d, device, **layer: dict(method="ott", zero_point=m.zero_point),
        missing=lambda m: _bits(m) + _groups(m) + _window(m), kept=_pool_kept, slots=lambda m: m.pool_size,
        kept_values=lambda m: m.keep_values, kept_by_keys=True, assume_kept=_first_kept("pool", "pool_size")),
    rotatekv=MethodKernels(
        keys_per_channel=False, rotated_keys=False, quantize_keys=_store_own("keys"),
        quantize_values=lambda m, v, layer_idx, span, **where: ops.quantize_values(
            v, m.v_bits, m.group_size, decode_layout=True, zero_point="int", clip_ratio=m.clip(m.v_bits), **where),
        attention=_rotatekv_attention, missing=_rotatekv_missing, kept=_sinks_kept, slots=lambda m: m.num_sinks,
        assume_kept=_first_kept("sinks", "num_sinks")),
    spectral=MethodKernels(
        keys_per_channel=False, rotated_keys=False, quantize_keys=_spectral_quantizer("keys"),
        quantize_values=_spectral_quantizer("values"), attention=_spectral_attention, missing=_spectral_missing,
        transforms=True, own_quantizer=_rotated_quantizer, kept=_prefix_kept, slots=lambda m: m.sink_tokens,
        assume_kept=_first_kept("", "sink_tokens"), group=lambda m, head_dim: m.group(head_dim)),
)


def missing(method: KVMethod) -> list[str]:
    """What of this method configuration the fused kernels do not implement."""
    if method.name == "fp16":
        return []  # the static BF16 mirror, no kernel
    if method.name not in KERNELS:
        return [f"method={method.name} (kernels exist for {', '.join(sorted(KERNELS))})"]
    return KERNELS[method.name].missing(method)


def storage_granule(method: KVMethod) -> int:
    """Packed capacities are multiples of this: whole residual windows, kernel stages and 16-token value tiles."""
    return math.lcm(max(method.residual_length, 1), ops.stage_tokens(method.name, method.group_size), 16)


@register_backend("cupy")
@dataclass
class CupyBackend(Backend):
    """Fused CUDA kernels on packed storage (every method of :data:`KERNELS`); fp16 on the static BF16 mirror."""

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
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if text.num_attention_heads % kv_heads or text.num_attention_heads // kv_heads > 8:
            raise ValueError(f"backend=cupy: {text.num_attention_heads} query heads over {kv_heads} KV heads; the "
                             "decode kernel takes 1 to 8 query heads per KV head")

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
            return TorchStaticCache.for_model(model, method, pad_lengths, capacity)
        return CupyKVCache.for_model(model, method, pad_lengths, capacity, engine=True)

    def capacity_multiple(self, method: KVMethod) -> int:
        if method.name not in KERNELS:  # fp16's mirror
            return max(method.residual_length, method.group_size, 16)
        return storage_granule(method)


def check_method(method: KVMethod) -> None:
    """Raise ValueError unless the fused kernels implement this method configuration."""
    CupyBackend().check(method)


class CupyKVLayer(CacheLayerMixin):
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
        self.stage = ops.stage_tokens(method.name, method.group_size)
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
        self.state.reset()
        if self.is_initialized:
            self._reset_counts()

    def _reset_counts(self) -> None:
        b = self.batch
        self.pads_left = list(self.pad_lengths) if self.pad_lengths is not None else [0] * b
        if len(self.pads_left) != b:
            raise ValueError(f"the cache was built for {len(self.pads_left)} sequences, the model sent {b}")
        self.tokens, self.keys_packed, self.values_packed = [0] * b, [0] * b, [0] * b
        self.n_packed = [0] * b
        self.prepared = {stream: [-1] * b for stream in self.in_step}  # the P whose stage was prepared
        if self.kept is not None:
            self.kept.reset()
        self._sync_counts()

    # -- transformers API ---------------------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        m = self.method
        self.device, self.dtype = key_states.device, key_states.dtype
        b, h, _, d = key_states.shape
        self.batch, self.heads, self.head_dim = b, h, d
        self.group_size = self.kernels.group(m, d)
        self.key_residual = torch.zeros(b, h, self.window, d, dtype=self.dtype, device=self.device)
        self.value_residual = torch.zeros(b, h, self.window, d, dtype=self.dtype, device=self.device)
        self.n_packed_dev = torch.zeros(b, dtype=torch.int32, device=self.device)
        self.n_res_dev = torch.zeros(b, dtype=torch.int32, device=self.device)
        self.keys_packed_dev = torch.zeros(b, dtype=torch.int32, device=self.device)
        self.values_packed_dev = torch.zeros(b, dtype=torch.int32, device=self.device)
        #: the next tokens of each in-step stream to flush (window indices 0 .. stage), dequantized ahead of time
        self.restored = {stream: torch.zeros(b, h, self.stage, d, dtype=self.dtype, device=self.device)
                         for stream in self.in_step}
        self.state.allocate(b, h, self.device)
        # the layouts method.dequantize reads (what the method's own quantizers return)
        probe = torch.ones(1, h, m.group_size, d, dtype=self.dtype, device=self.device)
        self.key_like = self.kernels.own_quantizer(m, "keys")(probe, self.layer_idx)
        self.value_like = self.kernels.own_quantizer(m, "values")(probe, self.layer_idx)
        granule = storage_granule(m)
        self.keys_store = None
        self._allocate(max(granule, math.ceil(self.capacity / granule) * granule))
        if self.kernels.exact:
            self.kept = KeptTokens(b, h, self.kernels.slots(m), d, self.capacity, self.dtype, self.device)
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
        if self.kernels.transforms:
            key_states = self.method.transform_key(key_states, self.layer_idx)
        if self.decoding or (not self.engine and t == 1 and not any(self.pads_left)):
            ops.append_residual(key_states, value_states, self.key_residual, self.value_residual, self.n_res_dev,
                                rotate=self.kernels.rotated_keys)
            self.n_res_dev += 1
            self.attending = key_states
            self._chunk = None
            return key_states, value_states
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
        storage, the exact tokens and the window (it applies OScaR's and QuaRot's query transform; OSCAR's runs in
        torch first). Under the engine the kernel's split plan covers the whole capacity (fixed across steps, so the
        step can be replayed); otherwise the longest stored row, and the step's flushes follow."""
        if self._chunk is not None:
            return self._prefill_attention(module, query, scaling)
        m = self.method
        if self.kernels.transforms:
            query = m.transform_query(query, self.layer_idx)
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
        out = stored_attention(module, self.method.transform_query(query, self.layer_idx), stored_keys,
                               stored_values, stored, new, scaling)
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
            if p:
                idx = torch.tensor(members, device=self.device)
                out_k[idx, :, :p] = self._dequantized("keys", members, [0] * len(members), p)
                out_v[idx, :, :p] = self._dequantized("values", members, [0] * len(members), p)
        for i, (tokens, p, n) in enumerate(zip(self.tokens, self.n_packed, new)):
            out_k[i, :, p:tokens] = self.key_residual[i, :, :tokens - p]
            out_v[i, :, p:tokens] = self.value_residual[i, :, :tokens - p]
            out_k[i, :, tokens:tokens + n] = keys[i, :, t - n:]
            out_v[i, :, tokens:tokens + n] = values[i, :, t - n:]
        return out_k, out_v

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
        """Device, after the step's attention: each in-step stream keeps exactly R tokens unpacked (the ``kivi``
        policy's values, the ``window`` policy's keys and values). Each row whose window passed R gets its oldest
        unpacked token of the stream (window index packed - P) replaced by its dequantization, which ``_prepare``
        computed (and whose bytes it stored) when the token's stage filled; the stream's packed count advances."""
        b, h, _, d = self.value_residual.shape
        for stream in self.in_step:
            window, packed = self._window_of(stream), self._packed_dev(stream)
            due = (self.n_packed_dev + self.n_res_dev - packed > self.method.residual_length)
            at = (packed - self.n_packed_dev).long().view(b, 1, 1, 1).expand(b, h, 1, d)
            restored = torch.where(due.view(b, 1, 1, 1), self.restored[stream].gather(2, at), window.gather(2, at))
            window.scatter_(2, at, restored)
            packed += due

    def advance(self) -> None:
        """Host, between steps: count the step's token; rows whose keys fill a window (or whose P passes a stage)
        are flushed and their windows moved; a stage of the in-step streams that filled is prepared."""
        self.seq_len += 1
        self.tokens = [t + 1 for t in self.tokens]
        due = []
        for i, t in enumerate(self.tokens):
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

    # -- storage ------------------------------------------------------------------------------
    def _window_of(self, stream: str) -> Tensor:
        return self.key_residual if stream == "keys" else self.value_residual

    def _packed_dev(self, stream: str) -> Tensor:
        return self.keys_packed_dev if stream == "keys" else self.values_packed_dev

    def _allocate(self, capacity: int) -> None:
        m = self.method
        keys, values = ops.empty_storage(m.name, self.batch, self.heads, capacity, self.head_dim, k_bits=m.k_bits,
                                         v_bits=m.v_bits, group_size=self.group_size, dtype=self.dtype,
                                         device=self.device)
        if self.keys_store is not None:  # growing: every entry of the old storage (whole value tiles) moves over
            for new, old in ((keys, self.keys_store), (values, self.values_store)):
                for name in new:
                    new[name][:, :, :old[name].shape[2]] = old[name]
        self.keys_store, self.values_store, self.capacity = keys, values, capacity
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

    def assume_stored(self, tokens: int) -> None:
        """Benchmarks: every row holds ``tokens`` tokens, counted as the policy leaves them after a prefill; the
        contents of the storage, windows and exact slots are the caller's (scripts/bench_generate.py writes them at
        random). A method that keeps tokens keeps each row's first ones, as many as its slots hold (its state set
        so: OTT's pool full, RotateKV's sinks, OSCAR's sink prefix; kernels.backend._first_kept)."""
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

    @property
    def n_res(self) -> list[int]:
        """Tokens each row's kernel reads from the window: T - P."""
        return [t - p for t, p in zip(self.tokens, self.n_packed)]

    def _sync_counts(self) -> None:
        """Host counts -> the device tensors the kernels read (in place: their addresses never change)."""
        self.n_packed_dev.copy_(torch.tensor(self.n_packed, dtype=torch.int32))
        self.n_res_dev.copy_(torch.tensor(self.n_res, dtype=torch.int32))
        self.keys_packed_dev.copy_(torch.tensor(self.keys_packed, dtype=torch.int32))
        self.values_packed_dev.copy_(torch.tensor(self.values_packed, dtype=torch.int32))
        if self.kept is not None:
            self.kept.sync_counts(self.n_packed)

    def _packed_prefix(self, tokens: int) -> int:
        """P after ``tokens`` tokens: the tokens whose keys and values are both packed, in whole kernel stages."""
        return min(self.policy.packed(tokens)) // self.stage * self.stage

    def _flush(self, stream: str, x: Tensor, rows: list[int], offsets: list[int], values: Tensor | None = None):
        """Quantize tokens x [len(rows), H, n, D] (as the window holds them) of ``rows`` at stream positions
        ``offsets`` into the packed storage by the method's hook. A method that keeps tokens gets each chunk's span
        (rows sharing a position share a call) and, for keys, stages its kept tokens (their values: ``values``,
        the same tokens' values as they came)."""
        m = self.method
        store = self.keys_store if stream == "keys" else self.values_store
        hook = self.kernels.quantize_keys if stream == "keys" else self.kernels.quantize_values
        if not self.kernels.exact:
            hook(m, x, out=store, rows=rows, offsets=offsets)
            return
        for start, at in _by_offset(offsets).items():
            members = [rows[j] for j in at]
            index = torch.tensor(at, device=self.device)
            span = TokenSpan(torch.tensor(members, device=self.device), start, self.state.tensors)
            hook(m, x[index], self.layer_idx, span, out=store, rows=members, offsets=[start] * len(at))
            if stream == "keys":
                self._keep(members, start, x[index], values[index])

    def _keep(self, rows: list[int], start: int, keys: Tensor, values: Tensor) -> None:
        """Stage the tokens the method keeps among a key chunk [b, H, n, D] of ``rows`` from position ``start``
        (after its key flush: OTT's pool holds them then); a value the method does not keep exactly is staged as
        its dequantization (what the torch path attends)."""
        b, h, n, _ = keys.shape
        mask = self.kernels.kept(self.method, self.state.tensors, torch.tensor(rows, device=self.device), start, n)
        mask = mask.expand(b, h, n)
        if not bool(mask.any()):
            return
        if not self.kernels.kept_values(self.method):
            values = self.method.dequantize(self.kernels.own_quantizer(self.method, "values")(values, self.layer_idx))
        self.kept.stage(rows, start, mask, keys, values)

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
            idx = torch.tensor(members, device=self.device)
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
        policy packs, keep the rest (and packed tokens after P, dequantized) in the window."""
        t = keys.shape[2]
        for i in range(self.batch):
            skip = min(self.pads_left[i], t)
            self.pads_left[i] -= skip
            if skip == t:
                continue
            total, kp, vp, p = self.tokens[i], self.keys_packed[i], self.values_packed[i], self.n_packed[i]
            total_new = total + t - skip
            kp_new, vp_new = self.policy.packed(total_new)
            p_new = self._packed_prefix(total_new)
            # the unpacked tokens of each stream, from its first unpacked one
            k = torch.cat([self.key_residual[i:i + 1, :, kp - p:total - p], keys[i:i + 1, :, skip:]], dim=2)
            v = torch.cat([self.value_residual[i:i + 1, :, vp - p:total - p], values[i:i + 1, :, skip:]], dim=2)
            self._ensure_capacity(max(kp_new, vp_new))
            if kp_new > kp:
                self._flush("keys", k[:, :, :kp_new - kp], [i], [kp], values=v[:, :, kp - vp:kp_new - vp])
            if vp_new > vp:
                self._flush("values", v[:, :, :vp_new - vp], [i], [vp])
            window_k = torch.cat([self._dequantized("keys", [i], [p_new], kp_new - p_new), k[:, :, kp_new - kp:]], 2)
            window_v = torch.cat([self._dequantized("values", [i], [p_new], vp_new - p_new), v[:, :, vp_new - vp:]], 2)
            self.key_residual[i, :, :total_new - p_new] = window_k[0]
            self.value_residual[i, :, :total_new - p_new] = window_v[0]
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
        their dequantized values (the method's own, what the torch path attends) in ``restored`` for
        ``finish_step``. Runs after a prefill and every step, so a stage is prepared before its first token falls
        due: at T = R + 1 (P = 0) or T = P + R + 1 after P moved, R >= stage. Rows sharing packed - P share the
        launches."""
        for stream in self.in_step:
            counts = self.keys_packed if stream == "keys" else self.values_packed
            groups: dict[int, list[int]] = {}
            for i in rows:
                if self._due_stage(stream, i):
                    groups.setdefault(counts[i] - self.n_packed[i], []).append(i)
                    self.prepared[stream][i] = self.n_packed[i]
            for start, members in groups.items():
                idx = torch.tensor(members, device=self.device)
                offsets = [self.n_packed[i] + start for i in members]
                raw = self._window_of(stream)[idx, :, start:self.stage]
                self._ensure_capacity(max(offsets) - start + self.stage)
                self._flush(stream, raw, members, offsets, values=self.value_residual[idx, :, start:self.stage])
                self.restored[stream][idx, :, start:] = self._own_dequantized(stream, raw, members, offsets)

    def _own_dequantized(self, stream: str, x: Tensor, rows: list[int], offsets: list[int]) -> Tensor:
        """The method's own quantization and dequantization of tokens x [len(rows), H, n, D] (as the window holds
        them) of ``rows`` at ``offsets``: what the torch path attends for them, in the model dtype. A method that
        keeps tokens quantizes each position's rows at their span (its kept tokens come back exact)."""
        own = self.kernels.own_quantizer(self.method, stream)
        if not self.kernels.exact:
            return self.method.dequantize(own(x, self.layer_idx)).to(self.dtype)
        out = torch.empty_like(x)
        for start, at in _by_offset(offsets).items():
            index = torch.tensor(at, device=self.device)
            span = TokenSpan(torch.tensor([rows[j] for j in at], device=self.device), start, self.state.tensors)
            packed = replace(own(x[index], self.layer_idx, span), start=start)
            out[index] = self.method.dequantize(packed).to(self.dtype)
        return out

    def packed(self, stream: str, rows: list[int], start: int, n: int) -> PackedTensor:
        """Packed tokens start .. start + n of ``rows`` ("keys" or "values") read back from the storage into the
        reference layout: the PackedTensor the method's own quantizer returns for them (what ``dequantize`` reads),
        with the tokens it keeps exactly among them (from the exact slots; their exact_pos padded with -1 per row
        and head, so the buffers differ in layout from the torch path's concatenated chunks, not in content)."""
        m, g, stop = self.method, self.method.group_size, start + n
        idx = torch.tensor(rows, device=self.device)
        if self.kernels.exact:
            like = self.key_like if stream == "keys" else self.value_like
            store = self.keys_store if stream == "keys" else self.values_store
            order = m.channel_order(self.layer_idx, self.heads * self.head_dim) if m.name == "rotatekv" else None
            packed = method_layouts.load_packed(m.name, stream, store, rows, start, n, like, order)
            if stream == "keys" or self.kernels.kept_values(m):
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

    def _dequantized(self, stream: str, rows: list[int], starts: list[int], n: int) -> Tensor:
        """Packed tokens starts[i] .. starts[i] + n of each of ``rows`` dequantized by the method, in its attention
        space (kept tokens exact): [len(rows), H, n, D] in the model dtype."""
        if n <= 0:
            return torch.empty(len(rows), self.heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        if len(set(starts)) > 1:
            return torch.cat([self._dequantized(stream, [i], [start], n) for i, start in zip(rows, starts)])
        return self.method.dequantize(self.packed(stream, rows, starts[0], n)).to(self.dtype)

    # -- introspection ------------------------------------------------------------------------
    def static_tensors(self) -> list[Tensor]:
        kept = [] if self.kept is None else list(self.kept.buffers.values())
        return [*self.keys_store.values(), *self.values_store.values(), self.key_residual, self.value_residual,
                self.n_packed_dev, self.n_res_dev, self.keys_packed_dev, self.values_packed_dev,
                *self.restored.values(), *kept, *self.state.tensors.values()]

    def token_counts(self) -> dict[str, int]:
        return dict(keys_packed=sum(self.keys_packed), keys_residual=sum(self.tokens) - sum(self.keys_packed),
                    values_packed=sum(self.values_packed),
                    values_residual=sum(self.tokens) - sum(self.values_packed))

    @staticmethod
    def _packed_bytes(store: dict[str, Tensor], tokens: int) -> int:
        """Real bytes of ``tokens`` packed tokens of one row: every buffer's entries for them (one per token, or one
        per group of G tokens for per-channel parameters) times an entry's bytes."""
        capacity = store["codes"].shape[2]
        return sum(tokens * buf.shape[2] // capacity * buf[0, :, 0].numel() * buf.element_size()
                   for buf in store.values())

    @property
    def kept_nbytes(self) -> int:
        """Real bytes of the tokens kept exactly (kernels.kept_tokens.KeptTokens.nbytes); 0 for the other methods."""
        if self.kept is None or not self.is_initialized:
            return 0
        return self.kept.nbytes(self.keys_packed, self.values_packed, self.n_packed)

    @property
    def nbytes(self) -> int:
        """Real stored bytes of the held tokens (what ``QuantizedKVCache.nbytes`` counts): the packed ones in the
        storage (kept tokens' unread codes included, as the torch path counts them), the unpacked ones at full
        precision (the window's dequantized copies of packed tokens are not counted), and ``kept_nbytes``: each kept
        token's key and value once they are packed (in its exact slot; before, as the window's unpacked token)."""
        if not self.is_initialized:
            return 0
        per_token = self.heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        packed = sum(self._packed_bytes(self.keys_store, kp) + self._packed_bytes(self.values_store, vp)
                     + (2 * t - kp - vp) * per_token for t, kp, vp in zip(self.tokens, self.keys_packed,
                                                                          self.values_packed))
        return packed + self.kept_nbytes

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.static_tensors())


def _by_offset(offsets: list[int]) -> dict[int, list[int]]:
    """Offset -> the indices of ``offsets`` that hold it."""
    groups: dict[int, list[int]] = {}
    for j, offset in enumerate(offsets):
        groups.setdefault(offset, []).append(j)
    return groups


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

    def finish_step(self) -> None:
        for layer in self.layers:
            layer.finish_step()
        super().finish_step()
