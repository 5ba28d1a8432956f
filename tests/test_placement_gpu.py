"""Two GPUs: a tiny model split over cuda:0 and cuda:1 (oscar.placement, accelerate's hooks) generates the tokens
the same model generates on one GPU, for fp16, OScaR on the CuPy kernels and on the mirror, and KIVI (values flushed
inside the step, reading the per-device lengths); every layer's cache storage sits on its layer's GPU; kernels
launched on cuda:1 give the bytes they give on cuda:0 and leave the current device as it was. Skipped without two
GPUs (run with ``pytest -m gpu tests/test_placement_gpu.py`` on nvidia-h200-x2)."""

from __future__ import annotations

import copy

import pytest
import torch

from oscar import build_method
from oscar.backend import build_backend
from oscar.lm import KVModel
from oscar.placement import dispatch, plan
from tests.test_engine_gpu import PROMPTS, char_tokenizer
from tests.test_kernels import _gpu_ready

two_gpus = pytest.mark.skipif(not _gpu_ready() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs and CuPy")
pytestmark = [pytest.mark.gpu, two_gpus]

#: layer 0 (and the embeddings) on GPU 0, layer 1 and the head on GPU 1
SPLIT = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "model.rotary_emb": 1,
         "lm_head": 1}


@pytest.fixture(scope="module")
def models():
    """(tiny-llama in bf16 on cuda:0, the same weights split by SPLIT, tokenizer); weights of std 0.1."""
    from tests.conftest import build_tiny

    whole = build_tiny("tiny-llama").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in whole.parameters():
            if weight.dim() == 2:
                weight.copy_(torch.randn(weight.shape, generator=gen) * 0.1)
    whole.generation_config.eos_token_id = 1
    split = dispatch(copy.deepcopy(whole), plan(whole, SPLIT, None, torch.bfloat16, "tiny-llama"))
    return whole.to("cuda:0"), split, char_tokenizer()


@pytest.mark.parametrize("method, backend", [("fp16", "torch"), ("oscar", "cupy"), ("oscar", "torch"),
                                             ("kivi", "torch")])
def test_a_split_model_generates_the_one_gpu_tokens(models, method, backend):
    whole, split, tokenizer = models
    torch.cuda.set_device(0)
    tokens = []
    for model in (whole, split):
        # fused_layers off on one GPU too: a split model decodes with transformers' own modules (oscar.engine)
        lm = KVModel(copy.deepcopy(model), tokenizer, build_method(method, residual_length=32),
                     backend=build_backend(backend), decode="eager" if model is whole else "auto", fused_layers="off")
        enc = tokenizer(PROMPTS, return_tensors="pt", padding=True).to("cuda:0")
        tokens.append(lm.engine.generate(enc["input_ids"], enc["attention_mask"], 90, eos_token_ids=set()))
        if model is split:
            assert lm.engine.mode == "eager"
            cache = lm.engine._slots[2].cache
            for index, layer in enumerate(cache.layers):
                storage = layer.keys_store["codes"] if backend == "cupy" else layer.keys
                assert storage.device == torch.device("cuda", index)
                if backend == "torch":
                    assert layer.cache_lengths.device == torch.device("cuda", index)
                    assert torch.equal(layer.cache_lengths.cpu(), cache.lengths.cpu())
            assert torch.cuda.current_device() == 0
    assert all(len(set(row)) >= 8 for row in tokens[0])  # varied tokens: a wrong cache would show
    assert tokens[0] == tokens[1]


def test_graph_decoding_is_refused_for_a_split_model(models):
    _, split, tokenizer = models
    with pytest.raises(ValueError, match="a sharded model decodes eagerly"):
        KVModel(copy.deepcopy(split), tokenizer, build_method("oscar"), backend=build_backend("cupy"), decode="graph")


def test_kernels_on_the_other_gpu_give_the_same_bytes_and_keep_the_current_device():
    from kernels import ops

    torch.cuda.set_device(0)
    k = torch.randn(2, 4, 64, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    v = torch.randn(2, 4, 64, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    results = {}
    for index in (0, 1):
        kd, vd = k.to(f"cuda:{index}"), v.to(f"cuda:{index}")
        keys = ops.quantize_keys(kd, 2, 32)
        values = ops.quantize_values(vd, 2, 32)
        results[index] = [ops.hadamard(kd)] + [keys.buffers[n] for n in sorted(keys.buffers)] + \
                         [values.buffers[n] for n in sorted(values.buffers)]
        assert all(t.device == torch.device("cuda", index) for t in results[index])
        assert torch.cuda.current_device() == 0
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b.to("cuda:0"))
