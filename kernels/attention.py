"""decode_attention: one new query token per sequence over its packed + exact + residual cache.

    decode_attention(q, keys, values, key_residual, value_residual, n_packed, n_residual, method=..., k_bits=...,
                     v_bits=..., group_size=..., scaling=..., [zero_point=..., signs=..., codebook=..., exact=...,
                     affine=..., rope=...])

<-> kernels.reference.<method>_decode (DECODE_REFERENCES): softmax(q' k'^T * scaling) v' over [dequantized packed |
exact | residual]; RotateKV's packed logits come first from rotatekv.cu (:func:`rotatekv_logits`). The arguments are
checked (:func:`_checked_shape`), the packed tokens split over thread blocks (kernels.plans), then one launch
attends each split and one combines the splits' partial results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels import plans, runtime
from kernels.plans import (BLOCKS_PER_SM, EXACT_METHODS, MAX_SPLITS, METHODS, MIN_BLOCKS, NSTAGE, ROPE_RUN,
                           ROTATEKV_TOKENS_PER_BLOCK, STAGE_TOKENS, decode_smem_bytes, rotatekv_smem_bytes,
                           residual_splits, split_tokens, stage_tokens)
from kernels.runtime import dtype_define, float_zero_point, inv


def decode_attention(query: Tensor, keys: dict[str, Tensor], values: dict[str, Tensor], key_residual: Tensor,
                     value_residual: Tensor, n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int,
                     group_size: int, scaling: float, rotate_query: bool = True, method: str = "oscar",
                     zero_point: str | None = None, signs: Tensor | None = None, codebook=None,
                     exact: dict | None = None, affine: tuple[float, float] = (0.0, 1.0), rope: dict | None = None,
                     max_packed: int | None = None, splits: tuple[int, int] | None = None, out: Tensor | None = None,
                     poison: bool = False, mode: int = 0, nstage: int = NSTAGE, min_blocks: int = MIN_BLOCKS,
                     blocks_per_sm: int = BLOCKS_PER_SM, max_splits: int = MAX_SPLITS) -> Tensor:
    """Attention of one new query token per sequence over its packed + exact + residual cache.

    query [B, Hq, 1, D] as the model computes it (the kernel applies OScaR's and QuaRot's query transform; OSCAR's
    query comes rotated by the layer's matrix); keys/values: packed storage (kernels.storage.empty_storage) with
    capacity cap, in the decode layouts; key_residual/value_residual [B, H, rcap, D] full-precision recent tokens
    (OScaR's and QuaRot's keys already rotated, like kernels.quantizers.append_residual writes them, OSCAR's by its
    matrix; the others' as they are); n_packed [B] int32 (multiples of :func:`stage_tokens`) and n_residual [B]
    int32: valid tokens of each sequence.
    ``method`` (:data:`METHODS`) picks the kernel variant; ``rotate_query`` is OScaR's/QuaRot's switch (the other
    methods never rotate); ``zero_point`` the KIVI/OTT/QuaRot convention (default the method's: float for KIVI and
    OTT, int for QuaRot and RotateKV; OSCAR's is float); TurboQuant+ needs ``signs`` [D] (+-1 float32 on the device)
    and ``codebook`` (its 4 ascending levels). OTT, RotateKV and OSCAR (:data:`EXACT_METHODS`) need ``exact``
    (kernels.method_layouts.empty_exact: the tokens kept in full precision, attended before the window, and the
    skip bits of their packed copies); OSCAR takes ``affine`` = (a, b), the code map s' = b s, z' = z + a s of its
    stored (scale, zero) ((0, 1); Lloyd-Max (std, mean): :func:`affine_levels` of its levels); RotateKV needs
    ``rope`` (kernels.method_layouts.rotatekv_tables: key_group, anchors, step, head_group) and its keys in
    kernels.method_layouts.rotatekv_key_layout. Returns [B, Hq, 1, D] in the query dtype (written into ``out`` if
    given). ``splits`` = (number, tokens per split) overrides the packed part's heuristic (the full-precision tokens
    run over :func:`~kernels.plans.residual_splits` blocks beside them); ``poison`` fills the partial-result
    workspace with NaN (tests); ``mode`` 1/2 compile benchmark variants without the math / without the value product
    (wrong outputs); ``nstage`` (copy ring buffers, >= 2), ``min_blocks`` (launch bound: the resident blocks per
    multiprocessor, one wave of which the split plan fills where the context allows), ``blocks_per_sm`` and
    ``max_splits`` (split heuristic: kernels.plans.split_tokens on the device's multiprocessors) are tuning knobs.
    """
    shape = _checked_shape(query, keys, key_residual, value_residual, exact, method, group_size, zero_point,
                           rotate_query, signs, codebook, k_bits, v_bits, rope, nstage)
    b, hq, hkv, d = shape.batch, shape.query_heads, shape.kv_heads, shape.head_dim
    if max_packed is None:
        max_packed = int(n_packed.max())
    sms = runtime.multiprocessors(runtime.device_index(query.device))
    splits, tps = splits or split_tokens(max_packed, b, hkv, stage_tokens(method, group_size), sms, blocks_per_sm,
                                         max_splits, min_blocks)
    parts = splits + residual_splits(shape.residual_capacity, shape.exact_capacity)
    o_part, ml_part, out = _workspace(query, parts, out, poison)
    defines = _defines(method, shape, k_bits, v_bits, group_size, nstage, min_blocks, mode, query.dtype)
    smem = decode_smem_bytes(d, k_bits, v_bits, group_size, hq // hkv, nstage, shape.residual_capacity, method,
                             shape.exact_capacity)
    logits = (rotatekv_logits(query, keys, n_packed, exact["skip"], rope, k_bits, group_size, scaling, max_packed,
                              poison) if method == "rotatekv" else None)
    fields, extra = _operands(method, query, keys, values, exact, shape.exact_capacity, signs, codebook, affine,
                              logits)
    runtime.launch("decode_attention.cu", "decode_attention", defines, (parts, hkv, b), (32,),
                   (query.reshape(b, hq, d).contiguous(), *fields, key_residual, value_residual, n_packed,
                    n_residual, o_part, ml_part, np.int32(hkv), np.int32(shape.capacity),
                    np.int32(shape.residual_capacity), np.int32(splits), np.int32(tps),
                    np.float32(scaling * math.log2(math.e)), np.int32(shape.rotate_query and method != "turboquant"),
                    inv(math.sqrt(d)), *extra), query.device, smem)
    runtime.launch("decode_attention.cu", "combine", defines, (b * hq, d // plans.COMBINE_DIMS),
                   (plans.COMBINE_THREADS,), (o_part, ml_part, out, np.int32(parts)), query.device)
    return out


@dataclass(frozen=True)
class _Shape:
    """The checked sizes and switches of a decode_attention call."""

    batch: int
    query_heads: int
    kv_heads: int
    head_dim: int
    capacity: int  # packed tokens per row of the storage
    residual_capacity: int
    exact_capacity: int  # 0 for the methods that keep no exact tokens
    zero_float: bool
    rotate_query: bool


def _checked_shape(query: Tensor, keys: dict, key_residual: Tensor, value_residual: Tensor, exact: dict | None,
                   method: str, group_size: int, zero_point: str | None, rotate_query: bool, signs, codebook,
                   k_bits: int, v_bits: int, rope: dict | None, nstage: int) -> _Shape:
    """decode_attention's arguments checked (ValueError naming the first that does not fit), with their sizes."""
    runtime.check_input(query, "query", 4)
    if method not in METHODS:
        raise ValueError(f"decode_attention has kernels for {sorted(METHODS)}, got method={method!r}")
    zero_float = float_zero_point(zero_point or ("float" if method in ("kivi", "ott", "spectral") else "int"))
    if method == "spectral" and not zero_float:
        raise ValueError("spectral: OSCAR's quantizer has a float zero point (x = s code + min)")
    if method in ("kivi", "ott", "spectral", "rotatekv"):
        rotate_query = False
    if method == "turboquant" and (signs is None or codebook is None or k_bits != 2 or v_bits != 2):
        raise ValueError("turboquant: decode_attention needs signs and codebook, and 2-bit keys and values")
    if method == "rotatekv" and rope is None:
        raise ValueError("rotatekv: decode_attention needs `rope` (kernels.method_layouts.rotatekv_tables)")
    b, hq, tq, d = query.shape
    if tq != 1:
        raise ValueError(f"decode attention takes one query token per sequence, got {tq}")
    if nstage < 2:
        raise ValueError(f"the copy ring needs at least 2 buffers, got nstage={nstage}")
    if d % group_size or group_size > d:
        raise ValueError(f"{method}: groups of {group_size} must divide head_dim {d}")
    hkv = keys["codes"].shape[1]
    if hq % hkv or hq // hkv > 8:
        raise ValueError(f"{hq} query heads over {hkv} KV heads: the kernel takes 1..8 query heads per KV head")
    cap, rcap = keys["codes"].shape[2], key_residual.shape[2]
    for name, t in (("key_residual", key_residual), ("value_residual", value_residual)):
        if t.dtype != query.dtype or not t.is_contiguous() or t.shape != (b, hkv, rcap, d):
            raise ValueError(f"{name} must be contiguous [B, H, rcap, D] in {query.dtype}, got {tuple(t.shape)}")
    ecap = _exact_capacity(exact, method, b, hkv, d, cap, query.dtype) if method in EXACT_METHODS else 0
    tok = stage_tokens(method, group_size)
    if cap % tok:
        raise ValueError(f"{method}: the storage capacity must be a multiple of the {tok}-token stages, got {cap}")
    return _Shape(b, hq, hkv, d, cap, rcap, ecap, zero_float, rotate_query)


def _workspace(query: Tensor, parts: int, out: Tensor | None, poison: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The splits' partial outputs [B, Hq, parts, D] and (max, sum) [B, Hq, parts, 2] fp32 (NaN with ``poison``),
    and ``out`` [B, Hq, 1, D] (allocated, or checked)."""
    b, hq, _, d = query.shape
    o_part = torch.empty(b, hq, parts, d, dtype=torch.float32, device=query.device)
    ml_part = torch.empty(b, hq, parts, 2, dtype=torch.float32, device=query.device)
    if poison:
        o_part.fill_(float("nan"))
        ml_part.fill_(float("nan"))
    if out is None:
        out = torch.empty(b, hq, 1, d, dtype=query.dtype, device=query.device)
    elif out.shape != (b, hq, 1, d) or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {(b, hq, 1, d)} {query.dtype} tensor")
    return o_part, ml_part, out


def _defines(method: str, shape: _Shape, k_bits: int, v_bits: int, group_size: int, nstage: int, min_blocks: int,
             mode: int, dtype: torch.dtype) -> dict:
    """The #defines of the method's decode_attention.cu variant."""
    defines = dict(HEAD_DIM=shape.head_dim, K_BITS=k_bits, V_BITS=v_bits, GROUP=group_size,
                   HPG=shape.query_heads // shape.kv_heads, IS_BF16=dtype_define(dtype), NSTAGE=nstage,
                   MIN_BLOCKS=min_blocks, MODE=mode, COMBINE_THREADS=plans.COMBINE_THREADS,
                   COMBINE_DIMS=plans.COMBINE_DIMS)
    if method != "oscar":
        defines.update(METHOD=METHODS[method], ZERO_FLOAT=int(shape.zero_float), STAGE_TOKENS=STAGE_TOKENS)
    if method in EXACT_METHODS:
        defines["EXACT"] = 1
    return defines


def _operands(method: str, query: Tensor, keys: dict, values: dict, exact: dict | None, ecap: int, signs, codebook,
              affine: tuple[float, float], logits: Tensor | None) -> tuple[tuple, tuple]:
    """The method's storage in the kernel's seven slots (key codes, scale, zero, norm; value codes, scale, zero) and
    its trailing arguments (TurboQuant+'s signs and codebook terms, OSCAR's affine map, the exact tokens)."""
    d = query.shape[-1]
    extra = ()
    if method == "turboquant":  # block norms in place of the scales, no zeros
        fields = (keys["codes"], keys["norm"], keys["norm"], np.uint64(0), values["codes"], values["norm"],
                  values["norm"])
        extra = (signs, *map(np.float32, codebook_terms(codebook)))
        if signs.shape != (d,) or signs.dtype != torch.float32 or signs.device != query.device:
            raise ValueError(f"signs must be a float32 [{d}] tensor on {query.device}")
    elif method == "rotatekv":  # the logits in place of the key codes, no key parameters
        fields = (logits, np.uint64(0), np.uint64(0), np.uint64(0), values["codes"], values["scale"], values["zero"])
    else:
        fields = (keys["codes"], keys["scale"], keys["zero"], keys["norm"] if method == "oscar" else np.uint64(0),
                  values["codes"], values["scale"], values["zero"])
    if method == "spectral":
        if keys["scale"].dtype != torch.float32 or values["scale"].dtype != torch.float32:
            raise ValueError("spectral: the scales and zeros are stored in fp32 (empty_storage)")
        extra = tuple(map(np.float32, affine))
    if method in EXACT_METHODS:
        extra += (exact["keys"], exact["values"], exact["count"], np.int32(ecap), exact["skip"])
    return fields, extra


def _exact_capacity(exact: dict | None, method: str, b: int, hkv: int, d: int, cap: int, dtype) -> int:
    """The exact tokens' capacity ecap, after checking the dict (kernels.method_layouts.empty_exact)."""
    if exact is None:
        raise ValueError(f"{method}: decode_attention needs `exact` (kernels.method_layouts.empty_exact): the tokens "
                         "the method keeps exactly")
    ecap = exact["keys"].shape[2]
    for name in ("keys", "values"):
        t = exact[name]
        if t.shape != (b, hkv, ecap, d) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"exact {name} must be contiguous [B, H, ecap, D] in {dtype}, got {tuple(t.shape)}")
    if exact["count"].shape != (b, hkv) or exact["count"].dtype != torch.int32:
        raise ValueError(f"exact count must be int32 [B, H] = {(b, hkv)}, got {tuple(exact['count'].shape)}")
    words = (b, hkv, (cap + 31) // 32)
    if exact["skip"].shape != words or exact["skip"].dtype != torch.int32 or not exact["skip"].is_contiguous():
        raise ValueError(f"exact skip must be contiguous int32 {words} (a bit per packed token), got "
                         f"{tuple(exact['skip'].shape)}")
    return ecap


def rotatekv_logits(query: Tensor, keys: dict, n_packed: Tensor, skip: Tensor, rope: dict, k_bits: int,
                    group_size: int, scaling: float, max_packed: int, poison: bool, min_blocks: int | None = None,
                    rope_per_tile: bool | None = None) -> Tensor:
    """RotateKV's packed keys as base-2 logits [B, Hq, cap] fp32 (kernels/rotatekv.cu), skipped tokens -inf.
    ``min_blocks`` (resident blocks per SM asked of the register allocator) and ``rope_per_tile`` (a tile's RoPE
    cos/sin kept over its heads, or made per k-step) are the kernel's knobs; None: its defaults."""
    b, hq, _, d = query.shape
    hkv, cap = keys["codes"].shape[1], keys["codes"].shape[2]
    g = int(rope["head_group"])
    if hkv % g or g not in (1, 2, 4, 8):
        raise ValueError(f"rotatekv: head groups of {g} KV heads must divide {hkv} KV heads (1, 2, 4 or 8)")
    if rope["key_group"].shape != (hkv * d,) or rope["key_group"].dtype != torch.int16:
        raise ValueError(f"rotatekv: key_group must be int16 [H * D] = [{hkv * d}]")
    if rope["anchors"].shape[0] < math.ceil(cap / ROPE_RUN) or rope["anchors"].shape[1:] != (d // 2, 2) \
            or rope["offsets"].shape != (ROPE_RUN, d // 2, 2):
        raise ValueError(f"rotatekv: RoPE anchors [>= cap / {ROPE_RUN}, D / 2, 2] and offsets [{ROPE_RUN}, D / 2, 2] "
                         "expected")
    logits = torch.empty(b, hq, cap, dtype=torch.float32, device=query.device)
    if poison:
        logits.fill_(float("nan"))
    hpg = hq // hkv
    blocks = math.ceil(max(max_packed, 1) / ROTATEKV_TOKENS_PER_BLOCK)
    defines = dict(HEAD_DIM=d, K_BITS=k_bits, GROUP=group_size, HEAD_GROUP=g, HKV=hkv, HPG=hpg,
                   IS_BF16=dtype_define(query.dtype), TPB=ROTATEKV_TOKENS_PER_BLOCK)
    if min_blocks is not None:
        defines["MIN_BLOCKS"] = int(min_blocks)
    if rope_per_tile is not None:
        defines["ROPE_PER_TILE"] = int(rope_per_tile)
    runtime.launch("rotatekv.cu", "rotatekv_scores", defines, (blocks, hkv // g, b), (128,),
                   (query.reshape(b, hq, d).contiguous(), keys["codes"], keys["scale"], keys["zero"], rope["key_group"],
                    rope["anchors"], rope["offsets"], n_packed, skip, logits, np.int32(cap),
                    np.float32(scaling * math.log2(math.e)), np.float32(1 / math.sqrt(g * d))),
                   query.device, rotatekv_smem_bytes(d, group_size, hkv, g, hpg, ROTATEKV_TOKENS_PER_BLOCK))
    return logits


def codebook_terms(levels) -> tuple[float, float, float]:
    """(a, b, k/2) of a symmetric 4-level codebook (ascending levels l0..l3): L(c) = a + b c + d c1 with c1 the
    code's high bit, a = l0, b = l1 - l0, d = l2 - 2 l1 + l0 and k/2 = d / (2 b); exact because l3 - l2 = l1 - l0."""
    lv = [float(x) for x in levels]
    if len(lv) != 4 or not math.isclose(lv[3] - lv[2], lv[1] - lv[0], rel_tol=1e-6, abs_tol=0.0):
        raise ValueError(f"the decode kernel takes a symmetric 4-level codebook (l3 - l2 = l1 - l0), got {lv}")
    a, b = lv[0], lv[1] - lv[0]
    return a, b, (lv[2] - 2 * lv[1] + lv[0]) / (2 * b)


def affine_levels(levels) -> tuple[float, float]:
    """(a, b) of equally spaced reconstruction levels l_c = a + b c (OSCAR's Lloyd-Max levels in std units, the
    released kernel's): the affine code map decode_attention's ``affine`` takes."""
    lv = [float(x) for x in levels]
    steps = [hi - lo for lo, hi in zip(lv, lv[1:])]
    if len(lv) < 2 or not all(math.isclose(st, steps[0], rel_tol=1e-6, abs_tol=0.0) for st in steps):
        raise ValueError(f"the decode kernel takes equally spaced levels (an affine code map), got {lv}")
    return lv[0], (lv[-1] - lv[0]) / (len(lv) - 1)
