"""The method contract, checked for every registered method (``available_methods()``): a method file dropped into
methods/ with its conf/method YAML is tested here with no list to edit, and a broken one fails with its name in
the test id. Each method runs as ``make_method`` (tests/conftest.py) builds it on tiny-llama.

- the interface: packed shapes, dtype, ``nbytes`` = the sum of the stored buffers, ``dequantize`` in the space
  ``transform_query`` / ``transform_key`` rotate into;
- 8 bits is close to full precision, with quantize_prefill on and off (and a decode step over stored tokens);
- a sample generates alone what it generates inside a left-padded batch (the decode engine, eager);
- decode tokens are really quantized (stored packed, not kept in full precision);
- two caches of one method instance, used at once, give what two instances give (per-sequence state lives in
  the cache), through the reference cache and the decode engine's static caches;
- conf/method/<name>.yaml holds exactly the dataclass's hyperparameters at their defaults.
The decode engine's bit-identity with the reference cache and its stored bytes are in tests/test_engine.py,
parametrized the same way.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from oscar import available_methods, method_class
from oscar.attention import bind_cache, record_attention
from oscar.engine import DecodeEngine
from oscar.exact import EXACT_BUFFERS
from oscar.lm import KVModel
from oscar.paths import REPO_ROOT
from oscar.quant import PackedTensor
from tests.conftest import build_tiny
from tests.test_quant import kv_like

METHODS = available_methods()
R = 32  # a short residual window: a few dozen tokens cross several flushes
PROMPTS = ["The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide from "
           "the hunters who have followed it since the early morning along the river.",
           "Once upon a time, in a small village by the sea, there lived an old fisherman"]


def quantizes(name: str) -> bool:
    defaults = {f.name: f.default for f in dataclasses.fields(method_class(name))}
    return (defaults["k_bits"], defaults["v_bits"]) != (16, 16)


def eight_bits(name: str) -> dict:
    return dict(k_bits=8, v_bits=8) if quantizes(name) else {}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama at its registry weights (std 0.02): logits of 8-bit caches are close to full precision."""
    return build_tiny("tiny-llama")


# ----------------------------------------------------------------------------- configuration


def test_every_method_config_is_a_registered_method():
    assert sorted(p.stem for p in (REPO_ROOT / "conf" / "method").glob("*.yaml")) == METHODS


@pytest.mark.parametrize("name", METHODS)
def test_yaml_holds_the_dataclass_defaults(name):
    """conf/method/<name>.yaml names every hyperparameter at its dataclass default (a value computed from the
    model, like a calibration file's path, only where the dataclass has none), and composes into a method."""
    from hydra import compose, initialize_config_dir

    from oscar import build_method

    yaml = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "conf" / "method" / f"{name}.yaml"), resolve=False)
    assert yaml.pop("name") == name
    fields = {f.name: f for f in dataclasses.fields(method_class(name))}
    assert set(yaml) == set(fields), "the yaml and the dataclass name different hyperparameters"
    for key, value in yaml.items():
        default = fields[key].default if fields[key].default is not dataclasses.MISSING else fields[key].default_factory()
        if isinstance(value, str) and "${" in value:
            assert default is None, f"{key}: a per-model value where the dataclass has a default"
        else:
            assert value == default, key
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO_ROOT / "conf")):
        options = OmegaConf.to_container(compose("config", overrides=[f"method={name}"]).method, resolve=True)
    assert type(build_method(options.pop("name"), **options)) is method_class(name)


# ----------------------------------------------------------------------------- the interface


@pytest.mark.parametrize("name", METHODS)
def test_interface_contract(name, make_method, tiny):
    """Packed shapes, dtype and bytes, and dequantization into the attention space: transform_query(q) .
    dequantize(quantize_keys(k)) ~ q . k, transform_key(k) ~ the dequantized keys, the values come back; at 8 bits
    within 0.2 (a wrong space or a missing inverse transform gives ~1 or more; spectral's clip, which stays at any
    width, gives ~0.1: the 8-bit accuracy itself is checked on the model below) and at most half the error at the
    default bits, which really quantize."""
    # keys with large channels (what KV methods target), Gaussian values; 128 tokens: more than a sink prefix kept
    # exactly (spectral's 64) stays quantized
    k, q = kv_like(b=2, h=2, t=128, d=64, seed=1), kv_like(b=2, h=2, t=8, d=64, seed=3)
    v = torch.randn(2, 2, 128, 64, generator=torch.Generator().manual_seed(2))
    errors = {}
    for bits, hyperparameters in (("8", eight_bits(name)), ("default", {})):
        method = make_method(name, **hyperparameters)
        method.prepare_model(copy.deepcopy(tiny))  # what a method learns from the model (RoPE, calibration)
        for x, quantize in ((k, method.quantize_keys), (v, method.quantize_values)):
            for dtype in (torch.float32, torch.bfloat16):
                packed = quantize(x.to(dtype), 0)
                assert isinstance(packed, PackedTensor) and packed.shape == x.shape and packed.dtype == dtype
                assert packed.nbytes == sum(b.numel() * b.element_size() for b in packed.buffers.values()) > 0
                assert all(b.shape[0] == x.shape[0] for b in packed.buffers.values())  # batch rows on dim 0
                x_hat = method.dequantize(packed)
                assert x_hat.shape == x.shape and x_hat.dtype == dtype and torch.isfinite(x_hat).all()
        k_hat, v_hat = method.dequantize(method.quantize_keys(k, 0)), method.dequantize(method.quantize_values(v, 0))
        errors[bits] = torch.tensor([relative(method.transform_query(q, 0) @ k_hat.transpose(-1, -2),
                                              q @ k.transpose(-1, -2)),
                                     relative(k_hat, method.transform_key(k, 0)),  # full-precision keys, same space
                                     relative(v_hat, v)])
    if not quantizes(name):
        assert (errors["default"] < 1e-6).all()
    else:
        assert (errors["8"] < 0.2).all() and (errors["8"] < errors["default"] / 2).all(), errors
        assert (errors["default"] > 1e-3).all() and (errors["default"] < 1.0).all(), errors


# ----------------------------------------------------------------------------- in a cache, on a model


@pytest.mark.parametrize("quantize_prefill", [True, False])
@pytest.mark.parametrize("name", METHODS)
def test_eight_bits_is_close_to_full_precision(name, quantize_prefill, make_method, tiny, varied_tiny):
    ids = torch.randint(0, 1000, (1, 96), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = tiny(torch.cat([ids, torch.tensor([[7]])], 1)).logits
    ref, ref_next = logits[:, :-1], logits[:, -1:]
    model = copy.deepcopy(tiny)
    lm = KVModel(model, varied_tiny[1], make_method(name, residual_length=R, **eight_bits(name)))
    cache = lm.new_cache(quantize_prefill=quantize_prefill)
    with torch.no_grad():
        out = model(ids, cache=cache).logits
        step = model(torch.tensor([[7]]), cache=cache).logits  # one decode step over the stored tokens
    assert relative(out, ref) < (1e-2 if quantize_prefill else 1e-5)
    assert relative(step, ref_next) < 1e-2
    assert cache.token_counts(0)["keys_packed"] > 0


@pytest.mark.parametrize("name", METHODS)
def test_a_padded_batch_generates_what_each_sample_generates_alone(name, make_method, varied_tiny):
    model, tokenizer = varied_tiny
    lm = KVModel(copy.deepcopy(model), tokenizer, make_method(name, residual_length=R), decode="eager")
    together = lm.generate(PROMPTS, max_new_tokens=24)
    alone = [lm.generate([p], max_new_tokens=24)[0] for p in PROMPTS]
    assert together == alone
    assert len(set(tokenizer(together[0], add_special_tokens=False).input_ids)) >= 10  # varied: a wrong cache shows


@pytest.mark.parametrize("name", METHODS)
def test_decode_tokens_are_really_quantized(name, make_method, varied_tiny):
    """12 prompt tokens, 116 decode steps (R = 32, quantize_prefill=false): every token is stored, packed or in the
    window, and the packed keys and values of the decode tokens are quantized copies of what attention first saw,
    stored in fewer than 16 bits a value. Tokens a method keeps exactly by design (oscar.exact: OTT's pool, the sinks
    of RotateKV and spectral, whose first 64 tokens are sinks) are left out of the comparison and of the bytes."""
    model, tokenizer = varied_tiny
    lm = KVModel(copy.deepcopy(model), tokenizer, make_method(name, residual_length=R))
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(5))
    teacher = torch.randint(0, 1000, (1, 116), generator=torch.Generator().manual_seed(6))
    cache = lm.new_cache()
    with torch.no_grad(), record_attention(lm.model) as seen:
        lm.model(ids, cache=cache)
        for i in range(teacher.shape[1]):
            lm.model(teacher[:, i:i + 1], cache=cache)
    counts = cache.token_counts(0)
    assert counts["keys_packed"] + counts["keys_residual"] == counts["values_packed"] + counts["values_residual"] == 128
    assert counts["keys_residual"] <= R and counts["values_residual"] <= R
    stored = cache.layers[0].groups[0]
    for stream, what in ((stored.keys, "key"), (stored.values, "value")):
        # each token as attention first saw it (the new tokens of each call are in full precision)
        exact = torch.cat([seen[0][0][what]] + [call[what][:, :, -1:] for call in seen[0][1:]], dim=2)
        n, packed = stream.num_packed, stream.packed
        kept = torch.zeros(n, dtype=torch.bool)
        if "exact_pos" in packed.buffers:
            positions = packed.buffers["exact_pos"].flatten().long()
            kept[positions[positions >= 0].cpu()] = True
        decode = torch.arange(12, n)[~kept[12:]]
        assert len(decode) > 0, f"no decode {what} was flushed and quantized"
        decoded = lm.method.dequantize(packed)[:, :, decode]
        if quantizes(name):
            assert 1e-3 < relative(decoded, exact[:, :, decode]) < 1.0, what
            codes = packed.nbytes - sum(packed.buffers[b].numel() * packed.buffers[b].element_size()
                                        for b in EXACT_BUFFERS if b in packed.buffers)
            assert codes < packed.num_tokens * exact[:, :, :1].numel() * 2  # < 16 bits a value
        else:
            assert torch.equal(decoded, exact[:, :, decode])


def _teacher_steps(model, cache, ids, teacher):
    """The prompt, then one teacher token per call (a generator: callers interleave two caches): last-token
    logits of each call."""
    with torch.no_grad():
        yield model(ids, cache=cache).logits[:, -1]
        for i in range(teacher.shape[1]):
            yield model(teacher[:, i:i + 1], cache=cache).logits[:, -1]


@pytest.mark.parametrize("name", METHODS)
def test_two_caches_of_one_method_instance_at_once(name, make_method, varied_tiny):
    """One method instance serving two caches, their calls interleaved (prefill A, prefill B, then a step of each
    in turn), gives bit for bit what two instances give, each alone: through the reference cache (teacher-forced
    logits) and the decode engine's static caches (greedy tokens)."""
    model, tokenizer = varied_tiny
    steps = 12  # both sequences cross a key flush (at 32 tokens) and value flushes
    prompts = [torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(n)) for n in (29, 23)]
    teachers = [torch.randint(0, 1000, (1, steps), generator=torch.Generator().manual_seed(n + 1)) for n in (29, 23)]
    alone = []
    for ids, teacher in zip(prompts, teachers):
        lm = KVModel(copy.deepcopy(model), tokenizer, make_method(name, residual_length=R), decode="eager")
        alone.append((torch.stack(list(_teacher_steps(lm.model, lm.new_cache(), ids, teacher))),
                      lm.engine.generate(ids, torch.ones_like(ids), steps, set())))
    shared = KVModel(copy.deepcopy(model), tokenizer, make_method(name, residual_length=R), decode="eager")
    runs = [_teacher_steps(shared.model, shared.new_cache(), ids, teacher) for ids, teacher in zip(prompts, teachers)]
    together = [[], []]
    for _ in range(steps + 1):
        for i, run in enumerate(runs):
            together[i].append(next(run))
    for (logits, _), mine in zip(alone, together):
        assert torch.equal(torch.stack(mine), logits)

    engines = [shared.engine, DecodeEngine(shared.model, shared.method, shared.backend, "eager")]
    slots, picked = [], []
    for engine, ids in zip(engines, prompts):  # prefill A, then B
        slot = engine._slot([0], engine.capacity(ids.shape[1], steps))
        slots.append(slot)
        picked.append([int(engine._prefill(ids, torch.ones_like(ids), slot.cache).argmax(-1))])
    for _ in range(steps - 1):
        for engine, slot, tokens in zip(engines, slots, picked):
            bind_cache(shared.model, slot.cache)
            if not slot.cache.decoding:
                slot.cache.begin_decode()
            slot.ids.fill_(tokens[-1])
            engine._decode_step(slot)
            slot.cache.advance()
            tokens.append(int(slot.picked))
    assert picked == [generated[0] for _, generated in alone]
