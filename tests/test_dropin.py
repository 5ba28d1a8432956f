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
