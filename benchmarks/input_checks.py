"""The quantizers' input check: what it costs next to the quantization it guards.

Per case, the fastest of ``--repeats`` calls (a shared machine only slows calls down; the three jobs interleaved in
five rounds, so drift hits all alike) of ``quantize_keys`` / ``quantize_values`` with the finite check off
(``quantize_us``), of ``check_input`` with it on, split into the finite check (``finite_check_us``) and the
shape/dtype check (``structure_check_us``), and their sum over the quantization (``overhead``). Cases: a decode
step's value token (the ``kivi`` flush quantizes one per step), a flushed key block of R = 128 tokens, and a 2K-token
prefill chunk, at SmolLM2's (3 KV heads, D = 64) and an 8B model's (8 KV heads, D = 128) attention shape. On a GPU
the check also synchronizes with the host once per call (skipped while a CUDA graph is being captured).
"""

from __future__ import annotations

import logging

import torch

from benchmarks.harness import Run, wall_seconds

log = logging.getLogger("benchmarks.input_checks")

CASES = [  # (label, method, which, shape [B, H, T, D])
    ("value token, 3x64", "kivi", "values", (1, 3, 1, 64)),
    ("value token, 8x128", "kivi", "values", (1, 8, 1, 128)),
    ("key block R=128, 3x64", "oscar", "keys", (1, 3, 128, 64)),
    ("key block R=128, 8x128", "oscar", "keys", (1, 8, 128, 128)),
    ("prefill 2K keys, 8x128", "oscar", "keys", (1, 8, 2048, 128)),
]
FIELDS = ["case", "method", "which", "shape", "device", "quantize_us", "finite_check_us", "structure_check_us",
          "overhead"]


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--device", default="cpu", help="where the tensors live (cpu, cuda)")


def run(args, bench: Run) -> None:
    from oscar import build_method

    torch.manual_seed(0)
    for label, name, which, shape in CASES:
        x = torch.randn(shape, device=args.device)
        checked, unchecked = build_method(name), build_method(name)
        unchecked.check_finite = False
        quantize = getattr(unchecked, f"quantize_{which}")
        jobs = {"quantize": lambda: quantize(x, 0), "checks": lambda: checked.check_input(x, which),
                "structure": lambda: unchecked.check_input(x, which)}
        times = {k: [] for k in jobs}
        for fn in jobs.values():
            fn()  # warm-up
        for _ in range(5):
            for k, fn in jobs.items():
                times[k] += [wall_seconds(fn, args.device) for _ in range(max(1, args.repeats // 5))]
        quantize_us, checks_us, structure_us = (min(times[k]) * 1e6 for k in ("quantize", "checks", "structure"))
        row = bench.add(dict(case=label, method=name, which=which, shape="x".join(map(str, shape)), device=args.device,
                             quantize_us=quantize_us, finite_check_us=checks_us - structure_us,
                             structure_check_us=structure_us, overhead=checks_us / quantize_us))
        log.info("%-26s quantize %8.1f us, finite check %6.1f us, shape/dtype check %6.1f us: %5.1f%%", label,
                 quantize_us, row["finite_check_us"], structure_us, 100 * row["overhead"])
