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
For the methods that keep tokens exactly (OTT's pool, RotateKV's sinks, OSCAR's sink prefix) the kept tokens are
the torch path's (same positions, same values) and the stored bytes are the torch path's but for their exact copies,
which the cupy cache keeps in its own layout (kernels.kept_tokens: counted as :func:`expected_kept_bytes` says).
The kernels run lane by lane on the emulator (tests/test_method_kernels_emulated.py's ``emulated_ops``); the GPU
half is tests/test_cupy_methods_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from test_kernels import ATTENTION_TOL, _rel, real_looking
from test_kernels_methods import assert_close_to_reference
from test_kernels_exact_methods import cuda_hadamard, rotary
from test_method_kernels_emulated import emulated_ops, emulator_libraries  # noqa: F401 (fixtures)

from kernels import method_layouts, ops, reference
from kernels.backend import CupyKVLayer
from kernels.reference import DECODE_REFERENCES
from methods.rotatekv import effective_head_group
from oscar import build_method
from oscar.cache import QuantizedKVLayer
from oscar.exact import EXACT_BUFFERS, restore_exact
from oscar.rope import rope_tables

#: (method, hyperparameters): a short window R so that a few dozen tokens cross several flushes
CONFIGS = [
    ("kivi", dict(group_size=32, residual_length=32)),
    ("quarot", dict(group_size=32, residual_length=32, flush="block", zero_point="float")),
    ("turboquant", dict(group_size=32, residual_length=32)),
    ("oscar", dict(group_size=32, residual_length=32)),
    # the methods that keep tokens exactly: OTT's pool fills and stops admitting, RotateKV's sinks (SINKS) pass P
    # during decoding (R = 48: a stage of values prepared before its keys flush, its sinks among them), OSCAR's window
    # policy flushes keys and values one token a step, its sink prefix of 40 tokens
    ("ott", dict(group_size=32, residual_length=32, pool_size=3)),
    ("rotatekv", dict(group_size=32, residual_length=48, head_group=2, num_sinks=4)),
    ("spectral", dict(group_size=64, residual_length=32, sink_tokens=40)),
]
#: more of their configurations (the GPU runs them too: tests/test_cupy_methods_gpu.py)
MORE_CONFIGS = [
    ("quarot", dict(group_size=32, residual_length=48, clip_ratio=0.9)),
    ("ott", dict(group_size=32, residual_length=64, scope="token", keep_values=False, flush="block")),
    ("rotatekv", dict(group_size=32, residual_length=48, num_sinks=3, flush="window")),
    ("spectral", dict(group_size=64, residual_length=48, sink_tokens=8, codebook="lloyd_max", flush="kivi")),
]
#: RotateKV's sinks per row (what its prefill hook would find; -1: none): some below the prompt's first flush, some
#: flushed during decoding
SINKS = [[0, 5, 33, 60], [1, 40, -1, -1], [2, 21, 30, 50]]
HKV, HQ, D = 2, 4, 64

def _ids(config):
    name, options = config
    return name + "".join(f"-{k}{v}" for k, v in options.items() if k != "group_size")


def prepared_method(name: str, options: dict, hkv: int, d: int, device):
    """The method as a loaded model would leave it (what its prepare_model sets): OSCAR with a random orthogonal K
    rotation, RotateKV with a Llama 3.1 rotary embedding, a random channel order and its head group."""
    method = build_method(name, **options)
    gen = torch.Generator().manual_seed(0)
    if name == "spectral":
        rotation = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
        method._k_rotation = rotation.float().unsqueeze(0).to(device)
    if name == "rotatekv":
        method._rotary, method._num_kv_heads = rotary(d).to(device), hkv
        method._group = effective_head_group(method.head_group, hkv)
        method._orders = [torch.randperm(hkv * d, generator=gen).to(device)]
    return method


def _channel_order(layer: CupyKVLayer):
    m = layer.method
    return layer.kernels.channel_order(m, 0, layer.heads * layer.head_dim)


def storage_in_reference_layout(layer: CupyKVLayer) -> tuple[dict, dict]:
    """The layer's whole storage converted to the layouts kernels.reference reads."""
    if layer.kernels.exact:
        keys = method_layouts._key_layout(layer.kernels.kernel, layer.keys_store, layer.method.k_bits,
                                          _channel_order(layer), inverse=True)
    elif layer.kernels.keys_per_channel:
        keys = ops.key_decode_layout(layer.keys_store, layer.method.k_bits, inverse=True)
    else:
        keys = ops.token_key_decode_layout(layer.keys_store, layer.method.k_bits, inverse=True)
    return keys, ops.value_decode_layout(layer.values_store, layer.method.v_bits, layer.group_size, inverse=True)


def reference_attention(layer: CupyKVLayer, q, scaling: float):
    """(fp64 reference, plain torch path in the model dtype) of the method's decode reference over the layer's own
    storage, windows and counts: [B, Hq, 1, D] float32."""
    m = layer.method
    kwargs = dict(k_bits=m.k_bits, v_bits=m.v_bits, group_size=layer.group_size, scaling=scaling)
    if layer.kernels.exact:
        kwargs["exact"] = layer.kept.buffers
    kernel = layer.kernels.kernel  # the kernel family (a renamed variant runs its family's reference)
    if kernel == "spectral":
        q = m.transform_query(q, 0)
        if m.codebook == "lloyd_max":
            kwargs["levels"] = m.reconstruction_levels()
    if kernel == "rotatekv":
        cos, sin = rope_tables(m._rotary, torch.arange(layer.capacity, device=q.device), layer.head_dim)
        kwargs.update(order=_channel_order(layer), head_group=m.grouped_heads, rope_cos=cos, rope_sin=sin)
    if kernel == "turboquant":
        d = q.shape[-1]
        kwargs.update(signs=m.signs(d, q.device), codebook=m.codebook(2, d).tolist())
    if kernel in ("kivi", "quarot", "ott"):
        kwargs["zero_point"] = m.zero_point
    keys, values = storage_in_reference_layout(layer)
    fn = DECODE_REFERENCES[kernel]
    counts = (layer.n_packed_dev, layer.n_res_dev)
    args = (q, keys, values, layer.key_residual, layer.value_residual, *counts)
    return fn(*args, dtype=torch.float64, **kwargs), fn(*args, dtype=q.dtype, **kwargs)


#: methods whose kernels write the torch path's codes bit for bit (their parameters too, up to CPU torch's division:
#: CUDA torch and the kernels multiply by the fp32 reciprocal, CPU torch divides, so a scale rarely rounds one bf16
#: ulp apart on the CPU); OScaR's and TurboQuant+'s fp32 norms sum in another order (an ulp, which can move a code)
EXACT_CODES = ("kivi", "quarot", "ott", "rotatekv")
#: the least fraction of equal code bytes otherwise: OSCAR's kernel multiplies by the fp32 reciprocal of its levels
#: as CUDA torch does (kernels.reference.spectral_quantize), where CPU torch divides (a code moves at a tie), and its
#: window keys come from the layer's matrix product over another batch shape than the torch path's
CODES_EQUAL = dict(spectral=0.995)


def assert_nearly_equal(got: torch.Tensor, want: torch.Tensor, exact_codes: bool, what, equal: float = 0.99):
    """``got`` == ``want`` but for rounding: a fraction >= ``equal`` of the elements bit-equal and the others within
    2% (with exact codes: all of them; else >= 99.9% of them, a moved code being a whole quantization step)."""
    got, want = got.float(), want.float()
    assert (got == want).float().mean() >= equal, (what, _worst(got, want, got == want))
    close = (got - want).abs() <= 0.02 * want.abs() + 1e-6
    assert close.all() if exact_codes else close.float().mean() >= 0.999, (what, _worst(got, want, close))


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what) -> None:
    """|got - want| <= bound elementwise (NaN nowhere), with the worst offender in the message."""
    ok = (got.double() - want.double()).abs() <= bound.double()
    assert ok.all(), (what, _worst(got, want, ok))


def _worst(got: torch.Tensor, want: torch.Tensor, ok: torch.Tensor) -> str:
    """Where ``ok`` fails: how many elements, the largest difference, its index and both values."""
    diff = torch.where(ok, 0.0, (got.double() - want.double()).abs().nan_to_num(float("inf")))
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return (f"{int((~ok).sum())} of {ok.numel()} elements off, the worst {float(diff[index]):.3g} at {index}: got "
            f"{float(got[index]):.6g}, want {float(want[index]):.6g} (NaN: got {int(got.isnan().sum())}, want "
            f"{int(want.isnan().sum())})")


def rounding_bound(want: torch.Tensor, dtype: torch.dtype, reference: torch.Tensor) -> torch.Tensor:
    """What one rounding of the model-dtype inputs can move a value computed from them: an ulp of the value plus an
    ulp of the scale of its inputs (``reference``: that scale, broadcast against ``want``): OSCAR's rotated keys come
    from the layer's matrix product over another batch shape than the torch path's, so an element can round one
    ulp apart, and every parameter of its group with it."""
    eps = torch.finfo(dtype).eps
    return 2 * eps * (want.double().abs() + reference.double().abs())


def assert_same_storage(layer: CupyKVLayer, torch_layer: QuantizedKVLayer, bit_for_bit: bool = False):
    """Token counts, stored bytes and the packed bytes of every row equal the torch path's (every buffer bit for
    bit with ``bit_for_bit``)."""
    exact = layer.kernels.kernel in EXACT_CODES
    assert layer.token_counts() == torch_layer.token_counts()
    assert layer.nbytes - layer.kept_nbytes == torch_layer.nbytes - torch_kept_bytes(torch_layer)
    assert layer.kept_nbytes == expected_kept_bytes(layer, torch_layer)
    for group in torch_layer.groups:
        for stream in ("keys", "values"):
            want = getattr(group, stream).packed
            if want is None:
                continue
            got = layer.packed(stream, group.rows.tolist(), 0, want.num_tokens)
            assert got.meta == want.meta and got.buffers.keys() == want.buffers.keys()
            for name, buf in want.buffers.items():
                what = (stream, name)
                if name in EXACT_BUFFERS:  # the same kept tokens, in another layout (padded per row and head)
                    (got_mask, got_kept), (want_mask, want_kept) = kept_view(got), kept_view(want)
                    assert torch.equal(got_mask, want_mask), what
                    if exact or stream == "values":  # values are kept as they came
                        assert torch.equal(got_kept, want_kept), (what, _worst(got_kept, want_kept,
                                                                               got_kept == want_kept))
                    else:  # OSCAR's rotated kept keys: an ulp of the element or of its token's scale
                        rms = want_kept.float().square().mean(-1, keepdim=True).sqrt()
                        assert_within(got_kept, want_kept, rounding_bound(want_kept, layer.dtype, rms), what)
                elif bit_for_bit:
                    assert torch.equal(got.buffers[name], buf), (what, _worst(got.buffers[name], buf,
                                                                              got.buffers[name] == buf))
                elif name == "codes" or (exact and name == "zero"):
                    same = (got.buffers[name] == buf).float().mean()
                    assert same == 1 if exact else same >= CODES_EQUAL.get(layer.kernels.kernel, 0.999), (what, same)
                elif name == "norm":  # fp32 / fp16 norms: summed in another order
                    torch.testing.assert_close(got.buffers[name], buf, rtol=2e-3, atol=0, msg=str(what))
                elif buf.dtype == torch.float32:  # OSCAR's fp32 (scale, zero) or Lloyd-Max (std, mean) per group
                    assert_within(got.buffers[name], buf, group_parameter_bound(want, stream, name, layer.dtype), what)
                else:  # scales: up to one ulp (bit for bit on the GPU)
                    assert_nearly_equal(got.buffers[name], buf, True, what, equal=0.9)


def group_parameter_bound(packed, stream: str, name: str, dtype: torch.dtype) -> torch.Tensor:
    """How far one of OSCAR's fp32 group parameters may be from the torch path's: keys (rotated in the model dtype
    by another matrix product) within :func:`rounding_bound` of the group's spread (the uniform quantizer's range
    scale * levels, Lloyd-Max's std), plus the fp32 sums of the group's mean and variance in another order
    (group_size ulps); values (stored as they came) only the latter."""
    buffers, g = packed.buffers, packed.meta["group_size"]
    spread = buffers["std"] if "std" in buffers else buffers["scale"] * ((1 << packed.meta["bits"]) - 1)
    want = buffers[name]
    bound = g * torch.finfo(torch.float32).eps * (want.double().abs() + spread.double())
    return bound + rounding_bound(want, dtype, spread) if stream == "keys" else bound


def kept_view(packed) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens of a PackedTensor: which (mask [b, H, n] bool) and their values ([b, H, n, D], zeros
    elsewhere)."""
    b, h, n, d = packed.shape
    pos = packed.buffers["exact_pos"][..., 0].long().expand(b, h, -1) - packed.start
    index = torch.where(pos < 0, torch.full_like(pos, n), pos)
    mask = torch.zeros(b, h, n + 1, dtype=torch.bool, device=pos.device).scatter_(2, index, True)[..., :n]
    zeros = torch.zeros(b, h, n, d, dtype=packed.dtype, device=pos.device)
    return mask, restore_exact(zeros, packed.buffers, packed.start)


def torch_kept_bytes(torch_layer: QuantizedKVLayer) -> int:
    """Bytes of the torch path's exact buffers (its kept tokens, padded per chunk, and their int32 positions)."""
    return sum(buf.numel() * buf.element_size() for g in torch_layer.groups for stream in (g.keys, g.values)
               if stream.packed is not None for name, buf in stream.packed.buffers.items() if name in EXACT_BUFFERS)


def expected_kept_bytes(layer: CupyKVLayer, torch_layer: QuantizedKVLayer) -> int:
    """What the cupy layer stores for the torch path's kept tokens: per (row, head) kept token a key once its key is
    packed and a value once its value is packed (model dtype), and per (row, head) an int32 count and the int32 skip
    words of its P packed tokens."""
    per_slot = layer.head_dim * torch.empty((), dtype=layer.dtype).element_size()
    total = sum(layer.heads * (4 + 4 * -(-p // 32)) for p in layer.n_packed) if layer.kernels.exact else 0
    for g in torch_layer.groups:
        if g.keys.packed is None or "exact_pos" not in g.keys.packed.buffers:
            continue
        pos = g.keys.packed.buffers["exact_pos"][..., 0].long().expand(len(g.rows), layer.heads, -1)
        total += int(((pos >= 0).sum() + ((pos >= 0) & (pos < g.values.num_packed)).sum()) * per_slot)
    return total


#: finish_step's rows (R = 32, stage 16): n_packed, n_residual, keys packed, values packed. Row 0 is due in both
#: streams at window index 0, row 1 in values only (index 7), row 2 in neither, row 3 parked (all zero), row 4 in
#: both at different indices (14 and 15)
FINISH_COUNTS = [[0, 32, 64, 0, 96], [33, 40, 32, 0, 48], [0, 40, 64, 0, 110], [0, 39, 64, 0, 111]]
FINISH_CASES = [(("values",), torch.bfloat16, 128), (("keys", "values"), torch.float16, 64),
                (("keys",), torch.bfloat16, 256)]


def check_finish_step(streams, dtype, d: int, device, seed: int = 0) -> None:
    """ops.finish_step (every in-step stream in one launch) against kernels.reference.finish_step on random windows
    and restored tokens: the windows bit for bit (the due rows' oldest unpacked token replaced, every other token as
    it was) and the counts (the due streams' packed counts advanced, the others untouched)."""
    b, h, rcap, stage, r = 5, 3, 48, 16, 32
    gen = torch.Generator().manual_seed(seed)
    windows = {s: torch.randn(b, h, rcap, d, generator=gen).to(dtype).to(device) for s in streams}
    restored = {s: torch.randn(b, h, stage, d, generator=gen).to(dtype).to(device) for s in streams}
    counts = torch.tensor(FINISH_COUNTS, dtype=torch.int32, device=device)
    want_windows, want_counts = {s: w.clone() for s, w in windows.items()}, counts.clone()
    reference.finish_step(want_windows, restored, want_counts, r)
    ops.finish_step(windows, restored, counts, r)
    assert torch.equal(counts, want_counts)
    for s in streams:
        assert torch.equal(windows[s].view(torch.int16), want_windows[s].view(torch.int16)), s
    due = {"keys": [0, 4], "values": [0, 1, 4]}
    before = torch.tensor(FINISH_COUNTS, dtype=torch.int32, device=device)
    for s in streams:  # the reference itself: the due rows advanced, the others not
        row = 2 if s == "keys" else 3
        assert (want_counts[row] - before[row]).nonzero().flatten().tolist() == due[s], s


@pytest.mark.parametrize("streams, dtype, d", FINISH_CASES, ids=lambda c: str(c))
def test_finish_step_kernel_equals_reference(emulated_ops, streams, dtype, d):
    check_finish_step(streams, dtype, d, "cpu")


def check_cache_against_torch_path(name: str, options: dict, device, dtype=torch.bfloat16, hkv: int = HKV,
                                   hq: int = HQ, d: int = D, strict: bool = False) -> None:
    """Rows of 37, 50 and 20 tokens (left pads poisoned with NaN): the prompt's attention (the layer's own, over its
    chunk) against SDPA over the torch path's tokens; then the decode steps through the step protocol,
    layer by layer against QuantizedKVLayer fed the same tokens: storage and stored tokens after every step (see
    :func:`assert_same_storage`; ``strict``: bit for bit where the method's codes are, as on the GPU), the kernel's
    attention against the method's decode reference every fourth step and at the last. Decoding runs 32 steps, or
    longer when R needs it: every row (the shortest has 20 tokens) fills its key window at least once."""
    method = prepared_method(name, options, hkv, d, device)
    pads, prompt = [13, 0, 30], 50
    steps = max(32, method.residual_length - (prompt - max(pads)) + 12)
    b = len(pads)
    layer = CupyKVLayer(method, 0, pads, capacity=128, engine=True)
    torch_layer = QuantizedKVLayer(method, 0, pad_lengths=pads)
    if name == "rotatekv":  # the sinks its prefill hook would find, in both caches' state
        for state in (layer.state, torch_layer.state):
            sinks = state.allocate(b, hkv, device)["sinks"]
            sinks[:, 0, :] = torch.tensor([row[:method.num_sinks] for row in SINKS], device=device)
    k = real_looking(b, hkv, prompt + steps, d, dtype, seed=1, device=device)
    v = real_looking(b, hkv, prompt + steps, d, dtype, seed=2, device=device) * 0.5
    for i, pad in enumerate(pads):  # never stored: poison them
        k[i, :, :pad] = float("nan")
        v[i, :, :pad] = float("nan")
    exact = strict and layer.kernels.kernel in EXACT_CODES
    scaling, checked = d**-0.5, 0
    want_k, want_v = torch_layer.update(k[:, :, :prompt], v[:, :, :prompt])
    layer.update(k[:, :, :prompt], v[:, :, :prompt])
    q = real_looking(b, hq, prompt, d, dtype, seed=99, device=device)
    module = AttentionStub(hq // hkv)
    prefill = layer.attend(module, q, None, scaling)  # attends the prompt, then flushes it
    want = sdpa_attention_forward(module, method.transform_query(q, 0), want_k, want_v,
                                  prefill_mask(pads, prompt, device), scaling=scaling)[0]
    for i, pad in enumerate(pads):  # the torch path's outputs of the real queries (pads: never used)
        torch.testing.assert_close(prefill[i, pad:], want[i, pad:], rtol=0.02, atol=0.02)
    layer.begin_decode(None)
    assert_same_storage(layer, torch_layer, exact)
    for step in range(steps):
        t = prompt + step
        want_k, want_v = torch_layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        for stream, want in (("keys", want_k), ("values", want_v)):  # every stored token as attention sees it
            got = stored_as_attended(layer, stream)
            for i, n in enumerate(layer.tokens):
                if exact:
                    assert torch.equal(got[i, :, :n], want[i, :, t - n:t]), step
                else:
                    assert_nearly_equal(got[i, :, :n], want[i, :, t - n:t], layer.kernels.kernel in EXACT_CODES,
                                        step)
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if step % 4 == 0 or step == steps - 1:
            q = real_looking(b, hq, 1, d, dtype, seed=100 + step, device=device) * 2.0
            references = reference_attention(layer, q, scaling)
            out = layer.attend(None, q, None, scaling)
            assert_close_to_reference(out.transpose(1, 2), *references)
            checked += 1
        layer.finish_step()
        layer.advance()
        assert_same_storage(layer, torch_layer, exact)
    assert checked == len(range(0, steps, 4)) + ((steps - 1) % 4 != 0)
    assert min(layer.keys_packed) > 0 and min(layer.values_packed) > 0
    if layer.kernels.exact:  # kept tokens staged, some of them attended from the exact slots
        assert int(layer.kept.buffers["count"].sum()) > 0


class AttentionStub:
    """What SDPA's transformers wrapper reads of an attention module."""

    is_causal = True

    def __init__(self, groups: int):
        self.num_key_value_groups = groups


def prefill_mask(pads: list[int], t: int, device) -> torch.Tensor:
    """The [B, 1, t, t] causal mask over a left-padded prompt (pad keys hidden; a pad query sees its own key)."""
    i = torch.arange(t, device=device)
    real = i.view(1, t) >= torch.tensor(pads, device=device).view(-1, 1)
    mask = (i.view(t, 1) >= i.view(1, t)) & real.view(-1, 1, t)
    return (mask | torch.eye(t, dtype=torch.bool, device=device)).unsqueeze(1)


def stored_as_attended(layer: CupyKVLayer, stream: str) -> torch.Tensor:
    """Every stored token of the layer as prefill attention reads it ([B, H, max tokens, D], row b's from index 0):
    the packed ones dequantized by the method, then the window."""
    b, h, d = layer.batch, layer.heads, layer.head_dim
    empty = torch.zeros(b, h, 0, d, dtype=layer.dtype, device=layer.device)
    keys, values = layer._stored_tokens(empty, empty, [0] * b, max(layer.tokens))
    return keys if stream == "keys" else values


@pytest.mark.parametrize("config", CONFIGS + MORE_CONFIGS, ids=_ids)
def test_cache_stores_and_attends_like_the_torch_path(emulated_ops, monkeypatch, config):
    """Prefill flushes (R=48: 48 keys packed and waiting in the window with 2 packed values), key windows filling
    during decoding (at 32, 48 or 64 tokens), the kernel's P passing a stage, the kivi policy's value flushed in
    every step past R; the block policy's keys and values together. OSCAR's decode tokens (each step's key and the
    queries attended) are rotated by ops.rotate_rows, its prefill chunks in torch."""
    rotated = []
    rotate_rows = emulated_ops.rotate_rows

    def counted(x, matrix, out=None):
        rotated.append(x.shape[2])
        return rotate_rows(x, matrix, out)

    monkeypatch.setattr(emulated_ops, "rotate_rows", counted)
    with cuda_hadamard("cpu"):  # RotateKV's Hadamard as CUDA torch and its kernels compute it
        check_cache_against_torch_path(*config, "cpu")
    assert set(rotated) == ({1} if config[0] == "spectral" else set()), rotated


#: the variants that read packed tokens back with a kernel (kernels/dequantize.cu, RotateKV's keys
#: kernels/rotatekv_keys.cu), each storage layout and zero point: OScaR's keys with their norms, KIVI's float zero
#: (kivi policy) and int zero at 4 bits, QuaRot's per-token keys, TurboQuant+'s codebook (per-token keys and value
#: tiles), OTT's (KIVI's layouts, its pool written over), RotateKV's (its sinks written over), OSCAR's fp32
#: parameters with either codebook (its sink prefix written over)
DEQUANTIZE_CONFIGS = [
    ("oscar", dict(group_size=32, residual_length=32)),
    ("kivi", dict(group_size=32, residual_length=32)),
    ("kivi", dict(group_size=32, residual_length=32, k_bits=4, v_bits=4, zero_point="int")),
    ("quarot", dict(group_size=32, residual_length=32, clip_ratio=0.9)),
    ("quarot", dict(group_size=32, residual_length=32, flush="block", zero_point="float", k_bits=4, v_bits=4)),
    ("turboquant", dict(group_size=32, residual_length=32)),
    ("ott", dict(group_size=32, residual_length=32, pool_size=3)),
    ("rotatekv", dict(group_size=32, residual_length=32, head_group=2, num_sinks=4)),
    ("spectral", dict(group_size=64, residual_length=32, sink_tokens=40)),
    ("spectral", dict(group_size=64, residual_length=32, sink_tokens=8, codebook="lloyd_max")),
]


def check_dequantize_kernel(name: str, options: dict, device, dtype=torch.bfloat16, hkv: int = HKV, d: int = D,
                            method=None, keys_values: tuple | None = None) -> None:
    """A prefill chunk's view of what the cache stored (3 rows of 80 real-looking tokens, or ``keys_values`` [3, H,
    80, D] each as a model made them for ``method``, prepared on that model), read by the variant's dequantize
    kernel (and, for the methods that keep tokens, those written over), equals the method's dequantize of the same
    tokens read back into the reference layout, bit for bit: spans of rows at token offsets inside a group, written
    into a strided view (token-major, as the prefill's buffers) of a NaN-poisoned buffer that stays poisoned around
    the span."""
    method = method or prepared_method(name, options, hkv, d, device)
    layer = CupyKVLayer(method, 0, None, capacity=128, engine=True)
    b, t = 3, 80
    if name == "rotatekv":  # the sinks its prefill hook would find
        sinks = layer.state.allocate(b, hkv, device)["sinks"]
        sinks[:, 0, :] = torch.tensor([row[:method.num_sinks] for row in SINKS], device=device)
    k, v = keys_values or (real_looking(b, hkv, t, d, dtype, seed=3, device=device),
                           real_looking(b, hkv, t, d, dtype, seed=4, device=device) * 0.5)
    layer.update(k, v)
    layer.attend(AttentionStub(2), real_looking(b, 2 * hkv, t, d, dtype, seed=5, device=device), None, d**-0.5)
    m = layer.method
    if layer.kernels.exact:
        assert layer.kept.kept_below([t] * b)[0] > 0, "no token kept: their overwrite is untested"
    for stream in ("keys", "values"):
        packed = min(layer.keys_packed if stream == "keys" else layer.values_packed)
        assert packed >= 48, (stream, packed)
        assert layer.kernels.reads_packed(stream), (stream, "no kernel reads the stream")
        for rows, start, n in (([0, 1, 2], 0, packed), ([2, 0], 5, packed - 21), ([1], 33, packed - 33)):
            want = m.dequantize(layer.packed(stream, rows, 0, packed)).to(dtype)[:, :, start:start + n]
            buf = torch.full((len(rows), n + 3, hkv, d), float("nan"), dtype=dtype, device=device)
            got = buf.transpose(1, 2)[:, :, 1:n + 1]
            assert layer._dequantized(stream, rows, [start] * len(rows), n, out=got) is got
            what = (stream, rows, start, n)
            assert torch.equal(got, want), (what, _worst(got, want, got == want))
            assert buf[:, 0].isnan().all() and buf[:, n + 1:].isnan().all(), what


@pytest.mark.parametrize("config", DEQUANTIZE_CONFIGS, ids=_ids)
def test_dequantize_kernel_equals_the_methods_dequantize(emulated_ops, config):
    with cuda_hadamard("cpu"):
        check_dequantize_kernel(*config, "cpu")


def model_keys_and_values(name: str, device, dtype=torch.bfloat16, **options):
    """(method, (K, V)): the method prepared on tiny-llama (RotateKV's head groups of its 2 KV heads, a random channel
    order; OSCAR's random rotations, its value rotation folded in) and the post-RoPE keys and values [3, 2, 80, 64]
    the model's first layer makes for random tokens, as a cache receives them."""
    from transformers import DynamicCache

    model = tiny_model("tiny-llama", dtype, device)
    extra = dict(rotatekv=dict(head_group=2, num_sinks=4), spectral=dict(group_size=64, sink_tokens=40))
    method = build_method(name, **{**model_options(name, model), **extra[name], **options})
    method.prepare_model(model)
    if name == "rotatekv":
        method._orders = [torch.randperm(HKV * D, generator=torch.Generator().manual_seed(i)).to(device)
                          for i in range(model.config.num_hidden_layers)]
    ids = torch.randint(0, 1000, (3, 80), generator=torch.Generator().manual_seed(0)).to(device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    return method, (cache.layers[0].keys, cache.layers[0].values)


@pytest.mark.parametrize("name, options", [("rotatekv", {}), ("spectral", dict(codebook="lloyd_max")),
                                           ("spectral", {})],
                         ids=["rotatekv", "spectral-lloyd_max", "spectral"])
def test_dequantize_kernel_reads_a_models_keys_and_values(emulated_ops, name, options):
    """The prefix read of real model K/V (tiny-llama's, post-RoPE: RotateKV's kernels undo and re-apply the model's
    own RoPE) equals the method's dequantize bit for bit."""
    method, keys_values = model_keys_and_values(name, "cpu", **options)
    with cuda_hadamard("cpu"):
        check_dequantize_kernel(name, {}, "cpu", method=method, keys_values=keys_values)


def tiny_model(name: str, dtype, device="cpu", **overrides):
    """A registry tiny model (tiny-llama: 4 query / 2 KV heads, head_dim 64; ``overrides`` of its config) with
    weights of std 0.1 (logits that vary step to step)."""
    from tests.conftest import build_tiny

    model = build_tiny(name, **overrides).to(device)
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.1)
    return model.to(dtype)


def _engine_logits(model, method, ids, mask, teacher, chunk: int | None = None):
    """Per-step logits [B, S, V] through the decode engine's static cache and step protocol (eager): the prompt's
    last token (prefilled in ``chunk``-token chunks), then one teacher token per step; and the cache."""
    from kernels.backend import CupyBackend
    from oscar.cache import cache_argument
    from oscar.engine import DecodeEngine

    engine = DecodeEngine(model, method, CupyBackend(), "eager", prefill_chunk=chunk)
    pads = (mask == 0).long().cumprod(-1).sum(-1).tolist()
    slot = engine._slot(pads, engine.capacity(ids.shape[1], teacher.shape[1] + 1))
    cache = slot.cache
    logits = [engine._prefill(ids, mask, cache)]
    cache.begin_decode()
    with torch.no_grad():
        for i in range(teacher.shape[1]):  # engine._step with the logits kept
            slot.ids.copy_(teacher[:, i:i + 1])
            cache.prepare_step()
            out = model(input_ids=slot.ids, position_ids=cache.lengths.view(-1, 1), attention_mask=cache.decode_mask(),
                        logits_to_keep=1, **cache_argument(model, cache))
            cache.finish_step()
            cache.advance()
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1).float(), cache


def check_model_against_torch_path(name: str, engine: bool, model, monkeypatch, chunk: int | None = None) -> None:
    """A left-padded batch (50 and 30 prompt tokens) and 20 teacher-forced decode steps (key windows filling at
    64 and 32 tokens, values flushed every step past R) in bf16: the per-step logits of the cupy cache (the
    engine's step protocol, or transformers-style calls that flush inside attention and grow the storage) differ
    from the torch path's by at most 2x what changing only the torch path's attention arithmetic (SDPA in fp32
    over the same bf16 keys and values) moves them, plus a small tolerance; token counts and stored bytes equal.
    ``chunk``: both prefill the prompt in chunks of that many tokens (each chunk attends to the earlier ones as
    stored: quantized where the policy packed them).
    (Against an fp32 model the gap is set by quantization codes that flip with the activations' rounding.)"""
    import oscar.attention
    from test_engine import _teacher_forced_logits

    from kernels.backend import CupyBackend
    from oscar.attention import attach
    from oscar.cache import QuantizedKVCache

    method = build_method(name, **model_options(name, model))
    ids = torch.randint(0, 1000, (2, 50), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    teacher = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(2))
    ids, mask, teacher = ids.to(model.device), mask.to(model.device), teacher.to(model.device)
    method.prepare_model(model)
    attach(model, method)
    torch_cache = QuantizedKVCache.for_model(model, method, mask)
    torch_path = _teacher_forced_logits(model, torch_cache, ids, mask, teacher, chunk).float()
    sdpa = oscar.attention.sdpa_attention_forward

    def sdpa_fp32(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(query.dtype), weights

    with monkeypatch.context() as patch:
        patch.setattr(oscar.attention, "sdpa_attention_forward", sdpa_fp32)
        fp32_attention = _teacher_forced_logits(model, QuantizedKVCache.for_model(model, method, mask), ids, mask,
                                                teacher, chunk).float()
    if engine:
        got, cupy_cache = _engine_logits(model, method, ids, mask, teacher, chunk)
    else:
        cupy_cache = CupyBackend().new_cache(model, method, mask)
        got = _teacher_forced_logits(model, cupy_cache, ids, mask, teacher, chunk).float()
        assert cupy_cache.layers[0].capacity > 32  # grown from one window
    for layer in range(model.config.get_text_config().num_hidden_layers):
        assert cupy_cache.token_counts(layer) == torch_cache.token_counts(layer)
        assert cupy_cache.layers[layer].kept_nbytes == expected_kept_bytes(cupy_cache.layers[layer],
                                                                           torch_cache.layers[layer])
    kept = sum(layer.kept_nbytes for layer in cupy_cache.layers)
    with HostReads() as reads:  # the kept bytes of every layer summed on the device, read once
        stored = cupy_cache.nbytes
    assert stored == sum(layer.nbytes for layer in cupy_cache.layers)
    assert stored - kept == torch_cache.nbytes - sum(map(torch_kept_bytes, torch_cache.layers))
    assert (kept > 0) == (name in ("ott", "rotatekv", "spectral")) == (reads.count == 1), reads.count
    err_cupy, noise = _rel(got, torch_path), _rel(fp32_attention, torch_path)
    assert err_cupy <= 2 * noise + 1e-3, (err_cupy, noise)


class HostReads(TorchDispatchMode):
    """Counts the device-to-host scalar reads (``int(tensor)``, ``tensor.item()``) run inside it."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten._local_scalar_dense
        return func(*args, **(kwargs or {}))


def model_options(name: str, model) -> dict:
    """G = 32 and R = 32 (a few dozen tokens cross several flushes); OTT's pool of 4, RotateKV without a
    calibration file (its sinks from its prefill hook), OSCAR with random rotations of the model's shape and a
    16-token sink prefix."""
    from benchmarks.harness import random_spectral_calibration

    extra = dict(ott=lambda: dict(pool_size=4), rotatekv=lambda: dict(reorder=False),
                 spectral=lambda: dict(sink_tokens=16, calibration=random_spectral_calibration(model)))
    return dict(group_size=32, residual_length=32, **extra.get(name, dict)())


@pytest.mark.parametrize("name, engine, chunk", [
    ("kivi", False, None), ("oscar", True, 16), ("kivi", True, None), ("quarot", True, None),
    ("turboquant", True, 16), ("ott", True, None), ("rotatekv", False, 16), ("spectral", True, 16),
])
def test_tiny_model_decodes_like_the_torch_path(emulated_ops, monkeypatch, name, engine, chunk):
    check_model_against_torch_path(name, engine, tiny_model("tiny-llama", torch.bfloat16), monkeypatch, chunk)


@pytest.mark.parametrize("name", ["oscar", "kivi", "rotatekv", "quarot", "turboquant", "ott"])
def test_benchmarks_fill_what_a_prefill_leaves(emulated_ops, name):
    """benchmarks.filled.fill(): each method's cache holds the torch path's token counts and stored bytes
    after 300 tokens (R=128: keys packed to 256, kivi-policy values to 172 with 12 of them waiting in the window;
    OSCAR's R=256: 44 of each), plausible stored tokens (finite, spread), and the engine decodes from it through the
    kernels. The kept tokens are each row's first ones as the slots hold (OSCAR's 44 packed ones of its prefix, as
    the torch path keeps; OTT's pool full and RotateKV's 20 sinks, where a prompt's would be elsewhere: their bytes
    are then compared but for the kept tokens)."""
    from benchmarks.filled import fill
    from benchmarks.harness import bench_method
    from kernels.backend import CupyBackend
    from oscar.attention import attach
    from oscar.engine import DecodeEngine

    model = tiny_model("tiny-llama", torch.bfloat16)
    method = bench_method(name, model)
    method.prepare_model(model)
    attach(model, method)
    engine = DecodeEngine(model, method, CupyBackend(), "eager")
    context, b = 300, 2
    slot = fill(engine, b, context, engine.capacity(context, 8))
    torch_layer = QuantizedKVLayer(method, 0)
    torch_layer.update(real_looking(b, HKV, context, D, torch.bfloat16, seed=3, device="cpu"),
                       real_looking(b, HKV, context, D, torch.bfloat16, seed=4, device="cpu"))
    for layer in slot.cache.layers:
        assert layer.token_counts() == torch_layer.token_counts()
        assert layer.nbytes - layer.kept_nbytes == torch_layer.nbytes - torch_kept_bytes(torch_layer)
        if name in ("ott", "rotatekv"):
            assert layer.kept.buffers["count"].tolist() == [[layer.kernels.slots(method)] * HKV] * b
        else:
            assert layer.kept_nbytes == expected_kept_bytes(layer, torch_layer)
    for x in (stored_as_attended(slot.cache.layers[0], "keys"), stored_as_attended(slot.cache.layers[0], "values")):
        assert torch.isfinite(x).all() and 1e-3 < x.float().std() < 1e3
    first = torch.tensor([5, 7])
    tokens = engine.decode(slot, first, 3, eos_token_ids=set())
    assert [len(row) for row in tokens] == [3, 3]
    keys_packed = method.flush_policy.keys_packed(context + 2)
    assert slot.cache.layers[0].token_counts()["keys_residual"] == b * (context + 2 - keys_packed)


@pytest.mark.parametrize("config", [DEQUANTIZE_CONFIGS[0], DEQUANTIZE_CONFIGS[6]], ids=_ids)
def test_allocated_bytes_follow_a_grown_storage(emulated_ops, config):
    """allocated_bytes, summed once and kept, is summed again when the storage grows (a cache outside the engine
    doubles its capacity): it always equals the bytes of the layer's buffers now, the kept tokens' included."""
    method = prepared_method(*config, HKV, D, "cpu")
    layer = CupyKVLayer(method, 0, None, capacity=64)

    def held() -> int:
        return sum(t.numel() * t.element_size() for t in layer.static_tensors())

    layer.update(real_looking(2, HKV, 80, D, torch.bfloat16, seed=3, device="cpu"),
                 real_looking(2, HKV, 80, D, torch.bfloat16, seed=4, device="cpu"))
    first, capacity = layer.allocated_bytes, layer.capacity
    assert first == held() > 0 and layer.allocated_bytes == first
    layer.reserve(4 * capacity)
    assert layer.capacity > capacity
    assert layer.allocated_bytes == held() > first
