"""The fused decode-step layers on a GPU (the CPU emulator's half: tests/test_fused_layers_emulated.py): the kernels
against transformers' own modules on CUDA (RMSNorm, alone and after the residual add, and SiLU(gate) * up within 2x
torch's error against float64, RoPE and the residual sum bit-equal; outputs poisoned first), OSCAR's float32 rotation
of a token's heads as accurate as torch's float32 product, fused forwards of the tiny models in bfloat16 as accurate
as transformers', the engine's CUDA-graph tokens in float32 equal to the unfused engine's (fused on and merged), the
model restored exactly after, and fewer GPU operations per decode step. Every method's bf16 step with the fused
layers (fused_layers=auto on a GPU): tests/test_engine_gpu.py, graph against eager."""

from __future__ import annotations

import copy

import pytest
import torch
from test_fused_layers_emulated import (FP32_TOL, ROTATE_CASES, assert_as_accurate, check_add_rms_norm,
                                       check_rotate_rows, max_error, outlier_input, rope_tables, varied)
from transformers.models.llama import modeling_llama

from kernels import layers
from kernels.fused_layers import LayerFusion
from tests.test_kernels import _gpu_ready

gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")
pytestmark = [pytest.mark.gpu, gpu]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BF16, F16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, strided", [((1, 1, 4096), False), ((8, 1, 4096), False), ((3, 5, 576), False),
                                            ((4, 1, 32, 128), False), ((4, 1, 32, 128), True)])
def test_rms_norm_matches_transformers(shape, strided, dtype):
    n = shape[-1]
    norm = modeling_llama.LlamaRMSNorm(n, eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(n, device="cuda"))
    if strided:  # the query heads of a merged q/k/v projection's rows
        x = outlier_input((*shape[:2], 48 * n), dtype, seed=n).cuda()[..., :shape[2] * n].view(shape)
    else:
        x = outlier_input(shape, dtype, seed=sum(shape), scale=3.0).cuda()
    out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    fused = layers.rms_norm(x, norm.weight, norm.variance_epsilon, out=out)
    with torch.no_grad():
        plain = norm(x)
    xd = x.double()
    reference = norm.weight.double() * xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-5)
    assert_as_accurate(fused, plain, reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 4096), (8, 1, 4096), (3, 5, 576)], ids=str)
def test_add_rms_norm_is_the_residual_add_then_the_norm(shape, dtype):
    check_add_rms_norm(shape, dtype, "cuda")


@pytest.mark.parametrize("shape, dtype", ROTATE_CASES + [((4, 32, 1, 128), BF16), ((64, 8, 1, 128), F16)], ids=str)
def test_rotate_rows_is_the_float32_product(shape, dtype):
    check_rotate_rows(shape, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, tokens, hq, hk, dim, shared", [(1, 1, 32, 8, 128, False), (8, 1, 32, 8, 128, False),
                                                                (2, 7, 9, 3, 64, True), (3, 1, 8, 2, 256, False)])
def test_rotary_equals_transformers_bit_for_bit(batch, tokens, hq, hk, dim, shared, dtype):
    rows = outlier_input((batch, tokens, (hq + hk) * dim), dtype, seed=dim).cuda()
    q = rows[..., :hq * dim].view(batch, tokens, hq, dim).transpose(1, 2)
    k = rows[..., hq * dim:].view(batch, tokens, hk, dim).transpose(1, 2)
    cos, sin = (t.cuda() for t in rope_tables(batch, tokens, dim, dtype, shared, seed=batch))
    outs = [torch.full_like(x, float("nan")) for x in (q, k)]
    got = layers.rotary(q, k, cos, sin, *outs)
    for a, b in zip(got, modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, merged", [((1, 1, 14336), True), ((8, 1, 14336), False), ((2, 5, 1536), True)])
def test_silu_mul_matches_transformers(shape, merged, dtype):
    if merged:
        both = outlier_input((*shape[:-1], 2 * shape[-1]), dtype, seed=3, scale=2.0).cuda()
        gate, up = both[..., :shape[-1]], both[..., shape[-1]:]
    else:
        gate, up = (outlier_input(shape, dtype, seed=i, scale=2.0).cuda() for i in (1, 2))
    out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    fused = layers.silu_mul(gate, up, out=out)
    plain = torch.nn.functional.silu(gate) * up
    g = gate.double()
    assert_as_accurate(fused, plain, g / (1 + torch.exp(-g)) * up.double(), dtype)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_fused_bf16_forward_as_accurate_as_transformers(name):
    model = varied(name, torch.bfloat16).cuda()
    reference = copy.deepcopy(model).double()
    ids = torch.randint(0, 1000, (4, 1), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        want, plain = reference(input_ids=ids).logits, model(input_ids=ids).logits
        for merge in (False, True):
            fusion = LayerFusion(model, merge=merge)
            with fusion.active():
                fused = model(input_ids=ids).logits
            fusion.remove()
            assert max_error(fused, want) <= 2 * max_error(plain, want) + FP32_TOL, merge


def _lm(model, method: str, backend: str, fused_layers: str):
    from oscar import build_method
    from oscar.backend import build_backend
    from oscar.lm import KVModel
    from tests.test_engine_gpu import char_tokenizer

    return KVModel(copy.deepcopy(model), char_tokenizer(), build_method(method, residual_length=32),
                   backend=build_backend(backend), decode="graph", fused_layers=fused_layers)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("method, backend", [("fp16", "torch"), ("kivi", "torch"), ("fp16", "cupy")])
def test_graph_tokens_in_float32_equal_the_unfused_engines(name, method, backend):
    """CUDA-graph decoding with the fused layers (on; merged) gives the tokens of fused_layers=off in float32 (the
    kernel methods' attention takes 16-bit models only: their fused bf16 step is tests/test_engine_gpu.py's, graph
    against eager); after ``unfuse`` every parameter holds its values in its own storage."""
    from tests.test_engine_gpu import PROMPTS

    model = varied(name).cuda()
    tokens = {}
    for fused_layers in ("off", "on", "merged"):
        lm = _lm(model, method, backend, fused_layers)
        assert lm.engine.fused_layers == fused_layers
        enc = lm.tokenizer(PROMPTS, return_tensors="pt", padding=True).to("cuda")
        tokens[fused_layers] = lm.engine.generate(enc["input_ids"], enc["attention_mask"], 60, eos_token_ids=set())
        assert lm.engine._slots[2].graph is not None
        if fused_layers == "merged":
            before = {k: p.detach().clone() for k, p in lm.model.named_parameters()}
            lm.engine.unfuse()
            storages = [p.untyped_storage().data_ptr() for p in lm.model.parameters()]
            assert len(set(storages)) == len(storages)
            assert all(torch.equal(p, before[k]) for k, p in lm.model.named_parameters())
    assert all(len(set(row)) >= 8 for row in tokens["off"])
    assert tokens["on"] == tokens["off"] and tokens["merged"] == tokens["off"]


def test_auto_fuses_on_one_gpu_and_cuts_the_operations_of_a_step():
    """fused_layers=auto is merged for a model on one GPU; a replayed decode step of tiny-llama (bf16) runs at least
    16 fewer GPU operations per layer with the fused layers on (transformers' RMSNorm is about 7 kernels, its RoPE
    about 10, the SiLU product 2, the attention's residual add 1 in the norm after it: one add_rms_norm a layer),
    and merged 2 more (the q/k/v and gate/up GEMMs)."""
    from benchmarks.profiling import step_breakdown

    model = varied("tiny-llama", torch.bfloat16).cuda()
    assert _lm(model, "fp16", "torch", "auto").engine.fused_layers == "merged"
    counts, fused_adds = {}, {}
    for fused_layers in ("on", "off", "merged"):
        lm = _lm(model, "fp16", "torch", fused_layers)
        enc = lm.tokenizer(["Hello world, this is"], return_tensors="pt").to("cuda")
        slot = lm.engine._slot([0], lm.engine.capacity(enc["input_ids"].shape[1], 40))
        logits = lm.engine._prefill(enc["input_ids"], enc["attention_mask"], slot.cache)
        lm.engine.decode(slot, logits.argmax(-1), 4, eos_token_ids=set())  # warm-up and capture
        split, ops = step_breakdown(lambda: lm.engine.decode(slot, slot.picked.clone(), 9, eos_token_ids=set()), 8)
        counts[lm.engine.fused_layers] = split["kernels_per_step"]
        fused_adds[lm.engine.fused_layers] = sum(op.name == "add_rms_norm" for op in ops) / 8
    layers_n = model.config.num_hidden_layers
    assert fused_adds == {"on": layers_n, "off": 0, "merged": layers_n}  # one residual add + norm a layer
    assert counts["on"] <= counts["off"] - 16 * layers_n, counts
    assert counts["merged"] <= counts["on"] - 2 * layers_n, counts
