"""The kernels' public namespace: ``from kernels import ops``, then ``ops.<name>``; one launcher per reference
function. This module only gathers the names; the code lives by job in kernels.runtime (compiling and launching
kernels/*.cu with CuPy, imported on first use: CPU-only installs import this fine), kernels.quantizers (the quantize
launchers), kernels.decode_layouts, kernels.storage (``empty_*``), kernels.plans (method variants, splits, shared
memory), kernels.attention (``decode_attention``) and kernels.layers (the decode step's norms, RoPE and MLP product;
kernels.fused_layers swaps them into a model).

    hadamard(x)                              <-> oscar.quant.hadamard
    hadamard_step(q, keys, lengths)          <-> the same of a decode step's query and (in place) its new keys
    rotate_rows(x, matrix)                   <-> (x.float() @ matrix).to(x.dtype), the fp32 sums in channel order:
                                                 OSCAR's decode-step query and key rotation (one launch each)
    finish_step(windows, restored, ...)      <-> kernels.reference.finish_step: a decode step's in-step flushes
    quantize_keys(k, bits, G)                <-> methods.oscar.OScaR.quantize_keys (rotate, token norm, per channel)
    quantize_channel_keys(k, bits, G)        <-> methods.kivi.KIVI.quantize_keys (per channel, float zero)
    quantize_token_keys(k, bits, G)          <-> methods.quarot.QuaRot.quantize_keys (Hadamard, per token, clip)
    quantize_values(v, bits, G)              <-> quantize_groups(v, bits, G, "token", zero_point, clip_ratio): the
                                                 values of OScaR, KIVI and QuaRot
    quantize_turboquant(x, G, signs, levels) <-> methods.turboquant.TurboQuant.quantize_keys / quantize_values
    quantize_spectral(x, bits, G, clip)      <-> methods.spectral.Spectral's uniform quantizer (quantile clip, fp32
                                                 scale/zero), kernels.reference.spectral_quantize
    dequantize(store, layout, bits, G, ...)  <-> the methods' dequantize of packed tokens (KIVI, OScaR, QuaRot, OTT,
                                                 OSCAR; every method's values): a prefill chunk's stored prefix read
                                                 back from the storage
    dequantize_turboquant(store, stream, ...) <-> methods.turboquant.TurboQuant.dequantize, the same way
    quantize_rotatekv_keys(k, bits, G, ...)  <-> methods.rotatekv.RotateKV.quantize_keys (RoPE undone, grouped-head
                                                 Hadamard, channel order, per token, clip)
    dequantize_rotatekv_keys(store, ...)     <-> methods.rotatekv.RotateKV.dequantize of its keys, as dequantize
    pool_outliers(k, values, pool, ...)      <-> methods.ott.OTT.pool_outliers (the pool's admission, the filled
                                                 chunk), then kernels.kept_tokens.KeptTokens.stage of what it pooled
    decode_attention(q, ..., method=)        <-> kernels.reference.<method>_decode (DECODE_REFERENCES):
                                                 softmax(q' k'^T * scaling) v' over [dequantized packed | exact |
                                                 residual]; RotateKV's packed logits from rotatekv.cu first
    rms_norm(x, weight, eps)                 <-> transformers' LlamaRMSNorm / Qwen3RMSNorm forward   (kernels.layers:
    rotary(q, k, cos, sin)                   <-> its apply_rotary_pos_emb                            a decode step's
    silu_mul(gate, up)                       <-> silu(gate) * up of its SiLU MLP                     small layers)

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
    ott         pool_outliers(k), then                         quantize_values(zero_point=...)           as they are
                quantize_channel_keys(filled)
    rotatekv    quantize_rotatekv_keys(k) (codes in the order  quantize_values(zero_point="int",         as they are
                of rotatekv_key_layout)                        clip_ratio=...)                           (post-RoPE)
    spectral    quantize_spectral(k_rot, decode_layout=        quantize_spectral(v, decode_layout=       k @ R_K
                "keys") (Lloyd-Max: its own, store_packed)     "values") (Lloyd-Max: its own)
(residual windows [B, H, rcap, D] in the model dtype; rotated keys as append_residual(rotate=True) writes them;
OSCAR's by its layer's matrix: a decode token's key and query by rotate_rows before the kernel, a prefill chunk's
by method.transform_key / transform_query)

OTT's keys flush through two kernels: pool_outliers admits the chunk's outliers to the pool, stages them in the
exact slots and fills their places from their groups, then KIVI's quantize_channel_keys packs the filled chunk (the
method's own bytes: its quantizer is KIVI's on that chunk). RotateKV's have kernels both ways
(kernels.rotatekv_keys: RoPE undone and re-applied at the tokens' stream positions from the model's table,
kernels.method_layouts.rotatekv_rope_positions). OSCAR's flush every 32-token stage (its window policy) for keys and
values alike, so its uniform quantizer has a kernel (the Lloyd-Max switch, whose torch means and stds sum in an order
a kernel would not reproduce, runs the method's own). Their exactly kept tokens
live in ``kernels.method_layouts.empty_exact`` (full-precision keys and values per row and head, attended like the
window, plus a skip bit per packed token for their packed copies; its docstring states what a cache keeps where).
RotateKV's keys are rebuilt per position by kernels/rotatekv.cu on tensor cores (dequantized, P^T, the grouped-head
Hadamard, RoPE from the model's table every ROPE_RUN positions times the rotation by the rest), which writes the packed
tokens' base-2 logits [B, Hq, cap] fp32 that decode_attention streams in place of key codes.

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

from kernels.attention import affine_levels, codebook_terms, decode_attention, rotatekv_logits
from kernels.decode_layouts import (check_value_decode_layout, key_decode_layout, token_key_decode_layout,
                                    value_decode_layout)
from kernels.plans import (BLOCKS_PER_SM, COMBINE_DIMS, COMBINE_THREADS, EXACT_METHODS, MAX_SPLITS, METHODS,
                           MIN_BLOCKS, MIN_GROUPS_PER_SPLIT, NSTAGE, RESIDUAL_TOKENS, ROPE_RUN,
                           ROTATEKV_TOKENS_PER_BLOCK, STAGE_TOKENS, decode_smem_bytes, residual_splits,
                           rotatekv_smem_bytes, split_tokens, stage_tokens)
from kernels.quantizers import (append_residual, clip_rank, dequantize, dequantize_turboquant, finish_step,
                                hadamard, hadamard_step, key_warps_per_head, quantize_channel_keys, quantize_keys,
                                quantize_spectral, quantize_token_keys, quantize_turboquant, quantize_values,
                                rotate_rows)
from kernels.layers import rms_norm, rotary, silu_mul
from kernels.ott_pool import pool_outliers
from kernels.rotatekv_keys import dequantize_rotatekv_keys, quantize_rotatekv_keys
from kernels.runtime import KERNEL_DIR, SUPPORTED_BITS, SUPPORTED_HEAD_DIMS, cupy_available
from kernels.storage import empty_keys, empty_storage, empty_turboquant, empty_values

__all__ = [
    "BLOCKS_PER_SM", "COMBINE_DIMS", "COMBINE_THREADS", "EXACT_METHODS", "KERNEL_DIR", "MAX_SPLITS", "METHODS",
    "MIN_BLOCKS", "MIN_GROUPS_PER_SPLIT", "NSTAGE", "RESIDUAL_TOKENS", "ROPE_RUN", "ROTATEKV_TOKENS_PER_BLOCK",
    "STAGE_TOKENS", "SUPPORTED_BITS", "SUPPORTED_HEAD_DIMS", "affine_levels", "append_residual",
    "check_value_decode_layout", "clip_rank", "codebook_terms", "cupy_available", "decode_attention",
    "decode_smem_bytes", "dequantize", "dequantize_rotatekv_keys", "dequantize_turboquant", "empty_keys",
    "empty_storage", "empty_turboquant", "empty_values", "finish_step", "hadamard", "hadamard_step",
    "key_decode_layout", "key_warps_per_head", "pool_outliers", "quantize_channel_keys", "quantize_keys",
    "quantize_rotatekv_keys", "quantize_spectral", "quantize_token_keys", "quantize_turboquant", "quantize_values",
    "residual_splits", "rms_norm", "rotary", "rotate_rows", "rotatekv_logits", "rotatekv_smem_bytes", "silu_mul",
    "split_tokens", "stage_tokens", "token_key_decode_layout", "value_decode_layout",
]
