"""backend=cupy's cache (kernels/backend.py) for every method with kernels, on the CPU emulator against the torch
path: the reference cache (oscar.cache.QuantizedKVCache) fed the same tokens, and the method's decode reference.

Layer by layer (direct cache calls with real-looking K/V, a left-padded batch of per-row lengths, prefill then
decode steps through the engine's step protocol: update/attend/finish_step in the step, advance between steps):
at every step the token counts, the stored bytes (``nbytes``), the packed bytes (read back into the reference
layout) and every stored token as attention sees it equal the torch path's, so each flush happens when the policy
says (``kivi``: keys every R tokens, values one a step once R are held; ``block``: both every R); the kernel's
attention over the cache is within 2x the plain torch path's error of the fp64 reference plus a small tolerance.
A tiny random-weight model then decodes through the engine's protocol (and through transformers-style calls
without the engine) with per-step logits as close to an fp32 reference as the torch path's.
The kernels run lane by lane on the emulator (tests/test_method_kernels_emulated.py's ``emulated_ops``); the GPU
half is tests/test_cupy_methods_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import ATTENTION_TOL, _rel, real_looking
from test_kernels_methods import assert_close_to_reference
from test_kernels import _host_source as quantize_host_source
from test_kernels import emulator_builder
from test_method_kernels_emulated import DECODE_LAUNCHERS, QUANT_LAUNCHERS, emulated_ops  # noqa: F401 (fixture)

from kernels import ops
from kernels.backend import CupyKVLayer
from kernels.reference import DECODE_REFERENCES
from oscar import build_method
from oscar.cache import QuantizedKVLayer

#: (method, hyperparameters): a short window R so that a few dozen tokens cross several flushes
CONFIGS = [
    ("kivi", dict(group_size=32, residual_length=32)),
    ("quarot", dict(group_size=32, residual_length=48, clip_ratio=0.9)),
    ("quarot", dict(group_size=32, residual_length=32, flush="block", zero_point="float")),
    ("turboquant", dict(group_size=32, residual_length=32)),
    ("oscar", dict(group_size=32, residual_length=32)),
]
HKV, HQ, D = 2, 4, 64

#: the cache's other launches: the window append and the prefill's key rotation
CACHE_LAUNCHERS = r"""
extern "C" void launch_append_residual(unsigned gx, unsigned bx, unsigned long long smem, const u16* k, const u16* v,
                                       u16* kr, u16* vr, const int* n_res, int B, int H, int rcap, int rotate,
                                       float isd) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { append_residual(k, v, kr, vr, n_res, B, H, rcap, rotate, isd); });
}
extern "C" void launch_hadamard_rows(unsigned gx, unsigned bx, unsigned long long smem, const u16* x, u16* y,
                                     long long rows, float isd) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { hadamard_rows(x, y, rows, isd); });
}
"""


@pytest.fixture(scope="module")
def emulator_libraries(tmp_path_factory):
    """source file -> (defines -> ctypes library with a launch_<kernel> function per kernel the cache calls)."""
    from test_decode_emulated import _host_source as decode_host_source

    return {"quantize.cu": emulator_builder(tmp_path_factory.mktemp("emu_cache_quant"),
                                            quantize_host_source() + QUANT_LAUNCHERS + CACHE_LAUNCHERS),
            "decode_attention.cu": emulator_builder(tmp_path_factory.mktemp("emu_cache_decode"),
                                                    decode_host_source(wrapper=DECODE_LAUNCHERS))}


def _ids(config):
    name, options = config
    return name + "".join(f"-{k}{v}" for k, v in options.items() if k != "group_size")


def storage_in_reference_layout(layer: CupyKVLayer) -> tuple[dict, dict]:
    """The layer's whole storage converted to the layouts kernels.reference reads."""
    if layer.kernels.keys_per_channel:
        keys = ops.key_decode_layout(layer.keys_store, layer.method.k_bits, inverse=True)
    else:
        keys = ops.token_key_decode_layout(layer.keys_store, layer.method.k_bits, inverse=True)
    return keys, ops.value_decode_layout(layer.values_store, layer.method.v_bits, layer.method.group_size,
                                         inverse=True)


def reference_attention(layer: CupyKVLayer, q, scaling: float):
    """(fp64 reference, plain torch path in the model dtype) of the method's decode reference over the layer's own
    storage, windows and counts: [B, Hq, 1, D] float32."""
    m = layer.method
    kwargs = dict(k_bits=m.k_bits, v_bits=m.v_bits, group_size=m.group_size, scaling=scaling)
    if m.name == "turboquant":
        kwargs.update(signs=m.signs(D), codebook=m.codebook(2, D).tolist())
    if m.name in ("kivi", "quarot"):
        kwargs["zero_point"] = m.zero_point
    keys, values = storage_in_reference_layout(layer)
    fn = DECODE_REFERENCES[m.name]
    counts = (layer.n_packed_dev, layer.n_res_dev)
    args = (q, keys, values, layer.key_residual, layer.value_residual, *counts)
    return fn(*args, dtype=torch.float64, **kwargs), fn(*args, dtype=q.dtype, **kwargs)


#: methods whose kernels write the torch path's codes bit for bit (their parameters too, up to CPU torch's division:
#: CUDA torch and the kernels multiply by the fp32 reciprocal, CPU torch divides, so a scale rarely rounds one bf16
#: ulp apart on the CPU); OScaR's and TurboQuant+'s fp32 norms sum in another order (an ulp, which can move a code)
EXACT_CODES = ("kivi", "quarot")


def assert_nearly_equal(got: torch.Tensor, want: torch.Tensor, exact_codes: bool, what, equal: float = 0.99):
    """``got`` == ``want`` but for rounding: a fraction >= ``equal`` of the elements bit-equal and the others within
    2% (with exact codes: all of them; else >= 99.9% of them, a moved code being a whole quantization step)."""
    got, want = got.float(), want.float()
    assert (got == want).float().mean() >= equal, what
    close = ((got - want).abs() <= 0.02 * want.abs() + 1e-6).float().mean()
    assert close == 1 if exact_codes else close >= 0.999, (what, close)


def assert_same_storage(layer: CupyKVLayer, torch_layer: QuantizedKVLayer):
    """Token counts, stored bytes and the packed bytes of every row equal the torch path's."""
    exact = layer.method.name in EXACT_CODES
    assert layer.token_counts() == torch_layer.token_counts()
    assert layer.nbytes == torch_layer.nbytes
    for group in torch_layer.groups:
        for stream in ("keys", "values"):
            want = getattr(group, stream).packed
            if want is None:
                continue
            got = layer.packed(stream, group.rows.tolist(), 0, want.num_tokens)
            assert got.meta == want.meta and got.buffers.keys() == want.buffers.keys()
            for name, buf in want.buffers.items():
                if name == "codes" or (exact and name == "zero"):
                    same = (got.buffers[name] == buf).float().mean()
                    assert same == 1 if exact else same >= 0.999, (stream, name, same)
                elif name == "norm":  # fp32 / fp16 norms: summed in another order
                    torch.testing.assert_close(got.buffers[name], buf, rtol=2e-3, atol=0, msg=str((stream, name)))
                else:  # scales: up to one ulp (bit for bit on the GPU)
                    assert_nearly_equal(got.buffers[name], buf, True, (stream, name), equal=0.9)


@pytest.fixture
def cache_ops(emulated_ops, monkeypatch):
    """The emulated kernels.ops with combine blocks of head_dim threads (the emulator runs one OS thread per CUDA
    thread: 512-thread combine blocks would dominate the run; the combine at 512 is the kernel tests')."""
    monkeypatch.setattr(ops, "COMBINE_THREADS", D)
    return emulated_ops


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_cache_stores_and_attends_like_the_torch_path(cache_ops, config):
    """Rows of 37, 50 and 20 tokens (left pads poisoned with NaN), then 32 decode steps: prefill flushes (R=48: 48
    keys packed and waiting in the window with 2 packed values), key windows filling during decoding (at 32, 48 or
    64 tokens), the kernel's P passing a stage, the kivi policy's value flushed in every step past R; the block
    policy's keys and values together. The attention is checked every fourth step and at the last."""
    name, options = config
    method = build_method(name, **options)
    dtype, pads, prompt, steps = torch.bfloat16, [13, 0, 30], 50, 32
    b = len(pads)
    layer = CupyKVLayer(method, 0, pads, capacity=128, engine=True)
    torch_layer = QuantizedKVLayer(method, 0, pad_lengths=pads)
    k = real_looking(b, HKV, prompt + steps, D, dtype, seed=1, device="cpu")
    v = real_looking(b, HKV, prompt + steps, D, dtype, seed=2, device="cpu") * 0.5
    for i, pad in enumerate(pads):  # never stored: poison them
        k[i, :, :pad] = float("nan")
        v[i, :, :pad] = float("nan")
    torch_layer.update(k[:, :, :prompt], v[:, :, :prompt])
    layer.update(k[:, :, :prompt], v[:, :, :prompt])
    layer.begin_decode(None)
    assert_same_storage(layer, torch_layer)
    scaling, checked = D**-0.5, 0
    for step in range(steps):
        t = prompt + step
        old_k, old_v = layer._dense_old()
        want_k, want_v = torch_layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        for got, want in ((old_k, want_k[:, :, :-1]), (old_v, want_v[:, :, :-1])):  # every stored token
            assert_nearly_equal(got, want, name in EXACT_CODES, step)
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if step % 4 == 0 or step == steps - 1:
            q = real_looking(b, HQ, 1, D, dtype, seed=100 + step, device="cpu") * 2.0
            references = reference_attention(layer, q, scaling)
            out = layer.attend(None, q, None, scaling)
            assert_close_to_reference(out.transpose(1, 2), *references)
            checked += 1
        layer.finish_step()
        layer.advance()
        assert_same_storage(layer, torch_layer)
    assert checked == 9 and min(layer.keys_packed) > 0 and min(layer.values_packed) > 0
