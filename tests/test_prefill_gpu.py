"""Prefill on the GPU: oscar.attention.stored_attention's fast paths (FlashAttention's variable-length kernel, causal
bottom-right aligned, each row's keys read in place; cuDNN over the prefix and the chunk merged by log-sum-exp for
rows of one prefix length) against the float64 row-by-row reference, within 2x the error of SDPA with a boolean mask
in the same dtype over the same inputs plus a small tolerance; and the engine's chunked prefill of fp16 equal to its
whole-prompt prefill up to bf16 rounding. The quantized methods' chunked prefills against the torch path are in
tests/test_cupy_methods_gpu.py (backend=cupy) and tests/test_engine_gpu.py (graph == eager).

    pytest -m gpu tests/test_prefill_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from test_stored_attention import AttentionStub, case, row_by_row

from oscar.attention import _stored_mask, masked_blocks_attention, stored_attention
from tests.test_kernels import _gpu_ready

gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")
pytestmark = [pytest.mark.gpu, gpu]


@pytest.mark.parametrize("stored, new, t, window, heads", [
    ([40, 40], [40, 40], 40, None, (2, 6, 64)),
    ([70, 55], [16, 10], 16, None, (2, 6, 64)),
    ([70, 9], [16, 0], 16, 24, (2, 6, 64)),
    ([9000, 5000], [4096, 4096], 4096, None, (8, 32, 128)),     # Llama-3.1-8B's heads, a prefix of 4-5K
    ([300, 300], [64, 64], 64, None, (2, 6, 64)),                # one prefix length: cuDNN, merged
    ([9000, 9000], [4096, 4096], 4096, None, (8, 32, 128)),
    ([4096], [4096], 4096, None, (8, 32, 128)),                  # a whole prompt: SDPA causal
    ([6000, 4100], [2048, 2000], 2048, 1024, (4, 8, 256)),      # Gemma-like head_dim 256, a sliding window
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_prefill_is_as_accurate_as_sdpa(stored, new, t, window, heads, dtype):
    hkv, hq, d = heads
    query, keys, values = case(stored, new, t, hkv, hq, d, device="cuda", dtype=dtype)
    stub, width = AttentionStub(hq // hkv), max(stored)
    flash = stored_attention(stub, query, keys, values, stored, new, d**-0.5, window)
    mask = _stored_mask(stored, new, t, width, window, query.device)  # the same rule through SDPA with a mask
    sdpa = masked_blocks_attention(stub, query, keys[:, :, :width].contiguous(), values[:, :, :width].contiguous(),
                                   mask, scaling=d**-0.5, dropout=0.0)[0]
    want = row_by_row(query, keys, values, stored, new, d**-0.5, window)
    for row, n in enumerate(new):
        if n == 0:
            assert (flash[row] == 0).all()
            continue
        err_flash = (flash[row, t - n:].double() - want[row, t - n:]).abs().max()
        err_sdpa = (sdpa[row, t - n:].double() - want[row, t - n:]).abs().max()
        assert err_flash <= 2 * err_sdpa + 1e-3, (row, float(err_flash), float(err_sdpa))


@pytest.mark.parametrize("pads", [[0, 150], [0, 0]])
def test_chunked_prefill_gives_the_whole_prompt_logits(pads):
    """fp16 through the engine: 2 x 600 tokens (one row left-padded by 150: FlashAttention's variable-length path;
    none: cuDNN's merged path) in chunks of 128 against the whole prompt at once."""
    from oscar import build_method
    from oscar.attention import attach
    from oscar.backend import TorchBackend
    from oscar.engine import DecodeEngine
    from tests.conftest import build_tiny

    model = build_tiny("tiny-llama").to("cuda", torch.bfloat16)
    method = build_method("fp16")
    attach(model, method)
    ids = torch.randint(0, 1000, (2, 600), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :pads[1]] = 0
    logits = []
    for chunk in (None, 128):
        engine = DecodeEngine(model, method, TorchBackend(), "eager", prefill_chunk=chunk)
        slot = engine._slot(pads, engine.capacity(600, 8))
        logits.append(engine._prefill(ids, mask, slot.cache).float())
        assert slot.cache.token_counts(0)["keys_residual"] + slot.cache.token_counts(0)["keys_packed"] == 1200 - pads[1]
    torch.testing.assert_close(logits[1], logits[0], rtol=0.02, atol=0.02)
