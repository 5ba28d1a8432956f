"""What the quantizers' input check costs next to the quantization it guards: the median time of
``quantize_keys`` / ``quantize_values`` (check_finite off) and of ``check_input`` alone, split into the
finite check and the shape/dtype check; same inputs, same run, interleaved rounds; the fastest call of each (contention only adds time).

    python scripts/bench_input_checks.py [--repeats 200] [--device cpu]

Shapes: a decode step's value token (the ``kivi`` flush quantizes one per step), a flushed key
block of R = 128 tokens, and a 2K-token prefill chunk (perplexity), at SmolLM2's (3 KV heads, D = 64)
and an 8B model's (8 KV heads, D = 128) attention shape. On a GPU the check also synchronizes with
the host once per call (skipped while a CUDA graph is being captured).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from oscar import build_method

CASES = [  # (label, method, which, shape [B, H, T, D])
    ("value token, 3x64", "kivi", "values", (1, 3, 1, 64)),
    ("value token, 8x128", "kivi", "values", (1, 8, 1, 128)),
    ("key block R=128, 3x64", "oscar", "keys", (1, 3, 128, 64)),
    ("key block R=128, 8x128", "oscar", "keys", (1, 8, 128, 128)),
    ("prefill 2K keys, 8x128", "oscar", "keys", (1, 8, 2048, 128)),
]


def seconds(fn, repeats: int, device: str) -> list[float]:
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"device={args.device} threads={torch.get_num_threads()} repeats={args.repeats} (fastest call of the repeats: a shared machine only slows calls down, "
          "interleaved rounds)")
    print(f"{'case':26s} {'quantize, unchecked us':>23s} {'finite check us':>16s} {'shape/dtype check us':>21s} "
          f"{'overhead':>9s}")
    for label, name, which, shape in CASES:
        x = torch.randn(shape, device=args.device)
        method = build_method(name)
        unchecked = build_method(name)
        unchecked.check_finite = False
        quantize = getattr(unchecked, f"quantize_{which}")
        jobs = {"quantize": lambda: quantize(x, 0),                                   # noqa: E731
                "checks": lambda: method.check_input(x, which),                       # noqa: E731
                "structure": lambda: unchecked.check_input(x, which)}                 # noqa: E731
        times = {k: [] for k in jobs}
        for fn in jobs.values():
            seconds(fn, 3, args.device)  # warm-up
        for _ in range(5):  # interleaved rounds: drift on a shared machine hits all alike
            for k, fn in jobs.items():
                times[k] += seconds(fn, max(1, args.repeats // 5), args.device)
        q, c, s_ = (min(times[k]) * 1e6 for k in ("quantize", "checks", "structure"))
        print(f"{label:26s} {q:23.1f} {c - s_:16.1f} {s_:21.1f} {100 * c / q:8.1f}%")


if __name__ == "__main__":
    main()
