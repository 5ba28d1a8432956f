"""Long contexts on the GPU: the kernels index storage past 2^31 bytes. A packed storage of 10 rows x 1M tokens x 8 KV
heads x head_dim 128 (2-bit codes: the last row's key and value codes start past 2^31 bytes) is written by each kernel
method's quantizers at the end of its last row and read by the decode kernel over that whole row (1M packed tokens):
bytes and output bit-equal to the same work on a one-row copy, where every offset is small. The decode split plan is
given (one plan for both, so that they sum in the same order).

    pytest -m gpu tests/test_long_context_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import _gpu_ready, real_looking

from benchmarks.filled import fill_storage
from kernels import ops
from kernels.backend import KERNELS
from oscar import build_method

gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")
pytestmark = [pytest.mark.gpu, gpu]

ROWS, CAPACITY, HKV, HQ, D = 10, 1 << 20, 8, 32, 128


@pytest.mark.parametrize("name", ["oscar", "kivi", "quarot", "turboquant"])
def test_storage_past_2_31_bytes(name):
    method = build_method(name)
    kernels = KERNELS[name]
    keys, values = ops.empty_storage(name, ROWS, HKV, CAPACITY, D, k_bits=2, v_bits=2, group_size=32,
                                     dtype=torch.bfloat16, device="cuda")
    assert keys["codes"][ROWS - 1].data_ptr() - keys["codes"].data_ptr() >= 2**31
    fill_storage(name, keys, values, 2, getattr(method, "zero_point", None))
    small_keys = {n: b[ROWS - 1:].clone() for n, b in keys.items()}
    small_values = {n: b[ROWS - 1:].clone() for n, b in values.items()}
    # the quantizers: 256 new tokens at the end of the last row
    k = real_looking(1, HKV, 256, D, torch.bfloat16, seed=1)
    v = real_looking(1, HKV, 256, D, torch.bfloat16, seed=2)
    if kernels.rotated_keys:
        k = ops.hadamard(k)
    offset = CAPACITY - 256
    for store, row in ((keys, ROWS - 1), (small_keys, 0)):
        kernels.quantize_keys(method, k, out=store, rows=[row], offsets=[offset])
    for store, row in ((values, ROWS - 1), (small_values, 0)):
        kernels.quantize_values(method, v, out=store, rows=[row], offsets=[offset])
    for big, small in ((keys, small_keys), (values, small_values)):
        for n in big:
            assert torch.equal(big[n][ROWS - 1:], small[n]), n
    # the decode kernel over the whole last row
    q = real_looking(ROWS, HQ, 1, D, torch.bfloat16, seed=3)
    window = real_looking(ROWS, HKV, 64, D, torch.bfloat16, seed=4)
    n_packed = torch.zeros(ROWS, dtype=torch.int32, device="cuda")
    n_packed[-1] = CAPACITY
    n_res = torch.full((ROWS,), 16, dtype=torch.int32, device="cuda")
    variant = kernels.attention(method, D, torch.device("cuda"))
    common = dict(k_bits=2, v_bits=2, group_size=32, scaling=D**-0.5, splits=(128, CAPACITY // 128), **variant)
    big = ops.decode_attention(q, keys, values, window, window.clone(), n_packed, n_res, max_packed=CAPACITY,
                               poison=True, **common)
    small = ops.decode_attention(q[-1:].contiguous(), small_keys, small_values, window[-1:].contiguous(),
                                 window[-1:].contiguous(), n_packed[-1:], n_res[-1:], max_packed=CAPACITY,
                                 poison=True, **common)
    assert torch.isfinite(big).all()
    assert torch.equal(big[-1:], small)
