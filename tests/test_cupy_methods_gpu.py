"""backend=cupy for KIVI, QuaRot, TurboQuant+, OTT, RotateKV and OSCAR on the GPU: the cache against the torch path
(the checks of tests/test_cupy_cache_emulated.py, bit for bit where the method's codes are: CUDA torch rounds like
the kernels; the exactly kept tokens the torch path's) and a tiny model decoding like the torch path, through the
engine's step protocol and through transformers-style calls. CUDA-graph generation == eager generation for these
methods is in tests/test_engine_gpu.py.

    pytest -m gpu tests/test_cupy_methods_gpu.py tests/test_engine_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from test_cupy_cache_emulated import (CONFIGS, DEQUANTIZE_CONFIGS, FINISH_CASES, MORE_CONFIGS,
                                     check_cache_against_torch_path, check_dequantize_kernel, check_finish_step,
                                     check_model_against_torch_path, model_keys_and_values, tiny_model)
from test_kernels import DTYPES, _gpu_ready

gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")
pytestmark = [pytest.mark.gpu, gpu]

GPU_CONFIGS = CONFIGS + MORE_CONFIGS + [
    ("kivi", dict(group_size=64, residual_length=64, k_bits=4, v_bits=4, zero_point="int")),
    ("quarot", dict(group_size=32, residual_length=128, k_bits=4, v_bits=2)),
    ("turboquant", dict(group_size=64, residual_length=96, seed=3)),
]
#: (KV heads, query heads, head_dim): the tiny models' shape, Llama-3.1-8B's grouping at head_dim 128, 256 wide
SHAPES = [(2, 4, 64), (8, 32, 128), (2, 6, 256)]


def _ids(value):
    if isinstance(value, tuple) and isinstance(value[0], str):
        return value[0] + "".join(f"-{k}{v}" for k, v in value[1].items())
    return None


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[1]}x{s[0]}-d{s[2]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=_ids)
def test_cache_stores_and_attends_like_the_torch_path(config, dtype, shape):
    hkv, hq, d = shape
    check_cache_against_torch_path(*config, "cuda", dtype, hkv=hkv, hq=hq, d=d, strict=True)


@pytest.mark.parametrize("streams, dtype, d", FINISH_CASES, ids=lambda c: str(c))
def test_finish_step_kernel_equals_reference(streams, dtype, d):
    check_finish_step(streams, dtype, d, "cuda")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[1]}x{s[0]}-d{s[2]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", DEQUANTIZE_CONFIGS, ids=_ids)
def test_dequantize_kernel_equals_the_methods_dequantize(config, dtype, shape):
    hkv, _, d = shape
    check_dequantize_kernel(*config, "cuda", dtype, hkv=hkv, d=d)


@pytest.mark.parametrize("name, options", [("rotatekv", {}), ("spectral", {}),
                                           ("spectral", dict(codebook="lloyd_max"))],
                         ids=["rotatekv", "spectral", "spectral-lloyd_max"])
def test_dequantize_kernel_reads_a_models_keys_and_values(name, options):
    """RotateKV's and OSCAR's prefix read of tiny-llama's own K/V equals the method's dequantize bit for bit."""
    method, keys_values = model_keys_and_values(name, "cuda", **options)
    check_dequantize_kernel(name, {}, "cuda", method=method, keys_values=keys_values)


@pytest.mark.parametrize("model, overrides", [("tiny-llama", {}), ("tiny-qwen3", dict(head_dim=128))])
@pytest.mark.parametrize("engine, chunk", [(True, None), (False, None), (True, 16), (False, 16)],
                         ids=["engine", "transformers", "engine-chunks", "transformers-chunks"])
@pytest.mark.parametrize("name", ["oscar", "kivi", "quarot", "turboquant", "ott", "rotatekv", "spectral"])
def test_tiny_model_decodes_like_the_torch_path(name, engine, chunk, model, overrides, monkeypatch):
    """Whole and chunked prefills (each 16-token chunk attending the stored ones through the transient
    dequantization of the packed prefix), then the decode steps."""
    check_model_against_torch_path(name, engine, tiny_model(model, torch.bfloat16, "cuda", **overrides), monkeypatch,
                                   chunk)
