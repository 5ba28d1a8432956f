"""The plan of a decode_attention launch: each method's kernel variant (the METHOD define) and stage size, the split
of the packed tokens and of the full-precision ones over one-warp thread blocks, and the blocks' dynamic shared
memory."""

from __future__ import annotations

import math

#: thread blocks (one warp each) per multiprocessor that the split heuristic of decode_attention aims at,
#: the fewest G-token groups per split and the most splits per sequence (partials the combine reads),
#: the copy ring's buffers and the resident blocks per SM asked of the register allocator
#: (__launch_bounds__); chosen from H200 sweeps (the kernel question's tuning rows in results/efficiency/kernel.csv:
#: at the decode step's shapes the fastest of 36 sets of ring buffers, launch bound and most splits is within 5%)
BLOCKS_PER_SM = 48
NSTAGE = 2
MIN_BLOCKS = 16
MIN_GROUPS_PER_SPLIT = 8
MAX_SPLITS = 256
#: multiprocessors of the GPUs the plans were tuned on (H100 and H200 SXM): split_tokens' default; the launchers pass
#: the device's own count
DEFAULT_SMS = 132
#: threads of a combine block and the channels it merges (a block per head and COMBINE_DIMS channels; the threads a
#: multiple of COMBINE_DIMS, which divides every supported head dim)
COMBINE_THREADS = 512
COMBINE_DIMS = 32
#: full-precision tokens (exact ones and the window) per residual split: one per lane, so a window of R + a stage
#: runs over several blocks beside the packed splits instead of one warp's serial loop
RESIDUAL_TOKENS = 32
#: decode_attention's METHOD define per method name; per-token key methods stream STAGE_TOKENS tokens per stage
METHODS = dict(oscar=0, kivi=1, quarot=2, turboquant=3, ott=1, spectral=4, rotatekv=5)
STAGE_TOKENS = 32
#: the methods whose kernels attend exactly kept tokens (decode_attention's ``exact``, method_layouts.empty_exact)
EXACT_METHODS = ("ott", "rotatekv", "spectral")
#: tokens of one warp's tile in rotatekv.cu (its RoPE anchors are the model's table every RUN positions)
ROPE_RUN = 16
ROTATEKV_TOKENS_PER_BLOCK = 128


def split_tokens(max_packed: int, batch: int, kv_heads: int, stage: int, sms: int = DEFAULT_SMS,
                 blocks_per_sm: int = BLOCKS_PER_SM, max_splits: int = MAX_SPLITS,
                 resident: int = MIN_BLOCKS) -> tuple[int, int]:
    """(splits, tokens per split) of the packed part: ``batch`` x ``kv_heads`` rows of ``max_packed`` tokens in
    ``stage``-token stages over one-warp blocks, one per (split, row), on ``sms`` multiprocessors.

    Long splits (at least MIN_GROUPS_PER_SPLIT stages: few partials for the combine, copies in flight) sized for
    about ``blocks_per_sm`` blocks per multiprocessor; where that leaves fewer blocks than one wave of ``resident``
    per multiprocessor (batch 1, short contexts), shorter splits, down to one stage, until the grid fills the wave;
    at most ``max_splits`` splits, the largest that fits where a wave cannot. Every split holds tokens of the longest
    row (no empty one)."""
    stages = math.ceil(max(max_packed, 1) / stage)
    rows = batch * kv_heads
    want = math.ceil(max(max_packed, 1) * rows / (sms * blocks_per_sm))  # tokens a split for the aimed blocks
    per = max(MIN_GROUPS_PER_SPLIT, math.ceil(want / stage))  # stages per split
    wave = math.ceil(sms * resident / rows)  # splits per row that fill one wave
    if wave > 1 and math.ceil(stages / per) < wave:
        per = max(1, (stages - 1) // (wave - 1))  # the longest splits that still give a wave: ceil(stages/per) >= wave
    per = max(per, math.ceil(stages / max_splits))
    return math.ceil(stages / per), per * stage


def residual_splits(residual_capacity: int, exact_capacity: int = 0) -> int:
    """Residual splits of a decode_attention launch: the full-precision capacity (exact tokens + window) in slices of
    about RESIDUAL_TOKENS (fixed by the capacities, so a captured step's grid never changes)."""
    return max(1, math.ceil((residual_capacity + exact_capacity) / RESIDUAL_TOKENS))


def stage_tokens(method: str, group_size: int) -> int:
    """Tokens per stage of decode_attention (n_packed and the splits are multiples of it): the key group for
    per-channel keys (OScaR, KIVI, OTT), STAGE_TOKENS for per-token keys (QuaRot, TurboQuant+, OSCAR, RotateKV)."""
    return STAGE_TOKENS if METHODS[method] >= 2 else group_size


def decode_smem_bytes(head_dim: int, k_bits: int, v_bits: int, group_size: int, heads_per_kv: int, nstage: int,
                      residual_capacity: int, method: str = "oscar", exact_capacity: int = 0) -> int:
    """Dynamic shared memory of a decode_attention block: probabilities [8][TOK] fp32, rotated queries [HPG][D]
    fp32, then the ring of NSTAGE stages of TOK tokens (codes, scale/zero or norms, OScaR's token norms of keys,
    RotateKV's logits [HPG][TOK] fp32 instead; codes, scale/zero or norms of values; OSCAR's parameters fp32),
    which a residual split uses for the logits of its slice of the ecap + rcap full-precision tokens (at most
    [ecap + rcap][HPG] fp32) instead."""
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


def rotatekv_smem_bytes(head_dim: int, group_size: int, heads: int, head_group: int, heads_per_kv: int,
                        tokens_per_block: int = ROTATEKV_TOKENS_PER_BLOCK) -> int:
    """Dynamic shared memory of a rotatekv_scores block (kernels/rotatekv.cu): the (scale, -1024 - zero) fp16 pairs
    [TPB][H D / G + 1], the RoPE offsets [ROPE_RUN] and the block's anchors [TPB / ROPE_RUN], rows of fp32 pairs in
    the kernel's skewed layout (ROPE_ROW), the queries as 8-byte operands [D / 16][n-tiles of the group's
    queries][32] and the group's key groups [g D] int16."""
    query_tiles = math.ceil(head_group * heads_per_kv / 8)
    quarter = head_dim // 8 + (4 - head_dim // 8) % 16  # QSTRIDE: >= D / 8 and 4 mod 16
    rope_row = 4 * quarter + 1
    return (4 * tokens_per_block * (heads * head_dim // group_size + 1)
            + 8 * (ROPE_RUN + tokens_per_block // ROPE_RUN) * rope_row
            + 8 * head_dim // 16 * query_tiles * 32 + 2 * head_group * head_dim)
