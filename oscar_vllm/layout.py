"""One vLLM KV-cache page of OScaR: the packed keys and values of ``block_size`` tokens of one layer, all heads.

A page of B tokens holds B/G whole per-channel key groups and B/16 whole 16-token value tiles, each buffer in the
decode layout that ``kernels.ops.decode_attention`` reads (``kernels.ops.key_decode_layout``,
``value_decode_layout``). Regions, in this order inside the page's bytes (H = the rank's KV heads, D = head dim,
kb/vb = key/value bits, G = group size, ``dtype`` = the model's, for scale and zero):

    key_norm     [1, B, 1]        float32   OScaR's token norms (over the H heads of the page)
    key_scale    [H, B/G, D]      dtype     per-channel key groups, decode layout
    key_zero     [H, B/G, D]      dtype
    value_scale  [H, B, D/G]      dtype     per-token value groups, 16-token tiles
    value_zero   [H, B, D/G]      dtype
    key_codes    [H, B, D*kb/8]   uint8
    value_codes  [H, B, D*vb/8]   uint8

Every region has its token (or token-group) axis at dim 1, so the pages of a sequence, laid side by side along
that axis, are exactly the contiguous storage of :func:`kernels.ops.empty_storage` with capacity n*B (per-channel
groups, token norms and value tiles never cross a page). A page is ``B * bytes_per_token`` bytes: every region is
linear in B, so the bytes of one token are a constant (vLLM sizes its pages from one token's bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from oscar.quant import PackedTensor

KEY_REGIONS = ("key_norm", "key_scale", "key_zero", "key_codes")
VALUE_REGIONS = ("value_scale", "value_zero", "value_codes")
#: the order of the regions inside a page (fp32 first, then 2-byte parameters, then bytes: every offset aligned)
REGION_ORDER = ("key_norm", "key_scale", "key_zero", "value_scale", "value_zero", "key_codes", "value_codes")
#: tokens of a value tile (kernels.ops.value_decode_layout)
VALUE_TILE = 16


@dataclass(frozen=True)
class PageLayout:
    """Where each packed buffer of one page lives; shapes per page, bytes from the element sizes."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    dtype: torch.dtype = torch.float16

    def __post_init__(self):
        b, g, d = self.block_size, self.group_size, self.head_dim
        if self.k_bits not in (2, 4) or self.v_bits not in (2, 4):
            raise ValueError(f"OScaR pages pack 2 or 4 bits, got k_bits={self.k_bits}, v_bits={self.v_bits}")
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"scale/zero are stored in the model dtype, float16 or bfloat16; got {self.dtype}")
        if d % g or g % VALUE_TILE or g * self.v_bits % 64:
            raise ValueError(f"group size {g} must divide head_dim {d}, be a multiple of {VALUE_TILE} and hold "
                             f"8+ value code bytes (G * v_bits a multiple of 64)")
        if b % g or b % VALUE_TILE:
            raise ValueError(f"a page of {b} tokens must hold whole key groups of {g} and value tiles of "
                             f"{VALUE_TILE} tokens: use a block size that is a multiple of {math.lcm(g, VALUE_TILE)}")
        if self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, got {self.num_kv_heads}")

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """(shape per page, element dtype) of every region, in page order."""
        b, h, d, g = self.block_size, self.num_kv_heads, self.head_dim, self.group_size
        table = dict(key_norm=((1, b, 1), torch.float32), key_scale=((h, b // g, d), self.dtype),
                     key_zero=((h, b // g, d), self.dtype), value_scale=((h, b, d // g), self.dtype),
                     value_zero=((h, b, d // g), self.dtype), key_codes=((h, b, d * self.k_bits // 8), torch.uint8),
                     value_codes=((h, b, d * self.v_bits // 8), torch.uint8))
        return {name: table[name] for name in REGION_ORDER}

    def offsets(self) -> dict[str, int]:
        """Byte offset of every region inside a page."""
        out, at = {}, 0
        for name, (shape, dtype) in self.shapes().items():
            out[name] = at
            at += math.prod(shape) * dtype.itemsize
        return out

    @property
    def page_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.shapes().values())

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token in one layer (page_bytes / block_size: every region is linear in B)."""
        return self.page_bytes // self.block_size

    def views(self, pages: Tensor) -> dict[str, Tensor]:
        """The regions of every page as typed views (no copy), [num_blocks, *shape] each.

        pages: uint8 [num_blocks, >= page_bytes] whose rows are contiguous (a vLLM layer's KV cache flattened per
        block; rows may be padded past ``page_bytes``)."""
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.stride(1) != 1:
            raise ValueError(f"pages must be a uint8 [num_blocks, bytes] tensor with contiguous rows, "
                             f"got {pages.dtype} {tuple(pages.shape)} strides {pages.stride()}")
        if pages.shape[1] < self.page_bytes:
            raise ValueError(f"a page holds {pages.shape[1]} bytes, the layout needs {self.page_bytes}")
        n = pages.shape[0]
        out = {}
        for (name, (shape, dtype)), at in zip(self.shapes().items(), self.offsets().values()):
            size = math.prod(shape) * dtype.itemsize
            out[name] = pages[:, at:at + size].view(dtype).view(n, *shape)
        return out

    def write(self, pages: Tensor, block_ids: Tensor, keys: dict[str, Tensor], values: dict[str, Tensor]) -> None:
        """Store whole blocks: keys/values in the decode layout with batch n and capacity B (what
        ``kernels.ops.quantize_keys``/``quantize_values`` return with ``decode_layout=True``), row i into the page
        ``block_ids[i]``."""
        views = self.views(pages)
        block_ids = block_ids.to(device=pages.device, dtype=torch.long)
        for name, x in self._named(keys, values).items():
            shape, dtype = self.shapes()[name]
            if tuple(x.shape) != (block_ids.numel(), *shape) or x.dtype != dtype:
                raise ValueError(f"{name}: expected {(block_ids.numel(), *shape)} {dtype} (one row per block), got "
                                 f"{tuple(x.shape)} {x.dtype}")
            views[name][block_ids] = x.to(pages.device)

    def gather(self, pages: Tensor, block_table: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The packed storage of b sequences from their pages: block_table [b, n] (page ids in token order; pad
        rows with any valid id) -> (keys, values) dicts, contiguous, with capacity n*B: exactly the buffers of
        :func:`kernels.ops.empty_storage` (decode layouts) for ``decode_attention``."""
        views = self.views(pages)
        table = block_table.to(device=pages.device, dtype=torch.long)
        b, n = table.shape
        out = {}
        for name, view in views.items():
            x = view[table.reshape(-1)]  # [b*n, h, t, f]
            _, h, t, f = x.shape
            out[name] = x.view(b, n, h, t, f).transpose(1, 2).reshape(b, h, n * t, f)
        keys = {name.removeprefix("key_"): out[name] for name in KEY_REGIONS}
        values = {name.removeprefix("value_"): out[name] for name in VALUE_REGIONS}
        return keys, values

    def packed_tensors(self, keys: dict[str, Tensor], values: dict[str, Tensor]) -> tuple[PackedTensor, PackedTensor]:
        """Gathered decode-layout storage -> the methods' reference layout as PackedTensors (what
        ``methods.oscar.OScaR.quantize_keys``/``quantize_values`` return; ``dequantize`` reads them)."""
        from kernels.ops import key_decode_layout, value_decode_layout

        ref_keys = key_decode_layout(keys, self.k_bits, inverse=True)
        ref_values = value_decode_layout(values, self.v_bits, self.group_size, inverse=True)
        b, h, t, _ = keys["codes"].shape
        shape = (b, h, t, self.head_dim)
        key_meta = dict(bits=self.k_bits, group_size=self.group_size, axis="channel", zero_point="int")
        value_meta = dict(bits=self.v_bits, group_size=self.group_size, axis="token", zero_point="int")
        return (PackedTensor(ref_keys, shape, self.dtype, key_meta),
                PackedTensor(ref_values, shape, self.dtype, value_meta))

    @staticmethod
    def _named(keys: dict[str, Tensor], values: dict[str, Tensor]) -> dict[str, Tensor]:
        named = {f"key_{k}": v for k, v in keys.items()} | {f"value_{k}": v for k, v in values.items()}
        if set(named) != set(REGION_ORDER):
            raise ValueError(f"expected buffers {sorted(REGION_ORDER)}, got {sorted(named)}")
        return named
