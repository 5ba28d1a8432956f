"""Decode attention and quantization kernels per method on the GPU: OScaR, KIVI, QuaRot, TurboQuant+ vs BF16 SDPA.

    python scripts/bench_kernel_methods.py [--out results/efficiency] [--quick] [--no-tune]

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, D=128), bf16, 2-bit keys and values, G=32 (TurboQuant+:
its 2.5 bits per value), 64 residual tokens per sequence. Writes under --out, each row with the measured copy
bandwidth (device-to-device copy, bytes read + written per second):
  kernel_methods.csv         method, bits, batch, context, ms, floor_ms, pct_floor, sdpa_ms (+ speedup, bytes,
                             knobs): decode attention of each method on its packed cache vs the faster of two BF16
                             SDPA forms in the same run, and vs the method's own byte floor (the real stored bytes of
                             its packed part, from the storage it reads, at the copy bandwidth); batch 1 / 8 / 32,
                             context 4K-128K (4-bit KIVI / QuaRot / OScaR at batch 8 too)
  kernel_methods_stages.csv  batch 8, 32K and 128K: the full kernel against its variants that only stream the packed
                             bytes (MODE 1) and that skip the value product (MODE 2), per method
  kernel_methods_tuning.csv  ring buffers x launch bound per method at batch 8 and 1, 128K; the main table uses each
                             method's best (geometric mean over the two batches)
  kernel_methods_quant.csv   quantization kernels per method, keys and values: a flush (128 tokens per sequence) and a
                             prefill (32K tokens), batch 1 and 8, bytes read + written and fraction of copy bandwidth
  bench_kernel_methods.log   the run's log
GPU times are medians of triton.testing.do_bench over replays of a CUDA graph holding one call (L2 flushed before
every replay), as scripts/bench_kernels.py times them. Needs torch, cupy, triton; the whole grid takes a few minutes
on an H200.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

sys.path.insert(0, str(REPO_ROOT))

from kernels import ops  # noqa: E402
from scripts.bench_kernels import (bandwidth, bench, copy_bandwidth, graph_ms, log_outputs, sdpa_forms,  # noqa: E402
                                   write_csv)

log = logging.getLogger("bench_kernel_methods")
HQ, HKV, D, GROUP, RESIDUAL = 32, 8, 128, 32, 64
METHODS = ("oscar", "kivi", "quarot", "turboquant")


def fill_storage(method: str, keys: dict, values: dict, bits: int, zero_point: str | None = None) -> None:
    """Random codes and plausible parameters in a method's packed storage (ops.empty_storage): scales of a few
    hundredths, zeros that are group minima (float zero point: KIVI's default) or integer codes, TurboQuant+'s fp16
    corrected norms near 1, OScaR's fp32 token norms of real keys."""
    zero_point = zero_point or ("float" if method == "kivi" else "int")
    for store in (keys, values):
        store["codes"].random_(0, 256)
        if "scale" in store:
            store["scale"].uniform_(0.002, 0.05)
            if zero_point == "float":
                store["zero"].uniform_(-0.1, 0.0)  # the group min
            else:
                store["zero"].random_(0, 2**bits)
        else:
            store["norm"].uniform_(0.5, 2.0)
    if method == "oscar":
        keys["norm"].uniform_(1.0, 20.0)


def method_cache(method: str, bits: int, batch: int, context: int, dtype=torch.bfloat16, device="cuda",
                 hkv: int = HKV, d: int = D, g: int = GROUP, residual: int = RESIDUAL) -> dict:
    """Packed storage of `context` tokens per sequence (random codes, plausible parameters), residual windows,
    lengths and the method's decode_attention keyword arguments."""
    keys, values = ops.empty_storage(method, batch, hkv, context, d, k_bits=bits, v_bits=bits, group_size=g,
                                     dtype=dtype, device=device)
    fill_storage(method, keys, values, bits)
    kwargs = dict(k_bits=bits, v_bits=bits, group_size=g, scaling=d**-0.5, method=method, max_packed=context)
    if method == "turboquant":
        from oscar import build_method

        tq = build_method("turboquant", group_size=g)
        kwargs.update(signs=tq.signs(d, device), codebook=tq.codebook(2, d).tolist())
    k_res = torch.randn(batch, hkv, residual, d, dtype=dtype, device=device)
    return dict(keys=keys, values=values, k_res=k_res, v_res=torch.randn_like(k_res),
                n_packed=torch.full((batch,), context, dtype=torch.int32, device=device),
                n_res=torch.full((batch,), residual, dtype=torch.int32, device=device), kwargs=kwargs)


def stored_bytes(cache: dict) -> int:
    """Real bytes of the packed part the kernel reads: every buffer of the key and value storage."""
    return sum(b.numel() * b.element_size() for store in (cache["keys"], cache["values"]) for b in store.values())


def decode_call(cache: dict, query, **knobs):
    return lambda: ops.decode_attention(query, cache["keys"], cache["values"], cache["k_res"], cache["v_res"],
                                        cache["n_packed"], cache["n_res"], **cache["kwargs"], **knobs)


def tuning_rows(copy_gbs: float, methods, context: int = 131072) -> tuple[list[dict], dict]:
    """Ring buffers x launch bound per method at batch 8 and 1: rows and each method's best knobs."""
    grid = [dict(nstage=n, min_blocks=m) for n in (2, 3) for m in (8, 12, 16)]
    rows, best = [], {}
    for method in tqdm(methods, desc="tuning", unit="method"):
        times = {}
        for batch in (8, 1):
            cache = method_cache(method, 2, batch, context)
            q = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
            floor_ms = stored_bytes(cache) / copy_gbs / 1e6
            for i, knobs in enumerate(grid):
                ms = graph_ms(decode_call(cache, q, **knobs))
                times[batch, i] = ms
                rows.append(dict(method=method, batch=batch, context=context, **knobs, ms=ms, pct_floor=floor_ms / ms,
                                 copy_gbs=round(copy_gbs, 1)))
                log.info("tuning %-10s B=%d %s %.3f ms (%.0f%% of floor)", method, batch, knobs, ms,
                         100 * floor_ms / ms)
            del cache
            torch.cuda.empty_cache()
        fastest = {b: min(times[b, i] for i in range(len(grid))) for b in (8, 1)}
        score = {i: math.prod(times[b, i] / fastest[b] for b in (8, 1)) for i in range(len(grid))}
        best[method] = grid[min(score, key=score.get)]
        log.info("best knobs for %s (geometric mean over batches 8 and 1): %s", method, best[method])
    return rows, best


def decode_rows(copy_gbs: float, grid, tuning: dict) -> list[dict]:
    """(method, bits) x batch x context: kernel time, its byte floor, SDPA in the same run."""
    rows = []
    for batch, context, configs in tqdm(grid, desc="decode attention", unit="shape"):
        forms, tensors = sdpa_forms(batch, context)
        sdpa = {name: graph_ms(fn) for name, fn in forms.items()}
        sdpa_ms = min(sdpa.values())
        del forms, tensors
        torch.cuda.empty_cache()
        q = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
        for method, bits in configs:
            cache = method_cache(method, bits, batch, context)
            knobs = tuning.get(method, {})
            ms = graph_ms(decode_call(cache, q, **knobs))
            nbytes = stored_bytes(cache)
            floor_ms = nbytes / copy_gbs / 1e6
            rows.append(dict(method=method, bits=bits, batch=batch, context=context, ms=ms, floor_ms=floor_ms,
                             pct_floor=floor_ms / ms, sdpa_ms=sdpa_ms, speedup=sdpa_ms / ms, stored_bytes=nbytes,
                             bits_per_value=8 * nbytes / (2 * batch * HKV * context * D),
                             sdpa_gqa_ms=sdpa["sdpa_gqa"], sdpa_rows_ms=sdpa["sdpa_rows"],
                             eager_ms=bench(decode_call(cache, q, **knobs)), copy_gbs=round(copy_gbs, 1),
                             knobs=" ".join(f"{k}={v}" for k, v in knobs.items())))
            log.info("%-10s %d-bit B=%-3d T=%-6d %.3f ms, floor %.3f ms (%.0f%%), sdpa %.3f ms -> %.2fx", method, bits,
                     batch, context, ms, floor_ms, 100 * floor_ms / ms, sdpa_ms, sdpa_ms / ms)
            del cache
            torch.cuda.empty_cache()
    return rows


def stage_rows(copy_gbs: float, methods, tuning: dict, batch: int = 8, contexts=(32768, 131072)) -> list[dict]:
    """Full kernel vs loads only (MODE 1) vs no value product (MODE 2), per method."""
    rows = []
    for method in tqdm(methods, desc="kernel stages", unit="method"):
        for context in contexts:
            cache = method_cache(method, 2, batch, context)
            q = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
            floor_ms = stored_bytes(cache) / copy_gbs / 1e6
            times = {mode: graph_ms(decode_call(cache, q, mode=mode, **tuning.get(method, {}))) for mode in (0, 1, 2)}
            rows.append(dict(method=method, batch=batch, context=context, ms=times[0], loads_only_ms=times[1],
                             no_values_ms=times[2], floor_ms=floor_ms, copy_gbs=round(copy_gbs, 1)))
            log.info("stages %-10s B=%d T=%-6d full %.3f | loads only %.3f | no values %.3f | floor %.3f ms", method,
                     batch, context, times[0], times[1], times[2], floor_ms)
            del cache
            torch.cuda.empty_cache()
    return rows


def quantizers(method: str, k, out_keys: dict, out_values: dict):
    """(keys call, values call) of the method's quantization kernels writing the decode layouts."""
    g, bits = GROUP, 2
    if method == "oscar":
        return (lambda: ops.quantize_keys(k, bits, g, out=out_keys, decode_layout=True),
                lambda: ops.quantize_values(k, bits, g, out=out_values, decode_layout=True))
    if method == "kivi":
        return (lambda: ops.quantize_channel_keys(k, bits, g, out=out_keys, decode_layout=True),
                lambda: ops.quantize_values(k, bits, g, out=out_values, decode_layout=True, zero_point="float"))
    if method == "quarot":
        return (lambda: ops.quantize_token_keys(k, bits, g, out=out_keys, decode_layout=True),
                lambda: ops.quantize_values(k, bits, g, out=out_values, decode_layout=True))
    from oscar import build_method

    tq = build_method("turboquant", group_size=g)
    signs, levels = tq.signs(D, "cuda"), tq.codebook(2, D).tolist()
    return (lambda: ops.quantize_turboquant(k, g, signs, levels, out=out_keys, decode_layout="keys"),
            lambda: ops.quantize_turboquant(k, g, signs, levels, out=out_values, decode_layout="values"))


def quant_rows(copy_gbs: float, methods, shapes) -> list[dict]:
    rows = []
    for batch, tokens in tqdm(shapes, desc="quantization kernels", unit="shape"):
        k = torch.randn(batch, HKV, tokens, D, dtype=torch.bfloat16, device="cuda")
        for method in methods:
            keys, values = ops.empty_storage(method, batch, HKV, tokens, D, k_bits=2, v_bits=2, group_size=GROUP,
                                             dtype=k.dtype, device="cuda")
            for role, fn, store in zip(("keys", "values"), quantizers(method, k, keys, values), (keys, values)):
                ms = graph_ms(fn)
                nbytes = k.numel() * 2 + sum(b.numel() * b.element_size() for b in store.values())
                rows.append(dict(method=method, role=role, batch=batch, tokens=tokens,
                                 **bandwidth(ms, nbytes, copy_gbs), copy_gbs=round(copy_gbs, 1)))
                log.info("quantize %-10s %-6s B=%d T=%-6d %.4f ms  %.0f GB/s = %.0f%% of copy", method, role, batch,
                         tokens, ms, rows[-1]["gbs"], 100 * rows[-1]["copy_frac"])
            del keys, values
        del k
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/efficiency"))
    parser.add_argument("--quick", action="store_true", help="a few shapes only (smoke test)")
    parser.add_argument("--no-tune", action="store_true", help="kernels.ops defaults for every method")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(args.out / "bench_kernel_methods.log",
                                                                               mode="w")])
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    log.info("device %s: copy bandwidth %.0f GB/s (read + write)", torch.cuda.get_device_name(), copy_gbs)
    tuning, written = {}, [args.out / "bench_kernel_methods.log"]
    if not (args.quick or args.no_tune):
        rows, tuning = tuning_rows(copy_gbs, METHODS)
        written.append(write_csv(args.out / "kernel_methods_tuning.csv", rows))
    two_bit = [(m, 2) for m in METHODS]
    four_bit = [(m, 4) for m in ("oscar", "kivi", "quarot")]
    if args.quick:
        grid = [(1, 4096, two_bit), (8, 32768, two_bit + four_bit)]
    else:
        grid = [(b, t, two_bit + (four_bit if b == 8 else [])) for b in (1, 8, 32)
                for t in (4096, 8192, 16384, 32768, 65536, 131072)]
    written.append(write_csv(args.out / "kernel_methods.csv", decode_rows(copy_gbs, grid, tuning)))
    written.append(write_csv(args.out / "kernel_methods_stages.csv", stage_rows(
        copy_gbs, METHODS, tuning, contexts=(32768,) if args.quick else (32768, 131072))))
    shapes = [(1, 128), (8, 32768)] if args.quick else [(1, 128), (8, 128), (1, 32768), (8, 32768)]
    written.append(write_csv(args.out / "kernel_methods_quant.csv", quant_rows(copy_gbs, METHODS, shapes)))
    log_outputs("bench_kernel_methods", written)


if __name__ == "__main__":
    main()
