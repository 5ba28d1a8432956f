"""Backends: who stores a method's cache and computes its attention.

A backend is a small dataclass registered by name (``conf/backend/<name>.yaml``; its fields are the
options). It says which method configurations it implements (``missing``), checks what it needs before any
model is loaded, routes the model's attention through itself (``attach``) and makes the caches: one for any
forward call (``new_cache``: prefill-only tasks, transformers' generate for multimodal prompts) and one for
the decode engine (``static_cache``: storage allocated once for prompt + new tokens, written in place). A backend
may also offer every engine kernels that run here whatever the backend: the decode step's query/key Hadamards
(``step_rotation``) and its fused layers (``layer_fusion``: RMSNorm, RoPE and the SiLU product as one launch each).
Shared code never names a method: a configuration is checked by the backend that runs it.

    torch  (here)             the reference: packed tokens dequantized by the method, attention in SDPA;
                              with ``mirror`` the dequantized tokens are kept (oscar.cache) so decoding
                              costs what BF16 decoding costs, with the same numbers
    cupy   (kernels.backend)  packed storage on the GPU read by fused CUDA kernels

A third backend registers itself with ``@register_backend(name)`` in a module that conf/backend/<name>.yaml
names as ``module``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn

from oscar.attention import attach as attach_hook
from oscar.cache import QuantizedKVCache
from oscar.method import KVMethod
from oscar.registry import Registry
from oscar.static_cache import StaticCache, StepRotation, TorchStaticCache

#: backends by name; the first lookup imports the modules that define them (their ``@register_backend``)
BACKENDS: Registry["Backend"] = Registry("backend", ["oscar.backend", "kernels.backend"])


def register_backend(name: str):
    """Class decorator: make a Backend buildable as ``build_backend(name, ...)`` (a name taken: ValueError)."""
    return BACKENDS.register(name)


def available_backends(extra_module: str | None = None) -> list[str]:
    """The registered backend names, sorted (``extra_module`` imported first: a backend defined elsewhere)."""
    return BACKENDS.names([extra_module] if extra_module else [])


def build_backend(name: str, module: str | None = None, **options) -> "Backend":
    """``build_backend("torch", mirror=True)``; ``module`` is imported first (a backend defined elsewhere)."""
    return BACKENDS.build(name, options, [module] if module else [])


@dataclass
class Backend:
    """The interface. Subclasses override ``missing`` and the cache factories they change."""

    name: ClassVar[str] = "base"

    # -- checks, before any model is loaded ----------------------------------------------------
    def missing(self, method: KVMethod) -> list[str]:
        """What of this method configuration the backend does not implement (empty: all of it)."""
        return []

    def check(self, method: KVMethod) -> None:
        """Raise ValueError naming what is missing and which backends implement the configuration."""
        problems = self.missing(method)
        if not problems:
            return
        others = [name for name in available_backends() if name != self.name
                  and not BACKENDS.get(name)().missing(method)]
        where = f"; backend={' or backend='.join(others)} implements it" if others else ""
        raise ValueError(f"backend={self.name} does not implement {', '.join(problems)}{where}")

    def check_model(self, config) -> None:
        """Raise ValueError if the backend cannot run a model of this (text) config."""

    def check_available(self) -> None:
        """Raise if this machine lacks what the backend needs (a GPU, a package)."""

    # -- the model and its caches --------------------------------------------------------------
    def attach(self, model: nn.Module, method: KVMethod) -> None:
        """Route every attention module of ``model`` through the backend (default: the method hook)."""
        attach_hook(model, method)

    def new_cache(self, model: nn.Module, method: KVMethod, attention_mask: Tensor | None = None,
                  quantize_prefill: bool = False):
        """A cache for a batch of forward calls (prefill, perplexity, transformers' generate)."""
        raise NotImplementedError

    def static_cache(self, model: nn.Module, method: KVMethod, pad_lengths: list[int],
                     capacity: int) -> StaticCache | None:
        """The decode engine's cache for a batch, or None: generation then goes through transformers'
        generate on ``new_cache`` (eager, the reference)."""
        return None

    def has_static_cache(self, method: KVMethod) -> bool:
        """Whether :meth:`static_cache` gives ``method`` the decode engine's cache (what continuous batching needs),
        known before any model loads."""
        return False

    def step_rotation(self) -> StepRotation | None:
        """A fused decode-step rotation this backend offers the others' static caches (oscar.static_cache.StepRotation:
        the query's and the new keys' Hadamard in one launch), where it can run here; None: none."""
        return None

    def layer_fusion(self, config):
        """The fused decode-step layers this backend offers every engine of a model of this transformers ``config``
        where they can run here, as their factory ``(model, merge=False) -> fusion`` (kernels.fused_layers.LayerFusion:
        an ``active()`` scope and ``remove()``); None: none."""
        return None

    def capacity_multiple(self, method: KVMethod) -> int:
        """Static capacities are multiples of this (whole residual windows and groups)."""
        return max(method.residual_length, method.group_size, 1)

    def describe(self) -> dict:
        """What the run folder records about the backend."""
        return {"name": self.name, **dataclasses.asdict(self)}


@register_backend("torch")
@dataclass
class TorchBackend(Backend):
    """The reference: the method's own quantize/dequantize, attention in SDPA; any method, any device."""

    #: keep the dequantized packed tokens (filled once per flush) instead of dequantizing the whole packed
    #: part at every step: the same numbers, decoding at BF16 speed, through the decode engine. False: the
    #: per-step dequantization of the reference cache, decoded by transformers' generate
    mirror: bool = True

    def new_cache(self, model, method, attention_mask=None, quantize_prefill=False) -> QuantizedKVCache:
        return QuantizedKVCache.for_model(model, method, attention_mask, quantize_prefill, mirror=self.mirror)

    def has_static_cache(self, method: KVMethod) -> bool:
        return self.mirror

    def static_cache(self, model, method, pad_lengths, capacity) -> TorchStaticCache | None:
        if not self.mirror:
            return None
        return TorchStaticCache.for_model(model, method, pad_lengths, capacity, offered_step_rotation())


def offered_layer_fusion(config):
    """The fused decode-step layers a registered backend offers a model of this ``config`` (``Backend.layer_fusion``:
    the cupy backend's kernels for Llama and Qwen3 where CuPy and a GPU are present), found through the registry; None
    where none can run."""
    for name in available_backends():
        fusion = BACKENDS.get(name)().layer_fusion(config)
        if fusion is not None:
            return fusion
    return None


def offered_step_rotation() -> StepRotation | None:
    """The fused decode-step rotation a registered backend offers (``Backend.step_rotation``: the cupy backend's
    kernel where CuPy and a GPU are present), found through the registry: the core names no kernel."""
    for name in available_backends():
        rotation = BACKENDS.get(name)().step_rotation()
        if rotation is not None:
            return rotation
    return None
