"""The quantize launchers: one kernel per method's quantizer, bit for bit its torch reference.

    hadamard(x)                              <-> oscar.quant.hadamard
    hadamard_step(q, keys, lengths)          <-> the same of a decode step's query and (in place) its new keys
    rotate_rows(x, matrix)                   <-> (x.float() @ matrix).to(x.dtype) (up to the order of fp32 sums)
    append_residual(k, v, ...)               <-> a decode step's token into the residual windows (keys rotated)
    finish_step(windows, restored, ...)      <-> kernels.reference.finish_step: the step's in-step flushes
    quantize_keys(k, bits, G)                <-> methods.oscar.OScaR.quantize_keys (rotate, token norm, per channel)
    quantize_channel_keys(k, bits, G)        <-> methods.kivi.KIVI.quantize_keys (per channel, float zero)
    quantize_token_keys(k, bits, G)          <-> methods.quarot.QuaRot.quantize_keys (Hadamard, per token, clip)
    quantize_values(v, bits, G)              <-> quantize_groups(v, bits, G, "token", zero_point, clip_ratio)
    quantize_turboquant(x, G, signs, levels) <-> methods.turboquant.TurboQuant.quantize_keys / quantize_values
    quantize_spectral(x, bits, G, clip)      <-> methods.spectral.Spectral's uniform quantizer
    dequantize(store, layout, bits, G, ...)  <-> oscar.quant.dequantize_groups (OScaR: times its token norms) of
                                             the tokens these quantizers stored in the decode layouts
    dequantize_turboquant(store, stream, ...) <-> methods.turboquant.TurboQuant.dequantize, the same way

Every quantizer takes ``out=`` (the storage dict, kernels.storage), ``rows=`` (storage row of each input sequence)
and ``offsets=`` (token offset of each), and writes the reference's bytes or, with ``decode_layout``, those of
kernels.decode_layouts.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from kernels import runtime
from kernels.runtime import SUPPORTED_BITS, dtype_define, float_zero_point, inv, targets
from kernels.decode_layouts import check_value_decode_layout
from kernels.storage import empty_keys, empty_turboquant, empty_values
from oscar.quant import PackedTensor


def hadamard(x: Tensor) -> Tensor:
    """Normalized Walsh-Hadamard transform over the last dim, bit-equal to ``oscar.quant.hadamard``."""
    runtime.check_input(x, "x")
    d = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        grid = min(65535, (rows + 7) // 8)
        runtime.launch("quantize.cu", "hadamard_rows", dict(HEAD_DIM=d, IS_BF16=dtype_define(x.dtype)), (grid,), (256,),
                       (x, y, np.int64(rows), inv(math.sqrt(d))), x.device)
    return y


def hadamard_step(query: Tensor, keys: Tensor, lengths: Tensor) -> Tensor:
    """One decode step's Hadamards in one launch: returns hadamard(query) for query [B, Hq, 1, D], and rotates in place
    each row's new key, keys[b, :, lengths[b]], in ``keys`` [B, H, capacity, D] (a view of token-major storage,
    [B, capacity, H, D] contiguous: the torch static cache's); lengths [B] int64 on the device. Bit-equal to
    ``oscar.quant.hadamard`` of each (fp32 butterflies)."""
    runtime.check_input(query, "query", 4)
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
    runtime.launch("quantize.cu", "hadamard_step", dict(HEAD_DIM=d, IS_BF16=dtype_define(q.dtype)), grid, (256,),
                   (q, y, np.int64(b * hq), keys, lengths, np.int32(b), np.int32(heads), np.int64(capacity),
                    inv(math.sqrt(d))), q.device)
    return y


#: rows of x a block of rotate_rows takes (kernels/quantize.cu's ROTATE_ROWS)
ROTATE_ROWS = 8


def rotate_rows(x: Tensor, matrix: Tensor, out: Tensor | None = None) -> Tensor:
    """x [..., D] (bf16/fp16) times ``matrix`` [D, D] (float32, row-major, on x's device) in one launch: what
    ``(x.float() @ matrix).to(x.dtype)`` computes, the fp32 sums in the order of the channels (OSCAR's decode-step
    query and key rotation). Written into ``out`` (contiguous, x's shape and dtype) when given; returns it."""
    runtime.check_input(x, "x")
    d = x.shape[-1]
    if matrix.shape != (d, d) or matrix.dtype != torch.float32 or matrix.device != x.device:
        raise ValueError(f"rotate_rows: matrix must be a float32 [{d}, {d}] tensor on {x.device}, got "
                         f"{matrix.dtype} {tuple(matrix.shape)} on {matrix.device}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"rotate_rows: out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on "
                         f"{x.device}")
    x, matrix = x.contiguous(), matrix.contiguous()
    rows = x.numel() // d
    if rows:
        runtime.launch("quantize.cu", "rotate_rows", dict(HEAD_DIM=d, IS_BF16=dtype_define(x.dtype)),
                       (math.ceil(rows / ROTATE_ROWS),), (d,), (x, matrix, out, np.int64(rows)), x.device,
                       4 * ROTATE_ROWS * d)
    return out


def append_residual(key: Tensor, value: Tensor, key_residual: Tensor, value_residual: Tensor, n_residual: Tensor,
                    live: Tensor | None = None, rotate: bool = True) -> None:
    """Write one new token per sequence, key [B, H, 1, D] (rotated like :func:`hadamard` when ``rotate``) and
    value, into the residual windows [B, H, rcap, D] at position n_residual[b] (int32 on the device); with ``live``
    (int32 [B] on the device) n_residual then advances by it in the same launch (``n_residual += live``)."""
    runtime.check_input(key, "key", 4)
    b, h, t, d = key.shape
    if t != 1 or value.shape != key.shape or key_residual.shape[:2] != (b, h) or not key_residual.is_contiguous():
        raise ValueError("append_residual takes one token per sequence and contiguous [B, H, rcap, D] windows")
    for name, counts in (("n_residual", n_residual), ("live", live)):
        if counts is not None and (counts.dtype != torch.int32 or counts.shape != (b,) or not counts.is_contiguous()):
            raise ValueError(f"append_residual: {name} must be a contiguous int32 [{b}] tensor")
    key, value = key.contiguous(), value.contiguous()
    runtime.launch("quantize.cu", "append_residual", dict(HEAD_DIM=d, IS_BF16=dtype_define(key.dtype)),
                   (b,), (32 * min(h, 16),), (key, value, key_residual, value_residual, n_residual,
                                              np.uint64(0) if live is None else live, np.int32(h), np.int32(key_residual.shape[2]), np.int32(rotate),
                                              inv(math.sqrt(d))), key.device)


def finish_step(windows: dict[str, Tensor], restored: dict[str, Tensor], counts: Tensor, residual_length: int) -> None:
    """A decode step's in-step flushes of ``windows`` (stream name -> [B, H, rcap, D] window: "keys" and/or "values",
    one dtype) in one launch, in place; bit-equal to ``kernels.reference.finish_step``. Each row whose window holds
    more than ``residual_length`` unpacked tokens of a stream gets its oldest one (window index packed - n_packed)
    replaced by its dequantization from ``restored`` [B, H, stage, D], and that stream's packed count advances.
    counts: [4, B] int32 on the device, rows n_packed, n_residual, keys packed, values packed."""
    streams = sorted(windows)  # "keys" before "values", as the kernel numbers them
    if not streams or set(streams) - {"keys", "values"} or sorted(restored) != streams:
        raise ValueError(f"finish_step takes the windows and restored tokens of keys and/or values, got {streams}")
    first = windows[streams[0]]
    runtime.check_input(first, "window", 4)
    b, h, rcap, d = first.shape
    stage = restored[streams[0]].shape[2]
    for name in streams:
        w, r = windows[name], restored[name]
        if w.shape != (b, h, rcap, d) or r.shape != (b, h, stage, d) or w.dtype != first.dtype \
                or r.dtype != first.dtype or not (w.is_contiguous() and r.is_contiguous()):
            raise ValueError("finish_step: contiguous [B, H, rcap, D] windows and [B, H, stage, D] restored tokens of "
                             "one dtype")
    if counts.dtype != torch.int32 or counts.shape != (4, b) or not counts.is_contiguous():
        raise ValueError(f"finish_step: counts must be a contiguous int32 [4, {b}] tensor")
    keys, values = windows.get("keys", first), windows.get("values", first)
    key_restored, value_restored = (restored.get(name, restored[streams[0]]) for name in ("keys", "values"))
    runtime.launch("quantize.cu", "finish_step", dict(HEAD_DIM=d, IS_BF16=dtype_define(first.dtype)),
                   (b * len(streams),), (128,),
                   (keys, key_restored, values, value_restored, counts, np.int32(b), np.int32(h), np.int32(rcap),
                    np.int32(stage), np.int32(streams[0] == "values"), np.int32(residual_length)), first.device)


# ----------------------------------------------------------------------------- per-channel keys


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
    return _per_channel_keys(k, bits, group_size, False, False, float_zero_point(zero_point), out, rows, offsets,
                             decode_layout, 0, warps_per_head, 1, True)


def _per_channel_keys(k: Tensor, bits: int, group_size: int, rotate: bool, norm: bool, zero_float: bool,
                      out: dict | None, rows, offsets, decode_layout: bool, mode: int, warps_per_head: int | None,
                      min_blocks: int, persistent: bool) -> PackedTensor:
    runtime.check_input(k, "k", 4)
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
    out_rows, out_off = targets(b, rows, offsets, k.device)
    threads = 32 * h * wph
    smem = 4 * (group_size * h + h * (3 if bits == 2 and not zero_float else 4) * 16 * (d // 32)
                + (threads // 32 * 2 * 16 * (d // 32) if wph > 1 else 0))
    blocks = t // group_size * b  # one per (sequence, group)
    if blocks:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=dtype_define(k.dtype), HEADS=h, WPH=wph,
                       KMINB=min_blocks, MODE=mode, DECODE_LAYOUT=int(decode_layout))
        if not norm:
            defines.update(KEY_NORM=0, ZERO_FLOAT=int(zero_float))
        if persistent:  # at most as many blocks as threads fit on the SMs (2048 each on sm_80/sm_90)
            blocks = min(blocks, runtime.multiprocessors(runtime.device_index(k.device)) * max(1, 2048 // threads))
        runtime.launch("quantize.cu", "quantize_keys", defines, (blocks,), (threads,),
                       (k, np.int32(b), np.int32(t), np.int32(rotate), inv(math.sqrt(d)), inv(2**bits - 1),
                        out["codes"], out["scale"], out["zero"], out["norm"] if norm else np.uint64(0), np.int32(cap),
                        out_rows, out_off), k.device, smem)
    meta = dict(bits=bits, group_size=group_size, axis="channel", zero_point="float" if zero_float else "int")
    if decode_layout:
        meta["layout"] = "decode"  # dequantize_groups refuses it: key_decode_layout(..., inverse=True) first
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), k.dtype, meta)


# ----------------------------------------------------------------------------- per-token groups


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
    runtime.check_input(x, "x", 4)
    b, h, t, d = x.shape
    zero_float = float_zero_point(zero_point)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"the per-token kernel packs {SUPPORTED_BITS} bits, got {bits}")
    if d % group_size or group_size % 8 or group_size > 128:
        raise ValueError(f"per-token groups of {group_size} channels: need a multiple of 8, at most 128, dividing "
                         f"head_dim {d}")
    if not 0 < clip_ratio <= 1:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    if layout == 1:
        check_value_decode_layout(d, bits, group_size)
    if layout == 2 and group_size % 16:
        raise ValueError(f"the per-token key layout needs groups of whole 16-channel k-steps, got G={group_size}")
    x = x.contiguous()
    if out is None:
        out = empty_values(b, h, t, d, bits, group_size, x.dtype, x.device)
    cap = _storage_capacity(out, layout)
    out_rows, out_off = targets(b, rows, offsets, x.device)
    chunks = b * h * t * d // 8  # 16-byte chunks, max(G / 8, 4) per lane
    if chunks:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=dtype_define(x.dtype), DECODE_LAYOUT=layout)
        if zero_float:
            defines["ZERO_FLOAT"] = 1
        if clip_ratio != 1.0:
            defines["CLIP_BITS"] = int(np.float32(clip_ratio).view(np.uint32))
        if rotate:
            defines["ROTATE_TOKENS"] = 1
        warps = math.ceil(chunks / (32 * max(group_size // 8, 4)))
        runtime.launch("quantize.cu", "quantize_values", defines, (math.ceil(warps / 8),), (256,),
                       (x, np.int32(h), np.int32(t), np.int64(chunks), inv(2**bits - 1), out["codes"], out["scale"],
                        out["zero"], np.int32(cap), out_rows, out_off), x.device)
    meta = dict(bits=bits, group_size=group_size, axis="token", zero_point=zero_point)
    if layout:
        meta["layout"] = "decode"  # dequantize_groups refuses it: convert with inverse=True first
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), x.dtype, meta)


def _storage_capacity(out: dict, layout: int) -> int:
    """Tokens per row of ``out`` (a per-token quantizer's storage), checked against the value tiles' 16-token unit
    where ``layout`` is 1 (:func:`value_decode_layout`)."""
    cap = out["codes"].shape[2]
    if layout == 1 and cap % 16:
        raise ValueError("the value tiles store whole 16-token tiles: the storage capacity must be a multiple of 16")
    return cap


def _row_warp_blocks(n_rows: int, device) -> int:
    """Blocks of 8 warps (one row each, grid-striding) for ``n_rows`` rows: at most 8 per multiprocessor."""
    return min(math.ceil(n_rows / 8), 8 * runtime.multiprocessors(runtime.device_index(device)))


# ----------------------------------------------------------------------------- reading packed tokens back

#: the storage layouts :func:`dequantize` reads (kernels/dequantize.cu's LAYOUT)
DEQUANTIZE_LAYOUTS = {"channel_keys": 0, "value_tiles": 1, "token_keys": 2}


def dequantize(store: dict, layout: str, bits: int, group_size: int, rows: Tensor, start: int, n: int, out: Tensor,
               zero_point: str = "int", levels=None) -> Tensor:
    """Tokens start .. start + n of storage rows ``rows`` (int32 [b] on the device) in the model dtype, written into
    ``out`` [b, H, n, D] (any strides, the last dim contiguous) and returned: bit for bit the method's dequantize of
    the same tokens in the reference layout. ``layout``: "channel_keys" (KIVI's and OScaR's keys, times OScaR's
    token norms where the store holds them), "value_tiles" (the values of every method but TurboQuant+) or
    "token_keys" (QuaRot's and OSCAR's keys); the stores the quantizers above write with ``decode_layout``. Scale and
    zero in the model dtype, or in fp32 (OSCAR's); ``levels`` (OSCAR's 4 Lloyd-Max levels in std units, fp32 (std,
    mean) with the float zero point) decode code q as mean + std * levels[q]."""
    runtime.check_input(out, "out", 4)
    b, h, _, d = out.shape
    if layout not in DEQUANTIZE_LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(DEQUANTIZE_LAYOUTS)}, got {layout!r}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"the dequantize kernel unpacks {SUPPORTED_BITS} bits, got {bits}")
    codes = store["codes"]
    cap = _storage_capacity(store, DEQUANTIZE_LAYOUTS[layout])
    if out.shape[2] != n or out.stride(-1) != 1 or codes.shape[1] != h or codes.shape[3] * 8 != d * bits:
        raise ValueError(f"out must be [rows, H, n, D] with a contiguous last dim for storage of shape "
                         f"{tuple(codes.shape)} at {bits} bits and n={n}, got {tuple(out.shape)}")
    if rows.dtype != torch.int32 or rows.shape != (b,) or not 0 <= start <= start + n <= cap:
        raise ValueError(f"rows: int32 [{b}] on the device, tokens {start}..{start + n} within the capacity {cap}")
    param32 = store["scale"].dtype == torch.float32
    if not param32 and store["scale"].dtype != out.dtype or store["zero"].dtype != store["scale"].dtype:
        raise ValueError(f"scale and zero in the model dtype {out.dtype} or both in fp32, got "
                         f"{store['scale'].dtype} and {store['zero'].dtype}")
    if levels is not None and (len(levels) != 4 or bits != 2 or not param32 or zero_point != "float"):
        raise ValueError("levels: OSCAR's 4 Lloyd-Max levels, for 2-bit codes with fp32 (std, mean) and the float "
                         "zero point")
    norm = store.get("norm") if layout == "channel_keys" else None
    total = b * h * n * d * bits // 8  # one thread per code byte
    if total:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=dtype_define(out.dtype),
                       LAYOUT=DEQUANTIZE_LAYOUTS[layout], KEY_NORM=int(norm is not None),
                       ZERO_FLOAT=int(float_zero_point(zero_point)), PARAM32=int(param32),
                       LEVEL_TABLE=int(levels is not None))
        blocks = min(math.ceil(total / 256), 32 * runtime.multiprocessors(runtime.device_index(out.device)))
        runtime.launch("dequantize.cu", "dequantize", defines, (blocks,), (256,),
                       (codes, store["scale"], store["zero"], norm if norm is not None else np.uint64(0), np.int32(h),
                        np.int32(cap), rows, np.int32(start), np.int32(n), np.int64(total), out,
                        np.int64(out.stride(0)), np.int64(out.stride(1)), np.int64(out.stride(2)),
                        *np.asarray(levels if levels is not None else (0, 0, 0, 0), dtype=np.float32)), out.device)
    return out


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
    runtime.check_input(x, "x", 4)
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
    cap = _storage_capacity(out, layout)
    out_rows, out_off = targets(b, rows, offsets, x.device)
    n_rows = b * h * t
    if n_rows:
        levels = np.asarray(codebook, dtype=np.float32)
        mids = (levels[1:] + levels[:-1]) / np.float32(2)  # as torch computes them in fp32
        defines = dict(HEAD_DIM=d, BITS=2, GROUP=group_size, IS_BF16=dtype_define(x.dtype), DECODE_LAYOUT=layout,
                       TURBO=1)
        blocks = _row_warp_blocks(n_rows, x.device)
        runtime.launch("quantize.cu", "quantize_turboquant", defines, (blocks,), (256,),
                       (x, signs, np.int32(h), np.int32(t), np.int64(n_rows), inv(math.sqrt(d)), *levels, *mids,
                        out["codes"], out["norm"], np.int32(cap), out_rows, out_off), x.device, 8 * d)
    meta = dict(bits=2, group_size=group_size, method="turboquant")
    if layout:
        meta["layout"] = "decode"
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), x.dtype, meta)


def dequantize_turboquant(store: dict, stream: str, group_size: int, signs: Tensor, codebook, rows: Tensor,
                          start: int, n: int, out: Tensor) -> Tensor:
    """TurboQuant+'s tokens start .. start + n of storage rows ``rows`` (int32 [b] on the device) in the model dtype,
    written into ``out`` [b, H, n, D] (the last dim contiguous) and returned: bit for bit
    ``TurboQuant.dequantize`` of the same tokens (``signs``, ``codebook``: as :func:`quantize_turboquant` takes
    them). ``stream``: "keys" (the per-token key layout) or "values" (the value tiles), as quantize_turboquant's
    ``decode_layout`` wrote them."""
    runtime.check_input(out, "out", 4)
    b, h, _, d = out.shape
    layout = {"values": 1, "keys": 2}.get(stream)
    if layout is None:
        raise ValueError(f"stream must be 'keys' or 'values', got {stream!r}")
    codes = store["codes"]
    cap = _storage_capacity(store, layout)
    if out.shape[2] != n or out.stride(-1) != 1 or codes.shape[1] != h or codes.shape[3] * 4 != d:
        raise ValueError(f"out must be [rows, H, n, D] with a contiguous last dim for 2-bit storage of shape "
                         f"{tuple(codes.shape)} and n={n}, got {tuple(out.shape)}")
    if rows.dtype != torch.int32 or rows.shape != (b,) or not 0 <= start <= start + n <= cap:
        raise ValueError(f"rows: int32 [{b}] on the device, tokens {start}..{start + n} within the capacity {cap}")
    if signs.shape != (d,) or signs.dtype != torch.float32 or signs.device != out.device:
        raise ValueError(f"signs must be a float32 [{d}] tensor on {out.device}")
    n_rows = b * h * n
    if n_rows:
        defines = dict(HEAD_DIM=d, BITS=2, GROUP=group_size, IS_BF16=dtype_define(out.dtype), LAYOUT=layout,
                       TURBO=1)
        runtime.launch("dequantize.cu", "dequantize_turboquant", defines, (_row_warp_blocks(n_rows, out.device),),
                       (256,), (codes, store["norm"], signs, np.int32(h), np.int32(cap), rows, np.int32(start),
                                np.int32(n), np.int64(n_rows), *np.asarray(codebook, dtype=np.float32),
                                inv(math.sqrt(d)), out, np.int64(out.stride(0)), np.int64(out.stride(1)),
                                np.int64(out.stride(2))), out.device)
    return out


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
    runtime.check_input(x, "x", 4)
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
    cap = _storage_capacity(out, layout)
    out_rows, out_off = targets(b, rows, offsets, x.device)
    n_rows = b * h * t
    if n_rows:
        defines = dict(HEAD_DIM=d, BITS=bits, GROUP=group_size, IS_BF16=dtype_define(x.dtype), DECODE_LAYOUT=layout)
        blocks = _row_warp_blocks(n_rows, x.device)
        runtime.launch("spectral_quantize.cu", "quantize_spectral", defines, (blocks,), (256,),
                       (x, np.int32(h), np.int32(t), np.int64(n_rows), np.int32(clip_rank(clip_ratio, d)),
                        inv(2**bits - 1), out["codes"], out["scale"], out["zero"], np.int32(cap), out_rows, out_off),
                       x.device, 8 * d)
    meta = dict(bits=bits, group_size=group_size, axis="token", zero_point="float")
    if layout:
        meta["layout"] = "decode"
    return PackedTensor(dict(out), (out["codes"].shape[0], h, cap, d), x.dtype, meta)
