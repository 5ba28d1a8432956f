"""TurboQuant+ "turbo2" (the community version of TurboQuant, Zandieh et al., arXiv 2504.19874).

Algorithm, for every head vector x (D channels) of K and of V:
  1. random rotation: y = H_D diag(s) x, with s a seeded +-1 vector and H_D the normalized
     Walsh-Hadamard transform; after it every coordinate of y / ||y|| is close to N(0, 1/D);
  2. scalar quantization of each coordinate of u = y / ||y|| to the nearest level of the Lloyd-Max
     codebook of N(0, 1/D): at 2 bits the levels are +-0.4528/sqrt(D) and +-1.5104/sqrt(D);
  3. a corrected norm per block of G = 32 coordinates (``group_size``), stored in fp16:
     n_b = ||y_b|| / ||c_b|| where c_b are the chosen levels, so the block is rebuilt as n_b * c_b
     with its exact norm (computed in fp32, the huge or tiny vectors scaled by a power of two first);
  4. dequantization: y_hat = n_b * c_b per block, x_hat = diag(s) H_D y_hat.
Other widths b (1-8): the 2^b-level Lloyd-Max codebook of the same N(0, 1/D), which is how the TurboQuant paper
defines its b-bit quantizer (b = 1: +-sqrt(2/pi)/sqrt(D) = +-0.7979/sqrt(D), a sign with the corrected block norm).
Stored per value: b bits of code + 16 bits per 32 values = 2.5 bits at b = 2. The signs (D bits per
model, fixed by ``seed``) and the codebook are constants of the method, not per-token state, so
``nbytes`` does not count them. The original TurboQuant adds a 1-bit QJL sketch of the residual for
unbiased inner products; TurboQuant+ drops it (as we do: not implemented).
Choices that are ours: one sign vector shared by every layer and head (as TurboQuant+ does); the
most recent R tokens kept in full precision with the ``kivi`` flush policy, for a fair comparison
with the other methods (``residual_length=0`` quantizes everything, as TurboQuant+ does); a corrected norm
beyond fp16 (n_b is about 8.5 x the vector's RMS at D = 64, so values of RMS above ~7,700) is stored in the same
16 bits as a bfloat16 (float32's range, 8 significant bits) with the sign bit, unused by a norm, as its flag
(:func:`encode_norms`): fp16 alone would make those blocks inf and their vectors NaN.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from oscar.method import FlushPolicy, KVMethod, register_method
from oscar.quant import (PackedTensor, hadamard, is_power_of_two, lloyd_max_gaussian, norm_scale, pack_bits,
                         unpack_bits)


# Constants of the method, made once per device (a decode step replayed from a CUDA graph cannot copy them in)
@functools.cache
def _signs(seed: int, d: int, device: torch.device) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=gen) * 2 - 1).float().to(device)


@functools.cache
def _codebook(bits: int, d: int, device: torch.device) -> Tensor:
    return (torch.tensor(lloyd_max_gaussian(bits), dtype=torch.float64) / math.sqrt(d)).float().to(device)


def encode_norms(norm: Tensor) -> Tensor:
    """Corrected block norms (float32, >= 0) as 16 stored bits each, an fp16 tensor: the fp16 number wherever it is
    finite (TurboQuant+'s format, bit for bit), else the bfloat16 number with the sign bit set."""
    half = norm.to(torch.float16)
    wide = (norm.to(torch.bfloat16).view(torch.int16) | -0x8000).view(torch.float16)
    return torch.where(torch.isfinite(half), half, wide)


def decode_norms(stored: Tensor) -> Tensor:
    """The float32 norms of :func:`encode_norms`' bits (read as bits: never computed with as fp16)."""
    bits = stored.view(torch.int16)
    return torch.where(bits < 0, (bits & 0x7FFF).view(torch.bfloat16).float(), stored.float())


@register_method("turboquant")
@dataclass
class TurboQuant(KVMethod):
    uses_hadamard = True

    flush: FlushPolicy = "kivi"
    #: seed of the random +-1 signs applied before the Hadamard transform
    seed: int = 0

    def check_model(self, head_dim: int, num_kv_heads: int) -> None:
        if not is_power_of_two(head_dim):
            raise ValueError(f"turboquant rotates with a Hadamard transform: head_dim must be a power of two, got {head_dim}")
        if head_dim % self.group_size:
            raise ValueError(f"turboquant: group_size={self.group_size} (values per corrected norm) must divide head_dim={head_dim}")

    def signs(self, d: int, device=None) -> Tensor:
        """The seeded +-1 vector [d] (float32) applied before the Hadamard transform."""
        return _signs(self.seed, d, torch.device(device or "cpu"))

    def codebook(self, bits: int, d: int, device=None) -> Tensor:
        """Lloyd-Max levels of N(0, 1/d), ascending: [2^bits] float32."""
        return _codebook(bits, d, torch.device(device or "cpu"))

    def _quantize(self, x: Tensor, bits: int) -> PackedTensor:
        b, h, t, d = x.shape
        g = self.group_size
        meta = dict(bits=bits, group_size=g, method="turboquant")
        if bits == 16:
            return PackedTensor({"values": x}, tuple(x.shape), x.dtype, meta)
        if d % g:
            raise ValueError(f"turboquant: group_size={g} must divide head_dim={d}")
        scale = norm_scale(x.float(), -1)  # 1 but for huge (tiny) vectors: y is H diag(s) x / scale
        y = hadamard(x.float() / scale * self.signs(d, x.device))
        norm = y.norm(dim=-1, keepdim=True)
        u = y / torch.where(norm == 0, torch.ones_like(norm), norm)
        levels = self.codebook(bits, d, x.device)
        codes = torch.bucketize(u, (levels[1:] + levels[:-1]) / 2)  # nearest level
        chosen = levels[codes].view(b, h, t, d // g, g)
        blocks = y.view_as(chosen)
        corrected = blocks.norm(dim=-1) / chosen.norm(dim=-1) * scale  # levels are never 0, neither is the norm
        buffers = {"codes": pack_bits(codes.to(torch.uint8), bits), "norm": encode_norms(corrected)}
        return PackedTensor(buffers, tuple(x.shape), x.dtype, meta)

    def quantize_keys(self, k: Tensor, layer_idx: int) -> PackedTensor:
        return self._quantize(k, self.k_bits)

    def quantize_values(self, v: Tensor, layer_idx: int) -> PackedTensor:
        return self._quantize(v, self.v_bits)

    def dequantize(self, packed: PackedTensor) -> Tensor:
        bits = packed.meta["bits"]
        if bits == 16:
            return packed.buffers["values"]
        b, h, t, d = packed.shape
        codes = unpack_bits(packed.buffers["codes"], bits, d).long()
        levels = self.codebook(bits, d, codes.device)[codes]
        g = packed.meta["group_size"]
        blocks = levels.view(b, h, t, d // g, g) * decode_norms(packed.buffers["norm"]).unsqueeze(-1)
        x = hadamard(blocks.view(b, h, t, d)) * self.signs(d, codes.device)
        largest = torch.finfo(packed.dtype).max  # the inputs were finite: an error past the dtype's range is cut back
        return x.clamp(-largest, largest).to(packed.dtype)
