"""The drop-in: a KV method in a researcher's own transformers code, for the length of a ``with`` block.

    with oscar.apply(model, "oscar") as make_cache:
        out = model.generate(**inputs, cache=make_cache(inputs), max_new_tokens=32, do_sample=False)

On entry the model is prepared for the method (oscar.preparation: its ``prepare_model``, e.g. a value rotation folded
into v_proj / o_proj or RotateKV's sink hooks, and its attention routed through the backend); ``make_cache(inputs)``
(a tokenizer's batch, or its attention mask) gives a fresh cache of the method for one batch (``cache=`` since
transformers 5.2x, ``past_key_values=`` before: oscar.cache.cache_keyword); on exit the model is
put back exactly (its state dict bit for bit, its attention implementation, its hooks), and a model that another
method had prepared before the block (a ``KVModel``) is prepared for it again.

Inside the block the model attends only through the method: a forward that starts a sequence without one of its
caches gets a fresh one from its attention mask (so ``model.generate(**inputs)`` and a transformers
``pipeline("text-generation", model=model, ...)``, which makes a cache per call itself, run the method too), and
another method's cache is refused. Batches are left-padded (``tokenizer.padding_side = "left"``; the cache refuses
right padding).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from torch import Tensor, nn

from oscar.backend import Backend, build_backend
from oscar.method import KVMethod, build_method
from oscar.preparation import Preparation, preparation, prepare, restore

__all__ = ["CacheFactory", "apply"]


class CacheFactory:
    """What :func:`apply` yields: ``make_cache(inputs)`` -> a fresh cache of the method for one batch."""

    def __init__(self, model: nn.Module, prepared: Preparation):
        self.model, self.method, self.backend = model, prepared.method, prepared.backend
        self.open = True

    def __call__(self, inputs: Mapping | Tensor | None = None, quantize_prefill: bool = False):
        """A cache for the batch of ``inputs``: a tokenizer's output (its ``attention_mask``), the attention mask
        [B, T] itself, or None (a batch without padding). ``quantize_prefill``: attention reads what the cache stores
        from the first forward on (perplexity) instead of the prompt in full precision (oscar.cache)."""
        if not self.open:
            raise ValueError("make_cache: the oscar.apply block has ended and the model was restored; make caches "
                             "inside the block")
        mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else inputs
        if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2):
            raise ValueError(f"make_cache: expected a tokenizer's batch or its attention mask [B, T], got "
                             f"{type(mask).__name__}{tuple(mask.shape) if isinstance(mask, Tensor) else ''}")
        return self.backend.new_cache(self.model, self.method, mask, quantize_prefill)


@contextmanager
def apply(model: nn.Module, method: KVMethod | str, backend: Backend | str = "torch") -> Iterator[CacheFactory]:
    """Run ``model`` (a transformers causal LM) with ``method`` (a KVMethod, or a registered name with its defaults)
    inside the block, through ``backend`` ("torch": the reference, any device; "cupy": the fused kernels, on a CUDA
    GPU; or a Backend). Yields a :class:`CacheFactory`; the module docstring says what happens on entry, inside and
    on exit. The method, backend and model are checked before anything changes (one-line errors)."""
    method = build_method(method) if isinstance(method, str) else method
    if not isinstance(method, KVMethod):
        raise ValueError(f"oscar.apply: method must be a KVMethod or a method name, got {type(method).__name__}")
    backend = build_backend(backend) if isinstance(backend, str) else backend
    backend.check(method)
    backend.check_available()
    backend.check_model(model.config)
    method.check_config(model.config)
    before = preparation(model)
    earlier = None if before is None else (before.method, before.backend)
    factory = CacheFactory(model, prepare(model, method, backend))
    try:
        yield factory
    finally:
        factory.open = False
        restore(model)
        if earlier is not None:
            prepare(model, *earlier)
