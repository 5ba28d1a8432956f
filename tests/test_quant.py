"""Quantization primitives: Hadamard, asymmetric quantizer, bit packing, PackedTensor bytes."""

import math

import pytest
import torch

from oscar.quant import (PackedTensor, dequantize_groups, hadamard, hadamard_matrix, pack_bits, quantize_groups,
                         unpack_bits)


def kv_like(b=2, h=3, t=64, d=64, seed=0) -> torch.Tensor:
    """Random keys with a few large channels and a low-norm first token (the structure KV methods target)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g)
    x[..., 3] *= 12.0
    x[..., 17] += 6.0
    x[:, :, 0] *= 0.1
    return x


@pytest.mark.parametrize("d", [2, 8, 64, 128, 256])
def test_hadamard_matches_dense_and_is_orthogonal_and_self_inverse(d):
    x = torch.randn(5, 7, d, dtype=torch.float64)
    h = hadamard_matrix(d, torch.float64)
    assert torch.allclose(hadamard(x), x @ h, atol=1e-12)
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-12)
    # Sylvester natural order: entry (i, j) has sign (-1)^popcount(i & j)
    i, j = 3 % d, (d - 1)
    assert h[i, j] * math.sqrt(d) == pytest.approx((-1) ** bin(i & j).count("1"))


def test_hadamard_keeps_dtype_and_rejects_non_power_of_two():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert hadamard(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.randn(3, 96))


def _scale_per_element(p: PackedTensor) -> torch.Tensor:
    scale = p.buffers["scale"].float()
    g = p.meta["group_size"]
    if p.meta["axis"] == "channel":
        return scale.repeat_interleave(g, dim=2)
    return scale.repeat_interleave(g, dim=3)


@pytest.mark.parametrize("zero_point", ["int", "float"])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_round_trip_error_within_half_a_step(zero_point, axis, bits):
    x = kv_like()
    p = quantize_groups(x, bits, 32, axis, zero_point)
    err = (dequantize_groups(p) - x).abs()
    bound = _scale_per_element(p) / 2
    assert (err <= bound * (1 + 1e-5) + 1e-6).all(), (err - bound).max()
    assert p.buffers["codes"].dtype == torch.uint8


@pytest.mark.parametrize("zero_point", ["int", "float"])
def test_zero_range_groups_are_exact_and_finite(zero_point):
    x = kv_like(t=64)
    x[:, :, :32, 5] = 2.75  # one constant key group per head
    x[:, :, :, 9] = 0.0  # a channel that is zero everywhere
    x[:, :, 32:, 11] = -1.5
    for axis in ("channel", "token"):
        p = quantize_groups(x, 2, 32, axis, zero_point)
        assert all(torch.isfinite(b.float()).all() for b in p.buffers.values())
        y = dequantize_groups(p)
        assert torch.isfinite(y).all()
    y = dequantize_groups(quantize_groups(x, 2, 32, "channel", zero_point))
    assert torch.equal(y[:, :, :32, 5], x[:, :, :32, 5])
    assert torch.equal(y[:, :, :, 9], x[:, :, :, 9])
    assert torch.equal(y[:, :, 32:, 11], x[:, :, 32:, 11])


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_packing_round_trips_exactly(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 2, 5, 64), generator=g).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_bits(packed, bits, 64), codes)


def test_two_bit_layout_is_little_endian_within_int32_words():
    codes = torch.tensor([[1, 2, 3, 0] * 4 + [3] * 16], dtype=torch.uint8)
    words = pack_bits(codes, 2).view(torch.int32)
    expected = sum(int(c) << (2 * i) for i, c in enumerate(codes[0, :16].tolist()))
    assert words[0, 0].item() == expected  # code i of the word sits at bits [2i, 2i+2)


def test_nbytes_is_the_sum_of_real_buffers():
    x = kv_like(b=1, h=8, t=64, d=128).half()
    p = quantize_groups(x, 2, 32, "channel", "int")
    codes = 1 * 8 * 64 * 128 * 2 // 8
    params = 2 * (1 * 8 * (64 // 32) * 128) * 2  # scale + zero, fp16
    assert p.nbytes == codes + params == sum(b.numel() * b.element_size() for b in p.buffers.values())
    assert quantize_groups(x, 16, 32, "channel").nbytes == x.numel() * 2


def test_packed_tensors_concatenate_along_tokens():
    x = kv_like(t=96)
    parts = [quantize_groups(x[:, :, i:i + 32], 2, 32, "channel") for i in (0, 32, 64)]
    whole = quantize_groups(x, 2, 32, "channel")
    cat = PackedTensor.cat(parts)
    assert cat.shape == whole.shape and cat.nbytes == whole.nbytes
    assert torch.equal(dequantize_groups(cat), dequantize_groups(whole))


def test_bad_inputs_raise_clear_errors():
    x = kv_like(t=48)
    with pytest.raises(ValueError, match="T % G"):
        quantize_groups(x, 2, 32, "channel")
    with pytest.raises(ValueError, match="bits"):
        quantize_groups(x, 9, 16, "token")
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits(torch.zeros(3, 12, dtype=torch.uint8) + 1, 2)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_fast_packing_path_equals_the_bit_stream_definition(bits):
    """Codes that fill whole bytes take a shift path; it must write the generic little-endian stream."""
    codes = torch.randint(0, 2**bits, (2, 3, 64), generator=torch.Generator().manual_seed(7)).to(torch.uint8)
    stream = ((codes.int().unsqueeze(-1) >> torch.arange(bits)) & 1).flatten(-2)  # bit i*b+j = bit j of code i
    expected = (stream.view(2, 3, -1, 8) << torch.arange(8)).sum(-1).to(torch.uint8)
    assert torch.equal(pack_bits(codes, bits), expected)
