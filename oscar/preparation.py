"""Preparing a model for a KV method, and undoing it exactly.

A method's cache is only correct on a model prepared for that method object: its ``prepare_model`` done (a value
rotation folded into v_proj / o_proj, RotateKV's sink hooks) and the model's attention routed through the backend
(``attach``: the query transform). :func:`prepare` does both, keeping what undoing them takes: a copy of the
parameters ``prepare_model`` may change (the value and output projections, on the CPU; any other parameter it
changes is refused), the attention implementation of every config, and a guard on the model's forward.
:func:`restore` puts the model back: its state dict bit for bit, its attention implementation, its hooks.

The guard (a forward pre-hook on the model) lets a prepared model attend only through its method's caches:

- a cache of another method object is refused, in one line (unless the two are interchangeable:
  oscar.method.interchangeable);
- one of the method's caches is checked against the batch (oscar.cache.QuantizedKVCache.check_batch: the padding it
  was made for; a cache that already holds another sequence);
- a forward that starts a sequence without one (no cache, or a transformers cache still empty: what ``generate``
  makes when given none, as a ``pipeline`` calls it) gets a fresh cache of the method from its attention mask;
- a transformers cache that already holds tokens is refused, and so is a static one (``cache_implementation="static"``:
  the model shapes its masks to the cache's fixed length, and the batch's padding is then unknown).

Preparing a model that another method prepared restores it first. :class:`oscar.lm.KVModel` and
:func:`oscar.apply` prepare through here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.cache_utils import StaticCache

from oscar.attention import detach
from oscar.backend import Backend, TorchBackend
from oscar.cache import cache_keyword
from oscar.method import KVMethod, interchangeable, prepared_method, release
from oscar.weights import FOLD_MARKS, restore_unfolded, value_output_parameters

__all__ = ["Preparation", "preparation", "prepare", "restore"]


@dataclass(eq=False)
class Preparation:
    """What :func:`prepare` did to a model, and what undoing it takes."""

    method: KVMethod
    backend: Backend
    #: the value and output projections before ``prepare_model`` (CPU copies, by oscar.weights.value_output_parameters'
    #: keys); empty for a method without a prepare_model
    saved: dict[str, Tensor]
    #: every config of the model and its ``_attn_implementation_internal`` before ``attach``
    implementations: list[tuple[PretrainedConfig, object]]
    guard: torch.utils.hooks.RemovableHandle | None = field(default=None, repr=False)


#: each prepared model's :class:`Preparation`, weakly keyed by the model (nothing here keeps a model alive)
_PREPARATIONS: "weakref.WeakKeyDictionary[nn.Module, Preparation]" = weakref.WeakKeyDictionary()


def preparation(model: nn.Module) -> Preparation | None:
    """How :func:`prepare` left ``model`` (None: it is not prepared through here)."""
    return _PREPARATIONS.get(model)


@torch.no_grad()
def prepare(model: nn.Module, method: KVMethod, backend: Backend | None = None) -> Preparation:
    """Prepare ``model`` for ``method`` through ``backend`` (default: torch): ``method.prepare_model`` and
    ``backend.attach``, the guard installed (module docstring). Nothing to do when it is prepared so already; a
    model prepared for another method (or backend) is restored first. A model whose value projections were folded
    outside this module is refused (nothing here knows them as loaded)."""
    backend = TorchBackend() if backend is None else backend
    done = _PREPARATIONS.get(model)
    if done is not None and done.method is method and done.backend == backend:
        return done
    if done is not None:
        restore(model)
    elif any(model.__dict__.get(mark) for mark in FOLD_MARKS):
        owner = prepared_method(model)
        raise ValueError(f"the value projections of this {type(model).__name__} were rotated by "
                         f"{owner.name if owner else 'a value fold'} outside KVModel and oscar.apply, which cannot "
                         "restore them: load a fresh model")
    release(model)  # a method that prepared it directly (method.prepare_model) lets go of its hooks
    folds = type(method).prepare_model is not KVMethod.prepare_model  # the default changes nothing: nothing to copy
    saved = {key: p.detach().to("cpu", copy=True) for key, p in value_output_parameters(model).items()} if folds else {}
    versions = {name: p._version for name, p in model.named_parameters()}
    implementations = [(config, config.__dict__.get("_attn_implementation_internal")) for config in _configs(model)]
    done = Preparation(method, backend, saved, implementations)
    _PREPARATIONS[model] = done
    try:
        method.prepare_model(model)
        backend.attach(model, method)
        kept = {id(p) for p in value_output_parameters(model).values()} if folds else set()
        changed = [name for name, p in model.named_parameters() if p._version != versions[name] and id(p) not in kept]
        if changed:
            raise ValueError(f"{method.name}.prepare_model changed {', '.join(changed[:3])}, which nothing can restore "
                             "(a copy is kept of the value and output projections only): load a fresh model")
    except Exception:
        restore(model)
        raise
    done.guard = model.register_forward_pre_hook(_guard(done), with_kwargs=True)
    return done


@torch.no_grad()
def restore(model: nn.Module) -> None:
    """Undo :func:`prepare`: the guard and the method's hooks removed, the attention modules unrouted and every
    config's attention implementation put back, the value and output projections copied back bit for bit. A model
    not prepared through here is left as it is."""
    done = _PREPARATIONS.pop(model, None)
    if done is None:
        return
    if done.guard is not None:
        done.guard.remove()
    release(model)
    detach(model)
    for config, implementation in done.implementations:
        config._attn_implementation_internal = implementation
    if done.saved:
        restore_unfolded(model, done.saved)
    for mark in FOLD_MARKS:
        model.__dict__.pop(mark, None)


def _configs(model: nn.Module) -> list[PretrainedConfig]:
    """Every config of ``model``: its modules' and, at any depth, their sub-configs (each once)."""
    found: dict[int, PretrainedConfig] = {}
    stack = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while stack:
        config = stack.pop()
        if id(config) not in found:
            found[id(config)] = config
            stack += [sub for key in config.sub_configs
                      if isinstance(sub := getattr(config, key, None), PretrainedConfig)]
    return list(found.values())


def _new_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens per row a forward call feeds (its input_ids or inputs_embeds)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    return 0 if ids is None else ids.shape[1]


def _guard(done: Preparation):
    """The forward pre-hook of a prepared model (the module docstring's rules)."""
    method, keyword = done.method, None

    def guard(model: nn.Module, args: tuple, kwargs: dict):
        nonlocal keyword
        keyword = keyword or cache_keyword(model)  # the forward's signature, read once
        name = "past_key_values" if "past_key_values" in kwargs and "cache" not in kwargs else keyword
        cache = kwargs.get(name)
        given = kwargs.get("attention_mask")
        mask = given if isinstance(given, Tensor) and given.dim() == 2 else None
        owner = getattr(cache, "method", None)
        if isinstance(owner, KVMethod):
            if not interchangeable(method, owner):
                which = f"another {owner.name} method object" if owner.name == method.name else owner.name
                raise ValueError(f"this {type(model).__name__} is prepared for {method.name}, and the cache is "
                                 f"{which}'s: make caches from the model's own preparation (the make_cache of its "
                                 "oscar.apply block, or KVModel.new_cache)")
            check = getattr(cache, "check_batch", None)
            if check is not None:
                check(mask, _new_tokens(args, kwargs))
            return None
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(f"this {type(model).__name__} is prepared for {method.name}, and the forward brought a "
                             f"{type(cache).__name__} holding {cache.get_seq_length()} tokens: start sequences with "
                             "no cache (one of the method's is made) or with make_cache(inputs)")
        if isinstance(cache, StaticCache) or given is not None and mask is None:
            # a fixed-length cache: the model shapes its masks to that length, and its padding is unknown here
            raise ValueError(f"this {type(model).__name__} is prepared for {method.name}, whose caches grow with the "
                             f"sequence: a {type(cache).__name__ if cache is not None else 'static cache'} "
                             "(cache_implementation='static') or a mask that is not [batch, tokens] is not supported; "
                             "pass cache=make_cache(inputs), or no cache")
        kwargs[name] = done.backend.new_cache(model, method, mask)
        return args, kwargs

    return guard
