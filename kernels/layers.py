"""The launchers of kernels/fused_layers.cu: a decode step's small layers in one launch each, numbers as transformers'.

    rms_norm(x, weight, eps)       <-> LlamaRMSNorm / Qwen3RMSNorm forward (fp32 mean of squares, rsqrt, rounded to the
                                       dtype, times the weight, rounded); x [..., N] (Qwen3's per-head q_norm/k_norm:
                                       [B, T, H, D])
    add_rms_norm(x, res, w, eps)   <-> a decoder layer's residual add, then the norm after it: (res + x, its RMSNorm),
                                       the sum rounded as torch adds in the dtype
    rotary(q, k, cos, sin)         <-> transformers' apply_rotary_pos_emb(q, k, cos, sin) (rotate-half RoPE, each
                                       product and sum rounded as torch rounds them: bit for bit); q [B, Hq, T, D],
                                       k [B, Hk, T, D], cos/sin [B or 1, T, D]
    silu_mul(gate, up)             <-> silu(gate) * up of a SiLU MLP (gate, up [..., I]: two projections' outputs or the
                                       halves of one merged projection's)
    rotate_rows(x, matrix)         <-> (x.float() @ matrix).to(x.dtype): a float32 rotation [D, D] of x [..., D]
                                       (OSCAR's per-layer matrix on a decode token's query and key heads)

Every launcher takes float32, bfloat16 or float16 CUDA tensors (all in one dtype) of any strides with contiguous
channels, and ``out=`` tensors to write (allocated otherwise: contiguous for the norm and the MLP, the input's layout
for RoPE, as torch's elementwise ops lay theirs out).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from kernels import runtime

SOURCE = "fused_layers.cu"
#: the DTYPE define of each model dtype
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: threads per block of the elementwise kernels; the norm's rows take at most this many per block (several short rows
#: share a block)
BLOCK = 256
#: rows of rotate_rows per block (each sharing the block's loads of the matrix)
ROTATE_ROWS = 8
#: a norm's channels per thread: a row of N channels takes ceil(N / ROW_ELEMS) threads (rounded up to whole warps, at
#: most 1024): hidden size 4096 in 512 threads (one 8-element load each), a head of 128 in one warp
ROW_ELEMS = 8


def _check(name: str, *tensors: Tensor) -> torch.dtype:
    """The common dtype of ``tensors``; ValueError unless they are CUDA tensors of one supported dtype with
    contiguous channels."""
    dtype = tensors[0].dtype
    for x in tensors:
        runtime.check_cuda(x, name)
        if x.dtype not in DTYPES or x.dtype != dtype:
            raise ValueError(f"{name}: tensors of one dtype among {', '.join(map(str, DTYPES))}, got "
                             f"{', '.join(str(t.dtype) for t in tensors)}")
        if x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
            raise ValueError(f"{name}: channels (the last dim) must be contiguous, got strides {x.stride()}")
    return dtype


def norm_threads(size: int) -> int:
    """Threads per row of the norm kernel for rows of ``size`` channels (whole warps, at most 1024)."""
    return min(1024, 32 * math.ceil(size / ROW_ELEMS / 32))


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """RMSNorm over the last dim (N channels) of x [..., N] with weight [N]: a new contiguous tensor (or ``out``, of
    x's shape)."""
    _check("rms_norm", x, weight)
    out = _norm_output("rms_norm", x, weight, out)
    _launch_norm("rms_norm", x, (), weight, out, eps)
    return out


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, out: Tensor | None = None,
                 sum_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A decoder layer's residual add and the norm after it in one launch: (residual + x, RMSNorm(residual + x)) for
    x, residual [..., N] of one shape, the sum rounded to the dtype as torch adds; new contiguous tensors (or
    ``sum_out``, ``out``)."""
    _check("add_rms_norm", x, residual, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: x and residual of one shape, got {tuple(x.shape)} and "
                         f"{tuple(residual.shape)}")
    out = _norm_output("add_rms_norm", x, weight, out)
    sum_out = _norm_output("add_rms_norm", x, weight, sum_out)
    rows3 = _rows3(residual)
    _launch_norm("add_rms_norm", x, (rows3, np.int64(rows3.stride(0)), np.int64(rows3.stride(1)), sum_out), weight,
                 out, eps)
    return sum_out, out


def _norm_output(name: str, x: Tensor, weight: Tensor, out: Tensor | None) -> Tensor:
    """``out`` checked (a contiguous tensor of x's shape and dtype), or a new one; weight checked against x's rows."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"{name}: weight of shape ({n},) for rows of {n} channels, got {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    return out


def _rows3(x: Tensor) -> Tensor:
    """x [..., N] as (outer, inner) rows [O, I, N]: a view where strides allow."""
    return x.reshape(-1, x.shape[-2] if x.dim() > 1 else 1, x.shape[-1])


def _launch_norm(name: str, x: Tensor, residual_args: tuple, weight: Tensor, out: Tensor, eps: float) -> None:
    """The norm kernel ``name`` over x's rows (``residual_args``: add_rms_norm's residual, its strides, sum_out)."""
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if not rows:
        return
    rows3 = _rows3(x)
    threads = norm_threads(n)
    per_block = max(1, BLOCK // threads)
    defines = dict(DTYPE=DTYPES[x.dtype], NORM_SIZE=n, ROW_THREADS=threads, ROW_ELEMS=math.ceil(n / threads),
                   ROWS_PER_BLOCK=per_block)
    inner = rows3.shape[1]
    runtime.launch(SOURCE, name, defines, (math.ceil(rows / per_block),), (threads * per_block,),
                   (rows3, np.int64(rows3.stride(0)), np.int64(rows3.stride(1)), *residual_args, weight, out,
                    np.int64(inner * n), np.int64(n), np.int32(inner), np.int64(rows), np.float32(eps),
                    np.float32(1) / np.float32(n)), x.device, smem=4 * per_block * (threads // 32))


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor | None = None,
           k_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """RoPE of q [B, Hq, T, D] and k [B, Hk, T, D] in one launch with cos/sin [B or 1, T, D] (the model's rotary
    embedding's, in the dtype): (q_embed, k_embed), new tensors laid out as q and k (or ``q_out``, ``k_out``)."""
    _check("rotary", q, k, cos, sin)
    b, hq, t, d = q.shape
    if k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (b, t, d) or d % 2:
        raise ValueError(f"rotary: q [B, Hq, T, D] and k [B, Hk, T, D] with an even D, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1:] != (t, d):
        raise ValueError(f"rotary: cos and sin [B or 1, T, D] = [{b} or 1, {t}, {d}], got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    cos, sin = cos.expand(b, t, d), sin.expand(b, t, d)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError("rotary: q_out and k_out of q's and k's shapes")
    _check("rotary", q, q_out, k_out)
    pairs = b * t * (hq + k.shape[1]) * (d // 2)
    if pairs:
        strides = [np.int64(s) for x in (q, k) for s in (x.stride(0), x.stride(1), x.stride(2))]
        out_strides = [np.int64(s) for x in (q_out, k_out) for s in (x.stride(0), x.stride(1), x.stride(2))]
        runtime.launch(SOURCE, "rotary", dict(DTYPE=DTYPES[q.dtype], ROPE_DIM=d), (math.ceil(pairs / BLOCK),),
                       (BLOCK,), (q, *strides[:3], k, *strides[3:], cos, sin, np.int64(cos.stride(0)),
                                  np.int64(cos.stride(1)), q_out, *out_strides[:3], k_out, *out_strides[3:],
                                  np.int32(hq), np.int32(k.shape[1]), np.int32(t), np.int64(pairs)), q.device)
    return q_out, k_out


def silu_mul(gate: Tensor, up: Tensor, out: Tensor | None = None) -> Tensor:
    """silu(gate) * up for gate, up [..., I] of one shape: a new contiguous tensor (or ``out``)."""
    _check("silu_mul", gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if out is None else out
    if out.shape != gate.shape or out.dtype != gate.dtype or not out.is_contiguous():
        raise ValueError(f"silu_mul: out must be a contiguous {gate.dtype} tensor of shape {tuple(gate.shape)}")
    width = gate.shape[-1]
    total = gate.numel()
    if total:
        g, u = (x.reshape(-1, width) for x in (gate, up))  # views where the leading dims merge (a merged GEMM's halves)
        g, u = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, u))
        runtime.launch(SOURCE, "silu_mul", dict(DTYPE=DTYPES[gate.dtype], SILU_MUL=1), (math.ceil(total / BLOCK),),
                       (BLOCK,), (g, np.int64(g.stride(0)), u, np.int64(u.stride(0)), out, np.int64(width),
                                  np.int32(width), np.int64(total)), gate.device)
    return out


def rotate_rows(x: Tensor, matrix: Tensor, out: Tensor | None = None) -> Tensor:
    """x [..., D] times a float32 matrix [D, D] in float32, rounded to x's dtype, as
    ``(x.float() @ matrix).to(x.dtype)`` (up to the float32 sums' order): a new contiguous tensor (or ``out``). Meant
    for a few rows (a decode token's heads); a prefill chunk's rows are a GEMM's work."""
    _check("rotate_rows", x)
    runtime.check_cuda(matrix, "rotate_rows")
    d = x.shape[-1]
    if matrix.dtype != torch.float32 or matrix.shape != (d, d):
        raise ValueError(f"rotate_rows: a float32 matrix [{d}, {d}] for rows of {d} channels, got "
                         f"{matrix.dtype} {tuple(matrix.shape)}")
    if not 0 < d <= 1024:
        raise ValueError(f"rotate_rows: rows of 1 to 1024 channels (one thread each), got {d}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"rotate_rows: out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    rows = x.numel() // d
    if rows:
        args = (x.reshape(rows, d).contiguous(), matrix.contiguous(), out, np.int64(rows))
        runtime.launch(SOURCE, "rotate_rows", dict(DTYPE=DTYPES[x.dtype], ROTATE_DIM=d, ROTATE_ROWS=ROTATE_ROWS),
                       (math.ceil(rows / ROTATE_ROWS),), (d,), args, x.device, smem=4 * ROTATE_ROWS * d)
    return out
