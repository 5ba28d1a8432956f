"""Which kernel the torch static cache's decode attention (BF16 or dequantized) should use: a capacity-sized cache
where each row uses its own number of tokens, Llama-3.1-8B attention shape, CUDA-graph GPU time per layer.

    python scripts/bench_dense_attention.py > results/efficiency/dense_attention.log

Forms, all over a [B, capacity, 8, 128] bf16 cache with 100 unused slots per row: SDPA with a boolean mask (its
own backend choice, memory-efficient, cuDNN), FlashAttention's variable-length kernel with ``seqused_k`` (what
oscar.static_cache uses), and as the bound an unmasked SDPA over exactly the used tokens (flash rows; SDPA's GQA
form), plus the largest difference between the masked SDPA and the variable-length output.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

sys.path.insert(0, str(REPO_ROOT))

from scripts.bench_kernels import capture  # noqa: E402

HQ, HKV, D = 32, 8, 128


def graph_us(fn, replays: int = 20) -> str:
    """GPU microseconds per call of ``fn`` replayed from a CUDA graph (the mean over ``replays`` back-to-back
    replays, timed by events)."""
    graph = capture(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return f"{start.elapsed_time(end) / replays * 1000:.1f} us"


def main() -> None:
    print(torch.ops.aten._flash_attention_forward.default._schema)
    for b, cap in ((1, 32768), (1, 131072), (8, 32768), (8, 131072)):
        keys = torch.randn(b, cap, HKV, D, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        k4, v4 = keys.transpose(1, 2), values.transpose(1, 2)
        q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        used = torch.full((b,), cap - 100, device="cuda", dtype=torch.int32)
        mask = torch.arange(cap, device="cuda").view(1, 1, 1, cap) < used.view(b, 1, 1, 1)
        rows = q.reshape(b, HKV, HQ // HKV, D)
        cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32)
        flat_k, flat_v = keys.view(b * cap, HKV, D), values.view(b * cap, HKV, D)

        def masked(backends=None):
            if backends is None:
                return F.scaled_dot_product_attention(rows, k4, v4, attn_mask=mask)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(rows, k4, v4, attn_mask=mask)

        def varlen():
            return torch.ops.aten._flash_attention_forward(
                q.reshape(b, HQ, D), flat_k, flat_v, cu_q, cu_q * cap, 1, cap, 0.0, False, False, scale=D**-0.5,
                seqused_k=used)[0]

        def flash_rows_bound():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(rows, k4, v4)

        results = {"sdpa rows+mask (auto)": graph_us(masked),
                   "sdpa rows+mask efficient": graph_us(lambda: masked([SDPBackend.EFFICIENT_ATTENTION])),
                   "sdpa rows+mask cudnn": graph_us(lambda: masked([SDPBackend.CUDNN_ATTENTION])),
                   "flash rows no mask (bound)": graph_us(flash_rows_bound),
                   "sdpa gqa no mask (bound)": graph_us(lambda: F.scaled_dot_product_attention(q, k4, v4,
                                                                                               enable_gqa=True)),
                   "fa varlen seqused_k": graph_us(varlen)}
        error = (masked().reshape(b, HQ, D).float() - varlen().float()).abs().max().item()
        print(f"B={b} cap={cap}: " + "; ".join(f"{k}: {v}" for k, v in results.items())
              + f"; fa max err vs masked sdpa: {error:.2e}", flush=True)
        del keys, values, k4, v4, mask
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
