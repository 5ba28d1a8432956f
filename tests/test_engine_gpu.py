"""The decode engine on a GPU: CUDA-graph generation gives the tokens eager generation gives (tiny Llama and
Qwen3 in bf16, a left-padded batch, several flushes, an EOS in the middle), for fp16, OScaR, KIVI, QuaRot,
TurboQuant+, OTT, RotateKV and OSCAR on the CuPy kernels (the kivi policy's values flushed inside the step, OSCAR's
window policy its keys and values, their exact tokens beside the window) and three torch-path methods
with the mirror, their values flushed inside the step (KIVI; OTT and RotateKV read their per-sequence state there:
pools, sinks); the storage never moves during a generation, nor when the next batch reuses it."""

from __future__ import annotations

import copy

import pytest
import torch

from oscar import build_method
from oscar.backend import build_backend
from oscar.lm import KVModel
from tests.test_kernels import _gpu_ready

gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")
pytestmark = [pytest.mark.gpu, gpu]

CASES = [("fp16", "torch"), ("oscar", "cupy"), ("kivi", "torch"), ("ott", "torch"), ("rotatekv", "torch"),
         ("fp16", "cupy"), ("kivi", "cupy"), ("quarot", "cupy"), ("turboquant", "cupy"), ("ott", "cupy"),
         ("rotatekv", "cupy"), ("spectral", "cupy")]


def _spectral_options(model) -> dict:
    from benchmarks.harness import random_spectral_calibration

    return dict(sink_tokens=16, calibration=random_spectral_calibration(model))


#: RotateKV without its calibration file (the channel order does not change what the cache does); OSCAR with random
#: rotations of the model's shape and a 16-token sink prefix (the prompts' tokens cross it)
OPTIONS = {"rotatekv": lambda model: dict(reorder=False), "spectral": _spectral_options}
PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps on running through the field " * 3,
           "Hello world, this is"]


def char_tokenizer():
    """A byte-level tokenizer built here (the GPU machine has no tokenizer files): one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{chr(i): i + 2 for i in range(32, 127)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def tiny(request):
    """A registry tiny model on the GPU in bf16, weights of std 0.1 (greedy continuations that vary)."""
    from tests.conftest import build_tiny

    model = build_tiny(request.param).to("cuda", torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.1)
    model.generation_config.eos_token_id = 1
    return model, char_tokenizer()


def _lm(tiny, method: str, backend: str, decode: str) -> KVModel:
    model, tokenizer = tiny
    options = OPTIONS.get(method, lambda model: {})(model)
    return KVModel(copy.deepcopy(model), tokenizer, build_method(method, residual_length=32, **options),
                   backend=build_backend(backend), decode=decode)


@pytest.mark.parametrize("method, backend", CASES)
def test_graph_generation_equals_eager_generation(tiny, method, backend):
    model, tokenizer = tiny
    eager, graph = _lm(tiny, method, backend, "eager"), _lm(tiny, method, backend, "graph")
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True).to("cuda")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    free = eager.engine.generate(ids, mask, 90, eos_token_ids=set())
    assert all(len(set(row)) >= 8 for row in free)  # varied tokens: a wrong cache would show
    eos = free[0][50]
    first = free[0].index(eos)
    expected = eager.engine.generate(ids, mask, 90, eos_token_ids={eos})
    assert expected[0] == free[0][:first + 1]
    got = graph.engine.generate(ids, mask, 90, eos_token_ids={eos})
    assert got == expected
    slot = graph.engine._slots[2]
    assert slot.graph is not None  # the steps after the first were replays
    pointers = slot.cache.storage_pointers()
    again = graph.engine.generate(ids, mask, 90, eos_token_ids={eos})  # the next batch: same slot, same graph
    assert again == expected and graph.engine._slots[2] is slot and slot.cache.storage_pointers() == pointers
    assert graph.generate(PROMPTS, 40) == eager.generate(PROMPTS, 40)

