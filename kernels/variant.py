"""Kernel variants: what a method runs on the kernels of kernels.ops, each declared in its own kernels/variants/ file.

A variant is a small class registered under its method's name (``@register_variant("kivi")``, oscar.registry's one
behaviour: a name taken is refused, discovery of kernels/variants/ is lazy, an unknown name lists the known ones).
It names the kernel family it uses (``kernel``: a key of ``ops.METHODS``, which the cache passes to the storage,
stage and layout helpers), writes a chunk of tokens into the storage (``quantize_keys`` / ``quantize_values``), gives
the method's keywords of ``ops.decode_attention`` (``attention``) and says what of a configuration its kernels lack
(``missing``); a variant of a method that keeps tokens exactly also says which (``kept_positions``:
kernels.kept_tokens) and stages them as its keys flush (``flush_keys``). The cache (kernels.cupy_layer.CupyKVLayer)
reads nothing else of a method, so a new kernel method is one file in kernels/variants/ (docs/extending.md, step 6).
:data:`KERNELS` maps method names to variant instances.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Callable, ClassVar

import torch
from torch import Tensor

from kernels import method_layouts, ops
from oscar.exact import positions_mask
from oscar.method import KVMethod, TokenSpan
from oscar.quant import PackedTensor
from oscar.registry import Registry

#: kernel variants by method name; the first lookup imports every module of kernels.variants
VARIANTS: Registry["KernelVariant"] = Registry("kernel variant", ["kernels.variants"])


def register_variant(name: str):
    """Class decorator: the kernel variant of method ``name`` (a name taken: ValueError)."""
    return VARIANTS.register(name)


class KernelVariant:
    """The interface (defaults: a method whose window holds its keys as they came, no token kept exactly).

    ``quantize_keys(method, keys, **where)`` and ``quantize_values(method, values, **where)`` write [b, H, n, D] tokens
    (keys as the window holds them) into the storage in the decode layouts (``where``: out, rows, offsets); with
    ``exact`` they also take the layer and the chunk's TokenSpan (``quantize_keys(method, keys, layer_idx,
    span, **where)``: OTT's keys update the outlier pool in span.state). ``attention(method, head_dim, device,
    layer_idx=, capacity=, heads=)`` gives the keywords of ops.decode_attention for a layer of that packed capacity
    and KV heads."""

    name: ClassVar[str] = "base"
    #: the kernel family (ops.METHODS key): storage, stages, layouts and decode_attention's ``method``
    kernel: ClassVar[str] = ""
    #: keys in per-channel groups of G tokens (key_decode_layout), else per token (token_key_decode_layout)
    keys_per_channel: ClassVar[bool] = False
    #: the window holds keys rotated as ops.append_residual(rotate=True) writes them (the kernel rotates the query)
    rotated_keys: ClassVar[bool] = False
    #: the method's transform_query / transform_key run before the kernel and the window (OSCAR's matrix): a decode
    #: token's through :meth:`transform_token`, a prefill chunk's in torch
    transforms: ClassVar[bool] = False
    #: tokens kept exactly beside the window (kernels.kept_tokens), skipped in the packed part: see :meth:`kept`
    exact: ClassVar[bool] = False
    #: the kept set grows at key flushes (OTT's pool): a stage of values is prepared only once its keys are flushed
    kept_by_keys: ClassVar[bool] = False
    #: stream -> the storage layout ops.dequantize reads it back from (a prefill chunk's stored prefix): see
    #: :meth:`dequantize`
    dequantize_layouts: ClassVar[dict[str, str]] = {}

    def quantize_keys(self, m: KVMethod, keys: Tensor, *args, **where):
        raise NotImplementedError

    def quantize_values(self, m: KVMethod, values: Tensor, *args, **where):
        raise NotImplementedError

    def attention(self, m: KVMethod, head_dim: int, device, **layer) -> dict:
        return dict(method=self.kernel)

    def transform_token(self, m: KVMethod, x: Tensor, layer_idx: int) -> Tensor:
        """A decode step's query [B, Hq, 1, D] or new key [B, Hkv, 1, D] in the method's attention space, for a
        variant that :attr:`transforms` (its queries and keys take one map: transform_query is transform_key).
        Default: the method's torch transform_key."""
        return m.transform_key(x, layer_idx)

    def missing(self, m: KVMethod) -> list[str]:
        """What of this configuration the kernels do not implement (default: bits, groups, the window's stage)."""
        return self.bits(m) + self.groups(m) + self.window(m)

    def reads_packed(self, stream: str) -> bool:
        """Whether a kernel reads ``stream``'s packed tokens straight from the storage (:meth:`dequantize`); where
        not, the cache runs the method's own dequantize of the reference layout. Default: :attr:`dequantize_layouts`
        names a layout for it."""
        return stream in self.dequantize_layouts

    def dequantize(self, m: KVMethod, stream: str, store: dict, rows: Tensor, start: int, n: int, out: Tensor,
                   layer_idx: int) -> Tensor:
        """Packed tokens start .. start + n of storage rows ``rows`` (int32 [b]) of ``stream`` of layer ``layer_idx``
        read by a kernel straight from ``store`` into ``out`` [b, H, n, D], bit for bit the method's dequantize; called
        only where :meth:`reads_packed`. Default: ops.dequantize of the layout :attr:`dequantize_layouts` names, with
        the stream's :meth:`code_map`."""
        bits = m.k_bits if stream == "keys" else m.v_bits
        return ops.dequantize(store, self.dequantize_layouts[stream], bits, self.group(m, out.shape[-1]), rows, start,
                              n, out, **self.code_map(m, stream))

    def code_map(self, m: KVMethod, stream: str) -> dict:
        """ops.dequantize's keywords for the codes of ``stream`` as the method stores them (default: its zero point)."""
        return dict(zero_point=m.zero_point)

    def group(self, m: KVMethod, head_dim: int) -> int:
        """Channels per quantization group at this head dim."""
        return m.group_size

    def own_quantizer(self, m: KVMethod, stream: str) -> Callable[..., PackedTensor]:
        """The method's own quantizer of ``stream`` over tokens as the window holds them: (x, layer_idx, span) ->
        PackedTensor (the dequantized copies a stage flushed inside the step swaps in: CupyKVLayer.finish_step)."""
        own = m.quantize_keys if stream == "keys" else m.quantize_values
        return lambda x, layer_idx, span=None: own(x, layer_idx, span=span)

    def channel_order(self, m: KVMethod, layer_idx: int, channels: int) -> Tensor | None:
        """The key channel order the storage layout reads (RotateKV's permutation); None: none."""
        return None

    # -- tokens kept exactly (exact) -----------------------------------------------------
    def kept_positions(self, m: KVMethod, state: dict, device) -> Tensor:
        """The stream positions the method keeps, on ``device`` (after a chunk's key flush): int64 [B or 1, 1 or H,
        K], -1 = none (one row: every row's; one head: every head's)."""
        raise NotImplementedError

    def kept(self, m: KVMethod, state: dict, rows: Tensor, start: int, n: int) -> Tensor:
        """Which tokens of a chunk of ``rows`` [b] from stream position ``start`` the method keeps: [b, 1 or H, n]
        bool (after the chunk's key flush), from :meth:`kept_positions`."""
        positions = self.kept_positions(m, state, rows.device)
        positions = positions.expand(len(rows), -1, -1) if positions.shape[0] == 1 else positions[rows]
        return positions_mask(positions, start, n)

    def kept_limit(self, m: KVMethod) -> int | None:
        """Positions from here on are never kept, known on the host (OSCAR's sink prefix): a chunk that starts there
        stages nothing and reads no kept token back. None: any position may be kept."""
        return None

    def slots(self, m: KVMethod) -> int:
        """The most tokens one (row, head) keeps."""
        return 0

    def flush_keys(self, m: KVMethod, keys: Tensor, values: Tensor, layer_idx: int, span: TokenSpan, kept,
                   **where) -> PackedTensor:
        """An ``exact`` method's key chunk [b, H, n, D] (as the window holds it) flushed into the storage, and the
        tokens it keeps staged in ``kept`` (kernels.kept_tokens.KeptTokens; their values from ``values``, the same
        tokens' as they came): quantize_keys, then the tokens at :meth:`kept_positions` staged in one launch (a
        value the method does not keep exactly as its dequantization by the method's own quantizer, per token).
        Returns quantize_keys' result."""
        packed = self.quantize_keys(m, keys, layer_idx, span, **where)
        if self.may_keep(m, span.start):
            kept.stage_positions(span.rows, span.start, self.kept_positions(m, span.state, keys.device), keys, values,
                                 self.value_map(m, layer_idx))
        return packed

    def may_keep(self, m: KVMethod, start: int) -> bool:
        """Whether tokens from stream position ``start`` on may be kept (:meth:`kept_limit`)."""
        limit = self.kept_limit(m)
        return limit is None or start < limit

    def value_map(self, m: KVMethod, layer_idx: int) -> Callable[[Tensor], Tensor] | None:
        """What a kept token's value slot holds, as a map of values [..., D] (per token): None where it is the value
        itself (:meth:`kept_values`), else its dequantization by the method's own quantizer."""
        if self.kept_values(m):
            return None
        own = self.own_quantizer(m, "values")
        return lambda v: m.dequantize(own(v, layer_idx))

    def kept_values(self, m: KVMethod) -> bool:
        """Whether kept tokens' values are kept exactly too (else their slot holds the value's dequantization)."""
        return True

    def assume_kept(self, m: KVMethod, state: dict, packed: int) -> int:
        """Benchmarks (CupyKVLayer.assume_stored): set ``state`` as if each row's first tokens were kept, among
        ``packed`` packed keys; returns how many per (row, head)."""
        return 0

    # -- the checks most variants share ---------------------------------------------------------
    def bits(self, m: KVMethod, allowed: tuple[int, ...] = ops.SUPPORTED_BITS) -> list[str]:
        if m.k_bits in allowed and m.v_bits in allowed:
            return []
        return [f"k_bits={m.k_bits}, v_bits={m.v_bits} (the kernels pack {' or '.join(map(str, allowed))} bits)"]

    def groups(self, m: KVMethod) -> list[str]:
        """G of the value tiles (and of per-token key k-steps): a multiple of 16 up to 128, G * v_bits a multiple
        of 64."""
        g = m.group_size
        if g % 16 or g > 128 or g * m.v_bits % 64:
            return [f"group_size={g} (G a multiple of 16 up to 128 with G * v_bits a multiple of 64)"]
        return []

    def window(self, m: KVMethod) -> list[str]:
        """The tokens that leave the window one at a time (the kivi policy's values, the window policy's keys and
        values) are prepared a kernel stage ahead (CupyKVLayer): the window must hold a stage."""
        stage = ops.stage_tokens(self.kernel, m.group_size)
        if m.flush_policy.values_slide and m.residual_length < stage:
            return [f"residual_length={m.residual_length} with flush={m.flush} (the kernel path needs R >= {stage})"]
        return []


class OwnQuantizer(KernelVariant):
    """A variant whose keys flush with the method's own torch quantizer (its bookkeeping: OSCAR's prefix
    and Lloyd-Max codebook; the torch path's bytes by construction), written into the decode layouts by
    method_layouts.store_packed. Returns the method's PackedTensor, without the tokens it keeps
    exactly (the cache stages those in its exact slots: ``TokenSpan.kept_elsewhere``)."""

    def store_own(self, m: KVMethod, stream: str, x: Tensor, layer_idx: int, span: TokenSpan, out: dict, rows,
                  offsets) -> PackedTensor:
        packed = self.own_quantizer(m, stream)(x, layer_idx, replace(span, kept_elsewhere=True))
        order = self.channel_order(m, layer_idx, x.shape[1] * x.shape[3])
        method_layouts.store_packed(self.kernel, stream, packed, out, rows, offsets, order)
        return packed

    def quantize_keys(self, m: KVMethod, keys: Tensor, layer_idx: int, span: TokenSpan, **where):
        return self.store_own(m, "keys", keys, layer_idx, span, **where)


def first_kept(state: dict, field: str, n: int) -> int:
    """``state[field]`` (stream positions [B, m, P], -1 = none) holding each row's first ``n`` tokens; returns n."""
    state[field].fill_(-1)
    state[field][..., :n] = torch.arange(n, device=state[field].device)
    return n


class _Variants(Mapping):
    """Method name -> its kernel variant (one instance each), over the registry (lazy discovery)."""

    def __init__(self):
        self._made: dict[str, KernelVariant] = {}

    def __getitem__(self, name: str) -> KernelVariant:
        cls = VARIANTS.find(name)
        if cls is None:
            raise KeyError(name)
        if type(self._made.get(name)) is not cls:
            self._made[name] = cls()
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(VARIANTS.names())

    def __len__(self) -> int:
        return len(VARIANTS.names())


#: the kernel variant of each method with kernels, by method name
KERNELS: Mapping[str, KernelVariant] = _Variants()


def storage_granule(method: KVMethod) -> int:
    """Packed capacities are multiples of this: whole residual windows, kernel stages and 16-token value tiles."""
    stage = ops.stage_tokens(KERNELS[method.name].kernel, method.group_size)
    return math.lcm(max(method.residual_length, 1), stage, 16)
