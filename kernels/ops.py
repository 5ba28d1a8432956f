"""Launchers for the CuPy RawKernels in kernels/*.cu, one per reference function.

Each ``.cu`` file is compiled once per set of #defines (head_dim, bits, group size, dtype, ...) with
``cupy.RawModule`` and memoized per device; batch and sequence length are runtime arguments. Kernels
run on torch's current stream and read/write torch tensors in place (pointers from ``data_ptr``: no
copies). ``cupy`` is imported on first use, so CPU-only installs import this module fine.

    hadamard(x)                       <-> oscar.quant.hadamard
    quantize_keys(k, bits, G)         <-> methods.oscar.OScaR.quantize_keys (rotate, token norm, per channel)
    quantize_values(v, bits, G)       <-> oscar.quant.quantize_groups(v, bits, G, "token", "int")
    decode_attention(q, ...)          <-> softmax(q_rot . (norm * dequant(K)) * scaling) @ dequant(V)

The quantizers write the reference's bytes, or with ``decode_layout=True`` the same bytes permuted (scales
and zeros of keys inside each code word's channels, values inside 16-token tiles) so that the decode kernel
loads ready tensor-core operands; ``key_decode_layout``/``value_decode_layout`` convert either way.
"""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from oscar.quant import PackedTensor

KERNEL_DIR = Path(__file__).parent
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BITS = (2, 4)
#: thread blocks (one warp each) per multiprocessor that the split heuristic of decode_attention aims at,
#: the fewest G-token groups per split and the most splits per sequence (partials the combine reads),
#: the copy ring's buffers and the resident blocks per SM asked of the register allocator
#: (__launch_bounds__); chosen from the H200 sweep in results/efficiency/kernel_tuning.csv
BLOCKS_PER_SM = 48
NSTAGE = 2
MIN_BLOCKS = 16
MIN_GROUPS_PER_SPLIT = 8
MAX_SPLITS = 256
#: threads of a combine block (a multiple of the head dim)
COMBINE_THREADS = 512


@functools.cache
def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("backend=cupy needs CuPy (pip install cupy-cuda12x or cupy-cuda13x)") from e
    return cupy


@functools.cache
def _function(device_index: int, source: str, name: str, defines: tuple[tuple[str, int], ...]):
    """The compiled kernel ``name`` of kernels/<source> for these #defines on this device (memoized)."""
    cupy = _cupy()
    options = ("--std=c++17", f"-I{KERNEL_DIR}") + tuple(f"-D{k}={v}" for k, v in defines)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=(KERNEL_DIR / source).read_text(), options=options)
        return module.get_function(name)


@functools.cache
def _stream(device_index: int, handle: int):
    return _cupy().cuda.ExternalStream(handle, device_index)


_smem_opt_in: set = set()


def _launch(source: str, name: str, defines: dict, grid, block, args, device: torch.device, smem: int = 0):
    """Launch on ``device`` (its tensors' GPU) and torch's current stream there; the current device is kept."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, source, name, tuple(sorted(defines.items())))
    fn = _function(*key)
    stream = _stream(index, torch.cuda.current_stream(device).cuda_stream)
    packed = tuple(np.uint64(a.data_ptr()) if isinstance(a, Tensor) else a for a in args)
    # a layer on another GPU than the current one (a split model): launch in that GPU's context, then back
    with contextlib.nullcontext() if torch.cuda.current_device() == index else _cupy().cuda.Device(index):
        if smem > 48 * 1024 and (key, smem) not in _smem_opt_in:
            fn.max_dynamic_shared_size_bytes = max(smem, fn.max_dynamic_shared_size_bytes)
            _smem_opt_in.add((key, smem))
        fn(grid, block, packed, shared_mem=smem, stream=stream)


def _check(x: Tensor, name: str, dims: int | None = None) -> None:
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be bfloat16 or float16, got {x.dtype}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(x.shape)}")
    if x.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name}: head_dim {x.shape[-1]} is not one of {SUPPORTED_HEAD_DIMS}")


def _dtype_define(dtype: torch.dtype) -> int:
    return int(dtype == torch.bfloat16)


def _inv(x: float) -> np.float32:
    """1/x as torch computes ``tensor / python_scalar`` on CUDA: fp32 reciprocal of the fp32 divisor."""
    return np.float32(1.0) / np.float32(x)


def _int32(values, device) -> Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- Hadamard


def hadamard(x: Tensor) -> Tensor:
    """Normalized Walsh-Hadamard transform over the last dim, bit-equal to ``oscar.quant.hadamard``."""
    _check(x, "x")
    d = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        grid = min(65535, (rows + 7) // 8)
        _launch("quantize.cu", "hadamard_rows", dict(HEAD_DIM=d, IS_BF16=_dtype_define(x.dtype)), (grid,), (256,),
                (x, y, np.int64(rows), _inv(math.sqrt(d))), x.device)
    return y


def append_residual(key: Tensor, value: Tensor, key_residual: Tensor, value_residual: Tensor, n_residual: Tensor,
                    rotate: bool = True) -> None:
    """Write one new token per sequence, key [B, H, 1, D] (rotated like :func:`hadamard` when ``rotate``) and
    value, into the residual windows [B, H, rcap, D] at position n_residual[b] (int32 on the device)."""
    _check(key, "key", 4)
    b, h, t, d = key.shape
    if t != 1 or value.shape != key.shape or key_residual.shape[:2] != (b, h) or not key_residual.is_contiguous():
        raise ValueError("append_residual takes one token per sequence and contiguous [B, H, rcap, D] windows")
    key, value = key.contiguous(), value.contiguous()
    _launch("quantize.cu", "append_residual", dict(HEAD_DIM=d, IS_BF16=_dtype_define(key.dtype)),
            ((b * h + 7) // 8,), (256,), (key, value, key_residual, value_residual, n_residual, np.int32(b),
                                          np.int32(h), np.int32(key_residual.shape[2]), np.int32(rotate),
                                          _inv(math.sqrt(d))), key.device)


# ----------------------------------------------------------------------------- packed storage


def empty_keys(batch: int, heads: int, capacity: int, head_dim: int, bits: int, group_size: int,
               dtype: torch.dtype, device) -> dict[str, Tensor]:
    """Storage for packed keys: codes [B,H,cap,D*b/8], scale/zero [B,H,cap/G,D], norm [B,1,cap,1] fp32."""
    return dict(codes=torch.empty(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
                scale=torch.empty(batch, heads, capacity // group_size, head_dim, dtype=dtype, device=device),
                zero=torch.empty(batch, heads, capacity // group_size, head_dim, dtype=dtype, device=device),
                norm=torch.empty(batch, 1, capacity, 1, dtype=torch.float32, device=device))


def empty_values(batch: int, heads: int, capacity: int, head_dim: int, bits: int, group_size: int,
                 dtype: torch.dtype, device) -> dict[str, Tensor]:
    """Storage for packed values: codes [B,H,cap,D*b/8], scale/zero [B,H,cap,D/G]."""
    return dict(codes=torch.empty(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
                scale=torch.empty(batch, heads, capacity, head_dim // group_size, dtype=dtype, device=device),
                zero=torch.empty(batch, heads, capacity, head_dim // group_size, dtype=dtype, device=device))


def _targets(batch: int, rows, offsets, device):
    """Output rows and token offsets of the input sequences as int32 device arrays; null pointers (no copy to
    the device) for the default, sequence i into row i at token 0."""
    if rows is None and offsets is None:
        return np.uint64(0), np.uint64(0)
    rows = list(range(batch)) if rows is None else list(rows)
    offsets = [0] * batch if offsets is None else list(offsets)
    if len(rows) != batch or len(offsets) != batch:
        raise ValueError("rows and offsets need one entry per input sequence")
    return _int32(rows, device), _int32(offsets, device)


# ----------------------------------------------------------------------------- keys


def key_warps_per_head(heads: int, head_dim: int, group_size: int) -> int:
    """Warps per KV head of the key kernel: four row slots of 32 channels per lane (G * D / 4096 warps), fewer
    where the block would pass 16 warps (128 registers per thread). Four beat two on the H200 (B=8, 32K tokens,
    8 heads, D=128, G=32: 0.439 vs 0.502 ms, results/efficiency/kernel_quant.csv)."""
    wph = max(1, group_size * head_dim // 4096)
    while wph > 1 and heads * wph > 16:
        wph //= 2
    return wph


def quantize_keys(k: Tensor, bits: int, group_size: int, rotate: bool = True, out: dict | None = None,
                  rows=None, offsets=None, decode_layout: bool = False, mode: int = 0,
                  warps_per_head: int | None = None, min_blocks: int = 1, persistent: bool = True) -> PackedTensor:
    """OScaR key preprocessing in one kernel: k [B, H, T, D] -> packed keys (T a multiple of G).

    Per token: Hadamard of every head (skipped when ``rotate=False``, i.e. k is already rotated), L2 norm
    over all heads and channels (fp32), division by it, per-channel groups of G tokens with an integer zero
    point, packed along D. Without ``out`` returns a PackedTensor laid out exactly like
    ``build_method("oscar").quantize_keys(k)`` (or as :func:`key_decode_layout` gives it with
    ``decode_layout``). With ``out`` (see :func:`empty_keys`) input sequence i is written into row
    ``rows[i]`` at token ``offsets[i]`` (a multiple of G) of that storage instead.
    A thread block takes one (sequence, group) at a time with ``warps_per_head`` warps per head (default
    :func:`key_warps_per_head`); ``persistent`` launches at most as many blocks as the SMs hold by threads
    (more than fit by registers run in waves), each loading its next group while it finishes one (else one
    block per group); ``min_blocks`` resident blocks per SM are asked of the register allocator. ``mode`` 1/2
    compile benchmark variants that stop after the norms / after the group min/max (partial outputs).
    """
    _check(k, "k", 4)
    b, h, t, d = k.shape
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"the key kernel packs {SUPPORTED_BITS} bits, got {bits}")
    if t % group_size:
        raise ValueError(f"per-channel key groups of {group_size} tokens need T % G == 0, got T={t}")
    wph = warps_per_head or key_warps_per_head(h, d, group_size)
    rows_per_step = 1024 // d  # a lane holds 32 channels of a row
    if group_size % wph or (group_size // wph) % rows_per_step or h * wph > 32:
        raise ValueError(f"the key kernel runs one block of {wph} warp(s) per head over groups of {group_size} "
                         f"tokens: needs G / {wph} to be a multiple of {rows_per_step} and {h} heads * {wph} <= 32")
    k = k.contiguous()
    if out is None:
        out = empty_keys(b, h, t, d, bits, group_size, k.dtype, k.device)
    cap = out["codes"].shape[2]
    out_rows, out_off = _targets(b, rows, offsets, k.device)
    threads = 32 * h * wph
    smem = 4 * (group_size * h + h * (3 if bits == 2 else 4) * 16 * (d // 32)
                + (threads // 32 * 2 * 16 * (d // 32) if wph > 1 else 0))
    blocks = t // group_size * b  # one per (sequence, group)
    if blocks:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=_dtype_define(k.dtype), HEADS=h, WPH=wph,
                       KMINB=min_blocks, MODE=mode, DECODE_LAYOUT=int(decode_layout))
        if persistent:  # at most as many blocks as threads fit on the SMs (2048 each on sm_80/sm_90)
            index = k.device.index if k.device.index is not None else torch.cuda.current_device()
            blocks = min(blocks, _multiprocessors(index) * max(1, 2048 // threads))
        _launch("quantize.cu", "quantize_keys", defines, (blocks,), (threads,),
                (k, np.int32(b), np.int32(t), np.int32(rotate), _inv(math.sqrt(d)), _inv(2**bits - 1),
                 out["codes"], out["scale"], out["zero"], out["norm"], np.int32(cap), out_rows, out_off), k.device,
                smem)
    meta = dict(bits=bits, group_size=group_size, axis="channel", zero_point="int")
    if decode_layout:
        meta["layout"] = "decode"  # dequantize_groups refuses it: key_decode_layout(..., inverse=True) first
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), k.dtype, meta)


# ----------------------------------------------------------------------------- values


def check_value_decode_layout(head_dim: int, bits: int, group_size: int) -> None:
    """Raise unless values of this shape have a decode layout (whole 16-token tiles, 8+ code bytes per group)."""
    if group_size % 16 or group_size * bits % 64 or head_dim % group_size:
        raise ValueError(f"the decode layout of values needs G a multiple of 16 with G * bits a multiple of 64 "
                         f"dividing head_dim; got G={group_size}, bits={bits}, head_dim={head_dim}")


@functools.cache
def _value_tile_order(head_dim: int, bits: int, group_size: int) -> tuple[Tensor, Tensor]:
    """Reference-layout index of every element of a 16-token tile in the decode layout (common.cuh):
    (codes [16 * D*bits/8], scale/zero [16 * D/G])."""
    check_value_decode_layout(head_dim, bits, group_size)
    bpt, groups, bpg = head_dim * bits // 8, head_dim // group_size, group_size * bits // 8
    nbg = bpg // 8
    codes, params = torch.empty(16 * bpt, dtype=torch.long), torch.empty(16 * groups, dtype=torch.long)
    for t in range(16):
        q, code_slot, param_slot = (t & 7) >> 1, ((t & 1) << 1) | (t >> 3), (t & 1) | ((t >> 3) << 1)
        for cb in range(bpt):
            g, w = divmod(cb, bpg)
            codes[((w // nbg) * 4 + q) * (bpt // 2) + (g * nbg + w % nbg) * 4 + code_slot] = t * bpt + cb
        for g in range(groups):
            params[(q * groups + g) * 4 + param_slot] = t * groups + g
    return codes, params


@functools.cache
def _key_param_order(head_dim: int, bits: int) -> Tensor:
    """Reference channel of every scale/zero entry of a key row [D] in the decode layout (common.cuh)."""
    cpb = 8 // bits
    order = torch.empty(head_dim, dtype=torch.long)
    for c in range(head_dim):
        i = c % (4 * cpb)
        hb, p = divmod(i, cpb)
        order[c - i + 4 * p + 2 * (hb % 2) + hb // 2] = c
    return order


def key_decode_layout(keys: dict[str, Tensor], bits: int, inverse: bool = False) -> dict[str, Tensor]:
    """Packed keys from the reference layout to the decode layout that ``decode_attention`` reads (or back with
    ``inverse``): scale/zero [..., D] permuted inside each code word's channels; codes and norms unchanged."""
    order = _key_param_order(keys["scale"].shape[-1], bits)
    if inverse:
        order = torch.argsort(order)
    order = order.to(keys["scale"].device)
    return {name: x[..., order] if name in ("scale", "zero") else x for name, x in keys.items()}


def _permute_tiles(x: Tensor, order: Tensor) -> Tensor:
    """x [..., T, F] with T a multiple of 16: every 16-token tile's T*F elements gathered by order [16 * F]."""
    *lead, t, f = x.shape
    if t % 16:
        raise ValueError(f"the decode layout permutes whole 16-token tiles, got {t} tokens")
    tiles = x.reshape(*lead, t // 16, 16 * f)
    return tiles[..., order.to(x.device)].reshape(x.shape)


def value_decode_layout(values: dict[str, Tensor], bits: int, group_size: int,
                        inverse: bool = False) -> dict[str, Tensor]:
    """Packed values (codes [..., T, D*bits/8], scale/zero [..., T, D/G], T a multiple of 16) from the
    reference layout to the decode layout that ``decode_attention`` reads (or back with ``inverse``)."""
    head_dim = values["codes"].shape[-1] * 8 // bits
    codes, params = _value_tile_order(head_dim, bits, group_size)
    if inverse:
        codes, params = torch.argsort(codes), torch.argsort(params)
    return dict(codes=_permute_tiles(values["codes"], codes), scale=_permute_tiles(values["scale"], params),
                zero=_permute_tiles(values["zero"], params))


def quantize_values(v: Tensor, bits: int, group_size: int, out: dict | None = None, rows=None,
                    offsets=None, decode_layout: bool = False) -> PackedTensor:
    """Per-token value quantization, v [B, H, T, D] -> packed like ``quantize_groups(v, bits, G, "token")``,
    or in the layout :func:`value_decode_layout` gives it with ``decode_layout`` (T, the offsets and the
    storage capacity multiples of 16)."""
    _check(v, "v", 4)
    b, h, t, d = v.shape
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"the value kernel packs {SUPPORTED_BITS} bits, got {bits}")
    if d % group_size or group_size % 8 or group_size > 128:
        raise ValueError(f"value groups of {group_size} channels: need a multiple of 8, at most 128, dividing "
                         f"head_dim {d}")
    if decode_layout:
        check_value_decode_layout(d, bits, group_size)
        if t % 16 or any(o % 16 for o in offsets or ()) or (out is not None and out["codes"].shape[2] % 16):
            raise ValueError("the decode layout stores whole 16-token tiles: T, the offsets and the storage "
                             "capacity must be multiples of 16")
    v = v.contiguous()
    if out is None:
        out = empty_values(b, h, t, d, bits, group_size, v.dtype, v.device)
    cap = out["codes"].shape[2]
    out_rows, out_off = _targets(b, rows, offsets, v.device)
    chunks = b * h * t * d // 8  # 16-byte chunks, max(G / 8, 4) per lane
    if chunks:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=_dtype_define(v.dtype),
                       DECODE_LAYOUT=int(decode_layout))
        warps = math.ceil(chunks / (32 * max(group_size // 8, 4)))
        _launch("quantize.cu", "quantize_values", defines, (math.ceil(warps / 8),), (256,),
                (v, np.int32(h), np.int32(t), np.int64(chunks), _inv(2**bits - 1), out["codes"], out["scale"],
                 out["zero"], np.int32(cap), out_rows, out_off), v.device)
    meta = dict(bits=bits, group_size=group_size, axis="token", zero_point="int")
    if decode_layout:
        meta["layout"] = "decode"  # dequantize_groups refuses it: value_decode_layout(..., inverse=True) first
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), v.dtype, meta)


# ----------------------------------------------------------------------------- attention


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_tokens(max_packed: int, batch: int, kv_heads: int, group_size: int, device,
                 blocks_per_sm: int = BLOCKS_PER_SM, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(splits, tokens per split) for the packed part: about ``blocks_per_sm`` one-warp blocks per SM, at
    most ``max_splits`` per sequence."""
    device = torch.device(device)
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    want = math.ceil(max(max_packed, 1) * batch * kv_heads / (sms * blocks_per_sm))
    tps = max(MIN_GROUPS_PER_SPLIT * group_size, math.ceil(want / group_size) * group_size)
    splits = min(max_splits, max(1, math.ceil(max_packed / tps)))
    tps = math.ceil(max(max_packed, 1) / splits / group_size) * group_size
    return splits, tps


def decode_smem_bytes(head_dim: int, k_bits: int, v_bits: int, group_size: int, heads_per_kv: int, nstage: int,
                      residual_capacity: int) -> int:
    """Dynamic shared memory of a decode_attention block: probabilities [8][G] fp32, rotated queries [HPG][D]
    fp32, then the ring of NSTAGE stages of one group (codes, scale/zero, norms of keys; codes, scale/zero of
    values), which the residual split uses for its logits [rcap][HPG] fp32 instead."""
    d, g = head_dim, group_size
    stage = g * d * k_bits // 8 + 4 * d + 4 * g + g * d * v_bits // 8 + 4 * g * (d // g)
    return g * 8 * 4 + heads_per_kv * d * 4 + max(nstage * stage, residual_capacity * heads_per_kv * 4)


def decode_attention(query: Tensor, keys: dict[str, Tensor], values: dict[str, Tensor], key_residual: Tensor,
                     value_residual: Tensor, n_packed: Tensor, n_residual: Tensor, *, k_bits: int, v_bits: int,
                     group_size: int, scaling: float, rotate_query: bool = True, max_packed: int | None = None,
                     splits: tuple[int, int] | None = None, out: Tensor | None = None,
                     poison: bool = False, mode: int = 0, nstage: int = NSTAGE, min_blocks: int = MIN_BLOCKS,
                     blocks_per_sm: int = BLOCKS_PER_SM, max_splits: int = MAX_SPLITS) -> Tensor:
    """Attention of one new query token per sequence over its packed + residual cache.

    query [B, Hq, 1, D] (not rotated: the kernel applies the Hadamard when ``rotate_query``);
    keys/values: packed storage (see :func:`empty_keys`/:func:`empty_values`) with capacity cap, in the
    decode layouts (:func:`key_decode_layout`, :func:`value_decode_layout`);
    key_residual/value_residual [B, H, rcap, D] full-precision recent tokens (keys already rotated);
    n_packed [B] int32 (multiples of G) and n_residual [B] int32: valid tokens of each sequence.
    Returns [B, Hq, 1, D] in the query dtype (written into ``out`` if given). ``splits`` = (number, tokens
    per split) overrides the heuristic; ``poison`` fills the partial-result workspace with NaN (tests);
    ``mode`` 1/2 compile benchmark variants without the math / without the value product (wrong outputs);
    ``nstage`` (copy ring buffers, >= 2), ``min_blocks`` (launch bound), ``blocks_per_sm`` and ``max_splits``
    (split heuristic) are tuning knobs.
    """
    _check(query, "query", 4)
    b, hq, tq, d = query.shape
    if tq != 1:
        raise ValueError(f"decode attention takes one query token per sequence, got {tq}")
    if nstage < 2:
        raise ValueError(f"the copy ring needs at least 2 buffers, got nstage={nstage}")
    hkv = keys["codes"].shape[1]
    if hq % hkv or hq // hkv > 8:
        raise ValueError(f"{hq} query heads over {hkv} KV heads: the kernel takes 1..8 query heads per KV head")
    cap, rcap = keys["codes"].shape[2], key_residual.shape[2]
    for name, t in (("key_residual", key_residual), ("value_residual", value_residual)):
        if t.dtype != query.dtype or not t.is_contiguous() or t.shape != (b, hkv, rcap, d):
            raise ValueError(f"{name} must be contiguous [B, H, rcap, D] in {query.dtype}, got {tuple(t.shape)}")
    if max_packed is None:
        max_packed = int(n_packed.max())
    splits, tps = splits or split_tokens(max_packed, b, hkv, group_size, query.device, blocks_per_sm, max_splits)
    parts = splits + 1
    q = query.reshape(b, hq, d).contiguous()
    o_part = torch.empty(b, hq, parts, d, dtype=torch.float32, device=query.device)
    ml_part = torch.empty(b, hq, parts, 2, dtype=torch.float32, device=query.device)
    if poison:
        o_part.fill_(float("nan"))
        ml_part.fill_(float("nan"))
    if out is None:
        out = torch.empty(b, hq, 1, d, dtype=query.dtype, device=query.device)
    elif out.shape != (b, hq, 1, d) or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {(b, hq, 1, d)} {query.dtype} tensor")
    hpg = hq // hkv
    defines = dict(HEAD_DIM=d, K_BITS=k_bits, V_BITS=v_bits, GROUP=group_size, HPG=hpg,
                   IS_BF16=_dtype_define(query.dtype), NSTAGE=nstage, MIN_BLOCKS=min_blocks, MODE=mode,
                   COMBINE_THREADS=COMBINE_THREADS)
    smem = decode_smem_bytes(d, k_bits, v_bits, group_size, hpg, nstage, rcap)
    _launch("decode_attention.cu", "decode_attention", defines, (parts, hkv, b), (32,),
            (q, keys["codes"], keys["scale"], keys["zero"], keys["norm"], values["codes"], values["scale"],
             values["zero"], key_residual, value_residual, n_packed, n_residual, o_part, ml_part,
             np.int32(hkv), np.int32(cap), np.int32(rcap), np.int32(splits), np.int32(tps),
             np.float32(scaling * math.log2(math.e)), np.int32(rotate_query), _inv(math.sqrt(d))),
            query.device, smem)
    _launch("decode_attention.cu", "combine", defines, (b * hq,), (COMBINE_THREADS,),
            (o_part, ml_part, out, np.int32(parts)), query.device, 4 * parts)
    return out
