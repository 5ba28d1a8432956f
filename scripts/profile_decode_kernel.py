"""decode_attention at one shape for Nsight Compute: one call per method and mode inside the profiled range, the
warm-up calls (compilation, first launch) outside it.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        python scripts/profile_decode_kernel.py --batch 1 --context 131072 --methods oscar kivi --modes 0 1

The cache is the kernel question's (benchmarks.kernel.method_cache: random codes, plausible parameters, 2 bits,
Llama-3.1-8B's attention shape); ``--modes``: 0 the full kernel, 1 the packed bytes streamed only, 2 no value
product (kernels.attention.decode_attention's ``mode``). ncu reports the split kernel and the combine apart.
results/efficiency/kernel_profile.log is one such run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python scripts/profile_decode_kernel.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel import D, HQ, METHODS, decode_call, method_cache


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--methods", nargs="+", default=["oscar"], choices=METHODS, help="kernel question's methods")
    p.add_argument("--modes", nargs="+", type=int, default=[0], choices=(0, 1, 2))
    p.add_argument("--warmup", type=int, default=3, help="calls before the profiled one (outside the range)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (and CuPy)")
    profiler = torch.cuda.cudart()
    for method in args.methods:
        cache = method_cache(method, 2, args.batch, args.context)
        query = torch.randn(args.batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
        for mode in args.modes:
            call = decode_call(cache, query, mode=mode)
            for _ in range(args.warmup):
                call()
            torch.cuda.synchronize()
            profiler.cudaProfilerStart()
            call()
            torch.cuda.synchronize()
            profiler.cudaProfilerStop()
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
