"""The 16-bit baseline: the cache stores keys and values as they are (in the model dtype)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from oscar.method import KVMethod, register_method
from oscar.quant import PackedTensor, quantize_groups


@register_method("fp16")
@dataclass
class FP16(KVMethod):
    """No quantization: every token goes through the same cache path, stored unquantized."""

    k_bits: int = 16
    v_bits: int = 16
    residual_length: int = 0

    def __post_init__(self) -> None:
        if (self.k_bits, self.v_bits) != (16, 16):
            raise ValueError("fp16 stores keys and values unquantized: k_bits and v_bits must be 16")
        super().__post_init__()

    def quantize_keys(self, k: Tensor, layer_idx: int) -> PackedTensor:
        return quantize_groups(k, 16, self.group_size, "token")

    def quantize_values(self, v: Tensor, layer_idx: int) -> PackedTensor:
        return quantize_groups(v, 16, self.group_size, "token")
