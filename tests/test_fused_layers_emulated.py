"""The fused decode-step layers on the CPU emulator (tests/cuda_emu.h): kernels/fused_layers.cu through the launchers
of kernels.layers against transformers' own modules, and kernels.fused_layers' swaps through a model and the engine.

Kernels, on fresh random inputs with channel outliers (float32, bfloat16, float16; outputs poisoned with NaN before
each launch): RMSNorm (hidden rows, Qwen3's per-head rows, a merged projection's strided slice) and SiLU(gate) * up
(two tensors, a merged GEMM's halves) within 2x the error of transformers' module against float64 plus a tolerance
of a float32 rounding, and nearly every element bit-equal to it in 16 bits; RoPE bit-equal to apply_rotary_pos_emb
(per-sequence positions, one table broadcast over the batch, strided inputs); OSCAR's float32 rotation of a token's
heads as accurate as torch's float32 product. Modules: the swaps and the merged
projections restore the model exactly (modules, parameters, storage, the patched function); forwards of the fused
tiny Llama and Qwen3 match transformers'; SmolLM2's real activations through the fused modules match its own; the
engine's greedy tokens in float32 equal the unfused engine's. The GPU half is tests/test_fused_layers_gpu.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from test_method_kernels_emulated import _c_arg, kernel_host_source
from test_kernels import emulator_builder
from transformers.models.llama import modeling_llama

from kernels import layers, runtime
from kernels.fused_layers import ATTENTIONS, ROPE_FUNCTIONS, FusedMLP, FusedRMSNorm, LayerFusion

LAUNCHERS = r"""
#ifdef NORM_SIZE
extern "C" void launch_rms_norm(unsigned gx, unsigned bx, unsigned long long smem, const elem_t* x, long long xo,
                                long long xi, const elem_t* w, elem_t* out, long long oo, long long oi, int inner,
                                long long rows, float eps, float inv_size) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { rms_norm(x, xo, xi, w, out, oo, oi, inner, rows, eps, inv_size); });
}
extern "C" void launch_add_rms_norm(unsigned gx, unsigned bx, unsigned long long smem, const elem_t* x, long long xo,
                                    long long xi, const elem_t* r, long long ro, long long ri, elem_t* sum,
                                    const elem_t* w, elem_t* out, long long oo, long long oi, int inner,
                                    long long rows, float eps, float inv_size) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] {
    add_rms_norm(x, xo, xi, r, ro, ri, sum, w, out, oo, oi, inner, rows, eps, inv_size);
  });
}
#endif
#ifdef ROPE_DIM
extern "C" void launch_rotary(unsigned gx, unsigned bx, unsigned long long smem, const elem_t* q, long long qb,
                              long long qh, long long qt, const elem_t* k, long long kb, long long kh, long long kt,
                              const elem_t* cs, const elem_t* sn, long long cb, long long ct, elem_t* qo,
                              long long qob, long long qoh, long long qot, elem_t* ko, long long kob, long long koh,
                              long long kot, int hq, int hk, int tokens, long long pairs) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] {
    rotary(q, qb, qh, qt, k, kb, kh, kt, cs, sn, cb, ct, qo, qob, qoh, qot, ko, kob, koh, kot, hq, hk, tokens, pairs);
  });
}
#endif
#ifdef SILU_MUL
extern "C" void launch_silu_mul(unsigned gx, unsigned bx, unsigned long long smem, const elem_t* g, long long gr,
                                const elem_t* u, long long ur, elem_t* out, long long orow, int width,
                                long long total) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { silu_mul(g, gr, u, ur, out, orow, width, total); });
}
#endif
#ifdef ROTATE_DIM
extern "C" void launch_rotate_rows(unsigned gx, unsigned bx, unsigned long long smem, const elem_t* x,
                                   const float* matrix, elem_t* out, long long rows) {
  emu_launch({gx, 1, 1}, {bx, 1, 1}, smem, [&] { rotate_rows(x, matrix, out, rows); });
}
#endif
"""
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: float32 roundings of a value of 1 (the error both paths may differ by in float32)
FP32_TOL = 4 * 2.0**-24


@pytest.fixture(scope="module")
def layer_library():
    """defines -> ctypes library of kernels/fused_layers.cu built for the CPU emulator."""
    return emulator_builder(kernel_host_source(layers.SOURCE, LAUNCHERS))


@pytest.fixture
def emulated(layer_library, monkeypatch):
    """kernels.layers with every launch on the CPU emulator (CPU tensors): the launchers' arguments, #defines and
    grids are what the GPU runs. Returns the launched kernels' names, in order."""
    launched = []

    def launch(source, name, defines, grid, block, args, device, smem=0):
        assert source == layers.SOURCE
        lib = layer_library(**defines)
        getattr(lib, f"launch_{name}")(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), ctypes.c_ulonglong(smem),
                                       *map(_c_arg, args))
        launched.append(name)

    monkeypatch.setattr(runtime, "launch", launch)
    monkeypatch.setattr(runtime, "check_cuda", lambda x, name: None)
    return launched


def outlier_input(shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random activations with a few large channels (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x[..., torch.randperm(shape[-1], generator=g)[:3]] *= 20.0
    return x.to(dtype)


def max_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute error relative to the reference's largest magnitude."""
    return ((x.double() - reference).abs().max() / reference.abs().max()).item()


def assert_as_accurate(fused, torch_path, reference, dtype, equal_share: float = 0.99) -> None:
    """The fused output: finite (nothing left poisoned), within 2x plain torch's error against the float64 reference
    plus a float32 rounding; in 16 bits nearly every element bit-equal to torch's."""
    assert torch.isfinite(fused).all()
    err_fused, err_torch = max_error(fused, reference), max_error(torch_path, reference)
    assert err_fused <= 2 * err_torch + FP32_TOL, (err_fused, err_torch)
    if dtype != torch.float32:
        assert (fused == torch_path).float().mean() >= equal_share


# ----------------------------------------------------------------------------- RMSNorm


#: each shape in the dtypes that matter for it (every #define set is one more emulator build)
NORM_CASES = [
    # shape of x [..., N], dtype, what it is
    ((2, 3, 256), F32, "hidden rows (tiny models)"),
    ((2, 3, 256), BF16, "hidden rows (tiny models)"),
    ((2, 3, 256), F16, "hidden rows (tiny models)"),
    ((1, 1, 4096), BF16, "a decode token of an 8B model: 512 threads, 16 warps per row"),
    ((3, 1, 200), F16, "channels not a multiple of the threads (a partial last load)"),
    ((2, 3, 4, 64), F32, "per-head rows (Qwen3's q_norm / k_norm)"),
    ((2, 3, 4, 64), BF16, "per-head rows (Qwen3's q_norm / k_norm)"),
    ((2, 1, 4, 128), BF16, "per-head rows of a merged projection's strided slice"),
]


@pytest.mark.parametrize("shape, dtype, what", NORM_CASES,
                         ids=[f"{c[2].split(' (')[0].split(':')[0]}-{str(c[1])[6:]}" for c in NORM_CASES])
def test_rms_norm_matches_transformers(emulated, shape, dtype, what):
    n = shape[-1]
    norm = modeling_llama.LlamaRMSNorm(n, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(n)))
    if "strided" in what:  # the query heads' columns of [B, T, (4 + 2 + 2) heads x D] rows
        merged = outlier_input((*shape[:2], 8 * n), dtype, seed=n)
        x = merged[..., :4 * n].view(shape)
        assert not x.is_contiguous()
    else:
        x = outlier_input(shape, dtype, seed=sum(shape), scale=3.0)
    out = torch.full(shape, float("nan"), dtype=dtype)
    fused = layers.rms_norm(x, norm.weight, norm.variance_epsilon, out=out)
    assert fused is out and emulated == ["rms_norm"]
    with torch.no_grad():
        torch_path = norm(x)
    xd = x.double()
    reference = norm.weight.double() * xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-5)
    assert_as_accurate(fused, torch_path, reference, dtype)


def check_add_rms_norm(shape, dtype, device: str) -> None:
    """add_rms_norm on fresh inputs with outliers (outputs poisoned): the sum bit-equal to torch's ``residual + x`` in
    the dtype, its norm as accurate as transformers' module on that sum and equal to the norm kernel's own."""
    n = shape[-1]
    norm = modeling_llama.LlamaRMSNorm(n, eps=1e-5).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(n + 1)))
    x = outlier_input(shape, dtype, seed=sum(shape), scale=2.0).to(device)
    residual = outlier_input(shape, dtype, seed=sum(shape) + 1, scale=5.0).to(device)
    out, sum_out = (torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(2))
    got_sum, fused = layers.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon, out=out, sum_out=sum_out)
    assert got_sum is sum_out and fused is out
    assert torch.equal(got_sum, residual + x)
    with torch.no_grad():
        torch_path = norm(residual + x)
    hd = (residual + x).double()
    reference = norm.weight.double() * hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + 1e-5)
    assert_as_accurate(fused, torch_path, reference, dtype)
    assert torch.equal(fused, layers.rms_norm(got_sum, norm.weight, norm.variance_epsilon))


@pytest.mark.parametrize("shape, dtype", [((2, 3, 256), F32), ((2, 3, 256), BF16), ((2, 3, 256), F16),
                                          ((1, 1, 4096), BF16), ((3, 1, 200), F16)], ids=str)
def test_add_rms_norm_is_the_residual_add_then_the_norm(emulated, shape, dtype):
    """A decoder layer's residual add and its post-attention norm in one launch (check_add_rms_norm)."""
    check_add_rms_norm(shape, dtype, "cpu")
    assert emulated == ["add_rms_norm", "rms_norm"]


# ----------------------------------------------------------------------------- RoPE


def rope_tables(batch: int, tokens: int, dim: int, dtype, shared: bool, seed: int):
    """cos, sin [B or 1, T, D] from transformers' LlamaRotaryEmbedding at random positions up to 60K."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, head_dim=dim, rope_theta=500000.0,
                         max_position_embeddings=65536)
    positions = torch.randint(0, 60000, (1 if shared else batch, tokens), generator=torch.Generator().manual_seed(seed))
    return modeling_llama.LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=dtype), positions)


@pytest.mark.parametrize("batch, tokens, hq, hk, dim, shared, merged, dtype", [
    (2, 1, 4, 2, 64, False, False, F32),  # a decode step: per-sequence positions
    (2, 1, 4, 2, 64, False, False, BF16),
    (2, 1, 4, 2, 64, False, False, F16),
    (2, 5, 6, 2, 128, True, False, BF16),  # a chunk: one position table broadcast over the batch
    (3, 1, 4, 1, 64, False, True, BF16),  # q and k as a merged q/k/v projection's slices
    (1, 2, 2, 2, 256, False, False, F16),
], ids=lambda v: str(v)[6:] if isinstance(v, torch.dtype) else None)
def test_rotary_equals_transformers_bit_for_bit(emulated, batch, tokens, hq, hk, dim, shared, merged, dtype):
    heads = hq + 2 * hk
    rows = outlier_input((batch, tokens, heads * dim if merged else (hq + hk) * dim), dtype, seed=dim + tokens)
    q = rows[..., :hq * dim].view(batch, tokens, hq, dim).transpose(1, 2)  # as the attention forward makes them
    k = rows[..., hq * dim:(hq + hk) * dim].view(batch, tokens, hk, dim).transpose(1, 2)
    cos, sin = rope_tables(batch, tokens, dim, dtype, shared, seed=batch + dim)
    q_out, k_out = (torch.full_like(x, float("nan")) for x in (q, k))
    got = layers.rotary(q, k, cos, sin, q_out=q_out, k_out=k_out)
    assert got[0] is q_out and got[1] is k_out and emulated == ["rotary"]
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for name, a, b in zip("qk", got, want):
        assert torch.equal(a, b), name


def test_rotary_lays_its_outputs_out_as_its_inputs(emulated):
    q = outlier_input((2, 1, 4, 64), torch.bfloat16, seed=0).transpose(1, 2)
    k = outlier_input((2, 3, 64), torch.bfloat16, seed=1).view(2, 3, 1, 64)
    cos, sin = rope_tables(2, 1, 64, torch.bfloat16, False, seed=2)
    q_out, k_out = layers.rotary(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


# ----------------------------------------------------------------------------- SiLU(gate) * up


@pytest.mark.parametrize("shape, merged, dtype", [((2, 3, 512), False, F32), ((1, 1, 1536), True, BF16),
                                                  ((2, 1, 300), True, F16)],
                         ids=lambda v: str(v)[6:] if isinstance(v, torch.dtype) else None)
def test_silu_mul_matches_transformers(emulated, shape, merged, dtype):
    if merged:  # the halves of one [..., 2I] GEMM output
        both = outlier_input((*shape[:-1], 2 * shape[-1]), dtype, seed=shape[-1], scale=2.0)
        gate, up = both[..., :shape[-1]], both[..., shape[-1]:]
    else:
        gate, up = (outlier_input(shape, dtype, seed=i, scale=2.0) for i in (1, 2))
    out = torch.full(shape, float("nan"), dtype=dtype)
    fused = layers.silu_mul(gate, up, out=out)
    assert fused is out and emulated == ["silu_mul"]
    config = modeling_llama.LlamaConfig(hidden_size=8, intermediate_size=8, num_attention_heads=1, hidden_act="silu")
    mlp = modeling_llama.LlamaMLP(config)
    torch_path = mlp.act_fn(gate) * up  # LlamaMLP's product
    g = gate.double()
    reference = g / (1 + torch.exp(-g)) * up.double()
    assert_as_accurate(fused, torch_path, reference, dtype)


def test_launchers_refuse_what_the_kernels_do_not_take(emulated):
    x = torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="one dtype"):
        layers.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="weight of shape"):
        layers.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        layers.rms_norm(torch.randn(2, 64, 3).transpose(1, 2), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        layers.silu_mul(x.to(torch.int32), x.to(torch.int32))
    q = torch.randn(1, 2, 1, 64)
    with pytest.raises(ValueError, match=r"cos and sin \[B or 1, T, D\]"):
        layers.rotary(q, q, torch.randn(1, 1, 32), torch.randn(1, 1, 32))
    with pytest.raises(ValueError, match="x and residual of one shape"):
        layers.add_rms_norm(x, torch.randn(2, 2, 64), torch.ones(64), 1e-6)
    assert emulated == []


# ----------------------------------------------------------------------------- a float32 rotation of a token's heads


#: rows [B, H, 1, D] as a decode step's query or key heads, in the dtypes that matter (a partial last block of rows)
ROTATE_CASES = [((2, 4, 1, 128), F32), ((2, 32, 1, 128), BF16), ((3, 8, 1, 64), F16), ((1, 5, 1, 96), BF16)]


def check_rotate_rows(shape, dtype, device: str) -> None:
    """rotate_rows on fresh inputs with outliers, laid out as a model's heads ([B, T, H, D] transposed), and a random
    orthogonal float32 matrix (output poisoned): as accurate as the method's ``(x.float() @ R).to(dtype)`` against
    float64 and nearly every element equal to it in 16 bits; a matrix of another dtype or size refused."""
    b, h, t, d = shape
    g = torch.Generator().manual_seed(d + h)
    matrix = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float().to(device)
    x = outlier_input((b, t, h, d), dtype, seed=d + b, scale=2.0).to(device).transpose(1, 2)
    out = torch.full(shape, float("nan"), dtype=dtype, device=device)
    fused = layers.rotate_rows(x, matrix, out=out)
    assert fused is out
    assert_as_accurate(fused, (x.float() @ matrix).to(dtype), x.double() @ matrix.double(), dtype)
    with pytest.raises(ValueError, match="float32 matrix"):
        layers.rotate_rows(x, matrix.double())
    with pytest.raises(ValueError, match="float32 matrix"):
        layers.rotate_rows(x, matrix[:-1])


@pytest.mark.parametrize("shape, dtype", ROTATE_CASES, ids=str)
def test_rotate_rows_is_the_float32_product(emulated, shape, dtype):
    check_rotate_rows(shape, dtype, "cpu")
    assert emulated == ["rotate_rows"]


# ----------------------------------------------------------------------------- the swaps through a model


def varied(name: str, dtype=torch.float32) -> torch.nn.Module:
    """A registry tiny model with weights of std 0.1 (greedy continuations that vary token to token)."""
    from tests.conftest import build_tiny

    model = build_tiny(name)
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.1)
    return model.to(dtype)


def _storages(model) -> list[int]:
    return [p.untyped_storage().data_ptr() for p in model.parameters()]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("merge", [False, True], ids=["kernels", "merged"])
def test_fusion_swaps_for_its_scope_and_restores_the_model_exactly(name, merge):
    from tests.conftest import build_tiny

    model = build_tiny(name)
    modules = dict(model.named_modules())
    params = {name_: (p, p.detach().clone()) for name_, p in model.named_parameters()}
    storages = _storages(model)
    rope_file = ATTENTIONS[type(model.model.layers[0].self_attn)]
    fusion = LayerFusion(model, merge=merge)
    layers_n = model.config.num_hidden_layers
    norms = (4 if name == "tiny-qwen3" else 2) * layers_n + 1  # Qwen3: per-head q_norm and k_norm too
    state = {key: t.data_ptr() for key, t in model.state_dict().items()}
    with fusion.active():
        kinds = [type(m).__name__ for m in model.modules()]
        assert kinds.count("FusedRMSNorm") == norms and kinds.count("FusedMLP") == layers_n
        assert kinds.count("ProjectionSlice") == (3 * layers_n if merge else 0)
        assert rope_file.apply_rotary_pos_emb is not ROPE_FUNCTIONS[rope_file]
        assert all("forward" in layer.__dict__ for layer in model.model.layers)  # the fused decoder forward
        assert {key: t.data_ptr() for key, t in model.state_dict().items()} == state  # the same names and tensors
        if merge:  # a layer's q, k and v rows (and gate, up) in one storage
            attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
            for pair in ((attention.q_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)):
                assert len({linear.weight.untyped_storage().data_ptr() for linear in pair}) == 1
    after = dict(model.named_modules())
    assert len(after) == len(modules) and all(after[k] is m for k, m in modules.items())
    assert rope_file.apply_rotary_pos_emb is ROPE_FUNCTIONS[rope_file]
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)
    for key, p in model.named_parameters():
        assert p is params[key][0] and torch.equal(p, params[key][1]), key
    assert (_storages(model) != storages) == merge
    fusion.remove()
    assert len(set(_storages(model))) == len(storages)  # every parameter its own storage again
    for key, p in model.named_parameters():
        assert p is params[key][0] and torch.equal(p, params[key][1]), key
    with fusion.active():  # removed: it swaps nothing
        assert not any(type(m).__name__.startswith("Fused") for m in model.modules())


def test_fusion_is_offered_for_the_architectures_it_fuses_where_the_kernels_run():
    from kernels.backend import CupyBackend
    from oscar.models import build_config, load_spec

    configs = {name: build_config(load_spec(name)) for name in ("tiny-llama", "tiny-qwen3", "tiny-gemma3")}
    assert [LayerFusion.supports(c) for c in configs.values()] == [True, True, False]
    assert CupyBackend().layer_fusion(configs["tiny-llama"]) is (LayerFusion if runtime.cupy_available() else None)
    assert CupyBackend().layer_fusion(configs["tiny-gemma3"]) is None


@pytest.mark.parametrize("name, dtype", [("tiny-llama", torch.float32), ("tiny-qwen3", torch.float32),
                                         ("tiny-llama", torch.bfloat16), ("tiny-qwen3", torch.bfloat16)],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_fused_forward_matches_transformers(emulated, name, dtype):
    """The logits of a fused forward (kernels; then merged projections, one of them moved and changed after the merge:
    merged again on entry) within 2x the unfused model's error against its float64 copy, plus a float32 rounding."""
    import copy

    model = varied(name, dtype)
    ids = torch.randint(0, 1000, (2, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for merge in (False, True):
            fusion = LayerFusion(model, merge=merge)
            if merge:
                gate = model.model.layers[0].mlp.gate_proj.weight
                gate.data = gate.data * 1.5
            want = copy.deepcopy(model).double()(input_ids=ids).logits
            plain = model(input_ids=ids).logits
            with fusion.active():
                fused = model(input_ids=ids).logits
            fusion.remove()
            assert max_error(fused, want) <= 2 * max_error(plain, want) + FP32_TOL, merge
            assert {"rms_norm", "add_rms_norm", "rotary", "silu_mul"} <= set(emulated)
        assert torch.equal(model(input_ids=ids).logits, plain)  # unfused again: transformers' numbers exactly


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_fused_decoder_forward_is_transformers_forward_bit_for_bit(emulated, name):
    """In bfloat16, the fused decoder forward (the attention's residual add and the post-attention norm in one
    launch) gives the logits that transformers' own decoder forward gives over the same fused modules, bit for bit:
    the same operations in the same order and roundings; one add_rms_norm a layer in place of an add and a norm."""
    model = varied(name, torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(1))
    fusion = LayerFusion(model)
    with torch.no_grad(), fusion.active():
        emulated.clear()
        fused = model(input_ids=ids).logits
        assert emulated.count("add_rms_norm") == model.config.num_hidden_layers
        own = {layer: layer.__dict__.pop("forward") for layer in model.model.layers}  # transformers' forward
        emulated.clear()
        plain = model(input_ids=ids).logits
        assert "add_rms_norm" not in emulated
        for layer, forward in own.items():
            layer.forward = forward
    assert torch.isfinite(fused).all() and torch.equal(fused, plain)


def test_smollm2_activations_through_the_fused_modules(emulated, monkeypatch):
    """A real model's activations (SmolLM2-135M on a real sentence, first, middle and last layers) through the fused
    norm, RoPE and MLP: float32 and bfloat16, as accurate as its own modules against float64; RoPE bit-equal."""
    from oscar.models import load_model, load_tokenizer

    model, _ = load_model("smollm2-135m", device="cpu", dtype="float32")
    tokenizer = load_tokenizer("smollm2-135m")
    ids = tokenizer("The Eiffel Tower, finished in 1889, is the tallest structure in Paris.",
                    return_tensors="pt")["input_ids"]
    picked = [0, 15, model.config.num_hidden_layers - 1]
    seen: dict[tuple[int, str], tuple] = {}
    rope_calls = []
    original_rope = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                        lambda q, k, cos, sin: rope_calls.append((q, k, cos, sin)) or original_rope(q, k, cos, sin))
    hooks = [getattr(model.model.layers[i], part).register_forward_pre_hook(
        lambda module, args, key=(i, part): seen.__setitem__(key, args[0]))
        for i in picked for part in ("input_layernorm", "post_attention_layernorm", "mlp")]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    for dtype in (torch.float32, torch.bfloat16):
        for (i, part), x in seen.items():
            module = _copy(getattr(model.model.layers[i], part), dtype)
            fused = FusedMLP(module) if part == "mlp" else FusedRMSNorm(module)
            with torch.no_grad():
                got, plain = fused(x.to(dtype)), module(x.to(dtype))
                want = _copy(module, torch.float64)(x.double())
            # the MLP's output sums a product that may differ in one last bit: no element share to expect there
            assert_as_accurate(got, plain, want, dtype, equal_share=0.0 if part == "mlp" else 0.99)
        for q, k, cos, sin in (rope_calls[i] for i in picked):
            args = [t.to(dtype) for t in (q, k, cos, sin)]
            for got, want in zip(layers.rotary(*args), original_rope(*args)):
                assert torch.equal(got, want)


def _copy(module, dtype):
    import copy

    return copy.deepcopy(module).to(dtype)


# ----------------------------------------------------------------------------- through the engine


@pytest.mark.parametrize("name, method", [("tiny-llama", "fp16"), ("tiny-qwen3", "kivi")])
def test_engine_greedy_tokens_equal_the_unfused_engines(emulated, monkeypatch, name, method):
    """DecodeEngine with fused_layers on and merged (the model reported on one GPU, the kernels on the emulator) gives
    the tokens of fused_layers=off in float32: a left-padded batch, the torch backend's mirror, the prefill fused as
    the decode steps are; the model's modules are transformers' again after the prefill and every step."""
    import oscar.engine as engine_module
    from oscar import build_method
    from oscar.backend import TorchBackend
    from oscar.engine import DecodeEngine

    model = varied(name)
    kv_method = build_method(method, residual_length=32)
    backend = TorchBackend()
    kv_method.prepare_model(model)
    backend.attach(model, kv_method)
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    modules = dict(model.named_modules())
    tokens = {}
    for fused_layers in ("off", "on", "merged"):
        if fused_layers != "off":
            monkeypatch.setattr(engine_module, "model_devices", lambda model: [torch.device("cuda")])
            monkeypatch.setattr(engine_module, "offered_layer_fusion", lambda config: LayerFusion)
        engine = DecodeEngine(model, kv_method, backend, "eager", fused_layers=fused_layers)
        assert engine.fused_layers == fused_layers and (engine.fusion is None) == (fused_layers == "off")
        emulated.clear()
        tokens[fused_layers] = engine.generate(ids, mask, 12, eos_token_ids=set())
        if fused_layers != "off":
            assert emulated.count("rotary") == 12 * model.config.num_hidden_layers  # the prefill's and every step's
            engine.unfuse()
        assert all(dict(model.named_modules())[k] is m for k, m in modules.items())
    assert all(len(set(row)) >= 4 for row in tokens["off"])  # varied tokens: a wrong layer would show
    assert tokens["on"] == tokens["off"] and tokens["merged"] == tokens["off"]
