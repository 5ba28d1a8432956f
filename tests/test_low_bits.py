"""Every quantizing method at the frontier's bit widths (1, 2, 3 and 4 bits, and mixed K/V bits): one more
bit costs exactly one bit per stored value (codes packed at any width, the rest of what is stored unchanged) and
lowers the error, so no quantizer or packer breaks below 2 bits or at an odd width."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from oscar import available_methods, method_class
from tests.conftest import build_tiny
from tests.test_quant import kv_like

QUANTIZING = [m for m in available_methods()
              if {f.name: f.default for f in dataclasses.fields(method_class(m))}["k_bits"] != 16]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny("tiny-llama")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def quantized(method, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> tuple[tuple[int, int], tuple[float, float]]:
    """(key bytes, value bytes), (score error, value error) of one chunk quantized on its own."""
    pk, pv = method.quantize_keys(k, 0), method.quantize_values(v, 0)
    scores = method.transform_query(q, 0) @ method.dequantize(pk).transpose(-1, -2)
    return (pk.nbytes, pv.nbytes), (relative(scores, q @ k.transpose(-1, -2)), relative(method.dequantize(pv), v))


@pytest.mark.parametrize("name", QUANTIZING)
def test_one_more_bit_costs_one_bit_per_value_and_lowers_the_error(name, make_method, tiny):
    # 128 tokens: more than spectral's 64 exact sink tokens; keys with large channels, Gaussian values
    k, q = kv_like(b=1, h=2, t=128, d=64, seed=1), kv_like(b=1, h=2, t=8, d=64, seed=3)
    v = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(2))
    stored, errors = {}, {}
    for bits in (1, 2, 3, 4):
        method = make_method(name, k_bits=bits, v_bits=bits)
        method.prepare_model(copy.deepcopy(tiny))
        stored[bits], errors[bits] = quantized(method, k, v, q)
    for bits in (2, 3, 4):
        assert stored[bits][0] - stored[bits - 1][0] == k.numel() // 8, (bits, stored)
        assert stored[bits][1] - stored[bits - 1][1] == v.numel() // 8, (bits, stored)
        assert errors[bits][0] < errors[bits - 1][0] and errors[bits][1] < errors[bits - 1][1], (bits, errors)
    assert errors[4][0] < 0.25 and errors[4][1] < 0.25, errors
    mixed = make_method(name, k_bits=1, v_bits=2)
    mixed.prepare_model(copy.deepcopy(tiny))
    assert quantized(mixed, k, v, q) == ((stored[1][0], stored[2][1]), (errors[1][0], errors[2][1]))
