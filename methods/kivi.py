"""KIVI (Liu et al., ICML 2024): a tuning-free asymmetric 2-bit KV-cache quantization.

Algorithm:
  1. keys: per-channel groups of G consecutive tokens, asymmetric, zero point = group min (float);
  2. values: per-token groups of G consecutive channels, same quantizer;
  3. the most recent tokens stay in full precision (residual R): keys are flushed R at a time,
     values one token at a time (flush policy ``kivi``).
No rotation. Scale and min are stored in the model dtype (fp16 in KIVI's own runs).
At other widths b (1-8) the same quantizer has 2^b levels; at 1 bit they are each group's min and max.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from oscar.method import FlushPolicy, KVMethod, register_method
from oscar.quant import PackedTensor, ZeroPoint, quantize_groups


@register_method("kivi")
@dataclass
class KIVI(KVMethod):
    keys_per_channel = True

    flush: FlushPolicy = "kivi"
    #: "float" is KIVI's own (min as the zero); "int" isolates the effect of the zero-point convention
    zero_point: ZeroPoint = "float"

    def quantize_keys(self, k: Tensor, layer_idx: int) -> PackedTensor:
        return quantize_groups(k, self.k_bits, self.group_size, "channel", self.zero_point)

    def quantize_values(self, v: Tensor, layer_idx: int) -> PackedTensor:
        return quantize_groups(v, self.v_bits, self.group_size, "token", self.zero_point)
