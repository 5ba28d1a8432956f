"""QuaRot (Ashkboos et al., NeurIPS 2024) as a KV-cache method.

Algorithm (the KV part of QuaRot: weights and activations stay in full precision here):
  1. values: a per-head Hadamard H_D folded offline into v_proj (rows) and o_proj (columns), so the
     cache holds H v and the output projection undoes it;
  2. keys: the online Hadamard H_D on K after RoPE, and the same H_D on Q, so q.k is unchanged;
  3. K and V quantized per token in groups of G consecutive channels, asymmetric with an integer
     zero point, range optionally clipped (``clip_ratio``, QuaRot's KV default is no clipping);
  4. the most recent R tokens stay in full precision with the ``kivi`` flush policy.
QuaRot quantizes the whole cache with no residual window; R (default 128, as for every method of
the comparison) and its flush policy are our choices for a fair comparison: ``residual_length=0``
gives QuaRot's own setting. Scales and zeros are stored in the model dtype.
At other widths b (1-8) the same quantizer has 2^b levels; at 1 bit, with the integer zero point, one of the two
levels is 0 and the other one step (the group's range) on the side of the larger magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from oscar.method import FlushPolicy, KVMethod, register_method
from oscar.options import bounded
from oscar.quant import PackedTensor, ZeroPoint, hadamard, quantize_groups
from oscar.weights import fold_value_hadamard


@register_method("quarot")
@dataclass
class QuaRot(KVMethod):
    uses_hadamard = True

    flush: FlushPolicy = "kivi"
    #: min and max of each group are multiplied by this before the scale is taken (1.0 = no clipping)
    clip_ratio: float = bounded(1.0, gt=0, le=1)
    zero_point: ZeroPoint = "int"

    def prepare_model(self, model: torch.nn.Module) -> None:
        fold_value_hadamard(model)

    @property
    def hadamard_space(self) -> bool:
        return True

    def transform_query(self, q: Tensor, layer_idx: int) -> Tensor:
        return hadamard(q)

    def transform_key(self, k: Tensor, layer_idx: int) -> Tensor:
        return hadamard(k)

    def quantize_keys(self, k: Tensor, layer_idx: int) -> PackedTensor:
        return quantize_groups(hadamard(k), self.k_bits, self.group_size, "token", self.zero_point, self.clip_ratio)

    def quantize_values(self, v: Tensor, layer_idx: int) -> PackedTensor:
        return quantize_groups(v, self.v_bits, self.group_size, "token", self.zero_point, self.clip_ratio)
