"""backend=cupy: fused CUDA kernels on packed GPU storage (kernels.ops), for every method with a kernel variant
(OSCAR, method ``spectral``, has its variant and is refused until its cache's GPU test passes: its ``missing``).

Each method's variant (what it runs on the kernels) is its own file, kernels/variants/<method>.py, registered by name
(kernels.variant); the cache layer is kernels.cupy_layer.CupyKVLayer (its module docstring says how tokens move
between the packed storage, the exact slots and the window). This module is the backend: what it implements
(``missing``), the model checks, and the caches it makes (``new_cache`` for transformers' generate, growing by
doubling; ``static_cache`` for the decode engine). fp16 runs on the torch backend's static mirror (dense BF16 and
FlashAttention), so ``backend=cupy method=fp16,oscar,kivi`` compares engine against engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import ops
from kernels.runtime import cupy
from kernels.cupy_layer import CupyKVLayer
from kernels.fused_layers import LayerFusion
from kernels.variant import KERNELS, storage_granule
from oscar.attention import bind_cache
from oscar.backend import Backend, register_backend
from oscar.cache import QuantizedKVCache, left_pad_lengths
from oscar.method import KVMethod
from oscar.static_cache import StaticCache, TorchStaticCache

__all__ = ["KERNELS", "CupyBackend", "CupyKVCache", "CupyKVLayer", "check_method", "missing", "storage_granule"]


def missing(method: KVMethod) -> list[str]:
    """What of this method configuration the fused kernels do not implement."""
    if method.name == "fp16":
        return []  # the static BF16 mirror, no kernel
    if method.name not in KERNELS:
        return [f"method={method.name} (kernels exist for {', '.join(sorted(KERNELS))})"]
    return KERNELS[method.name].missing(method)


@register_backend("cupy")
@dataclass
class CupyBackend(Backend):
    """Fused CUDA kernels on packed storage (every method of :data:`KERNELS`); fp16 on the static BF16 mirror."""

    def missing(self, method: KVMethod) -> list[str]:
        return missing(method)

    def check_model(self, config) -> None:
        text = config.get_text_config()
        if any(kind == "sliding_attention" for kind in getattr(text, "layer_types", None) or []):
            raise ValueError("backend=cupy: the decode kernel attends over every stored token and has no "
                             "sliding-window layers; use backend=torch for this model")
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if head_dim not in ops.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"backend=cupy: head_dim {head_dim} is not one of {ops.SUPPORTED_HEAD_DIMS}")
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if text.num_attention_heads % kv_heads or text.num_attention_heads // kv_heads > 8:
            raise ValueError(f"backend=cupy: {text.num_attention_heads} query heads over {kv_heads} KV heads; the "
                             "decode kernel takes 1 to 8 query heads per KV head")

    def check_available(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("backend=cupy needs a CUDA GPU; use backend=torch on this machine")
        cupy()

    def new_cache(self, model, method, attention_mask=None, quantize_prefill=False):
        if method.name == "fp16":
            return QuantizedKVCache.for_model(model, method, attention_mask, quantize_prefill)
        if quantize_prefill:
            raise ValueError("backend=cupy quantizes decode tokens only (quantize_prefill=false); use backend=torch")
        pads = None if attention_mask is None else left_pad_lengths(attention_mask)
        return CupyKVCache.for_model(model, method, pads)

    def has_static_cache(self, method) -> bool:
        return True

    def static_cache(self, model, method, pad_lengths, capacity) -> StaticCache:
        if method.name == "fp16":
            return TorchStaticCache.for_model(model, method, pad_lengths, capacity)
        return CupyKVCache.for_model(model, method, pad_lengths, capacity, engine=True)

    def layer_fusion(self, config):
        """kernels.fused_layers.LayerFusion (RMSNorm, RoPE, the SiLU product as kernels) for the architectures it
        fuses, where the kernels can run."""
        return LayerFusion if LayerFusion.supports(config) and ops.cupy_available() else None

    def step_rotation(self):
        """kernels.ops.hadamard_step (bit-equal to the torch Hadamards) where the kernels can run."""
        return ops.hadamard_step if ops.cupy_available() else None

    def capacity_multiple(self, method: KVMethod) -> int:
        if method.name not in KERNELS:  # fp16's mirror
            return max(method.residual_length, method.group_size, 16)
        return storage_granule(method)


def check_method(method: KVMethod) -> None:
    """Raise ValueError unless the fused kernels implement this method configuration."""
    CupyBackend().check(method)


class CupyKVCache(StaticCache):
    """A transformers Cache whose layers hold packed GPU storage read by the fused decode kernel."""

    def __init__(self, method: KVMethod, num_layers: int, pad_lengths: list[int], capacity: int = 0,
                 device=None, engine: bool = False):
        check_method(method)
        self.method = method
        layers = [CupyKVLayer(method, i, pad_lengths, capacity, engine) for i in range(num_layers)]
        super().__init__(layers, pad_lengths, capacity, device, [None] * num_layers)

    @classmethod
    def for_model(cls, model, method: KVMethod, pad_lengths: list[int] | None = None, capacity: int = 0,
                  engine: bool = False, batch: int = 1) -> "CupyKVCache":
        """A cache for ``model``, bound to it (its attention reads this cache's layers)."""
        num_layers = model.config.get_text_config().num_hidden_layers
        device = next(model.parameters()).device
        cache = cls(method, num_layers, pad_lengths if pad_lengths is not None else [0] * batch, capacity, device,
                    engine)
        bind_cache(model, cache)
        return cache

    # the kernel reads per-row lengths itself: no masks to build (a constant stands in for HF's mask)
    def decode_mask(self) -> Tensor:
        if self._masks is None:
            self._masks = {"full_attention": torch.ones(self.batch_size, 1, 1, 1, dtype=torch.bool,
                                                        device=self.lengths.device)}
        return self._masks["full_attention"]

    def prepare_step(self) -> None:
        pass

    def finish_step(self) -> None:
        for layer in self.layers:
            layer.finish_step()
        super().finish_step()
