"""Torch references of the decode-attention kernels, one per method: softmax(q' k'^T * scaling) v' over the
dequantized packed tokens followed by the full-precision residual tokens of every sequence.

Arguments mirror ``kernels.ops.decode_attention`` but take the packed storage in the methods' reference layout
(what ``quantize_keys``/``quantize_values`` of the method return, the ``*_decode_layout(..., inverse=True)`` of
what the kernels read): query [B, Hq, 1, D] in the model dtype, keys/values dicts with capacity cap,
key_residual/value_residual [B, H, rcap, D] as the kernel reads them, n_packed/n_residual [B] (any device).
``dtype`` is the precision of the attention: float64 gives the exact result of the dequantized cache (the fp32
dequantization, not rounded); the model dtype gives the plain torch path (the methods' ``dequantize``, which
rounds to the model dtype, then SDPA in that dtype). Returns [B, Hq, 1, D] float32. OTT, RotateKV and OSCAR also
take ``exact`` (kernels.method_layouts.empty_exact): their exactly kept tokens are attended from it, and the packed
tokens its skip bits name are left out.

TurboQuant+ also has :func:`turboquant_quantize`, the method's quantizer with every fp32 sum taken in the order
the quantization kernel takes it (the method's own ``torch.norm`` may round a norm differently by an ulp).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.method_layouts import skip_mask
from methods.rotatekv import grouped_head_hadamard, permute_channels
from methods.spectral import clip_rows
from oscar.quant import PackedTensor, dequantize_groups, hadamard, pack_bits, unpack_bits
from oscar.rope import apply_rope, undo_rope


def _decode(query: Tensor, packed_keys: Callable, packed_values: Callable, key_residual: Tensor,
            value_residual: Tensor, n_packed: Tensor, n_residual: Tensor, scaling: float, dtype: torch.dtype,
            transform_query: Callable = lambda q: q, exact: dict | None = None) -> Tensor:
    """packed_keys(i, n) / packed_values(i, n): sequence i's n packed tokens dequantized in fp32 [1, H, n, D]; with
    ``exact``, its kept tokens between the packed and the window ones, the skipped packed ones masked out."""
    outs = []
    packed_dtype = query.dtype if dtype != torch.float64 else torch.float64
    for i, (n, r) in enumerate(zip(n_packed.tolist(), n_residual.tolist())):
        keys = [packed_keys(i, n).to(packed_dtype), key_residual[i:i + 1, :, :r]]
        values = [packed_values(i, n).to(packed_dtype), value_residual[i:i + 1, :, :r]]
        mask = None
        if exact is not None:
            h, e = exact["keys"].shape[1], exact["keys"].shape[2]
            keys.insert(1, exact["keys"][i:i + 1])
            values.insert(1, exact["values"][i:i + 1])
            count = exact["count"][i].to(key_residual.device).view(h, 1)
            mask = torch.cat([~skip_mask(exact["skip"][i], n).to(key_residual.device),
                              torch.arange(e, device=key_residual.device) < count,
                              torch.ones(h, r, dtype=torch.bool, device=key_residual.device)], dim=-1)
        k = torch.cat([x.to(dtype) for x in keys], dim=2)
        v = torch.cat([x.to(dtype) for x in values], dim=2)
        q = transform_query(query[i:i + 1])
        rep = q.shape[1] // k.shape[1]
        attn_mask = None if mask is None else mask.repeat_interleave(rep, 0).view(1, q.shape[1], 1, -1)
        outs.append(F.scaled_dot_product_attention(q.to(dtype), k.repeat_interleave(rep, 1),
                                                   v.repeat_interleave(rep, 1), attn_mask=attn_mask, scale=scaling))
    return torch.cat(outs).float()


def _groups(store: dict, names, i: int, n: int, axis: str, bits: int, group_size: int, zero_point: str,
            dtype: torch.dtype) -> Tensor:
    """Sequence i's first n tokens of a quantize_groups layout, dequantized in fp32: [1, H, n, D]."""
    per_group = n // group_size if axis == "channel" else n
    buffers = {name: store[name][i:i + 1, :, :per_group if name in ("scale", "zero") else n] for name in names}
    h, d = store["codes"].shape[1], store["codes"].shape[-1] * 8 // bits
    meta = dict(bits=bits, group_size=group_size, axis=axis, zero_point=zero_point)
    return dequantize_groups(PackedTensor(buffers, (1, h, n, d), dtype, meta), torch.float32)


def oscar_decode(query: Tensor, keys: dict, values: dict, key_residual: Tensor, value_residual: Tensor,
                 n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int, group_size: int, scaling: float,
                 dtype: torch.dtype = torch.float64, rotate_query: bool = True) -> Tensor:
    """OScaR: q' = H q (model dtype), k' = norm * dequant(K) (per-channel groups, integer zero), v' = dequant(V)
    (per token); the residual keys are already rotated."""
    def packed_keys(i, n):
        k = _groups(keys, ("codes", "scale", "zero"), i, n, "channel", k_bits, group_size, "int", query.dtype)
        return k * keys["norm"][i:i + 1, :, :n].float()

    def packed_values(i, n):
        return _groups(values, ("codes", "scale", "zero"), i, n, "token", v_bits, group_size, "int", query.dtype)

    return _decode(query, packed_keys, packed_values, key_residual, value_residual, n_packed, n_residual, scaling,
                   dtype, hadamard if rotate_query else lambda q: q)


def kivi_decode(query: Tensor, keys: dict, values: dict, key_residual: Tensor, value_residual: Tensor,
                n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int, group_size: int, scaling: float,
                dtype: torch.dtype = torch.float64, zero_point: str = "float") -> Tensor:
    """KIVI: no transform; keys per-channel groups of G tokens, values per token, both with a float zero point (or
    ``zero_point``)."""
    def packed_keys(i, n):
        return _groups(keys, ("codes", "scale", "zero"), i, n, "channel", k_bits, group_size, zero_point, query.dtype)

    def packed_values(i, n):
        return _groups(values, ("codes", "scale", "zero"), i, n, "token", v_bits, group_size, zero_point, query.dtype)

    return _decode(query, packed_keys, packed_values, key_residual, value_residual, n_packed, n_residual, scaling,
                   dtype)


def quarot_decode(query: Tensor, keys: dict, values: dict, key_residual: Tensor, value_residual: Tensor,
                  n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int, group_size: int, scaling: float,
                  dtype: torch.dtype = torch.float64, zero_point: str = "int") -> Tensor:
    """QuaRot: q' = H q (model dtype), keys (rotated) and values per token in groups of G channels; the residual
    keys are already rotated (the value rotation lives in the model's weights)."""
    def packed_keys(i, n):
        return _groups(keys, ("codes", "scale", "zero"), i, n, "token", k_bits, group_size, zero_point, query.dtype)

    def packed_values(i, n):
        return _groups(values, ("codes", "scale", "zero"), i, n, "token", v_bits, group_size, zero_point, query.dtype)

    return _decode(query, packed_keys, packed_values, key_residual, value_residual, n_packed, n_residual, scaling,
                   dtype, hadamard)


def _turboquant_dequantize(store: dict, i: int, n: int, bits: int, group_size: int, signs: Tensor, levels: Tensor,
                           exact: bool) -> Tensor:
    """TurboQuant.dequantize of sequence i's first n tokens: signs * H (levels[codes] * norm per block), in fp32
    (fp64 for the H when ``exact``): [1, H, n, D]."""
    codes = store["codes"][i:i + 1, :, :n]
    h, d = codes.shape[1], codes.shape[-1] * 8 // bits
    blocks = levels.to(codes.device)[unpack_bits(codes, bits, d).long()].view(1, h, n, d // group_size, group_size)
    y = (blocks * store["norm"][i:i + 1, :, :n].float().unsqueeze(-1)).view(1, h, n, d)
    return hadamard(y.double() if exact else y) * signs.to(y.device)


def turboquant_decode(query: Tensor, keys: dict, values: dict, key_residual: Tensor, value_residual: Tensor,
                      n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int, group_size: int,
                      scaling: float, signs: Tensor, codebook, dtype: torch.dtype = torch.float64) -> Tensor:
    """TurboQuant+ (turbo2): keys and values dequantized as the method does (codebook level times the block's
    corrected norm, rotated back), raw queries and residual tokens."""
    levels = torch.as_tensor(codebook, dtype=torch.float32)
    exact = dtype == torch.float64

    def packed_keys(i, n):
        return _turboquant_dequantize(keys, i, n, k_bits, group_size, signs, levels, exact)

    def packed_values(i, n):
        return _turboquant_dequantize(values, i, n, v_bits, group_size, signs, levels, exact)

    return _decode(query, packed_keys, packed_values, key_residual, value_residual, n_packed, n_residual, scaling,
                   dtype)


def ott_decode(query: Tensor, keys: dict, values: dict, key_residual: Tensor, value_residual: Tensor,
               n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int, group_size: int, scaling: float,
               exact: dict, dtype: torch.dtype = torch.float64, zero_point: str = "float") -> Tensor:
    """OTT: KIVI's packed keys and values, the pooled tokens (kept exactly, key and value) from ``exact``."""
    def packed_keys(i, n):
        return _groups(keys, ("codes", "scale", "zero"), i, n, "channel", k_bits, group_size, zero_point, query.dtype)

    def packed_values(i, n):
        return _groups(values, ("codes", "scale", "zero"), i, n, "token", v_bits, group_size, zero_point, query.dtype)

    return _decode(query, packed_keys, packed_values, key_residual, value_residual, n_packed, n_residual, scaling,
                   dtype, exact=exact)


def _spectral_groups(store: dict, i: int, n: int, bits: int, group_size: int, levels) -> Tensor:
    """Sequence i's first n OSCAR tokens dequantized in fp32 [1, H, n, D]: code * scale + zero (fp32 parameters),
    or with Lloyd-Max ``levels`` (std units) mean + std * levels[code] (std, mean as the method names them)."""
    scale = store["scale" if "scale" in store else "std"][i:i + 1, :, :n].float().unsqueeze(-1)
    zero = store["zero" if "zero" in store else "mean"][i:i + 1, :, :n].float().unsqueeze(-1)
    codes = store["codes"][i:i + 1, :, :n]
    h, d = codes.shape[1], codes.shape[-1] * 8 // bits
    c = unpack_bits(codes, bits, d).view(1, h, n, d // group_size, group_size)
    z = c.float() if levels is None else torch.as_tensor(levels, dtype=torch.float32, device=c.device)[c.long()]
    return (zero + scale * z if levels is not None else c.float() * scale + zero).view(1, h, n, d)


def spectral_decode(query: Tensor, keys: dict, values: dict, key_residual: Tensor, value_residual: Tensor,
                    n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int, group_size: int, scaling: float,
                    exact: dict, dtype: torch.dtype = torch.float64, levels=None) -> Tensor:
    """OSCAR (spectral): the query already rotated by the layer's matrix (as the residual and exact keys are), keys
    and values per token in groups of G channels with fp32 parameters: the uniform quantizer's code * s + min, or
    (``levels``: the Lloyd-Max levels in std units) mean + std * level; the sink prefix from ``exact``."""
    def packed_keys(i, n):
        return _spectral_groups(keys, i, n, k_bits, group_size, levels)

    def packed_values(i, n):
        return _spectral_groups(values, i, n, v_bits, group_size, levels)

    return _decode(query, packed_keys, packed_values, key_residual, value_residual, n_packed, n_residual, scaling,
                   dtype, exact=exact)


def spectral_quantize(x: Tensor, bits: int, group_size: int, clip_ratio: float) -> dict[str, Tensor]:
    """``methods.spectral.Spectral._quantize`` (codebook=uniform, the exact tokens aside) as CUDA torch computes it on
    any device: the span times fp32(1/levels) (CUDA divides by a Python number that way), the rest as the method:
    x [B, H, T, D] -> dict(codes [.., D*bits/8] uint8, scale [.., D/G], zero [.., D/G] fp32)."""
    b, h, t, d = x.shape
    y = clip_rows(x.float(), clip_ratio).view(b, h, t, d // group_size, group_size)
    levels = 2**bits - 1
    lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    span = hi - lo
    inv = torch.ones((), dtype=torch.float32) / torch.tensor(float(levels), dtype=torch.float32)
    scale = torch.where(span == 0, torch.where(lo == 0, torch.ones_like(lo), lo.abs()), span * inv.to(x.device))
    codes = torch.round((y - lo) / scale).clamp_(0, levels).to(torch.uint8).view(b, h, t, d)
    return dict(codes=pack_bits(codes, bits), scale=scale.squeeze(-1), zero=lo.squeeze(-1))


def rotatekv_decode(query: Tensor, keys: dict, values: dict, key_residual: Tensor, value_residual: Tensor,
                    n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int, group_size: int, scaling: float,
                    exact: dict, order: Tensor, head_group: int, rope_cos: Tensor, rope_sin: Tensor,
                    dtype: torch.dtype = torch.float64) -> Tensor:
    """RotateKV: packed keys z (per token, integer zero) turned back as the method does, k = RoPE_t(H_g P^T z_hat)
    at the stream positions t (``rope_cos``/``rope_sin`` [>= n, D]: the model's tables from position 0; in fp64 for
    the exact result, fp32 like the method otherwise), ``order`` the permutation [H * D], values per token with an
    integer zero; the raw query (post-RoPE, like the window's and the exact keys); the sinks from ``exact``."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    inverse = torch.argsort(order)

    def packed_keys(i, n):
        z = _groups(keys, ("codes", "scale", "zero"), i, n, "token", k_bits, group_size, "int", query.dtype)
        x = grouped_head_hadamard(permute_channels(z.to(compute), inverse.to(z.device)), head_group)
        return apply_rope(x, rope_cos[:n].to(x.device, compute), rope_sin[:n].to(x.device, compute))

    def packed_values(i, n):
        return _groups(values, ("codes", "scale", "zero"), i, n, "token", v_bits, group_size, "int", query.dtype)

    return _decode(query, packed_keys, packed_values, key_residual, value_residual, n_packed, n_residual, scaling,
                   dtype, exact=exact)


def _grouped_hadamard_fp32(x: Tensor, head_group: int) -> Tensor:
    """methods.rotatekv.grouped_head_hadamard of fp32 x [B, H, T, D] as CUDA torch computes it (_hadamard_fp32)."""
    b, h, t, d = x.shape
    y = x.transpose(1, 2).reshape(b, t, h // head_group, head_group * d)
    return _hadamard_fp32(y).reshape(b, t, h, d).transpose(1, 2)


def rotatekv_quantize_keys(k: Tensor, bits: int, group_size: int, head_group: int, clip_ratio: float, order: Tensor,
                           cos: Tensor, sin: Tensor) -> dict[str, Tensor]:
    """``methods.rotatekv.RotateKV.quantize_keys`` (its kept tokens aside) as CUDA torch computes it on any device:
    post-RoPE k [B, H, T, D], the model's cos/sin [T, D] at the tokens' positions, the channel ``order`` [H * D] ->
    dict(codes [B, H, T, D*bits/8] of z = P H_g RoPE^-1(k) in z's order, scale, zero [B, H, T, D/G] in k's dtype)."""
    z = permute_channels(_grouped_hadamard_fp32(undo_rope(k.float(), cos, sin), head_group), order).to(k.dtype)
    b, h, t, d = z.shape
    g = z.float().view(b, h, t, d // group_size, group_size)
    levels = 2**bits - 1
    lo, hi = g.amin(-1, keepdim=True) * clip_ratio, g.amax(-1, keepdim=True) * clip_ratio
    span = hi - lo
    inv = torch.ones((), dtype=torch.float32) / torch.tensor(float(levels), dtype=torch.float32)
    scale = torch.where(span == 0, torch.where(lo == 0, torch.ones_like(lo), lo.abs()), span * inv.to(k.device))
    scale = scale.to(k.dtype).float()
    zero = torch.round(-lo / scale).to(k.dtype).float()
    codes = (torch.round(g / scale) + zero).clamp_(0, levels).to(torch.uint8).view(b, h, t, d)
    return dict(codes=pack_bits(codes, bits), scale=scale.squeeze(-1).to(k.dtype), zero=zero.squeeze(-1).to(k.dtype))


def rotatekv_dequantize_keys(keys: dict, bits: int, group_size: int, head_group: int, order: Tensor, cos: Tensor,
                             sin: Tensor, dtype: torch.dtype) -> Tensor:
    """``methods.rotatekv.RotateKV.dequantize`` of keys (its kept tokens aside) as CUDA torch computes it on any
    device: the method's buffers (z's codes in z's order, scale, zero [B, H, T, D/G]) and the model's cos/sin [T, D]
    at their positions -> k = RoPE(H_g P^T z_hat) [B, H, T, D] in ``dtype``."""
    b, h, t, nb = keys["codes"].shape
    z = dequantize_groups(PackedTensor(keys, (b, h, t, nb * 8 // bits), dtype,
                                       dict(bits=bits, group_size=group_size, axis="token", zero_point="int")),
                          torch.float32)
    x = _grouped_hadamard_fp32(permute_channels(z, torch.argsort(order).to(z.device)), head_group)
    return apply_rope(x, cos.to(x.device), sin.to(x.device)).to(dtype)


def finish_step(windows: dict[str, Tensor], restored: dict[str, Tensor], counts: Tensor, residual_length: int) -> None:
    """A decode step's in-step flushes (``kernels.ops.finish_step``), in place, in torch: for each stream (name ->
    window [B, H, rcap, D]) and row whose window holds more than ``residual_length`` unpacked tokens (n_packed +
    n_residual - packed > R), the oldest one, window index packed - n_packed, becomes restored[stream][b, :, that
    index] and the stream's packed count (counts [4, B] int32: n_packed, n_residual, keys packed, values packed)
    advances."""
    n_packed, n_residual = counts[0], counts[1]
    for stream, window in windows.items():
        b, h, _, d = window.shape
        packed = counts[2 if stream == "keys" else 3]
        due = n_packed + n_residual - packed > residual_length
        # a row not due may point past the restored tokens: clamped, it writes its own window token back
        at = (packed - n_packed).long().clamp(0, restored[stream].shape[2] - 1).view(b, 1, 1, 1).expand(b, h, 1, d)
        written = torch.where(due.view(b, 1, 1, 1), restored[stream].gather(2, at), window.gather(2, at))
        window.scatter_(2, at, written)
        packed += due


def _hadamard_fp32(x: Tensor) -> Tensor:
    """oscar.quant.hadamard of fp32 x as CUDA torch computes it on any device: fp32 butterflies in torch's order,
    then the product with fp32(1 / sqrt(d)) (CUDA divides by a Python number that way; CPU torch divides)."""
    d = x.shape[-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    inv = torch.ones((), dtype=torch.float32) / torch.tensor(d ** 0.5, dtype=torch.float32)
    return y.reshape(x.shape) * inv.to(x.device)


def _lane_sums(sq: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Sums of sq [..., D] in the kernel's order: 32 lanes of D/32 consecutive values summed in order, then
    butterflies over the lanes (s_l + s_(l xor m), m = 1, 2, ..): (per block of group_size channels [..., D/G],
    the whole row [...])."""
    d = sq.shape[-1]
    epl = d // 32
    lanes = sq.reshape(*sq.shape[:-1], 32, epl)
    s = lanes[..., 0]
    for i in range(1, epl):
        s = s + lanes[..., i]
    partner = torch.arange(32, device=sq.device)
    m = 1
    while m < group_size // epl:
        s = s + s[..., partner ^ m]
        m *= 2
    blocks = s[..., ::group_size // epl]
    while m < 32:
        s = s + s[..., partner ^ m]
        m *= 2
    return blocks, s[..., 0]


def _sqrt(x: Tensor) -> Tensor:
    """The correctly rounded fp32 square root (CPU torch's vectorized sqrt is not; a float64 root rounded to fp32
    is)."""
    return x.double().sqrt().float()


def turboquant_quantize(x: Tensor, group_size: int, signs: Tensor, codebook) -> dict[str, Tensor]:
    """``methods.turboquant.TurboQuant._quantize`` at 2 bits with its fp32 sums in the order of the quantization
    kernel (see :func:`_lane_sums`), CUDA torch's division by sqrt(d) and correctly rounded square roots on any
    device: x [B, H, T, D] ->
    dict(codes [B, H, T, D/4] uint8, norm [B, H, T, D/G] fp16) in the reference layout."""
    b, h, t, d = x.shape
    levels = torch.as_tensor(codebook, dtype=torch.float32, device=x.device)
    y = _hadamard_fp32(x.float() * signs.to(x.device))
    block_y, total = _lane_sums(y * y, group_size)
    norm = _sqrt(total)
    u = y / torch.where(norm == 0, torch.ones_like(norm), norm).unsqueeze(-1)
    codes = torch.bucketize(u, (levels[1:] + levels[:-1]) / 2)
    chosen = levels[codes]
    block_c, _ = _lane_sums(chosen * chosen, group_size)
    return dict(codes=pack_bits(codes.to(torch.uint8), 2), norm=(_sqrt(block_y) / _sqrt(block_c)).to(torch.float16))


#: method name -> decode reference (the ``kernels.ops.METHODS`` with kernels)
DECODE_REFERENCES = dict(oscar=oscar_decode, kivi=kivi_decode, quarot=quarot_decode, turboquant=turboquant_decode,
                         ott=ott_decode, spectral=spectral_decode, rotatekv=rotatekv_decode)
