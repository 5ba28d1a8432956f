"""decode_attention at one shape for Nsight Compute: one call per method and mode inside the profiled range, the
warm-up calls (compilation, first launch) outside it.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        python scripts/profile_decode_kernel.py --batch 1 --context 131072 --methods oscar kivi --modes 0 1

The cache is the kernel question's (benchmarks.kernel.method_cache: random codes, plausible parameters, 2 bits,
Llama-3.1-8B's attention shape); ``--modes``: 0 the full kernel, 1 the packed bytes streamed only, 2 no value
product (kernels.attention.decode_attention's ``mode``). ncu reports the split kernel and the combine apart.
``rotatekv_logits`` is RotateKV's logits kernel alone (kernels/rotatekv.cu, the step's largest kernel for RotateKV):
random codes and parameters, a random channel order, head groups of 4 KV heads, RoPE at Llama 3.1's frequencies
(``--modes`` does not apply; ``--rotatekv-knobs`` profiles its variants). results/efficiency/kernel_profile.log is one
such run. With OSCAR_KERNEL_LINEINFO=1 the kernels compile with line information, so ncu's ``--section
SourceCounters`` places the stalls on their source lines.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python scripts/profile_decode_kernel.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.filled import fill_storage
from benchmarks.kernel import D, GROUP, HKV, HQ, METHODS, decode_call, method_cache

#: the kernel question's methods, and RotateKV's logits kernel alone
CHOICES = (*METHODS, "rotatekv_logits")


def rotatekv_logits_call(batch: int, context: int, query, head_group: int = 4, bits: int = 2, group: int = GROUP,
                         base: float = 500000.0, seed: int = 0, poison: bool = False, **knobs):
    """ops.rotatekv_logits of ``query`` [B, HQ, 1, D] over ``context`` packed tokens per sequence (the module
    docstring's cache), as a call (``poison``: its output NaN before the kernel writes it; ``knobs``: the kernel's,
    min_blocks and rope_per_tile)."""
    from kernels import ops
    from kernels.method_layouts import rotatekv_rope, rotatekv_tables

    device = query.device
    keys, values = ops.empty_storage("rotatekv", batch, HKV, context, D, k_bits=bits, v_bits=bits, group_size=group,
                                     dtype=query.dtype, device=device)
    fill_storage("rotatekv", keys, values, bits)
    frequencies = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)

    def cos_sin(positions):  # [P, D] each, rotate-half (each half repeats), fp32
        angles = positions.double()[:, None] * frequencies
        return [torch.cat([f(angles)] * 2, dim=-1).float().to(device) for f in (torch.cos, torch.sin)]

    rope = rotatekv_rope(*cos_sin(torch.arange(0, context, ops.ROPE_RUN)), *cos_sin(torch.arange(ops.ROPE_RUN)))
    order = torch.randperm(HKV * D, generator=torch.Generator().manual_seed(seed))
    tables = rotatekv_tables(order, group, head_group, rope)
    n_packed = torch.full((batch,), context, dtype=torch.int32, device=device)
    skip = torch.zeros(batch, HKV, math.ceil(context / 32), dtype=torch.int32, device=device)
    return lambda: ops.rotatekv_logits(query, keys, n_packed, skip, tables, bits, group, D**-0.5, context, poison,
                                       **knobs)


def rotatekv_knobs(text: str) -> tuple[int | None, int | None]:
    """``--rotatekv-knobs``' value: "default" (None, None) or MIN_BLOCKS:ROPE_PER_TILE, blocks >= 1, RoPE per tile
    0 or 1."""
    if text == "default":
        return None, None
    blocks, _, per_tile = text.partition(":")
    if not (blocks.isdigit() and int(blocks) >= 1 and per_tile in ("0", "1")):
        raise argparse.ArgumentTypeError(f"{text!r}: 'default' or MIN_BLOCKS:ROPE_PER_TILE (e.g. 4:0; blocks >= 1, "
                                         "ROPE_PER_TILE 0 or 1)")
    return int(blocks), int(per_tile)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--methods", nargs="+", default=["oscar"], choices=CHOICES,
                   help="kernel question's methods, or rotatekv_logits")
    p.add_argument("--modes", nargs="+", type=int, default=[0], choices=(0, 1, 2))
    p.add_argument("--warmup", type=int, default=3, help="calls before the profiled one (outside the range)")
    p.add_argument("--rotatekv-knobs", nargs="+", type=rotatekv_knobs, default=[(None, None)],
                   metavar="MIN_BLOCKS:ROPE_PER_TILE",
                   help="rotatekv_logits' variants, one profiled call each: e.g. 1:1 4:0 (default: the kernel's)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (and CuPy)")
    for method in args.methods:
        query = torch.randn(args.batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
        if method == "rotatekv_logits":
            for blocks, per_tile in args.rotatekv_knobs:
                profiled(rotatekv_logits_call(args.batch, args.context, query, min_blocks=blocks,
                                              rope_per_tile=per_tile), args.warmup)
        else:
            cache = method_cache(method, 2, args.batch, args.context)
            for mode in args.modes:
                profiled(decode_call(cache, query, mode=mode), args.warmup)
            del cache
        torch.cuda.empty_cache()


def profiled(call, warmup: int) -> None:
    """``call`` ``warmup`` times, then once inside the profiled range."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
