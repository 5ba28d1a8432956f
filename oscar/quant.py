"""Quantization primitives: Walsh-Hadamard transform, asymmetric group quantizer, Lloyd-Max codebooks, bit packing.

Every method in ``methods/`` is written with these functions only; every CuPy kernel in ``kernels/``
mirrors one of them and is tested against it.

Shapes follow the KV-cache convention ``[B, H, T, D]`` (batch, KV heads, tokens, head dim).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

Axis = Literal["channel", "token"]
ZeroPoint = Literal["int", "float"]

#: bit widths the quantizer and the packer accept; 16 means "stored unquantized" (a pass-through).
SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)


# ----------------------------------------------------------------------------- Hadamard


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_hadamard_dim(d: int) -> None:
    if not is_power_of_two(d):
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two size, got {d}")


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """Dense normalized Sylvester Hadamard matrix, H[i, j] = (-1)^popcount(i & j) / sqrt(d): [d, d].

    The reference the fast transform and the kernels are tested against. Symmetric and orthogonal,
    hence self-inverse.
    """
    _check_hadamard_dim(d)
    idx = torch.arange(d, device=device)
    parity = torch.zeros(d, d, dtype=torch.int64, device=device)
    anded = idx[:, None] & idx[None, :]
    for bit in range(max(1, d.bit_length() - 1)):
        parity ^= (anded >> bit) & 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(d)).to(dtype)


def hadamard(x: Tensor) -> Tensor:
    """Fast normalized Walsh-Hadamard transform over the last dim (natural order): [..., d] -> [..., d].

    O(d log d) butterflies computed in float32 (float64 stays float64), cast back to ``x.dtype``.
    Equal to ``x @ hadamard_matrix(d)``.
    """
    d = x.shape[-1]
    _check_hadamard_dim(d)
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(compute_dtype).reshape(-1, d)
    h = 1
    while h < d:
        # pairs (i, i + h) inside blocks of 2h: a + b, a - b
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) / math.sqrt(d)).to(x.dtype)


# ----------------------------------------------------------------------------- norms


#: magnitudes beyond which (or, above 0, below the inverse of which) a norm is taken of its values scaled by a power of
#: two: 2^50 squared, summed over up to 2^28 values, stays inside float32, and 2^-50 squared stays a normal number
_PLAIN_NORM_RANGE = 2.0 ** 50


def norm_scale(x: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """A power of two per slice of x over ``dim`` (kept as size-1 dims; x's dtype) that brings the slice's largest
    magnitude into [1/2, 1) where that magnitude lies beyond 2^50 or below 2^-50, and 1 elsewhere.

    Dividing by it and multiplying back are exact, so a norm taken as ``norm(x / s) * s`` is bit for bit the plain
    norm wherever the plain sum of squares neither overflows nor underflows (every ordinary input), and finite
    wherever the norm itself is (values up to float32's range, whose squares would overflow)."""
    amax = x.abs().amax(dim=dim, keepdim=True)
    outside = (amax > _PLAIN_NORM_RANGE) | ((amax < 1 / _PLAIN_NORM_RANGE) & (amax > 0))
    power = torch.ldexp(torch.ones_like(amax), torch.frexp(amax).exponent)  # amax in [power / 2, power)
    return torch.where(outside, power, torch.ones_like(amax))


def l2_norm(x: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """The L2 norm of float x over ``dim``, kept as size-1 dims: ``x.square().sum(dim).sqrt()`` bit for bit on
    ordinary inputs, and without the overflow of the squares (or their underflow) on huge (tiny) ones
    (:func:`norm_scale`)."""
    scale = norm_scale(x, dim)
    return (x / scale).square().sum(dim=dim, keepdim=True).sqrt() * scale


# ----------------------------------------------------------------------------- codebooks


@functools.lru_cache(maxsize=None)
def lloyd_max_gaussian(bits: int, iterations: int = 2000) -> tuple[float, ...]:
    """The 2^bits Lloyd-Max levels of N(0, 1) (ascending), by Lloyd's fixed-point iteration.

    Each level is the mean of N(0, 1) over its cell, each cell boundary the midpoint of two levels:
    bits=1 -> +-0.7979, bits=2 -> +-0.4528, +-1.5104. Scale by 1/sqrt(d) for N(0, 1/d).
    """
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    n = 2**bits
    levels = normal.icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    for _ in range(iterations):
        edges = torch.cat([torch.tensor([-math.inf]), (levels[1:] + levels[:-1]) / 2, torch.tensor([math.inf])]).double()
        pdf = torch.exp(normal.log_prob(edges)).nan_to_num(0.0)
        mass = normal.cdf(edges[1:]) - normal.cdf(edges[:-1])
        new = (pdf[:-1] - pdf[1:]) / mass
        if torch.allclose(new, levels, atol=1e-12, rtol=0):
            break
        levels = new
    return tuple(levels.tolist())


# ----------------------------------------------------------------------------- bit packing


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack b-bit codes along the last dim into bytes: uint8 [..., n] -> uint8 [..., n * b / 8].

    Little-endian bit stream: code i occupies bits [i*b, (i+1)*b) of the stream, so for b in
    {1, 2, 4, 8} byte j holds codes j*8/b .. (j+1)*8/b - 1 with the first one in the lowest bits,
    and the buffer read as little-endian int32 words holds 32/b consecutive codes per word.
    Needs n to be a multiple of 8.
    """
    if bits not in range(1, 9):
        raise ValueError(f"can only pack 1..8-bit codes, got bits={bits}")
    n = codes.shape[-1]
    if n % 8:
        raise ValueError(f"packing needs the last dim to be a multiple of 8, got {n}")
    c = codes.to(torch.int32)
    if 8 % bits == 0:  # whole codes per byte: shift each into place
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
        return (c.view(*codes.shape[:-1], n // per_byte, per_byte) << shifts).sum(-1).to(torch.uint8)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], n * bits // 8, 8)
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32))
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Exact inverse of :func:`pack_bits`: uint8 [..., n * b / 8] -> uint8 codes [..., n]."""
    if packed.shape[-1] * 8 != n * bits:
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold {n} codes of {bits} bits")
    p = packed.to(torch.int32)
    if 8 % bits == 0:
        shifts = torch.arange(8 // bits, device=packed.device, dtype=torch.int32) * bits
        return ((p.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(*packed.shape[:-1], n).to(torch.uint8)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((p.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], n, bits)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32))
    return (stream * weights).sum(-1).to(torch.uint8)


# ----------------------------------------------------------------------------- packed tensor


@dataclass
class PackedTensor:
    """A quantized ``[B, H, T, D]`` tensor held as its real stored buffers.

    ``buffers`` holds everything that is stored (packed codes, scales, zeros, token norms,
    full-precision outliers, ...), each with the token (or token-group) axis at dim 2, so chunks
    flushed at different times concatenate with :meth:`cat`. ``nbytes`` is the sum of the buffers:
    every memory figure of the project comes from it. ``meta`` is static (hashable) layout information.
    """

    buffers: dict[str, Tensor]
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    meta: dict = field(default_factory=dict)
    #: stream index of the first token (how many tokens of the sequence were stored before it): set by the
    #: cache when it stores a chunk, read by methods whose dequantization depends on positions
    start: int = 0

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def with_buffers(self, **buffers: Tensor) -> "PackedTensor":
        """A copy with extra (or replaced) buffers, e.g. per-token norms."""
        return replace(self, buffers={**self.buffers, **buffers})

    @staticmethod
    def cat(parts: list["PackedTensor"]) -> "PackedTensor":
        """Concatenate chunks of the same layout along the token axis."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if any(p.meta != first.meta or p.buffers.keys() != first.buffers.keys() for p in parts):
            raise ValueError("cannot concatenate packed tensors of different layouts")
        buffers = {k: torch.cat([p.buffers[k] for p in parts], dim=2) for k in first.buffers}
        b, h, _, d = first.shape
        return PackedTensor(buffers, (b, h, sum(p.num_tokens for p in parts), d), first.dtype, first.meta,
                            first.start)

    def select(self, rows: Tensor | slice) -> "PackedTensor":
        """The same tokens for a subset of the batch rows."""
        buffers = {k: v[rows] for k, v in self.buffers.items()}
        b = next(iter(buffers.values())).shape[0]
        return replace(self, buffers=buffers, shape=(b, *self.shape[1:]))


# ----------------------------------------------------------------------------- quantizer


def check_kv_tensor(x: Tensor, where: str) -> None:
    """Raise ValueError unless ``x`` is a floating-point [B, H, T, D] tensor (T = 0 is an empty chunk)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{where}: expected a torch.Tensor [B, H, T, D], got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{where}: expected a [B, H, T, D] tensor (4 dims), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{where}: expected a floating-point tensor (float32, float16, bfloat16), got {x.dtype}; "
                         "integer codes would be truncated")


def _grouped(x: Tensor, axis: Axis, group_size: int) -> Tensor:
    """[B, H, T, D] -> groups on the last dim: channel -> [B, H, T/G, D, G]; token -> [B, H, T, D/G, G]."""
    b, h, t, d = x.shape
    if axis == "channel":
        if t % group_size:
            raise ValueError(f"per-channel groups of {group_size} tokens need T % G == 0, got T={t}")
        return x.view(b, h, t // group_size, group_size, d).transpose(-1, -2)
    if d % group_size:
        raise ValueError(f"per-token groups of {group_size} channels need D % G == 0, got D={d}")
    return x.view(b, h, t, d // group_size, group_size)


def _ungrouped(g: Tensor, axis: Axis, shape) -> Tensor:
    if axis == "channel":
        return g.transpose(-1, -2).reshape(shape)
    return g.reshape(shape)


def quantize_groups(
    x: Tensor,
    bits: int,
    group_size: int,
    axis: Axis,
    zero_point: ZeroPoint = "int",
    clip_ratio: float = 1.0,
    param_dtype: torch.dtype | None = None,
) -> PackedTensor:
    """Asymmetric uniform quantization of x [B, H, T, D] in groups, packed.

    axis="channel": each (head, channel) is split into groups of G consecutive tokens (KIVI keys).
    axis="token": each token's head vector is split into groups of G consecutive channels.

    zero_point="int" (QuaRot / OScaR): s = (max-min)/(2^b-1), z = round(-min/s),
        q = clamp(round(x/s) + z, 0, 2^b-1), x_hat = (q - z) * s
    zero_point="float" (KIVI): s = (max-min)/(2^b-1), q = clamp(round((x-min)/s), 0, 2^b-1),
        x_hat = q * s + min
    A zero-range group gets a scale that reproduces its constant exactly (never NaN/inf).
    ``clip_ratio`` < 1 shrinks min and max before the scale is taken (RotateKV / QuaRot clipping).
    Scale and zero are stored in ``param_dtype`` (default: x.dtype), and the codes are computed
    from the stored values, so dequantization sees exactly what is kept.

    Returns a PackedTensor with buffers codes [B, H, T, D*b/8] (uint8), scale and zero
    ([B, H, T/G, D] per channel, [B, H, T, D/G] per token). bits=16 stores x as it is.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if x.dim() != 4:
        raise ValueError(f"expected [B, H, T, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"quantize_groups: expected a floating-point tensor, got {x.dtype}")
    shape = tuple(x.shape)
    meta = dict(bits=bits, group_size=group_size, axis=axis, zero_point=zero_point)
    if bits == 16:
        return PackedTensor({"values": x}, shape, x.dtype, meta)
    param_dtype = param_dtype or x.dtype
    g = _grouped(x.float(), axis, group_size)
    levels = 2**bits - 1
    lo = g.amin(-1, keepdim=True) * clip_ratio
    hi = g.amax(-1, keepdim=True) * clip_ratio
    span = hi - lo
    flat = span == 0
    # a constant group c: scale |c| (or 1 for c = 0) represents it exactly in both conventions
    scale = torch.where(flat, torch.where(lo == 0, torch.ones_like(lo), lo.abs()), span / levels)
    scale = scale.to(param_dtype).float()
    if zero_point == "int":
        zero = torch.round(-lo / scale).to(param_dtype).float()
        q = torch.round(g / scale) + zero
    elif zero_point == "float":
        zero = lo.to(param_dtype).float()
        q = torch.round((g - zero) / scale)
    else:
        raise ValueError(f"zero_point must be 'int' or 'float', got {zero_point!r}")
    codes = _ungrouped(q.clamp_(0, levels).to(torch.uint8), axis, shape)
    buffers = {
        "codes": pack_bits(codes, bits),
        "scale": scale.squeeze(-1).to(param_dtype),
        "zero": zero.squeeze(-1).to(param_dtype),
    }
    return PackedTensor(buffers, shape, x.dtype, meta)


def dequantize_groups(p: PackedTensor, dtype: torch.dtype | None = None) -> Tensor:
    """Inverse of :func:`quantize_groups` up to the rounding: PackedTensor -> [B, H, T, D].

    Computed in float32, returned in ``dtype`` (default: the dtype that was quantized).
    """
    dtype = dtype or p.dtype
    bits, axis, group_size = p.meta["bits"], p.meta["axis"], p.meta["group_size"]
    if p.meta.get("layout", "reference") != "reference":
        raise ValueError(f"packed in the {p.meta['layout']} layout of the kernels; convert it first "
                         "(kernels.ops.key_decode_layout / value_decode_layout with inverse=True)")
    if bits == 16:
        return p.buffers["values"].to(dtype)
    shape = p.shape
    codes = unpack_bits(p.buffers["codes"], bits, shape[-1]).float()
    g = _grouped(codes, axis, group_size)
    scale = p.buffers["scale"].float().unsqueeze(-1)
    zero = p.buffers["zero"].float().unsqueeze(-1)
    if p.meta["zero_point"] == "int":
        x = (g - zero) * scale
    else:
        x = g * scale + zero
    return _ungrouped(x, axis, shape).to(dtype)
