"""OTT, RotateKV and OSCAR (spectral) CuPy kernels against their torch references on the GPU.

Marked ``gpu`` (skipped without CUDA and CuPy); one call runs them all in a few minutes:

    pytest -m gpu tests/test_kernels_exact_methods.py

Each cache is filled by the method's own torch quantizer (what backend=cupy flushes with for these methods),
converted to the decode layouts (OTT: KIVI's, RotateKV: codes permuted into the channel order before its
permutation, OSCAR: the per-token key layout with fp32 parameters), with the exactly kept tokens (OTT's pooled
outliers, RotateKV's sinks, OSCAR's sink prefix) in kernels.method_layouts.empty_exact and their packed copies
skipped. Decode attention: error against the fp64 reference of kernels.reference within 2x the plain torch path's
error in the same dtype plus a small tolerance, per sequence; bf16 and fp16, head_dim 64/128/256, 1-8 query heads
per KV head, batch > 1 with per-sequence lengths, forced and heuristic splits, outputs and partials poisoned with
NaN before every launch; a CUDA-graph replay equals the eager call bit for bit; the kept tokens count once (from
the exact buffer, never from their poisoned packed copies). OSCAR's quantizer kernel: bytes equal to the method's own
on the GPU. The helpers here also build the caches of the CPU-emulated tests (tests/test_exact_kernels_emulated.py).
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
from test_kernels import DTYPES, gpu, real_looking
from test_kernels_methods import assert_close_to_reference

from kernels import ops
from kernels.method_layouts import empty_exact, rotatekv_key_layout, rotatekv_rope, rotatekv_tables, skip_words
from kernels.reference import DECODE_REFERENCES
from oscar import build_method
from oscar.exact import keep_exact
from oscar.method import TokenSpan
from oscar.quant import PackedTensor
from oscar.rope import apply_rope, rope_tables

#: the RoPE of the RotateKV caches: Llama 3.1's (theta 500000, llama3 scaling), any head_dim
LLAMA3_ROPE = dict(rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))


def rotary(head_dim: int):
    """A Llama 3.1 rotary embedding of this head_dim (the module RotateKV finds in a model)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
                         **LLAMA3_ROPE)
    return LlamaRotaryEmbedding(config)


@contextlib.contextmanager
def cuda_hadamard(device):
    """On the CPU, RotateKV's grouped-head Hadamard with CUDA torch's arithmetic (the product with fp32(1 / sqrt(g D))
    where CPU torch divides by sqrt(g D): kernels.reference._hadamard_fp32), the arithmetic RotateKV's kernels
    reproduce, so that they equal the method's torch code bit for bit there too; the method as it is on a GPU."""
    import methods.rotatekv
    from kernels.reference import _hadamard_fp32

    with contextlib.ExitStack() as stack:
        if torch.device(device).type == "cpu":
            stack.enter_context(mock.patch.object(methods.rotatekv, "hadamard", _hadamard_fp32))
        yield


def exact_method(name: str, hkv: int, d: int, kb: int, vb: int, g: int, device, seed: int = 0, **options):
    """The method as a loaded model would leave it: OSCAR with a random orthogonal K rotation, RotateKV with the
    rotary embedding, a random channel permutation (``order``; None = reorder=false) and its head group (what
    prepare_model sets from the model and the calibration)."""
    gen = torch.Generator().manual_seed(seed)
    if name == "ott":
        return build_method("ott", k_bits=kb, v_bits=vb, group_size=g, residual_length=max(g, 32), **options)
    if name == "spectral":
        m = build_method("spectral", k_bits=kb, v_bits=vb, group_size=g, **options)
        rotation = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
        m._k_rotation = rotation.float().unsqueeze(0).to(device)
        return m
    head_group = options.pop("head_group", 1)
    order = options.pop("order", "random")
    m = build_method("rotatekv", k_bits=kb, v_bits=vb, group_size=g, head_group=head_group,
                     reorder=order is not None, **options)
    m._rotary, m._group, m._num_kv_heads = rotary(d).to(device), head_group, hkv
    if order is not None:
        m._orders = [torch.randperm(hkv * d, generator=gen).to(device)]
    return m


def _order(m, hkv: int, d: int, device) -> torch.Tensor:
    return m._orders[0] if getattr(m, "_orders", None) else torch.arange(hkv * d, device=device)


def _place_exact(exact: dict, i: int, m, pk, pv, n: int) -> None:
    """Row i of the exact storage from a chunk's ``exact``/``exact_pos`` buffers (oscar.exact) of keys and values:
    the kept tokens in the slots, their counts per head, their skip bits (values the method does not keep, OTT's
    with keep_values=false: their dequantization, what the torch path attends)."""
    keys = pk.buffers
    h, d = exact["keys"].shape[1], exact["keys"].shape[3]
    pos = keys["exact_pos"][0, :, :, 0].expand(h, -1)  # [H, S]; -1 = padding (between chunks too)
    count = (pos >= 0).sum(-1)
    s = keys["exact"].shape[2]
    if s:
        first = torch.argsort((pos < 0).to(torch.int8), dim=-1, stable=True)  # each head's kept tokens first
        at = first.unsqueeze(-1).expand(h, s, d)
        exact["keys"][i, :, :s] = keys["exact"][0].gather(1, at)
        if "exact" in pv.buffers:
            exact["values"][i, :, :s] = pv.buffers["exact"][0].gather(1, at)
        else:
            restored = m.dequantize(pv)[0]  # [H, n, D]
            kept = pos.gather(1, first)
            exact["values"][i, :, :s] = (restored.gather(1, kept.clamp(min=0).long().unsqueeze(-1).expand(h, s, d))
                                         * (kept >= 0).unsqueeze(-1))
    exact["count"][i] = count.to(torch.int32)
    mask = torch.zeros(h, exact["skip"].shape[-1] * 32, dtype=torch.bool, device=pos.device)
    for head in range(h):
        mask[head, pos[head][pos[head] >= 0].long()] = True
    assert not mask[:, n:].any()
    exact["skip"][i] = skip_words(mask)


def _to_storage(store: dict, buffers: dict, i: int, n: int, per_channel: bool, g: int) -> None:
    for name, buf in buffers.items():
        name = {"std": "scale", "mean": "zero"}.get(name, name)
        if name in store:
            store[name][i, :, :n // g if per_channel and name in ("scale", "zero") else n] = buf[0]


def kernel_layout(name: str, m, keys: dict, values: dict, kb: int, vb: int, g: int, order) -> tuple[dict, dict]:
    """Reference-layout storage -> the layouts decode_attention (and rotatekv.cu) read."""
    if name == "ott":
        keys = ops.key_decode_layout(keys, kb)
    elif name == "spectral":
        keys = ops.token_key_decode_layout(keys, kb)
    else:
        keys = rotatekv_key_layout(keys, kb, order)
    return {k: v.contiguous() for k, v in keys.items()}, ops.value_decode_layout(values, vb, g)


def make_exact_cache(name: str, lengths, residuals, hkv: int, d: int, kb: int, vb: int, g: int, rcap: int, dtype,
                     data_seed: int, device="cuda", sinks=(0, 3, 40), **options):
    """Per-sequence packed storage of real-looking K/V quantized by the method's own torch quantizer, one chunk per
    sequence, with its exact tokens. RotateKV's keys are real-looking pre-RoPE keys turned post-RoPE at their
    positions (what the cache receives), its sinks the positions ``sinks`` below the packed length.

    Returns dict(store (kernel keys, values), ref (reference keys, values), k_res, v_res, counts (n_packed,
    n_residual), exact, kernel (decode_attention keywords), reference (keywords of the reference), method,
    query (query transform: OSCAR's rotation, else the identity))."""
    m = exact_method(name, hkv, d, kb, vb, g, device, seed=data_seed, **options)
    gq = m.group(d) if name == "spectral" else g
    b, tok = len(lengths), ops.stage_tokens(name, gq)
    cap = max(tok, 16, math.ceil(max(lengths) / tok) * tok)
    keys, values = ops.empty_storage(name, b, hkv, cap, d, k_bits=kb, v_bits=vb, group_size=gq, dtype=dtype,
                                     device=device)
    ref_keys, ref_values = ops.empty_storage(name, b, hkv, cap, d, k_bits=kb, v_bits=vb, group_size=gq, dtype=dtype,
                                             device=device)
    for store in (keys, values, ref_keys, ref_values):
        for buf in store.values():  # unused slots: finite but wrong values
            buf.zero_() if buf.dtype == torch.uint8 else buf.fill_(1.0)
    ecap = dict(ott=getattr(m, "pool_size", 0), spectral=getattr(m, "sink_tokens", 0),
                rotatekv=getattr(m, "num_sinks", 0))[name]
    exact = empty_exact(b, hkv, max(ecap, 1), d, cap, dtype, device)
    k_res = torch.zeros(b, hkv, rcap, d, dtype=dtype, device=device)
    v_res = torch.zeros_like(k_res)
    positions = torch.arange(cap + rcap, device=device)
    cos, sin = (rope_tables(m._rotary, positions, d) if name == "rotatekv" else (None, None))
    for i, (n, r) in enumerate(zip(lengths, residuals)):
        k = real_looking(1, hkv, n + r, d, dtype, seed=data_seed + i, device=device)
        v = real_looking(1, hkv, n + r, d, dtype, seed=data_seed + 100 + i, device=device) * 0.5
        state = m.new_state(1, hkv, device)
        if name == "rotatekv":
            k = apply_rope(k.float(), cos[:n + r], sin[:n + r]).to(dtype)
            chosen = torch.tensor([p for p in sinks if p < n][:m.num_sinks], dtype=torch.long)
            state["sinks"][0, 0, :len(chosen)] = chosen.to(device)
        span = TokenSpan(torch.arange(1, device=device), 0, state)
        if n:
            pk, pv = m.quantize_keys(k[:, :, :n], 0, span), m.quantize_values(v[:, :, :n], 0, span)
            for store in (keys, ref_keys):
                _to_storage(store, pk.buffers, i, n, name == "ott", gq)
            for store in (values, ref_values):
                _to_storage(store, pv.buffers, i, n, False, gq)
            _place_exact(exact, i, m, pk, pv, n)
        k_res[i, :, :r] = m.transform_key(k[:, :, n:], 0)[0]
        v_res[i, :, :r] = v[0, :, n:]
    counts = (torch.tensor(lengths, dtype=torch.int32, device=device),
              torch.tensor(residuals, dtype=torch.int32, device=device))
    common = dict(k_bits=kb, v_bits=vb, group_size=gq, scaling=1 / math.sqrt(d), exact=exact)
    kernel_kwargs, ref_kwargs = dict(common, method=name), dict(common)
    order = _order(m, hkv, d, device)
    if name == "ott" and "zero_point" in options:
        kernel_kwargs["zero_point"] = ref_kwargs["zero_point"] = options["zero_point"]
    if name == "spectral" and m.codebook == "lloyd_max":
        levels = m._levels(device)[1]
        kernel_kwargs["affine"] = ops.affine_levels(levels.tolist())
        ref_kwargs["levels"] = levels
    if name == "rotatekv":
        anchors = rope_tables(m._rotary, torch.arange(0, cap, ops.ROPE_RUN, device=device), d)
        first = rope_tables(m._rotary, torch.arange(ops.ROPE_RUN, device=device), d)
        kernel_kwargs["rope"] = rotatekv_tables(order, g, m._group, rotatekv_rope(*anchors, *first))
        ref_kwargs.update(order=order, head_group=m._group, rope_cos=cos, rope_sin=sin)
    return dict(store=kernel_layout(name, m, keys, values, kb, vb, gq, order), ref=(ref_keys, ref_values),
                k_res=k_res, v_res=v_res, counts=counts, exact=exact, kernel=kernel_kwargs, reference=ref_kwargs,
                method=m, query=(lambda q: m.transform_query(q, 0)) if name == "spectral" else (lambda q: q))


def exact_reference_errors(name: str, q, cache: dict):
    """(fp64 reference, plain torch path in the model dtype) of the cache for the (transformed) query q."""
    fn = DECODE_REFERENCES[name]
    args = (q, *cache["ref"], cache["k_res"], cache["v_res"], *cache["counts"])
    return (fn(*args, dtype=torch.float64, **cache["reference"]), fn(*args, dtype=q.dtype, **cache["reference"]))


def run_exact_case(name: str, lengths, residuals, hq: int, hkv: int, d: int, kb: int, vb: int, g: int, splits, dtype,
                   device, rcap: int = 64, data_seed: int = 1, **options):
    """The cache of make_exact_cache attended by ops.decode_attention (outputs and partials poisoned) against the
    fp64 reference: within 2x the plain torch path's error plus a small tolerance, per sequence."""
    cache = make_exact_cache(name, lengths, residuals, hkv, d, kb, vb, g, max(rcap, max(residuals)), dtype,
                             data_seed=data_seed, device=device, **options)
    q = cache["query"](real_looking(len(lengths), hq, 1, d, dtype, seed=7, device=device) * 2.0)
    out = ops.decode_attention(q, *cache["store"], cache["k_res"], cache["v_res"], *cache["counts"], splits=splits,
                               out=torch.full_like(q, float("nan")), poison=True, **cache["kernel"])
    assert_close_to_reference(out, *exact_reference_errors(name, q, cache))
    return cache, q, out


def check_exact_tokens_count_once(name: str, device, lengths, residuals, hq: int, hkv: int, d: int, g: int,
                                  splits=None, **options) -> None:
    """The kept tokens are attended exactly once, from the exact buffer, never from their packed copies. The exact
    keys get a common direction per head and distinctive values, the packed copies are poisoned (values scaled by
    1000, keys at the top code or scaled by 50: finite, never to be read). Two queries: one along the direction
    (the exact tokens dominate) and zero (every token weighs the same, so any poisoned copy shows). The kernel must
    match the reference for both, which the same cache misses by far more than the tolerance without its exact
    tokens (first query) or with the copies attended (second), so a kernel doing either fails."""
    from kernels.method_layouts import skip_mask
    from test_kernels import ATTENTION_TOL, _rel

    dtype = torch.bfloat16
    cache = make_exact_cache(name, lengths, residuals, hkv, d, 2, 2, g, 64, dtype, data_seed=21, device=device,
                             **options)
    exact, (ref_keys, ref_values), m = cache["exact"], cache["ref"], cache["method"]
    cap = ref_keys["codes"].shape[2]
    kept = torch.arange(exact["keys"].shape[2], device=device) < exact["count"].unsqueeze(-1)  # [B, H, ecap]
    assert all(bool(kept[i].any()) for i, n in enumerate(lengths) if n), "every row must keep tokens"
    direction = torch.randn(1, hkv, 1, d, generator=torch.Generator().manual_seed(4)).to(device)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    exact["keys"].copy_(torch.where(kept.unsqueeze(-1), 16.0 * direction, exact["keys"].float()).to(dtype))
    exact["values"].copy_(torch.where(kept.unsqueeze(-1), torch.full_like(exact["values"], 3.0), exact["values"]))
    copies = skip_mask(exact["skip"], cap)  # [B, H, cap]
    ref_values["scale"][copies] = 1000.0
    if name == "ott":
        ref_keys["codes"][copies] = 0xFF
    else:
        ref_keys["scale"][copies] *= 50
    cache["store"] = kernel_layout(name, m, ref_keys, ref_values, 2, 2, cache["kernel"]["group_size"],
                                   _order(m, hkv, d, device))
    along = (2.0 * math.sqrt(d) * direction).repeat_interleave(hq // hkv, 1).expand(len(lengths), -1, -1, -1)
    fn = DECODE_REFERENCES[name]
    for q, change, why in ((along, dict(count=torch.zeros_like(exact["count"])), "the exact tokens must matter"),
                           (torch.zeros_like(along), dict(skip=torch.zeros_like(exact["skip"])),
                            "attending the packed copies must show")):
        q = q.to(dtype).contiguous()
        out = ops.decode_attention(q, *cache["store"], cache["k_res"], cache["v_res"], *cache["counts"],
                                   splits=splits, out=torch.full_like(q, float("nan")), poison=True, **cache["kernel"])
        exact_ref, torch_path = exact_reference_errors(name, q, cache)
        assert_close_to_reference(out, exact_ref, torch_path)
        wrong = fn(q, ref_keys, ref_values, cache["k_res"], cache["v_res"], *cache["counts"],
                   **{**cache["reference"], "exact": {**exact, **change}})
        for i, n in enumerate(lengths):
            if n:
                tolerance = 2 * _rel(torch_path[i], exact_ref[i]) + ATTENTION_TOL
                assert _rel(wrong[i], exact_ref[i]) > 5 * tolerance, (i, why)


# ----------------------------------------------------------------------------- GPU

DECODE_CASES = [
    # method, lengths (packed, per sequence), residuals, hq, hkv, d, k_bits, v_bits, G, forced splits, options
    ("ott", [32 * 37, 32 * 5, 0], [17, 1, 9], 32, 8, 128, 2, 2, 32, None, {}),
    ("ott", [64 * 9, 64 * 3], [63, 5], 9, 3, 64, 2, 2, 64, (3, 64 * 4), dict(pool_size=4)),
    ("ott", [32 * 12], [31], 16, 2, 256, 4, 4, 32, None, dict(scope="token", outliers_per_group=2)),
    ("ott", [32 * 300, 32 * 7], [9, 100], 32, 8, 128, 2, 2, 32, (300, 32), dict(keep_values=False)),
    ("spectral", [32 * 37, 32 * 5, 0], [17, 1, 9], 32, 8, 128, 2, 2, 128, None, {}),
    ("spectral", [32 * 9, 32 * 3], [63, 5], 6, 2, 64, 2, 2, 128, (3, 32 * 4), dict(codebook="lloyd_max")),
    ("spectral", [32 * 12], [31], 16, 2, 256, 4, 4, 128, None, dict(sink_tokens=4)),
    ("spectral", [32 * 300, 32 * 7], [9, 100], 32, 8, 128, 2, 2, 128, (300, 32), dict(codebook="lloyd_max")),
    ("rotatekv", [32 * 37, 32 * 5, 0], [17, 1, 9], 32, 8, 128, 2, 2, 32, None, dict(head_group=4)),
    ("rotatekv", [32 * 9, 32 * 3], [63, 5], 9, 3, 64, 2, 2, 32, (3, 32 * 4), {}),
    ("rotatekv", [32 * 12], [31], 16, 2, 256, 4, 4, 64, None, dict(head_group=2, order=None)),
    ("rotatekv", [32 * 300, 32 * 7], [9, 100], 32, 8, 128, 2, 2, 32, (300, 32), dict(head_group=8)),
]


def _case_id(case):
    name, lengths, _, hq, hkv, d, kb, vb, g, splits, options = case
    return f"{name}-d{d}-h{hq}x{hkv}-k{kb}v{vb}-g{g}-n{len(lengths)}" + "".join(f"-{k}{v}" for k, v in options.items())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_decode_attention_matches_reference(case, dtype):
    name, lengths, residuals, hq, hkv, d, kb, vb, g, splits, options = case
    run_exact_case(name, lengths, residuals, hq, hkv, d, kb, vb, g, splits, dtype, "cuda", rcap=128,
                   data_seed=len(lengths) * d + kb, **options)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["ott", "spectral", "rotatekv"])
def test_cuda_graph_replay_equals_eager(name):
    """decode_attention (and RotateKV's logits kernel before it) captured in a CUDA graph and replayed gives the
    eager call's output bit for bit (the split plan fixed by max_packed, as the engine's step does)."""
    case = next(c for c in DECODE_CASES if c[0] == name)
    _, lengths, residuals, hq, hkv, d, kb, vb, g, _, options = case
    cache = make_exact_cache(name, lengths, residuals, hkv, d, kb, vb, g, 128, torch.bfloat16, data_seed=3, **options)
    q = cache["query"](real_looking(len(lengths), hq, 1, d, torch.bfloat16, seed=8) * 2.0)
    call = dict(max_packed=max(lengths), **cache["kernel"])
    args = (q, *cache["store"], cache["k_res"], cache["v_res"], *cache["counts"])
    eager = ops.decode_attention(*args, **call)
    out = torch.full_like(q, float("nan"))
    ops.decode_attention(*args, out=out, **call)  # compiled and warmed outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.decode_attention(*args, out=out, **call)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("min_blocks", [8, 16])
@pytest.mark.parametrize("name", ["ott", "spectral", "rotatekv"])
def test_decode_attention_launch_bounds_keep_the_result(name, min_blocks):
    """The register bounds the benchmark sweeps keep the result, bf16, 4 heads per KV head."""
    case = next(c for c in DECODE_CASES if c[0] == name)
    _, lengths, residuals, hq, hkv, d, kb, vb, g, _, options = case
    cache = make_exact_cache(name, lengths, residuals, hkv, d, kb, vb, g, 128, torch.bfloat16, data_seed=5, **options)
    q = cache["query"](real_looking(len(lengths), hq, 1, d, torch.bfloat16, seed=98) * 2.0)
    out = ops.decode_attention(q, *cache["store"], cache["k_res"], cache["v_res"], *cache["counts"],
                               out=torch.full_like(q, float("nan")), poison=True, min_blocks=min_blocks,
                               **cache["kernel"])
    assert_close_to_reference(out, *exact_reference_errors(name, q, cache))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name, g, options", [("ott", 32, dict(pool_size=5)), ("spectral", 128, {}),
                                              ("rotatekv", 32, dict(head_group=4))])
def test_exact_tokens_are_attended_exactly_once(name, g, options):
    check_exact_tokens_count_once(name, "cuda", [32 * 40, 32 * 3], [7, 20], 32, 8, 128, g, **options)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 8, 37, 128, 2, 128, 0.96, "keys"), (3, 3, 16, 64, 2, 64, 0.92, "values"),
                                  (1, 2, 21, 256, 4, 128, 0.0, None), (2, 4, 40, 128, 4, 64, 1.0, "values")])
def test_spectral_quantizer_bytes_equal_the_methods(case, dtype):
    """quantize_spectral equals OSCAR's own uniform quantizer on the GPU (CUDA torch) and kernels.reference.
    spectral_quantize byte for byte, straight and into storage at an odd token offset through the layout converters,
    the rest of the storage untouched; real-looking keys (the clip bites the outlier channels)."""
    from kernels.reference import spectral_quantize

    b, h, t, d, bits, g, clip, layout = case
    x = real_looking(b, h, t, d, dtype, seed=sum(case[:6]))
    own = exact_method("spectral", h, d, bits, bits, g, "cuda")._quantize(x, bits, clip, None).buffers
    want = spectral_quantize(x, bits, g, clip)
    for name in want:
        assert torch.equal(own[name], want[name]), name
    got = ops.quantize_spectral(x, bits, g, clip)
    for name in want:
        assert torch.equal(got.buffers[name], want[name]), name
    cap = 16 * math.ceil((t + 3) / 16)
    storage, _ = ops.empty_storage("spectral", b + 1, h, cap, d, k_bits=bits, v_bits=bits, group_size=g,
                                   dtype=dtype, device="cuda")
    for buf in storage.values():
        buf.fill_(0xA5) if buf.dtype == torch.uint8 else buf.fill_(float("nan"))
    rows = [(i + 1) % (b + 1) for i in range(b)]
    ops.quantize_spectral(x, bits, g, clip, out=storage, rows=rows, offsets=[3] * b, decode_layout=layout)
    back = ops.value_decode_layout(storage, bits, g, inverse=True) if layout == "values" else storage
    kept = {name: back[name].eq(0xA5) if name == "codes" else back[name].isnan() for name in want}
    if layout == "keys":
        back = ops.token_key_decode_layout(back, bits, inverse=True)
    for name in want:
        for i, row in enumerate(rows):
            assert torch.equal(back[name][row, :, 3:3 + t], want[name][i]), (name, i)
            assert kept[name][row, :, :3].all() and kept[name][row, :, 3 + t:].all(), name
        assert kept[name][[r for r in range(b + 1) if r not in rows]].all(), name


def check_rotatekv_key_kernels(device, d: int, bits: int, g: int, head_group: int, hkv: int, dtype,
                               order: bool = True, clip: float = 0.8, seed: int = 0) -> None:
    """RotateKV's key kernels (kernels/rotatekv_keys.cu) against kernels.reference's CUDA-torch arithmetic of the
    method, bit for bit, and on the GPU against the method's own quantize_keys / dequantize: 2 rows of 21 real-looking
    keys turned post-RoPE at stream positions 5 .. 25 quantized into storage rows 2 and 0 (NaN / 0xA5 poison around
    them stays), then spans of them read back into a strided view of a NaN-poisoned buffer (token-major, as the
    prefill's) that stays poisoned around the span."""
    from kernels import reference
    from kernels.method_layouts import rotatekv_rope_positions, rotatekv_z_index

    m = exact_method("rotatekv", hkv, d, bits, bits, g, device, seed=seed, head_group=head_group,
                     order="random" if order else None, clip_ratio=clip)
    b, t, off, cap, rows = 2, 21, 5, 48, [2, 0]
    chosen = _order(m, hkv, d, device)
    cos, sin = rope_tables(m._rotary, torch.arange(cap, device=device), d)
    rope, index = rotatekv_rope_positions(cos, sin), rotatekv_z_index(chosen)
    k = apply_rope(real_looking(b, hkv, t, d, dtype, seed=seed + d, device=device).float(), cos[off:off + t],
                   sin[off:off + t]).to(dtype)
    keys, _ = ops.empty_storage("rotatekv", 3, hkv, cap, d, k_bits=bits, v_bits=bits, group_size=g, dtype=dtype,
                                device=device)
    for buf in keys.values():
        buf.fill_(0xA5) if buf.dtype == torch.uint8 else buf.fill_(float("nan"))
    ops.quantize_rotatekv_keys(k, bits, g, head_group, clip, index, rope, keys, rows=rows, offsets=[off] * b)
    want = reference.rotatekv_quantize_keys(k, bits, g, head_group, clip, chosen, cos[off:off + t], sin[off:off + t])
    if device != "cpu":  # CUDA torch runs the method as the reference writes it
        state = m.new_state(b, hkv, device)
        own = m.quantize_keys(k, 0, TokenSpan(torch.arange(b, device=device), off, state, kept_elsewhere=True))
        for name in want:
            assert torch.equal(own.buffers[name], want[name]), name
    stored = rotatekv_key_layout(want, bits, chosen)  # the codes in x's order
    poisoned = {name: keys[name].eq(0xA5) if name == "codes" else keys[name].isnan() for name in keys}
    for name, buf in keys.items():
        for i, row in enumerate(rows):
            assert torch.equal(buf[row, :, off:off + t], stored[name][i]), (name, i)
            assert poisoned[name][row, :, :off].all() and poisoned[name][row, :, off + t:].all(), name
        assert poisoned[name][1].all(), name
    for start, n, chosen_rows in ((off, t, [2, 0]), (off + 7, 9, [0])):
        buf = torch.full((len(chosen_rows), n + 3, hkv, d), float("nan"), dtype=dtype, device=device)
        got = buf.transpose(1, 2)[:, :, 1:n + 1]
        rows_dev = torch.tensor(chosen_rows, dtype=torch.int32, device=device)
        assert ops.dequantize_rotatekv_keys(keys, bits, g, head_group, index, rope, rows_dev, start, n, got) is got
        z = {name: torch.stack([want[name][rows.index(r)] for r in chosen_rows])[:, :, start - off:start - off + n]
             for name in want}
        expected = reference.rotatekv_dequantize_keys(z, bits, g, head_group, chosen, cos[start:start + n],
                                                      sin[start:start + n], dtype)
        assert torch.equal(got, expected), (start, n)
        assert buf[:, 0].isnan().all() and buf[:, n + 1:].isnan().all(), (start, n)
        if device != "cpu":
            meta = dict(bits=bits, group_size=g, axis="token", zero_point="int", kind="keys", layer=0)
            none_kept = keep_exact(got.new_zeros(len(chosen_rows), hkv, n, d),  # the sinks are kept elsewhere
                                   torch.zeros(len(chosen_rows), 1, n, dtype=torch.bool, device=device), start)
            own = m.dequantize(PackedTensor({**z, **none_kept}, (len(chosen_rows), hkv, n, d), dtype, meta, start))
            assert torch.equal(got, own), (start, n)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [128, 512, 1024])
def test_cuda_hadamard_is_cuda_torchs(d):
    """The stand-in the emulated tests give RotateKV on the CPU (cuda_hadamard) is oscar.quant.hadamard on CUDA."""
    from kernels.reference import _hadamard_fp32
    from oscar.quant import hadamard

    x = torch.randn(64, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(d))
    assert torch.equal(_hadamard_fp32(x), hadamard(x))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(128, 2, 32, 4, 8), (128, 4, 32, 2, 8), (64, 2, 16, 1, 3), (256, 2, 64, 8, 8),
                                  (64, 2, 32, 2, 2)], ids=lambda c: f"d{c[0]}-k{c[1]}-g{c[2]}-hg{c[3]}-h{c[4]}")
def test_rotatekv_key_kernels_equal_the_methods(case, dtype):
    d, bits, g, head_group, hkv = case
    check_rotatekv_key_kernels("cuda", d, bits, g, head_group, hkv, dtype, order=hkv != 3, seed=sum(case))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope, per_group, g, hkv, d, t", [("head", 1, 32, 8, 128, 8192), ("head", 2, 64, 2, 64, 2048),
                                                           ("token", 1, 32, 4, 128, 1024)])
def test_ott_pool_kernel_matches_the_method(dtype, scope, per_group, g, hkv, d, t):
    """kernels/ott_pool.cu against OTT.pool_outliers and the stage of its mask on the GPU, bit for bit (filled chunk
    NaN-poisoned first, pools, slots, skip words; tests/test_exact_slots_emulated.check): a prefill's 8K-token chunk,
    pools part full that fill up mid-chunk, then the next chunk of the same rows."""
    from test_exact_slots_emulated import check

    m = build_method("ott", scope=scope, outliers_per_group=per_group, group_size=g, residual_length=128,
                     pool_size=64)
    pool = m.new_state(3, hkv, "cuda")["pool"]
    pool[2, :, :3] = torch.tensor([1, 7, 40], device="cuda")
    for start, seed in ((64, 0), (64 + t, 1)):
        k = real_looking(2, hkv, t, d, dtype, seed=seed)
        values = real_looking(2, hkv, t, d, dtype, seed=seed + 10)
        pool = check(m, k, values, pool, [2, 0], start)
    assert (pool[[0, 2]] >= 0).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kept_tokens_write_kernel_puts_back_what_restore_gives(dtype):
    """kernels/kept_tokens.cu on the GPU (tests/test_exact_slots_emulated.check_write): over a chunk and a strided
    window, kept tokens at both edges of the range."""
    from test_exact_slots_emulated import check_write

    check_write(dtype, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kept_tokens_stage_kernel_is_the_stage_of_their_mask(dtype):
    """kernels/kept_tokens.cu's stage_kept on the GPU (tests/test_exact_slots_emulated.check_stage_positions)."""
    from test_exact_slots_emulated import check_stage_positions

    check_stage_positions(dtype, "cuda")
