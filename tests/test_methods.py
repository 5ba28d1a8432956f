"""The registry's errors, KIVI's and OScaR's error ladder over bits, and OScaR specifics. The contract every method
keeps is checked for each of them in tests/test_conformance.py."""

import pytest
import torch

from oscar import build_method
from oscar.quant import dequantize_groups, hadamard
from tests.test_quant import kv_like

@pytest.mark.parametrize("kwargs, match", [
    (dict(name="nope"), "unknown KV method 'nope'"),
    (dict(name="oscar", k_bits=9), "k_bits=9"),
    (dict(name="kivi", v_bits=0), "v_bits=0"),
    (dict(name="oscar", residual_length=100, group_size=32), "multiple of group_size"),
    (dict(name="oscar", flavour=1), "no hyperparameter"),
    (dict(name="oscar", norm_scope="layer"), "norm_scope"),
])
def test_bad_hyperparameters_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_method(**kwargs)


def test_rotating_method_refuses_non_power_of_two_head_dim():
    with pytest.raises(ValueError, match="power of two"):
        build_method("oscar").check_model(head_dim=96, num_kv_heads=8)
    build_method("kivi").check_model(head_dim=96, num_kv_heads=8)  # no rotation: fine


@pytest.mark.parametrize("name", ["kivi", "oscar"])
@pytest.mark.parametrize("bits, tol", [(8, 0.01), (4, 0.12), (2, 0.5)])
def test_scores_approximate_q_kT_tighter_with_more_bits(name, bits, tol):
    """transform_query(q) @ dequantize(quantize_keys(k))^T ~ q @ k^T, within the error of each width."""
    method = build_method(name, k_bits=bits, v_bits=bits)
    k, q = kv_like(t=64, seed=1), kv_like(t=8, seed=2)
    packed = method.quantize_keys(k, 0)
    assert packed.nbytes > 0
    k_hat = method.dequantize(packed)
    assert k_hat.shape == k.shape
    scores = method.transform_query(q, 0) @ k_hat.transpose(-1, -2)
    ref = q @ k.transpose(-1, -2)
    rel = ((scores - ref).norm() / ref.norm()).item()
    assert rel < tol


def test_oscar_stores_one_fp32_norm_per_token_and_multiplies_it_back():
    k = kv_like(t=64).to(torch.bfloat16)
    method = build_method("oscar", k_bits=8)
    packed = method.quantize_keys(k, 0)
    norm = packed.buffers["norm"]
    assert norm.shape == (k.shape[0], 1, 64, 1) and norm.dtype == torch.float32
    hk = hadamard(k.float())
    assert torch.allclose(norm, hk.square().sum(dim=(1, 3), keepdim=True).sqrt(), rtol=1e-2)
    unscaled = dequantize_groups(packed, torch.float32)  # the quantized unit-norm keys
    assert torch.allclose(unscaled.square().sum(dim=(1, 3)), torch.ones(2, 64), atol=0.05)
    assert torch.allclose(method.dequantize(packed).float(), hk, atol=0.05 * hk.abs().max().item())
    assert packed.buffers["scale"].dtype == torch.bfloat16


def test_oscar_switches_change_what_is_stored():
    k = kv_like(t=64)
    assert "norm" not in build_method("oscar", scale=False).quantize_keys(k, 0).buffers
    head = build_method("oscar", norm_scope="head").quantize_keys(k, 0).buffers["norm"]
    assert head.shape == (2, 3, 64, 1)
    q = kv_like(t=4, seed=3)
    assert torch.equal(build_method("oscar", rotate=False).transform_query(q, 0), q)
    assert not torch.equal(build_method("oscar").transform_query(q, 0), q)


def test_zero_norm_token_is_read_as_one():
    k = kv_like(t=32)
    k[:, :, 7] = 0.0
    out = build_method("oscar", k_bits=8).quantize_keys(k, 0)
    assert torch.isfinite(out.buffers["norm"]).all() and (out.buffers["norm"][:, :, 7] == 1).all()
    assert torch.isfinite(build_method("oscar").dequantize(out)).all()


def test_kivi_uses_float_zero_and_per_channel_keys_per_token_values():
    method = build_method("kivi")
    k = kv_like(t=64)
    pk, pv = method.quantize_keys(k, 0), method.quantize_values(k, 0)
    assert pk.meta["axis"] == "channel" and pk.meta["zero_point"] == "float"
    assert pv.meta["axis"] == "token" and pv.buffers["scale"].shape == (2, 3, 64, 2)


def test_two_bit_oscar_cache_is_about_5_3x_smaller_than_fp16_in_real_bytes():
    """D=128, G=32, H_kv=8, fp16: 2-bit codes + fp16 scale/zero per 32 values + one fp32 norm per token."""
    b, h, t, d = 1, 8, 1024, 128
    k, v = kv_like(b, h, t, d).half(), kv_like(b, h, t, d, seed=4).half()
    oscar, fp16 = build_method("oscar"), build_method("fp16")
    quantized = oscar.quantize_keys(k, 0).nbytes + oscar.quantize_values(v, 0).nbytes
    full = fp16.quantize_keys(k, 0).nbytes + fp16.quantize_values(v, 0).nbytes
    assert full == 2 * b * h * t * d * 2
    codes, params = b * h * t * d // 4, 2 * b * h * t * d // 32 * 2
    assert quantized == 2 * codes + 2 * params + b * t * 4  # K and V codes, scale+zero, K norms
    assert 5.2 < full / quantized < 5.4
