"""The methods from a researcher's own transformers code: the drop-in (``oscar.apply``), the refusals of a cache
on a model not prepared for its method, the exact restoration of a model, a method object serving several models,
and every method's quantizer on large finite inputs."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_tiny

METHODS = ["fp16", "kivi", "oscar", "quarot", "rotatekv", "ott", "turboquant", "spectral"]


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.double() - exact.double()).norm() / exact.double().norm()).item()


# ----------------------------------------------------------------------------- large finite inputs


@pytest.mark.parametrize("name, options", [(name, {}) for name in METHODS] + [("spectral", {"codebook": "lloyd_max"})])
def test_every_method_is_finite_and_as_accurate_on_large_finite_inputs(name, options, make_method):
    """Keys and values of RMS 8000 in fp16 (TurboQuant+'s fp16 block norms overflowed there: NaN), and of RMS 1e20 and
    1e30 in bf16 and fp32 (a float32 sum of squares overflows past 1.8e19): every dequantized value is finite and its
    error relative to the input is what it is at RMS 1 (each quantizer is scale-invariant)."""
    method = make_method(name, **options)
    method.prepare_model(build_tiny("tiny-llama"))  # RotateKV's RoPE and order, OSCAR's rotations
    cases = [(torch.float16, 8000.0), (torch.bfloat16, 8000.0), (torch.bfloat16, 1e20), (torch.bfloat16, 1e30),
             (torch.float32, 8000.0), (torch.float32, 1e20), (torch.float32, 1e30)]
    unit = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(0))
    for dtype, rms in cases:
        errors = []
        for scale in (1.0, rms):
            x = (unit * scale).to(dtype)
            for what in ("keys", "values"):
                restored = method.dequantize(getattr(method, f"quantize_{what}")(x, 0))
                assert torch.isfinite(restored).all(), (dtype, rms, what)
                errors.append(_relative_error(restored, x))
        for small, large in zip(errors[:2], errors[2:]):
            assert large == pytest.approx(small, rel=0.02, abs=1e-3), (dtype, rms, errors)


def test_turboquant_keeps_fp16_norms_bit_for_bit_and_flags_the_ones_past_fp16():
    """The block norms fp16 holds are stored as fp16 (TurboQuant+'s format); one past fp16's range is stored in the same
    16 bits as a bfloat16 flagged by the sign bit, and reads back within bfloat16's precision."""
    from methods.turboquant import decode_norms, encode_norms

    norms = torch.tensor([0.0, 1e-3, 1.5, 65504.0, 65520.0, 1e5, 3e30])
    stored = encode_norms(norms)
    assert stored.dtype == torch.float16 and stored.element_size() == 2
    assert torch.equal(stored[:4], norms[:4].half())
    assert (stored[4:].view(torch.int16) < 0).all()
    assert torch.equal(decode_norms(stored)[:4], norms[:4].half().float())
    assert torch.allclose(decode_norms(stored)[4:], norms[4:], rtol=2 ** -8)


@pytest.mark.parametrize("scope", ["head", "token"])
def test_ott_pools_the_smallest_key_of_each_group_at_any_magnitude(scope):
    """OTT's outlier candidates are the smallest-norm keys of their groups at RMS 1e20 as at RMS 1 (a float32 sum of
    squares made every norm inf there, and the pool took whichever token came first)."""
    from oscar import build_method

    method = build_method("ott", scope=scope, group_size=16, residual_length=32)
    k = torch.randn(1, 2, 32, 64, generator=torch.Generator().manual_seed(0)) + 1
    k[:, :, [5, 27]] *= 0.5  # the smallest key of each group of 16 tokens
    for scale in (1.0, 1e20):
        mask = method.outlier_mask(k * scale, torch.zeros(1, 2 if scope == "head" else 1, dtype=torch.long))
        assert mask.nonzero()[:, 2].unique().tolist() == [5, 27], scale


# ----------------------------------------------------------------------------- the drop-in, method by method

import copy  # noqa: E402
import gc  # noqa: E402
import weakref  # noqa: E402

import oscar  # noqa: E402
from oscar.cache import cache_argument  # noqa: E402
from oscar.lm import KVModel  # noqa: E402

#: short windows and groups, so that the prompts' and the new tokens' keys and values are flushed (quantized)
OPTIONS = {"fp16": {}, "kivi": dict(group_size=16, residual_length=16), "oscar": dict(group_size=16, residual_length=16),
           "quarot": dict(residual_length=16), "rotatekv": dict(residual_length=16, num_sinks=4),
           "ott": dict(group_size=16, residual_length=16, pool_size=4), "turboquant": dict(residual_length=16),
           "spectral": dict(residual_length=16, sink_tokens=4)}
PROMPTS = ["The quick brown fox jumps over the lazy dog and then runs through the long grass of the field, "
           "past the old barn and the river, until the sun goes down behind the hills",
           "Hello world, this is a short prompt"]
NEW_TOKENS = 16


def _encode(tokenizer, prompts=PROMPTS):
    tokenizer.padding_side = "left"
    return tokenizer(prompts, return_tensors="pt", padding=True)


def _continuations(model, tokenizer, inputs, max_new_tokens: int = NEW_TOKENS, **generate) -> list[str]:
    """Greedy continuations of a left-padded batch through transformers' generate, decoded as KVModel decodes; a
    ``cache`` is handed over under the installed transformers' keyword (``past_key_values`` before 5.2x)."""
    from oscar.cache import cache_keyword

    if "cache" in generate:
        generate[cache_keyword(model)] = generate.pop("cache")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, **generate)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _hooks(model) -> dict[str, int]:
    """The forward (pre-)hooks on every module of ``model``, counted by module name."""
    return {name: len(m._forward_pre_hooks) + len(m._forward_hooks) for name, m in model.named_modules()}


def _implementations(model) -> list:
    from oscar.preparation import _configs

    return [config._attn_implementation for config in _configs(model)]


@pytest.fixture(scope="module")
def varied(varied_tiny):
    """tiny-llama with weights of std 0.1 (greedy continuations that vary), its tokenizer, and its fp16 tokens."""
    model, tokenizer = varied_tiny
    model = copy.deepcopy(model)
    return model, tokenizer, _continuations(model, tokenizer, _encode(tokenizer))


@pytest.mark.parametrize("name", METHODS)
def test_the_drop_in_gives_kvmodels_tokens_and_restores_the_model_exactly(name, varied, make_method):
    """For every method on tiny-llama, a left-padded batch whose prompts and new tokens cross the flushes: the greedy
    tokens of generate with make_cache(inputs) equal KVModel.generate's; on exit the state dict is bit for bit as
    before, the attention implementation and the hooks are as before, no attention module keeps the method, and the
    model gives fp16's tokens again."""
    model, tokenizer, fp16 = varied
    method = make_method(name, **OPTIONS[name])
    expected = KVModel(copy.deepcopy(model), tokenizer, method).generate(PROMPTS, NEW_TOKENS)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    hooks, implementations = _hooks(model), _implementations(model)
    inputs = _encode(tokenizer)
    with oscar.apply(model, method) as make_cache:
        given = _continuations(model, tokenizer, inputs, cache=make_cache(inputs))
    assert given == expected
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[key], state[key]) for key in state)
    assert _hooks(model) == hooks and _implementations(model) == implementations
    assert not any(hasattr(m, "kv_method") or hasattr(m, "kv_cache") for m in model.modules())
    assert _continuations(model, tokenizer, inputs) == fp16
    if name != "fp16":
        assert expected != fp16  # the methods quantize these tokens: a cache that stored nothing would show


def test_generate_given_no_cache_inside_the_block_runs_the_method(varied, make_method):
    """generate without a cache inside the block (transformers makes an empty one): the guard puts a fresh cache of
    the method in its place at the first forward, and the tokens are KVModel's (RotateKV: its sink hooks too)."""
    model, tokenizer, _ = varied
    method = make_method("rotatekv", **OPTIONS["rotatekv"])
    expected = KVModel(copy.deepcopy(model), tokenizer, method).generate(PROMPTS, NEW_TOKENS)
    with oscar.apply(model, method):
        assert _continuations(model, tokenizer, _encode(tokenizer)) == expected


def test_a_pipeline_runs_the_method_inside_the_block(varied, make_method):
    """transformers' text-generation pipeline makes its own cache per call (passing one through it would serve every
    prompt of a list): inside the block each call gets a fresh cache of the method, batched (left-padded) or not."""
    from transformers import pipeline

    model, tokenizer, fp16 = varied
    method = make_method("oscar", **OPTIONS["oscar"])
    expected = KVModel(copy.deepcopy(model), tokenizer, method).generate(PROMPTS, NEW_TOKENS)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, return_full_text=False)

    def texts(**more):
        return [out[0]["generated_text"] for out in pipe(PROMPTS, **settings, **more)]

    with oscar.apply(model, method) as make_cache:
        assert texts() == expected and texts(batch_size=2) == expected
        with pytest.raises(ValueError, match="one cache per call"):
            texts(cache=make_cache())  # one cache for the list's two generate calls: the second is refused
    assert texts() == fp16


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", ["oscar", "quarot", "rotatekv", "spectral"])
def test_a_cache_on_a_model_not_prepared_for_its_method_is_refused_at_the_first_forward(name, varied, make_method):
    """The methods that fold weights or transform queries: their cache on a model nobody prepared (the call the cache's
    docstring used to show) is refused in one line naming the fix, as is one made without its model when the method
    object prepared no model."""
    from oscar.cache import QuantizedKVCache

    model, tokenizer, _ = varied
    method = make_method(name, **OPTIONS[name])
    inputs = _encode(tokenizer)
    with pytest.raises(ValueError, match=r"not: prepare it with `with oscar\.apply\(model, method\)"):
        _continuations(model, tokenizer, inputs, cache=QuantizedKVCache.for_model(model, method,
                                                                                   inputs["attention_mask"]))
    cache = QuantizedKVCache(method, model.config.num_hidden_layers, pad_lengths=[0, 0])
    with pytest.raises(ValueError, match="none is: prepare it"):
        _continuations(model, tokenizer, inputs, cache=cache)


@pytest.mark.parametrize("name", ["fp16", "kivi", "ott", "turboquant"])
def test_a_method_that_needs_no_preparation_runs_on_an_unprepared_model(name, varied):
    """A cache of a method that neither folds weights nor transforms queries is correct on any model: the model's own
    attention over it gives KVModel's tokens."""
    from oscar import build_method
    from oscar.cache import QuantizedKVCache

    model, tokenizer, _ = varied
    method = build_method(name, **OPTIONS[name])
    expected = KVModel(copy.deepcopy(model), tokenizer, method).generate(PROMPTS, NEW_TOKENS)
    inputs = _encode(tokenizer)
    cache = QuantizedKVCache.for_model(model, method, inputs["attention_mask"])
    assert _continuations(model, tokenizer, inputs, cache=cache) == expected


def test_a_prepared_model_refuses_every_other_cache(varied):
    """Inside the block: another method's cache, another object of the same method, a transformers cache that holds
    tokens, a cache made for another batch's padding and one reused for a second generate call are refused, each in
    one line; make_cache after the block is refused."""
    from transformers import DynamicCache

    from oscar import build_method
    from oscar.cache import QuantizedKVCache

    model, tokenizer, _ = varied
    inputs = _encode(tokenizer)
    method = build_method("oscar", **OPTIONS["oscar"])
    with oscar.apply(model, method) as make_cache:
        for other, match in ((build_method("kivi"), "prepared for oscar, and the cache is kivi's"),
                             (build_method("oscar", **OPTIONS["oscar"]), "another oscar method object")):
            with pytest.raises(ValueError, match=match):
                _continuations(model, tokenizer, inputs, cache=QuantizedKVCache.for_model(model, other,
                                                                                           inputs["attention_mask"]))
        held = DynamicCache()
        with torch.no_grad():
            model(input_ids=inputs["input_ids"][:1, :4], cache=held)  # the guard made one of its own: still empty
            held.update(torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 4, 64), 0)
            with pytest.raises(ValueError, match="DynamicCache holding 4 tokens"):
                model(input_ids=inputs["input_ids"][:1, 4:5], cache=held)
        with pytest.raises(ValueError, match="made for a batch padded"):
            _continuations(model, tokenizer, inputs, cache=make_cache())
        cache = make_cache(inputs["attention_mask"])
        _continuations(model, tokenizer, inputs, cache=cache)
        with pytest.raises(ValueError, match="earlier generate call"):
            _continuations(model, tokenizer, inputs, cache=cache)
        with pytest.raises(ValueError, match="attention mask"):
            make_cache(inputs["input_ids"][0])
    with pytest.raises(ValueError, match="block has ended"):
        make_cache(inputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_the_cupy_backend_is_refused_on_a_cpu_only_machine_before_anything_changes(varied):
    model, _, _ = varied
    state = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="^backend=cupy needs a CUDA GPU; use backend=torch on this machine$"):
        with oscar.apply(model, "oscar", backend="cupy"):
            pass
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    assert _implementations(model) == ["sdpa"] * len(_implementations(model))


# ----------------------------------------------------------------------------- one model, several methods


def test_a_kvmodel_for_another_method_restores_the_model_first(varied):
    """KVModel(model, oscar) then KVModel(model, kivi) on one model: KIVI runs on the weights as loaded (its tokens are
    KIVI's on a fresh copy), and the first KVModel, whose method the model no longer has, is refused."""
    from oscar import build_method

    model, tokenizer, _ = varied
    model = copy.deepcopy(model)
    kivi = KVModel(copy.deepcopy(model), tokenizer, build_method("kivi", **OPTIONS["kivi"])).generate(PROMPTS, 16)
    first = KVModel(model, tokenizer, build_method("oscar", **OPTIONS["oscar"]))
    first.generate(PROMPTS, 16)
    assert KVModel(model, tokenizer, build_method("kivi", **OPTIONS["kivi"])).generate(PROMPTS, 16) == kivi
    with pytest.raises(ValueError, match="this KVModel's model is prepared for kivi now .*: make a new KVModel for "
                                         "oscar"):
        first.generate(PROMPTS, 16)


def test_a_restored_kvmodel_is_refused_where_it_would_read_its_caches_unprepared(varied):
    """After ``restore()`` (its own, or that of a second KVModel that had taken the model over) a KVModel's generate,
    new_cache and scheduled generation are refused in one line: its caches would be read without the method's query
    transform and value fold (tokens silently wrong before)."""
    from evals.scheduler import Job, scheduled_generate
    from oscar import build_method

    model, tokenizer, _ = varied
    model = copy.deepcopy(model)
    lm = KVModel(model, tokenizer, build_method("oscar", **OPTIONS["oscar"]))
    lm.generate(PROMPTS, 4)
    lm.restore()
    refused = "this KVModel's model is not prepared now .*: make a new KVModel for oscar"
    for call in (lambda: lm.generate(PROMPTS, 4), lm.new_cache,
                 lambda: list(scheduled_generate(lm, [Job("a", PROMPTS[0], 4, False)], 4096))):
        with pytest.raises(ValueError, match=refused):
            call()
    first = KVModel(model, tokenizer, build_method("oscar", **OPTIONS["oscar"]))
    KVModel(model, tokenizer, build_method("kivi", **OPTIONS["kivi"])).restore()
    with pytest.raises(ValueError, match=refused):
        first.generate(PROMPTS, 4)


def test_a_static_cache_inside_the_block_is_refused_in_one_line(varied):
    """``cache_implementation="static"`` (a fixed-length cache the model shapes its masks to) on a padded batch inside
    the block: one line naming the fix, where a shape error came from deep inside the attention."""
    model, tokenizer, _ = varied
    inputs, model = _encode(tokenizer), copy.deepcopy(model)
    with oscar.apply(model, "kivi"):
        with pytest.raises(ValueError, match="whose caches grow with the sequence: a StaticCache "
                                             r"\(cache_implementation='static'\).*pass cache=make_cache\(inputs\)"):
            _continuations(model, tokenizer, inputs, cache_implementation="static")


def test_several_samples_per_prompt_need_a_cache_of_the_repeated_batch(varied):
    """generate's num_return_sequences repeats each prompt's row: a cache made from the prompts' own batch is
    refused at the first forward with the two fixes; one made from the repeated batch, or none, samples; beam
    search is refused either way."""
    model, tokenizer, _ = varied
    inputs, model = _encode(tokenizer), copy.deepcopy(model)
    repeated = {key: value.repeat_interleave(2, dim=0) for key, value in inputs.items()}
    sample = dict(do_sample=True, num_return_sequences=2, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id)
    with oscar.apply(model, "kivi") as make_cache:
        with pytest.raises(ValueError, match="made for a batch of 2 rows and the forward sends 4 rows: make one cache "
                                             "per batch.*num_return_sequences and num_beams repeat.*pass no cache"):
            model.generate(**inputs, **cache_argument(model, make_cache(inputs)), **sample)
        for cache in (make_cache(repeated), None):
            given = {} if cache is None else cache_argument(model, cache)
            assert model.generate(**inputs, **given, **sample).shape == (4, inputs["input_ids"].shape[1] + 4)
        with pytest.raises(NotImplementedError, match="beam search is not supported"):
            model.generate(**inputs, num_beams=2, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id)


def test_two_kvmodels_of_a_method_that_leaves_the_model_as_it_is_share_it(varied):
    """Two KVModels of equal fp16 (or KIVI) objects on one model both generate (neither changes the model: their
    caches are interchangeable), while a KIVI of other hyperparameters is still refused."""
    from oscar import build_method
    from oscar.cache import QuantizedKVCache

    model, tokenizer, _ = varied
    model = copy.deepcopy(model)
    for name in ("fp16", "kivi"):
        first = KVModel(model, tokenizer, build_method(name, **OPTIONS.get(name, {})))
        expected = first.generate(PROMPTS, 8)
        second = KVModel(model, tokenizer, build_method(name, **OPTIONS.get(name, {})))
        assert second.generate(PROMPTS, 8) == expected
        assert first.generate(PROMPTS, 8) == expected
    other = build_method("kivi", k_bits=4, v_bits=4)
    inputs = _encode(tokenizer)
    with pytest.raises(ValueError, match="another kivi method object"):
        _continuations(model, tokenizer, inputs, cache=QuantizedKVCache.for_model(model, other,
                                                                                   inputs["attention_mask"]))


def test_the_block_on_a_kvmodels_model_gives_it_back_to_the_kvmodel(varied, make_method):
    """oscar.apply on a model a KVModel prepared for another method: inside, the block's method; after, the KVModel's
    tokens are what they were."""
    model, tokenizer, _ = varied
    lm = KVModel(copy.deepcopy(model), tokenizer, make_method("rotatekv", **OPTIONS["rotatekv"]))
    before = lm.generate(PROMPTS, 16)
    hooks = _hooks(lm.model)
    inputs = _encode(tokenizer)
    with oscar.apply(lm.model, "kivi") as make_cache:
        _continuations(lm.model, tokenizer, inputs, cache=make_cache(inputs))
    assert lm.generate(PROMPTS, 16) == before and _hooks(lm.model) == hooks


def test_one_rotatekv_object_serves_two_models_and_lets_them_go(varied, make_method):
    """One RotateKV method object prepared for a second model keeps the first one's sink hooks and output (it removed
    them: 2 -> 0 hooks on tiny-llama, 30 -> 0 on SmolLM2); a model of another shape is refused while one is served,
    and accepted once the models are freed (the method holds them weakly)."""
    from methods.rotatekv import decoder_layers
    from oscar import build_method

    model, tokenizer, _ = varied
    method = make_method("rotatekv", **OPTIONS["rotatekv"])
    first = KVModel(copy.deepcopy(model), tokenizer, method)
    before = first.generate(PROMPTS, 16)
    count = sum(len(layer._forward_pre_hooks) for _, layer in decoder_layers(first.model))
    second = KVModel(copy.deepcopy(model), tokenizer, method)
    assert sum(len(layer._forward_pre_hooks) for _, layer in decoder_layers(first.model)) == count == 2
    assert first.generate(PROMPTS, 16) == before == second.generate(PROMPTS, 16)

    uncalibrated = build_method("rotatekv", reorder=False, **OPTIONS["rotatekv"])
    kept = KVModel(build_tiny("tiny-llama"), tokenizer, uncalibrated)
    deeper = build_tiny("tiny-llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match="already serves a LlamaForCausalLM of another shape"):
        KVModel(deeper, tokenizer, uncalibrated)
    freed = weakref.ref(kept.model)
    del kept
    gc.collect()
    assert freed() is None
    assert KVModel(deeper, tokenizer, uncalibrated).generate(PROMPTS[1:], 4)


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M in float32 on the CPU, its tokenizer, and its fp16 continuations of the batch."""
    from oscar.models import load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return model, tokenizer, _continuations(model, tokenizer, _encode(tokenizer, SMOLLM2_PROMPTS), max_new_tokens=8)


SMOLLM2_PROMPTS = ["The history of the city goes back to Roman times, when a small fort was built on the river bank to "
                   "guard the crossing. Over the following centuries the town grew around it, and the capital of "
                   "Italy is", "The capital of Italy is"]


def test_on_smollm2_the_unprepared_call_is_refused_and_the_drop_in_gives_kvmodels_tokens(smollm2):
    """SmolLM2 with OScaR and KIVI (windows of 32 tokens, so the 48-token prompt and the new tokens are quantized): the
    cache's old docstring call on the unprepared model (it answered ',,,,' for OScaR) is refused; inside the block
    the tokens are KVModel's (one copy of the model serving both KVModels, prepared again for the second); after it,
    fp16's."""
    from oscar import build_method
    from oscar.cache import QuantizedKVCache

    model, tokenizer, fp16 = smollm2
    inputs = _encode(tokenizer, SMOLLM2_PROMPTS)
    copied = copy.deepcopy(model)
    for name in ("oscar", "kivi"):
        method = build_method(name, residual_length=32)
        if name == "oscar":
            with pytest.raises(ValueError, match="not: prepare it with `with oscar.apply"):
                _continuations(model, tokenizer, inputs, max_new_tokens=1,
                               cache=QuantizedKVCache.for_model(model, method, inputs["attention_mask"]))
        expected = KVModel(copied, tokenizer, method).generate(SMOLLM2_PROMPTS, 8)
        with oscar.apply(model, method) as make_cache:
            assert _continuations(model, tokenizer, inputs, 8, cache=make_cache(inputs)) == expected
        assert expected != fp16 and "Rome" in expected[1]
    assert _continuations(model, tokenizer, inputs, 8) == fp16


def test_on_smollm2_a_second_model_keeps_the_first_ones_rotatekv_hooks(smollm2):
    """One RotateKV method object prepared for a copy of SmolLM2 after the model: the model keeps its 30 sink hooks (the
    second preparation removed them all)."""
    from methods.rotatekv import decoder_layers
    from oscar import build_method

    model, tokenizer, _ = smollm2
    method = build_method("rotatekv", reorder=False)
    copied = copy.deepcopy(model)
    with oscar.apply(model, method):
        hooks = sum(len(layer._forward_pre_hooks) for _, layer in decoder_layers(model))
        KVModel(copied, tokenizer, method)
        assert sum(len(layer._forward_pre_hooks) for _, layer in decoder_layers(model)) == hooks == 30
    assert sum(len(layer._forward_pre_hooks) for _, layer in decoder_layers(model)) == 0


def test_a_copy_of_a_prepared_model_is_refused_and_copies_no_method_state(varied):
    """copy.deepcopy of a model prepared for RotateKV: its attention holds a fresh method object of the same
    hyperparameters (no model's hooks or state copied along), so its forward and preparing it again are refused; the
    original runs on."""
    from oscar import build_method

    model, tokenizer, _ = varied
    method = build_method("rotatekv", reorder=False, **OPTIONS["rotatekv"])
    lm = KVModel(copy.deepcopy(model), tokenizer, method)
    before = lm.generate(PROMPTS, 4)
    copied = copy.deepcopy(lm.model)
    twin = copied.model.layers[0].self_attn.kv_method
    assert twin == method and twin is not method and not list(twin._hooks.keys())
    with pytest.raises(ValueError, match="attends through another rotatekv method object"):
        _continuations(copied, tokenizer, _encode(tokenizer), 1)
    with pytest.raises(ValueError, match="load a fresh model"):
        KVModel(copied, tokenizer, method)
    assert lm.generate(PROMPTS, 4) == before


# ----------------------------------------------------------------------------- GPU


def _gpu_ready() -> bool:
    from tests.test_kernels import _gpu_ready as ready

    return ready()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("name", ["oscar", "kivi", "rotatekv"])
def test_the_cupy_backend_through_the_drop_in_gives_kvmodels_tokens(name):
    """backend="cupy" through oscar.apply (transformers' generate on the kernels' growing cache) on tiny-llama in bf16
    on CUDA, a left-padded batch crossing several flushes: the greedy tokens of KVModel with backend cupy; the model
    restored bit for bit after."""
    from oscar import build_method
    from oscar.backend import build_backend
    from tests.test_engine_gpu import PROMPTS as GPU_PROMPTS
    from tests.test_engine_gpu import char_tokenizer

    model = build_tiny("tiny-llama").to("cuda", torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.1)
    model.generation_config.eos_token_id = 1
    tokenizer = char_tokenizer()
    options = dict(reorder=False) if name == "rotatekv" else {}
    method = build_method(name, residual_length=32, **options)
    expected = KVModel(copy.deepcopy(model), tokenizer, method, backend=build_backend("cupy"),
                       decode="eager").generate(GPU_PROMPTS, 40)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    inputs = _encode(tokenizer, GPU_PROMPTS).to("cuda")
    with oscar.apply(model, method, backend="cupy") as make_cache:
        assert _continuations(model, tokenizer, inputs, 40, cache=make_cache(inputs)) == expected
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


# ----------------------------------------------------------------------------- the README


@pytest.mark.slow
def test_the_readmes_python_section_runs_as_written(tmp_path, monkeypatch):
    """The code blocks of the README's Python section, in order, as one script (SmolLM2, the drop-in, a pipeline,
    KVModel, the runner on one perplexity window), run from a folder whose conf/ is the repository's."""
    import re

    from oscar.paths import REPO_ROOT

    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Python\n"):text.index("## Methods\n")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 4
    (tmp_path / "conf").symlink_to(REPO_ROOT / "conf")
    monkeypatch.chdir(tmp_path)
    exec(compile("\n".join(blocks), "README.md", "exec"), {"__name__": "readme"})
    assert len((tmp_path / "runs" / "rows.csv").read_text().splitlines()) == 3  # header, perplexity, bytes per token


def test_a_prepare_model_that_changes_other_weights_is_refused_and_the_model_unprepared(varied):
    """A method whose prepare_model changes a weight besides the value and output projections (nothing keeps a copy of
    it): refused in one line naming the weight, the model left unprepared (its attention implementation, no guard)."""
    from methods.kivi import KIVI
    from oscar.preparation import preparation, prepare

    class ScalesQueries(KIVI):
        name = "scales_queries"

        def prepare_model(self, model):
            model.model.layers[0].self_attn.q_proj.weight.mul_(2)

    model, _, _ = varied
    model = copy.deepcopy(model)
    hooks, implementations = _hooks(model), _implementations(model)
    with pytest.raises(ValueError, match=r"changed model\.layers\.0\.self_attn\.q_proj\.weight, which nothing"):
        prepare(model, ScalesQueries())
    assert preparation(model) is None and _hooks(model) == hooks and _implementations(model) == implementations
