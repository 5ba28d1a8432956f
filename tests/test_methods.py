"""The registry's errors, KIVI's and OScaR's error ladder over bits, and OScaR specifics. The contract every method
keeps is checked for each of them in tests/test_conformance.py."""

import pytest
import torch

from oscar import build_method
from oscar.quant import dequantize_groups, hadamard, quantize_groups
from tests.test_quant import kv_like

@pytest.mark.parametrize("kwargs, match", [
    (dict(name="nope"), "unknown KV method 'nope'"),
    (dict(name="oscar", k_bits=9), "k_bits=9"),
    (dict(name="kivi", v_bits=0), "v_bits=0"),
    (dict(name="oscar", residual_length=100, group_size=32), "multiple of group_size"),
    (dict(name="oscar", flavour=1), "no hyperparameter"),
    (dict(name="oscar", norm_scope="layer"), "norm_scope"),
    (dict(name="oscar", norm_floor="mean"), "norm_floor"),
    (dict(name="oscar", rotation="random"), "rotation"),
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


def test_a_target_norm_constant_over_a_group_changes_no_code():
    """Why OScaR's target norm is not a switch: a per-channel group scaled by a constant keeps its codes (a power of
    two here, so the scaling is exact in floating point), for both zero points and any width."""
    x = kv_like(t=64)
    factor = torch.tensor([0.25, 8.0]).repeat_interleave(32).view(1, 1, 64, 1)  # one constant per 32-token group
    for zero_point in ("int", "float"):
        for bits in (1, 2, 3):
            plain = quantize_groups(x, bits, 32, "channel", zero_point)
            scaled = quantize_groups(x * factor, bits, 32, "channel", zero_point)
            assert torch.equal(plain.buffers["codes"], scaled.buffers["codes"])


def test_oscar_norm_floor_divides_by_at_least_the_group_median():
    k = kv_like(t=64)
    norm = build_method("oscar").quantize_keys(k, 0).buffers["norm"]            # [B, 1, T, 1]
    floored = build_method("oscar", norm_floor="group_median").quantize_keys(k, 0).buffers["norm"]
    medians = norm.view(2, 1, 2, 32).median(-1).values.repeat_interleave(32, -1).view_as(norm)
    assert torch.equal(floored, torch.maximum(norm, medians))
    assert (floored[:, :, 0] > norm[:, :, 0]).all()                            # the low-norm first token keeps its size
    exact = build_method("oscar", norm_floor="group_median", k_bits=8)
    assert torch.allclose(exact.dequantize(exact.quantize_keys(k, 0)), hadamard(k), atol=0.02 * k.abs().max().item())


@pytest.mark.parametrize("rotation", ["signed_hadamard", "orthogonal"])
def test_oscar_rotations_keep_q_dot_k_and_are_seeded_per_layer(rotation):
    k, q = kv_like(t=64), kv_like(t=4, seed=3)
    method = build_method("oscar", rotation=rotation)
    rotated = method.transform_key(k, 1)
    assert torch.allclose(method.transform_query(q, 1) @ rotated.transpose(-1, -2), q @ k.transpose(-1, -2),
                          atol=1e-3 * (q @ k.transpose(-1, -2)).abs().max().item())
    assert not torch.allclose(rotated, hadamard(k), atol=1e-3)                  # not the plain H_D
    assert not torch.allclose(rotated, method.transform_key(k, 2), atol=1e-3)   # another layer, another matrix
    assert torch.equal(rotated, build_method("oscar", rotation=rotation).transform_key(k, 1))  # seeded
    assert not torch.equal(rotated, build_method("oscar", rotation=rotation, rotation_seed=1).transform_key(k, 1))
    exact = build_method("oscar", rotation=rotation, k_bits=8)
    k_hat = exact.dequantize(exact.quantize_keys(k, 1))
    assert torch.allclose(k_hat, rotated, atol=0.02 * k.abs().max().item())


def test_the_kernels_refuse_oscars_new_switches_by_name():
    from kernels.backend import KERNELS

    missing = KERNELS["oscar"].missing
    assert missing(build_method("oscar")) == []
    assert missing(build_method("oscar", rotation="orthogonal")) == [
        "rotation=orthogonal (the kernels rotate with H_D only)"]
    assert missing(build_method("oscar", norm_floor="group_median")) == [
        "norm_floor=group_median (the kernels divide each token by its own norm)"]
