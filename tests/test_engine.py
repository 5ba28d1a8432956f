"""The decode engine and its caches on the CPU: the mirror gives the per-step dequantization's numbers bit for
bit, the engine's greedy tokens equal transformers' generate on the reference cache (left padding, flushes,
an EOS in the middle, sliding-window layers), stored bytes equal the reference cache's, storage never moves,
and backends refuse what they do not implement by name. The CUDA-graph half is in tests/test_engine_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch

from oscar import available_methods, build_method
from oscar.attention import attach
from oscar.backend import Backend, TorchBackend, build_backend
from oscar.cache import QuantizedKVCache, cache_argument
from oscar.engine import DecodeEngine, resolve_fused_layers, resolve_mode
from oscar.lm import KVModel
from tests.conftest import build_tiny

@pytest.fixture(scope="module")
def method_for(make_method):
    """``method_for(name, **overrides)``: a short residual window, so that a few dozen tokens cross several flushes."""
    return lambda name, **overrides: make_method(name, **{"residual_length": 32, **overrides})


@pytest.fixture(scope="module")
def tiny_and_tokenizer(varied_tiny):
    return varied_tiny


def _teacher_forced_logits(model, cache, ids, mask, teacher, chunk: int | None = None):
    """Per-step last-token logits [B, S, V]: the prompt (in forward calls of ``chunk`` tokens), then one teacher
    token per step."""
    logits = []
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    step = chunk or ids.shape[1]
    with torch.no_grad():
        for start in range(0, ids.shape[1], step):  # the prompt
            out = model(input_ids=ids[:, start:start + step], attention_mask=mask[:, :start + step],
                        position_ids=pos[:, start:start + step], **cache_argument(model, cache))
        logits.append(out.logits[:, -1])
        for i in range(teacher.shape[1]):  # one teacher token per step
            mask = torch.cat([mask, torch.ones_like(teacher[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=teacher[:, i:i + 1], attention_mask=mask, position_ids=pos,
                        **cache_argument(model, cache))
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("steps", [30, pytest.param(60, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", available_methods())
def test_mirror_gives_the_per_step_dequantization_bit_for_bit(name, steps, method_for):
    """Same logits, bit for bit, with and without the mirror: a left-padded batch (70 and 47 tokens) over 30 decode
    steps (the two rows' keys flushing at steps 26 and 17; -m slow: 60 steps, two flushes each; kivi-policy values
    one token per step, keys every 32)."""
    base = build_tiny("tiny-llama")
    ids = torch.randint(0, 1000, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    teacher = torch.randint(0, 1000, (2, 60), generator=torch.Generator().manual_seed(2))[:, :steps]
    runs = []
    for mirror in (False, True):
        method = method_for(name)
        model = copy.deepcopy(base)
        method.prepare_model(model)
        attach(model, method)
        cache = QuantizedKVCache.for_model(model, method, mask, mirror=mirror)
        runs.append((_teacher_forced_logits(model, cache, ids, mask, teacher), cache))
    (plain, plain_cache), (mirrored, mirror_cache) = runs
    assert torch.equal(plain, mirrored)
    assert mirror_cache.nbytes == plain_cache.nbytes  # the mirror is not stored bytes
    if name != "fp16":
        assert mirror_cache.allocated_bytes > mirror_cache.nbytes
        assert mirror_cache.token_counts()["keys_packed"] > 0


def _reference_and_engine(method_for, model, tokenizer, method_name, prompts, max_new, eos=None, **overrides):
    """(transformers' generate on the per-step reference cache, the engine on the mirror) texts."""
    texts = []
    for mirror in (False, True):
        lm = KVModel(copy.deepcopy(model), tokenizer, method_for(method_name, **overrides),
                     backend=TorchBackend(mirror=mirror), decode="eager")
        if eos is not None:
            lm.model.generation_config.eos_token_id = eos
        texts.append(lm.generate(prompts, max_new))
    return texts


PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps on running through the field " * 2,
           "Hello world, this is"]


@pytest.mark.parametrize("new_tokens", [40, pytest.param(70, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", available_methods())
def test_engine_generates_what_transformers_generate_does(name, new_tokens, tiny_and_tokenizer, method_for):
    """Greedy tokens of the engine (the torch static cache, eager steps) == transformers' generate on the
    reference cache, for a left-padded batch (33 and 5 prompt tokens) across flushes: 40 new tokens, a key flush
    in each row at R=32 (-m slow: 70, two in each)."""
    model, tokenizer = tiny_and_tokenizer
    reference, engine = _reference_and_engine(method_for, model, tokenizer, name, PROMPTS, new_tokens)
    assert engine == reference
    assert all(len(set(tokenizer(t, add_special_tokens=False).input_ids)) >= 20 for t in engine)


def test_engine_stops_a_sequence_at_eos_like_generate(tiny_and_tokenizer, method_for):
    """An EOS in the middle (a token the first sequence picks at step 12) ends that sequence, not the other."""
    model, tokenizer = tiny_and_tokenizer
    lm = KVModel(copy.deepcopy(model), tokenizer, method_for("kivi"), decode="eager")
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    new = 30  # the second row's keys flush at its 27th
    tokens = lm.engine.generate(enc["input_ids"], enc["attention_mask"], new, eos_token_ids=set())
    eos = tokens[0][12]
    assert eos not in tokens[0][:12]
    reference, engine = _reference_and_engine(method_for, model, tokenizer, "kivi", PROMPTS, new, eos=eos)
    assert engine == reference
    stopped = lm.engine.generate(enc["input_ids"], enc["attention_mask"], new, eos_token_ids={eos})
    assert stopped[0] == tokens[0][:13]  # up to and with the EOS
    assert len(stopped[1]) == new or eos in tokens[1]


def test_stop_at_newline_gives_the_first_line(tiny_and_tokenizer, method_for):
    model, tokenizer = tiny_and_tokenizer
    lm = KVModel(copy.deepcopy(model), tokenizer, method_for("oscar"), decode="eager")
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    lm.model.generation_config.eos_token_id = None
    full = lm.engine.generate(*tokenizer(PROMPTS, return_tensors="pt", padding=True).values(), 30, set())
    first = full[0][5]  # pretend the token at step 5 holds a newline
    lm._newline_tokens = {first, newline}
    texts = lm.generate(PROMPTS, 30, stop_at_newline=True)
    assert texts[0] == tokenizer.decode(full[0][:6], skip_special_tokens=True).split("\n")[0]


@pytest.mark.parametrize("name", available_methods())
def test_static_cache_stores_what_the_reference_cache_stores(name, tiny_and_tokenizer, method_for):
    """After a generation (45 new tokens: a key flush in each row), the engine's cache holds the reference cache's
    token counts and bytes (teacher forcing the same tokens), and its storage addresses never changed since a
    first, shorter generation of the same capacity."""
    model, tokenizer = tiny_and_tokenizer
    lm = KVModel(copy.deepcopy(model), tokenizer, method_for(name), decode="eager")
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    engine = lm.engine
    engine.generate(enc["input_ids"], enc["attention_mask"], 5, eos_token_ids=set())
    cache = engine._slots[2].cache
    before = cache.storage_pointers()
    tokens = engine.generate(enc["input_ids"], enc["attention_mask"], 45, eos_token_ids=set())  # the slot reused
    assert cache is engine._slots[2].cache and cache.storage_pointers() == before
    teacher = torch.tensor([row[:-1] for row in tokens])  # the last token is never stored
    reference = QuantizedKVCache.for_model(lm.model, lm.method, enc["attention_mask"])
    _teacher_forced_logits(lm.model, reference, enc["input_ids"], enc["attention_mask"], teacher)
    for layer in range(2):
        assert cache.token_counts(layer) == reference.token_counts(layer)
    assert cache.nbytes == reference.nbytes
    assert cache.allocated_bytes >= cache.nbytes


def test_sliding_window_layers_decode_like_generate(method_for):
    """A model with sliding-window layers (Gemma 3): the engine's per-layer-type masks keep each window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from oscar.models import load_tokenizer

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=24,
                              layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512)
    model = Gemma3ForCausalLM(config).eval()
    tokenizer = load_tokenizer("smollm2-135m")
    for name in ("fp16", "oscar"):  # 33 + 24 tokens: past the window of 24 at every step
        reference, engine = _reference_and_engine(method_for, model, tokenizer, name, PROMPTS, 24)
        assert engine == reference


def test_capacity_holds_prompt_and_new_tokens_in_whole_windows(tiny_and_tokenizer, method_for):
    model, _ = tiny_and_tokenizer
    engine = DecodeEngine(model, method_for("oscar", residual_length=128), TorchBackend(), "eager",
                          capacity_step=256)
    for prompt, new in ((1, 1), (100, 28), (129, 128), (1000, 64)):
        capacity = engine.capacity(prompt, new)
        assert capacity >= prompt + new and capacity % 256 == 0 and capacity - (prompt + new) < 256
    wide = DecodeEngine(model, method_for("kivi", residual_length=384, group_size=128), TorchBackend(), "eager")
    assert wide.capacity(10, 10) % 384 == 0


def test_backends_refuse_by_name_and_say_who_implements_it():
    from dataclasses import dataclass

    from oscar.method import KVMethod

    @dataclass
    class TinyMethod(KVMethod):  # a method no kernel implements (unregistered)
        name = "tiny"

    cupy = build_backend("cupy")
    with pytest.raises(ValueError, match=r"backend=cupy does not implement method=tiny \(kernels exist for kivi, "
                                         r"oscar, ott, quarot, rotatekv, spectral, turboquant\); backend=torch "
                                         r"implements"):
        cupy.check(TinyMethod())
    with pytest.raises(ValueError, match="flush=kivi"):
        cupy.check(build_method("oscar", flush="kivi"))
    for name in ("fp16", "oscar", "kivi", "quarot", "turboquant", "ott", "spectral"):
        cupy.check(build_method(name))
    cupy.check(build_method("rotatekv", reorder=False))
    TorchBackend().check(build_method("ott"))
    with pytest.raises(ValueError, match="unknown backend 'triton'; available: cupy, torch"):
        build_backend("triton")
    with pytest.raises(ValueError, match="no option"):
        build_backend("torch", speed=11)


def test_a_backend_without_a_static_cache_decodes_through_transformers_generate(tiny_and_tokenizer, method_for):
    model, tokenizer = tiny_and_tokenizer

    class DynamicOnly(Backend):
        def new_cache(self, model, method, attention_mask=None, quantize_prefill=False):
            return QuantizedKVCache.for_model(model, method, attention_mask, quantize_prefill)

    lm = KVModel(copy.deepcopy(model), tokenizer, method_for("kivi"), backend=DynamicOnly(), decode="eager")
    assert lm.engine.generate(*tokenizer(PROMPTS, return_tensors="pt", padding=True).values(), 5, set()) is None
    reference, _ = _reference_and_engine(method_for, model, tokenizer, "kivi", PROMPTS, 20)
    assert lm.generate(PROMPTS, 20) == reference


def test_decode_modes():
    assert resolve_mode("auto", "cpu") == "eager"
    assert resolve_mode("auto", "cuda:0") == "graph"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_mode("graph", "cpu")
    with pytest.raises(ValueError, match="decode must be one of"):
        resolve_mode("fast", "cpu")


def test_fused_layers_resolve_where_their_kernels_run():
    """auto: the fused layers, merged, on a model on one GPU where a backend offers them, off on a CPU, a model over
    several GPUs or without CuPy; on and merged refused there, by name."""
    assert resolve_fused_layers("auto", "cuda:0", offered=True) == "merged"
    assert resolve_fused_layers("auto", "cuda:0", offered=False) == "off"
    assert resolve_fused_layers("auto", "cpu", offered=True) == "off"
    assert resolve_fused_layers("auto", ["cuda:0", "cuda:1"], offered=True) == "off"
    assert resolve_fused_layers("merged", "cuda:0", offered=True) == "merged"
    assert resolve_fused_layers("off", "cpu", offered=False) == "off"
    with pytest.raises(ValueError, match="fused_layers=on: no backend offers fused layers for this model here"):
        resolve_fused_layers("on", "cuda:0", offered=False)
    with pytest.raises(ValueError, match=r"fused_layers=on .* on one GPU, and this model runs on cuda:0, cuda:1"):
        resolve_fused_layers("on", ["cuda:0", "cuda:1"], offered=True)
    with pytest.raises(ValueError, match="fused_layers must be one of auto, on, merged, off"):
        resolve_fused_layers("yes", "cpu", offered=True)
    engine = DecodeEngine(build_tiny("tiny-llama"), build_method("fp16"), TorchBackend(), "auto")
    assert engine.fused_layers == "off" and engine.fusion is None  # a CPU: transformers' own modules


@pytest.mark.parametrize("name", available_methods())
def test_hadamard_space_means_the_plain_hadamard(name, method_for):
    """A method that says its query/key transform is the plain Hadamard (the mirror then does both of a decode
    step in one kernel, kernels.ops.hadamard_step) transforms exactly so; the others are left to their own."""
    from oscar.quant import hadamard

    method = method_for(name)
    x = torch.randn(2, 4, 3, 64)
    if method.hadamard_space:
        assert torch.equal(method.transform_query(x, 0), hadamard(x))
        assert torch.equal(method.transform_key(x, 0), hadamard(x))
    assert build_method("oscar").hadamard_space and not build_method("oscar", rotate=False).hadamard_space
