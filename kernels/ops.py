"""Launchers for the CuPy RawKernels in kernels/*.cu, one per reference function.

Each ``.cu`` file is compiled once per set of #defines (head_dim, bits, group size, dtype, method, ...) with
``cupy.RawModule`` and memoized per device; batch and sequence length are runtime arguments. Kernels run on torch's
current stream and read/write torch tensors in place (pointers from ``data_ptr``: no copies). ``cupy`` is imported on
first use, so CPU-only installs import this module fine.

    hadamard(x)                              <-> oscar.quant.hadamard
    hadamard_step(q, keys, lengths)          <-> the same of a decode step's query and (in place) its new keys
    quantize_keys(k, bits, G)                <-> methods.oscar.OScaR.quantize_keys (rotate, token norm, per channel)
    quantize_channel_keys(k, bits, G)        <-> methods.kivi.KIVI.quantize_keys (per channel, float zero)
    quantize_token_keys(k, bits, G)          <-> methods.quarot.QuaRot.quantize_keys (Hadamard, per token, clip)
    quantize_values(v, bits, G)              <-> quantize_groups(v, bits, G, "token", zero_point, clip_ratio): the
                                                 values of OScaR, KIVI and QuaRot
    quantize_turboquant(x, G, signs, levels) <-> methods.turboquant.TurboQuant.quantize_keys / quantize_values
    quantize_spectral(x, bits, G, clip)      <-> methods.spectral.Spectral's uniform quantizer (quantile clip, fp32
                                                 scale/zero), kernels.reference.spectral_quantize
    decode_attention(q, ..., method=)        <-> kernels.reference.<method>_decode (DECODE_REFERENCES):
                                                 softmax(q' k'^T * scaling) v' over [dequantized packed | exact |
                                                 residual]; RotateKV's packed logits from rotatekv.cu first

The quantizers write the reference's bytes, or with ``decode_layout`` the same bytes permuted so that the decode
kernel loads ready tensor-core operands; ``key_decode_layout`` (per-channel scale/zero), ``token_key_decode_layout``
(per-token key codes) and ``value_decode_layout`` (16-token value tiles) convert either way.

What a cache holds and calls per method (storage from ``empty_storage``, all in the decode layouts):

    method      keys quantizer (a flush)                      values quantizer                          residual keys
    oscar       quantize_keys(k_rot, rotate=False)            quantize_values                           rotated
    kivi        quantize_channel_keys(k)                      quantize_values(zero_point="float")       as they are
    quarot      quantize_token_keys(k_rot, rotate=False)      quantize_values(clip_ratio=...)           rotated
    turboquant  quantize_turboquant(k, decode_layout="keys")  quantize_turboquant(v, decode_layout=     as they are
                                                              "values")
    ott         the method's own, method_layouts.store_packed  quantize_values(zero_point=...)           as they are
    rotatekv    the method's own, store_packed (codes in       quantize_values(zero_point="int",         as they are
                rotatekv_key_layout)                           clip_ratio=...)                           (post-RoPE)
    spectral    quantize_spectral(k_rot, decode_layout=        quantize_spectral(v, decode_layout=       k @ R_K
                "keys") (Lloyd-Max: its own, store_packed)     "values") (Lloyd-Max: its own)
(residual windows [B, H, rcap, D] in the model dtype; rotated keys as append_residual(rotate=True) writes them;
OSCAR's by its layer's matrix, method.transform_key, its query by transform_query before the kernel)

OTT's and RotateKV's keys flush with the methods' own torch quantizers: once per R tokens, with their bookkeeping
(OTT's outlier pool, RotateKV's sinks and RoPE positions), the torch path's bytes by construction
(kernels.method_layouts.store_packed permutes a chunk into the decode layouts). OSCAR's flush every 32-token stage
(its window policy) for keys and values alike, so its uniform quantizer has a kernel (the Lloyd-Max switch, whose
torch means and stds sum in an order a kernel would not reproduce, runs the method's own). Their exactly kept tokens
live in ``kernels.method_layouts.empty_exact`` (full-precision keys and values per row and head, attended like the
window, plus a skip bit per packed token for their packed copies; its docstring states what a cache keeps where).
RotateKV's keys are rebuilt per position by kernels/rotatekv.cu (dequantized, P^T, the grouped-head Hadamard, RoPE
from the model's table every ROPE_RUN positions and a one-position rotation), which writes the packed tokens' base-2
logits [B, Hq, cap] fp32 that decode_attention streams in place of key codes.

Every quantizer takes ``out=`` (the storage dict), ``rows=`` (storage row of each input sequence) and ``offsets=``
(token offset of each); one token at a time works for the value layouts (storage capacity a multiple of 16), keys
flush in whole groups (per channel) or any number of tokens (per token). Attention is then

    decode_attention(q, keys, values, key_residual, value_residual, n_packed, n_residual, method=..., k_bits=...,
                     v_bits=..., group_size=..., scaling=..., [zero_point=..., signs=..., codebook=..., exact=...,
                     affine=..., rope=...])

with n_packed [B] int32 on the device, multiples of ``stage_tokens(method, G)``: the tokens whose keys and values are
both packed, rounded down to whole stages. A policy whose keys and values flush at different times (``kivi``: keys
keep T mod R tokens, values exactly R) passes that rounded count and keeps the tokens after it in the residual
windows, those already packed as their dequantized values in the model dtype: exactly what the torch path attends to
(methods' ``dequantize``), so the kernel needs no per-stream lengths. Shapes must fit the kernels: head_dim 64/128/256,
1-8 query heads per KV head, 2 or 4 bits (TurboQuant+ 2), G a multiple of 16 with G * v_bits a multiple of 64
(OSCAR's G = min(group_size, head_dim)); RotateKV head groups of 1, 2, 4 or 8 KV heads.
"""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from oscar.quant import PackedTensor, pack_bits, unpack_bits

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
#: decode_attention's METHOD define per method name; per-token key methods stream STAGE_TOKENS tokens per stage
METHODS = dict(oscar=0, kivi=1, quarot=2, turboquant=3, ott=1, spectral=4, rotatekv=5)
STAGE_TOKENS = 32
#: the methods whose kernels attend exactly kept tokens (decode_attention's ``exact``, :func:`empty_exact`)
EXACT_METHODS = ("ott", "rotatekv", "spectral")
#: positions of one warp's run in rotatekv.cu (its RoPE anchors are the model's table every RUN positions)
ROPE_RUN = 16
ROTATEKV_TOKENS_PER_BLOCK = 64


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


def _device_index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _launch(source: str, name: str, defines: dict, grid, block, args, device: torch.device, smem: int = 0):
    """Launch on ``device`` (its tensors' GPU) and torch's current stream there; the current device is kept."""
    index = _device_index(device)
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


def hadamard_step(query: Tensor, keys: Tensor, lengths: Tensor) -> Tensor:
    """One decode step's Hadamards in one launch: returns hadamard(query) for query [B, Hq, 1, D], and rotates in place
    each row's new key, keys[b, :, lengths[b]], in ``keys`` [B, H, capacity, D] (a view of token-major storage,
    [B, capacity, H, D] contiguous: the static mirror's); lengths [B] int64 on the device. Bit-equal to
    ``oscar.quant.hadamard`` of each (fp32 butterflies)."""
    _check(query, "query", 4)
    b, hq, t, d = query.shape
    heads, capacity = keys.shape[1], keys.shape[2]
    if t != 1 or keys.shape != (b, heads, capacity, d) or not keys.transpose(1, 2).is_contiguous():
        raise ValueError(f"hadamard_step takes one query token [B, Hq, 1, D] and a token-major key cache "
                         f"[B, H, capacity, D], got {tuple(query.shape)} and {tuple(keys.shape)}")
    if keys.dtype != query.dtype or lengths.dtype != torch.int64 or lengths.shape != (b,):
        raise ValueError("hadamard_step: keys in the query's dtype and lengths an int64 [B] tensor")
    q = query.contiguous()
    y = torch.empty_like(q)
    rows = b * hq + b * heads
    grid = (min(65535, (rows + 7) // 8),)
    _launch("quantize.cu", "hadamard_step", dict(HEAD_DIM=d, IS_BF16=_dtype_define(q.dtype)), grid, (256,),
            (q, y, np.int64(b * hq), keys, lengths, np.int32(b), np.int32(heads), np.int64(capacity),
             _inv(math.sqrt(d))), q.device)
    return y


def cupy_available() -> bool:
    """Whether the kernels can run here: CuPy imports and a CUDA GPU is present."""
    try:
        _cupy()
    except ImportError:
        return False
    return torch.cuda.is_available()


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
               dtype: torch.dtype, device, norm: bool = True) -> dict[str, Tensor]:
    """Storage for per-channel packed keys: codes [B,H,cap,D*b/8], scale/zero [B,H,cap/G,D], and OScaR's token
    norm [B,1,cap,1] fp32 (without ``norm``: KIVI's keys)."""
    store = dict(codes=torch.empty(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
                 scale=torch.empty(batch, heads, capacity // group_size, head_dim, dtype=dtype, device=device),
                 zero=torch.empty(batch, heads, capacity // group_size, head_dim, dtype=dtype, device=device))
    if norm:
        store["norm"] = torch.empty(batch, 1, capacity, 1, dtype=torch.float32, device=device)
    return store


def empty_values(batch: int, heads: int, capacity: int, head_dim: int, bits: int, group_size: int,
                 dtype: torch.dtype, device) -> dict[str, Tensor]:
    """Storage for packed values: codes [B,H,cap,D*b/8], scale/zero [B,H,cap,D/G]."""
    return dict(codes=torch.empty(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
                scale=torch.empty(batch, heads, capacity, head_dim // group_size, dtype=dtype, device=device),
                zero=torch.empty(batch, heads, capacity, head_dim // group_size, dtype=dtype, device=device))


def empty_turboquant(batch: int, heads: int, capacity: int, head_dim: int, bits: int, group_size: int,
                     device) -> dict[str, Tensor]:
    """Storage for TurboQuant+ keys or values: codes [B,H,cap,D*b/8], corrected norms [B,H,cap,D/G] fp16."""
    return dict(codes=torch.empty(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
                norm=torch.empty(batch, heads, capacity, head_dim // group_size, dtype=torch.float16, device=device))


def empty_storage(method: str, batch: int, heads: int, capacity: int, head_dim: int, *, k_bits: int, v_bits: int,
                  group_size: int, dtype: torch.dtype, device) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(keys, values) storage dicts of ``method`` for ``decode_attention``: per-channel keys (OScaR with its token
    norms, KIVI and OTT without) as :func:`empty_keys`, per-token keys (QuaRot, RotateKV, OSCAR) and every method's
    values as :func:`empty_values` (OSCAR's scale/zero in fp32: its (scale, zero) or Lloyd-Max (std, mean)),
    TurboQuant+'s as :func:`empty_turboquant`. OTT, RotateKV and OSCAR also keep exact tokens
    (kernels.method_layouts.empty_exact)."""
    shape = (batch, heads, capacity, head_dim)
    if method == "turboquant":
        return (empty_turboquant(*shape, k_bits, group_size, device),
                empty_turboquant(*shape, v_bits, group_size, device))
    if method == "spectral":
        return (empty_values(*shape, k_bits, group_size, torch.float32, device),
                empty_values(*shape, v_bits, group_size, torch.float32, device))
    values = empty_values(*shape, v_bits, group_size, dtype, device)
    if method in ("oscar", "kivi", "ott"):
        return empty_keys(*shape, k_bits, group_size, dtype, device, norm=method == "oscar"), values
    if method in ("quarot", "rotatekv"):
        return empty_values(*shape, k_bits, group_size, dtype, device), values
    raise ValueError(f"no kernel storage for method={method!r}; kernels exist for {sorted(METHODS)}")


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
    return _per_channel_keys(k, bits, group_size, rotate, True, False, out, rows, offsets, decode_layout, mode,
                             warps_per_head, min_blocks, persistent)


def quantize_channel_keys(k: Tensor, bits: int, group_size: int, zero_point: str = "float", out: dict | None = None,
                          rows=None, offsets=None, decode_layout: bool = False,
                          warps_per_head: int | None = None) -> PackedTensor:
    """KIVI's keys: ``quantize_groups(k, bits, G, "channel", zero_point)`` in one kernel (OScaR's key kernel without
    rotation and norm), k [B, H, T, D] with T a multiple of G, into ``out`` (:func:`empty_keys` with
    ``norm=False``) at ``rows``/``offsets`` like :func:`quantize_keys`; scale/zero in the decode layout
    (:func:`key_decode_layout`) with ``decode_layout``."""
    return _per_channel_keys(k, bits, group_size, False, False, _zero_float(zero_point), out, rows, offsets,
                             decode_layout, 0, warps_per_head, 1, True)


def _zero_float(zero_point: str) -> bool:
    if zero_point not in ("int", "float"):
        raise ValueError(f"zero_point must be 'int' or 'float', got {zero_point!r}")
    return zero_point == "float"


def _per_channel_keys(k: Tensor, bits: int, group_size: int, rotate: bool, norm: bool, zero_float: bool,
                      out: dict | None, rows, offsets, decode_layout: bool, mode: int, warps_per_head: int | None,
                      min_blocks: int, persistent: bool) -> PackedTensor:
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
        out = empty_keys(b, h, t, d, bits, group_size, k.dtype, k.device, norm=norm)
    cap = out["codes"].shape[2]
    out_rows, out_off = _targets(b, rows, offsets, k.device)
    threads = 32 * h * wph
    smem = 4 * (group_size * h + h * (3 if bits == 2 and not zero_float else 4) * 16 * (d // 32)
                + (threads // 32 * 2 * 16 * (d // 32) if wph > 1 else 0))
    blocks = t // group_size * b  # one per (sequence, group)
    if blocks:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=_dtype_define(k.dtype), HEADS=h, WPH=wph,
                       KMINB=min_blocks, MODE=mode, DECODE_LAYOUT=int(decode_layout))
        if not norm:
            defines.update(KEY_NORM=0, ZERO_FLOAT=int(zero_float))
        if persistent:  # at most as many blocks as threads fit on the SMs (2048 each on sm_80/sm_90)
            blocks = min(blocks, _multiprocessors(_device_index(k.device)) * max(1, 2048 // threads))
        _launch("quantize.cu", "quantize_keys", defines, (blocks,), (threads,),
                (k, np.int32(b), np.int32(t), np.int32(rotate), _inv(math.sqrt(d)), _inv(2**bits - 1),
                 out["codes"], out["scale"], out["zero"], out["norm"] if norm else np.uint64(0), np.int32(cap),
                 out_rows, out_off), k.device, smem)
    meta = dict(bits=bits, group_size=group_size, axis="channel", zero_point="float" if zero_float else "int")
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


@functools.cache
def _token_key_slot_order(head_dim: int, bits: int) -> Tensor:
    """Reference channel of every code slot (byte * 8/bits + position) of a token row in the per-token key decode
    layout (common.cuh, token_key_code_byte)."""
    cpb, bpt = 8 // bits, head_dim * bits // 8
    order = torch.empty(head_dim, dtype=torch.long)
    for c in range(head_dim):
        ks, k = divmod(c, 16)
        byte = ((k & 7) >> 1) * (bpt // 4) + 4 * (ks // cpb) + (((k & 1) << 1) | (k >> 3))
        order[byte * cpb + ks % cpb] = c
    return order


def token_key_decode_layout(keys: dict[str, Tensor], bits: int, inverse: bool = False) -> dict[str, Tensor]:
    """Per-token packed keys (codes [..., D*bits/8]) from the reference layout to the decode layout that
    ``decode_attention`` reads for QuaRot and TurboQuant+ (or back with ``inverse``): the codes of every token row
    permuted so that each tensor-core k-step covers 16 consecutive channels; the other buffers unchanged."""
    codes = keys["codes"]
    d = codes.shape[-1] * 8 // bits
    order = _token_key_slot_order(d, bits)
    if inverse:
        order = torch.argsort(order)
    moved = pack_bits(unpack_bits(codes, bits, d)[..., order.to(codes.device)], bits)
    return {**keys, "codes": moved}


def _permute_tiles(x: Tensor, order: Tensor) -> Tensor:
    """x [..., T, F] with T a multiple of 16: every 16-token tile's T*F elements gathered by order [16 * F]."""
    *lead, t, f = x.shape
    if t % 16:
        raise ValueError(f"the decode layout permutes whole 16-token tiles, got {t} tokens")
    tiles = x.reshape(*lead, t // 16, 16 * f)
    return tiles[..., order.to(x.device)].reshape(x.shape)


def value_decode_layout(values: dict[str, Tensor], bits: int, group_size: int,
                        inverse: bool = False) -> dict[str, Tensor]:
    """Packed values (codes [..., T, D*bits/8] and per-token group parameters [..., T, D/G]: scale/zero, or
    TurboQuant+'s norm; T a multiple of 16) from the reference layout to the decode layout that
    ``decode_attention`` reads (or back with ``inverse``)."""
    head_dim = values["codes"].shape[-1] * 8 // bits
    codes, params = _value_tile_order(head_dim, bits, group_size)
    if inverse:
        codes, params = torch.argsort(codes), torch.argsort(params)
    return {name: _permute_tiles(x, codes if name == "codes" else params) for name, x in values.items()}


def quantize_values(v: Tensor, bits: int, group_size: int, out: dict | None = None, rows=None,
                    offsets=None, decode_layout: bool = False, zero_point: str = "int",
                    clip_ratio: float = 1.0) -> PackedTensor:
    """Per-token value quantization, v [B, H, T, D] -> packed like
    ``quantize_groups(v, bits, G, "token", zero_point, clip_ratio)``, or in the layout :func:`value_decode_layout`
    gives it with ``decode_layout`` (the storage capacity a multiple of 16: whole 16-token tiles)."""
    return _per_token_groups(v, bits, group_size, out, rows, offsets, 1 if decode_layout else 0, zero_point,
                             clip_ratio, rotate=False)


def quantize_token_keys(k: Tensor, bits: int, group_size: int, out: dict | None = None, rows=None, offsets=None,
                        decode_layout: bool = False, zero_point: str = "int", clip_ratio: float = 1.0,
                        rotate: bool = True) -> PackedTensor:
    """QuaRot's keys: ``quantize_groups(hadamard(k), bits, G, "token", zero_point, clip_ratio)`` in one kernel
    (``rotate=False``: k is already rotated), storage as :func:`empty_values`; the codes in the per-token key
    layout (:func:`token_key_decode_layout`) that ``decode_attention`` reads with ``decode_layout``."""
    return _per_token_groups(k, bits, group_size, out, rows, offsets, 2 if decode_layout else 0, zero_point,
                             clip_ratio, rotate)


def _per_token_groups(x: Tensor, bits: int, group_size: int, out: dict | None, rows, offsets, layout: int,
                      zero_point: str, clip_ratio: float, rotate: bool) -> PackedTensor:
    """The per-token group kernel: layout 0 = the reference's, 1 = value tiles, 2 = per-token key codes."""
    _check(x, "x", 4)
    b, h, t, d = x.shape
    zero_float = _zero_float(zero_point)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"the per-token kernel packs {SUPPORTED_BITS} bits, got {bits}")
    if d % group_size or group_size % 8 or group_size > 128:
        raise ValueError(f"per-token groups of {group_size} channels: need a multiple of 8, at most 128, dividing "
                         f"head_dim {d}")
    if not 0 < clip_ratio <= 1:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    if layout == 1:
        check_value_decode_layout(d, bits, group_size)
        if (t if out is None else out["codes"].shape[2]) % 16:
            raise ValueError("the decode layout stores whole 16-token tiles: the storage capacity must be a "
                             "multiple of 16")
    if layout == 2 and group_size % 16:
        raise ValueError(f"the per-token key layout needs groups of whole 16-channel k-steps, got G={group_size}")
    x = x.contiguous()
    if out is None:
        out = empty_values(b, h, t, d, bits, group_size, x.dtype, x.device)
    cap = out["codes"].shape[2]
    out_rows, out_off = _targets(b, rows, offsets, x.device)
    chunks = b * h * t * d // 8  # 16-byte chunks, max(G / 8, 4) per lane
    if chunks:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=_dtype_define(x.dtype), DECODE_LAYOUT=layout)
        if zero_float:
            defines["ZERO_FLOAT"] = 1
        if clip_ratio != 1.0:
            defines["CLIP_BITS"] = int(np.float32(clip_ratio).view(np.uint32))
        if rotate:
            defines["ROTATE_TOKENS"] = 1
        warps = math.ceil(chunks / (32 * max(group_size // 8, 4)))
        _launch("quantize.cu", "quantize_values", defines, (math.ceil(warps / 8),), (256,),
                (x, np.int32(h), np.int32(t), np.int64(chunks), _inv(2**bits - 1), out["codes"], out["scale"],
                 out["zero"], np.int32(cap), out_rows, out_off), x.device)
    meta = dict(bits=bits, group_size=group_size, axis="token", zero_point=zero_point)
    if layout:
        meta["layout"] = "decode"  # dequantize_groups refuses it: convert with inverse=True first
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), x.dtype, meta)


# ----------------------------------------------------------------------------- TurboQuant+


def quantize_turboquant(x: Tensor, group_size: int, signs: Tensor, codebook, out: dict | None = None, rows=None,
                        offsets=None, decode_layout: str | None = None) -> PackedTensor:
    """TurboQuant+ (turbo2) keys or values in one kernel, x [B, H, T, D] -> dict(codes [.., D/4] uint8 (2-bit),
    norm [.., D/G] fp16) like ``TurboQuant.quantize_keys``/``quantize_values`` (bit for bit like
    ``kernels.reference.turboquant_quantize``, which fixes the order of the fp32 sums); ``signs`` [D] (+-1 float32
    on the device) and ``codebook`` (the 4 ascending levels) are the method's. Into ``out``
    (:func:`empty_turboquant`) at ``rows``/``offsets``; ``decode_layout`` "keys" writes the codes in the per-token
    key layout (:func:`token_key_decode_layout`), "values" in the value tiles (:func:`value_decode_layout`, storage
    capacity a multiple of 16)."""
    _check(x, "x", 4)
    b, h, t, d = x.shape
    layout = {None: 0, "values": 1, "keys": 2}.get(decode_layout)
    if layout is None:
        raise ValueError(f"decode_layout must be None, 'keys' or 'values', got {decode_layout!r}")
    if d % group_size or group_size < d // 32:
        raise ValueError(f"turboquant: blocks of {group_size} channels must divide head_dim {d} (and hold >= D/32)")
    if signs.shape != (d,) or signs.dtype != torch.float32 or signs.device != x.device:
        raise ValueError(f"signs must be a float32 [{d}] tensor on {x.device}")
    if layout == 1:
        check_value_decode_layout(d, 2, group_size)
    x = x.contiguous()
    if out is None:
        out = empty_turboquant(b, h, t, d, 2, group_size, x.device)
    cap = out["codes"].shape[2]
    if layout == 1 and cap % 16:
        raise ValueError("the value tiles store whole 16-token tiles: the storage capacity must be a multiple of 16")
    out_rows, out_off = _targets(b, rows, offsets, x.device)
    n_rows = b * h * t
    if n_rows:
        levels = np.asarray(codebook, dtype=np.float32)
        mids = (levels[1:] + levels[:-1]) / np.float32(2)  # as torch computes them in fp32
        defines = dict(HEAD_DIM=d, BITS=2, GROUP=group_size, IS_BF16=_dtype_define(x.dtype), DECODE_LAYOUT=layout,
                       TURBO=1)
        blocks = min(math.ceil(n_rows / 8), 8 * _multiprocessors(_device_index(x.device)))
        _launch("quantize.cu", "quantize_turboquant", defines, (blocks,), (256,),
                (x, signs, np.int32(h), np.int32(t), np.int64(n_rows), _inv(math.sqrt(d)), *levels, *mids,
                 out["codes"], out["norm"], np.int32(cap), out_rows, out_off), x.device, 8 * d)
    meta = dict(bits=2, group_size=group_size, method="turboquant")
    if layout:
        meta["layout"] = "decode"
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), x.dtype, meta)


# ----------------------------------------------------------------------------- OSCAR


def clip_rank(clip_ratio: float, head_dim: int) -> int:
    """The rank (0-based, ascending) of |x| that methods.spectral.clip_rows clamps a row at; -1: no clip."""
    return min(int(clip_ratio * head_dim), head_dim - 1) if clip_ratio > 0 else -1


def quantize_spectral(x: Tensor, bits: int, group_size: int, clip_ratio: float, out: dict | None = None, rows=None,
                      offsets=None, decode_layout: str | None = None) -> PackedTensor:
    """OSCAR's uniform quantizer (``Spectral._quantize`` with codebook=uniform, its exact tokens aside) in one kernel:
    x [B, H, T, D] (keys already rotated by the layer's matrix, or values) -> codes [.., D*bits/8] uint8 and fp32
    scale/zero [.., D/G], bit for bit as CUDA torch computes them (kernels.reference.spectral_quantize). Into
    ``out`` (:func:`empty_storage` of "spectral") at ``rows``/``offsets``; ``decode_layout`` "keys" writes the codes
    in the per-token key layout (:func:`token_key_decode_layout`), "values" codes and parameters in the value tiles
    (:func:`value_decode_layout`, storage capacity a multiple of 16)."""
    _check(x, "x", 4)
    b, h, t, d = x.shape
    layout = {None: 0, "values": 1, "keys": 2}.get(decode_layout)
    if layout is None:
        raise ValueError(f"decode_layout must be None, 'keys' or 'values', got {decode_layout!r}")
    if bits not in SUPPORTED_BITS or d % group_size or group_size < d // 32:
        raise ValueError(f"spectral: {bits}-bit groups of {group_size} channels (2 or 4 bits, G dividing head_dim "
                         f"{d}, at least D/32)")
    if layout == 1:
        check_value_decode_layout(d, bits, group_size)
    x = x.contiguous()
    if out is None:
        out = empty_values(b, h, t, d, bits, group_size, torch.float32, x.device)
    if out["scale"].dtype != torch.float32:
        raise ValueError("spectral: the scales and zeros are stored in fp32 (empty_storage)")
    cap = out["codes"].shape[2]
    if layout == 1 and cap % 16:
        raise ValueError("the value tiles store whole 16-token tiles: the storage capacity must be a multiple of 16")
    out_rows, out_off = _targets(b, rows, offsets, x.device)
    n_rows = b * h * t
    if n_rows:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=_dtype_define(x.dtype), DECODE_LAYOUT=layout)
        blocks = min(math.ceil(n_rows / 8), 8 * _multiprocessors(_device_index(x.device)))
        _launch("spectral_quantize.cu", "quantize_spectral", defines, (blocks,), (256,),
                (x, np.int32(h), np.int32(t), np.int64(n_rows), np.int32(clip_rank(clip_ratio, d)),
                 _inv(2**bits - 1), out["codes"], out["scale"], out["zero"], np.int32(cap), out_rows, out_off),
                x.device, 8 * d)
    meta = dict(bits=bits, group_size=group_size, axis="token", zero_point="float")
    if layout:
        meta["layout"] = "decode"
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), x.dtype, meta)


# ----------------------------------------------------------------------------- attention


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_tokens(max_packed: int, batch: int, kv_heads: int, group_size: int, device,
                 blocks_per_sm: int = BLOCKS_PER_SM, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(splits, tokens per split) for the packed part: about ``blocks_per_sm`` one-warp blocks per SM, at
    most ``max_splits`` per sequence."""
    sms = _multiprocessors(_device_index(device))
    want = math.ceil(max(max_packed, 1) * batch * kv_heads / (sms * blocks_per_sm))
    tps = max(MIN_GROUPS_PER_SPLIT * group_size, math.ceil(want / group_size) * group_size)
    splits = min(max_splits, max(1, math.ceil(max_packed / tps)))
    tps = math.ceil(max(max_packed, 1) / splits / group_size) * group_size
    return splits, tps


def stage_tokens(method: str, group_size: int) -> int:
    """Tokens per stage of decode_attention (n_packed and the splits are multiples of it): the key group for
    per-channel keys (OScaR, KIVI, OTT), STAGE_TOKENS for per-token keys (QuaRot, TurboQuant+, OSCAR, RotateKV)."""
    return STAGE_TOKENS if METHODS[method] >= 2 else group_size


def decode_smem_bytes(head_dim: int, k_bits: int, v_bits: int, group_size: int, heads_per_kv: int, nstage: int,
                      residual_capacity: int, method: str = "oscar", exact_capacity: int = 0) -> int:
    """Dynamic shared memory of a decode_attention block: probabilities [8][TOK] fp32, rotated queries [HPG][D]
    fp32, then the ring of NSTAGE stages of TOK tokens (codes, scale/zero or norms, OScaR's token norms of keys,
    RotateKV's logits [HPG][TOK] fp32 instead; codes, scale/zero or norms of values; OSCAR's parameters fp32),
    which the residual split uses for its logits [ecap + rcap][HPG] fp32 instead."""
    d, g, tok = head_dim, group_size, stage_tokens(method, group_size)
    per_token_keys, fields = METHODS[method] >= 2, 1 if method == "turboquant" else 2
    param_bytes = 4 if method == "spectral" else 2
    if method == "rotatekv":
        keys = heads_per_kv * tok * 4
    else:
        keys = (tok * d * k_bits // 8 + fields * (tok * (d // g) * param_bytes if per_token_keys else d * 2)
                + (4 * tok if method == "oscar" else 0))
    stage = keys + tok * d * v_bits // 8 + fields * tok * (d // g) * param_bytes
    return tok * 8 * 4 + heads_per_kv * d * 4 + max(nstage * stage,
                                                    (exact_capacity + residual_capacity) * heads_per_kv * 4)


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


def _check_exact(exact: dict | None, method: str, b: int, hkv: int, d: int, cap: int, dtype) -> int:
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


def rotatekv_smem_bytes(head_dim: int, group_size: int, heads: int, head_group: int, heads_per_kv: int) -> int:
    """Dynamic shared memory of a rotatekv_scores block: (scale, zero) pairs [TPB][H D / G] u32, queries
    [HPG][g D] fp32, the step rotation [D / 2] float2."""
    return (4 * ROTATEKV_TOKENS_PER_BLOCK * heads * head_dim // group_size + 4 * heads_per_kv * head_group * head_dim
            + 4 * head_dim)


def _rotatekv_logits(query: Tensor, keys: dict, n_packed: Tensor, skip: Tensor, rope: dict, k_bits: int,
                     group_size: int, scaling: float, max_packed: int, poison: bool) -> Tensor:
    """RotateKV's packed keys as base-2 logits [B, Hq, cap] fp32 (kernels/rotatekv.cu), skipped tokens -inf."""
    b, hq, _, d = query.shape
    hkv, cap = keys["codes"].shape[1], keys["codes"].shape[2]
    g = int(rope["head_group"])
    if hkv % g or g not in (1, 2, 4, 8):
        raise ValueError(f"rotatekv: head groups of {g} KV heads must divide {hkv} KV heads (1, 2, 4 or 8)")
    if rope["key_group"].shape != (hkv * d,) or rope["key_group"].dtype != torch.int16:
        raise ValueError(f"rotatekv: key_group must be int16 [H * D] = [{hkv * d}]")
    if rope["anchors"].shape[0] < math.ceil(cap / ROPE_RUN) or rope["anchors"].shape[1:] != (d // 2, 2) \
            or rope["step"].shape != (d // 2, 2):
        raise ValueError(f"rotatekv: RoPE anchors [>= cap / {ROPE_RUN}, D / 2, 2] and step [D / 2, 2] expected")
    logits = torch.empty(b, hq, cap, dtype=torch.float32, device=query.device)
    if poison:
        logits.fill_(float("nan"))
    hpg = hq // hkv
    blocks = math.ceil(max(max_packed, 1) / ROTATEKV_TOKENS_PER_BLOCK)
    defines = dict(HEAD_DIM=d, K_BITS=k_bits, GROUP=group_size, HEAD_GROUP=g, HKV=hkv, HPG=hpg,
                   IS_BF16=_dtype_define(query.dtype))
    _launch("rotatekv.cu", "rotatekv_scores", defines, (blocks, hkv // g, b), (128,),
            (query.reshape(b, hq, d).contiguous(), keys["codes"], keys["scale"], keys["zero"], rope["key_group"],
             rope["anchors"], rope["step"], n_packed, skip, logits, np.int32(cap),
             np.float32(scaling * math.log2(math.e) / math.sqrt(g * d))),
            query.device, rotatekv_smem_bytes(d, group_size, hkv, g, hpg))
    return logits


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
    query comes rotated by the layer's matrix); keys/values: packed storage (see :func:`empty_storage`) with
    capacity cap, in the decode layouts; key_residual/value_residual [B, H, rcap, D] full-precision recent tokens
    (OScaR's and QuaRot's keys already rotated, like :func:`append_residual` writes them, OSCAR's by its matrix;
    the others' as they are); n_packed [B] int32 (multiples of :func:`stage_tokens`) and n_residual [B] int32: valid
    tokens of each sequence.
    ``method`` (:data:`METHODS`) picks the kernel variant; ``rotate_query`` is OScaR's/QuaRot's switch (the other
    methods never rotate); ``zero_point`` the KIVI/OTT/QuaRot convention (default the method's: float for KIVI and
    OTT, int for QuaRot and RotateKV; OSCAR's is float); TurboQuant+ needs ``signs`` [D] (+-1 float32 on the device)
    and ``codebook`` (its 4 ascending levels). OTT, RotateKV and OSCAR (:data:`EXACT_METHODS`) need ``exact``
    (kernels.method_layouts.empty_exact: the tokens kept in full precision, attended before the window, and the
    skip bits of their packed copies); OSCAR takes ``affine`` = (a, b), the code map s' = b s, z' = z + a s of its
    stored (scale, zero) ((0, 1); Lloyd-Max (std, mean): :func:`affine_levels` of its levels); RotateKV needs
    ``rope`` (kernels.method_layouts.rotatekv_tables: key_group, anchors, step, head_group) and its keys in
    kernels.method_layouts.rotatekv_key_layout. Returns [B, Hq, 1, D] in the query dtype (written into ``out`` if
    given). ``splits`` = (number, tokens per split) overrides the heuristic; ``poison`` fills the partial-result
    workspace with NaN (tests); ``mode`` 1/2 compile benchmark variants without the math / without the value product
    (wrong outputs); ``nstage`` (copy ring buffers, >= 2), ``min_blocks`` (launch bound), ``blocks_per_sm`` and
    ``max_splits`` (split heuristic) are tuning knobs.
    """
    _check(query, "query", 4)
    if method not in METHODS:
        raise ValueError(f"decode_attention has kernels for {sorted(METHODS)}, got method={method!r}")
    zero_float = _zero_float(zero_point or ("float" if method in ("kivi", "ott", "spectral") else "int"))
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
    ecap = _check_exact(exact, method, b, hkv, d, cap, query.dtype) if method in EXACT_METHODS else 0
    tok = stage_tokens(method, group_size)
    if cap % tok:
        raise ValueError(f"{method}: the storage capacity must be a multiple of the {tok}-token stages, got {cap}")
    if max_packed is None:
        max_packed = int(n_packed.max())
    splits, tps = splits or split_tokens(max_packed, b, hkv, tok, query.device, blocks_per_sm, max_splits)
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
    if method != "oscar":
        defines.update(METHOD=METHODS[method], ZERO_FLOAT=int(zero_float), STAGE_TOKENS=STAGE_TOKENS)
    if method in EXACT_METHODS:
        defines["EXACT"] = 1
    smem = decode_smem_bytes(d, k_bits, v_bits, group_size, hpg, nstage, rcap, method, ecap)
    extra = ()
    if method == "turboquant":  # block norms in place of the scales, no zeros
        fields = (keys["codes"], keys["norm"], keys["norm"], np.uint64(0), values["codes"], values["norm"],
                  values["norm"])
        extra = (signs, *map(np.float32, codebook_terms(codebook)))
        if signs.shape != (d,) or signs.dtype != torch.float32 or signs.device != query.device:
            raise ValueError(f"signs must be a float32 [{d}] tensor on {query.device}")
    elif method == "rotatekv":  # the logits in place of the key codes, no key parameters
        logits = _rotatekv_logits(query, keys, n_packed, exact["skip"], rope, k_bits, group_size, scaling, max_packed,
                                  poison)
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
    _launch("decode_attention.cu", "decode_attention", defines, (parts, hkv, b), (32,),
            (q, *fields, key_residual, value_residual, n_packed, n_residual, o_part, ml_part,
             np.int32(hkv), np.int32(cap), np.int32(rcap), np.int32(splits), np.int32(tps),
             np.float32(scaling * math.log2(math.e)), np.int32(rotate_query and method != "turboquant"),
             _inv(math.sqrt(d)), *extra), query.device, smem)
    _launch("decode_attention.cu", "combine", defines, (b * hq,), (COMBINE_THREADS,),
            (o_part, ml_part, out, np.int32(parts)), query.device, 4 * parts)
    return out
