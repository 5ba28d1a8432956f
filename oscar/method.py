"""The KV-method interface and its registry.

A method is a small dataclass: its fields are the hyperparameters (what a Hydra config sets), its
methods are the algorithm. Subclasses implement ``quantize_keys`` and ``quantize_values`` and, when
they change the attention space (a rotation), ``transform_query``/``transform_key``; everything
else (residual window, flushing, batching, attention) is the cache's and the hook's job.

Contract (checked by outside tests): with k, q of shape [B, H, T, D],
``method.transform_query(q, i) @ method.dequantize(method.quantize_keys(k, i)).transpose(-1, -2)``
approximates ``q @ k.transpose(-1, -2)``.

Checks in one place, inherited by every method: the fields are typed and range-checked at
construction (``oscar.options``: a bool must be a bool, ``zero_point`` one of its names, ...), and
every subclass's ``quantize_keys`` / ``quantize_values`` is wrapped so that its input is checked first
(:meth:`KVMethod.check_input`: a floating [B, H, T, D] tensor, whole key groups for
per-channel keys, finite values unless ``method.check_finite = False``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from oscar.options import bounded, check_options
from oscar.quant import SUPPORTED_BITS, PackedTensor, check_kv_tensor, dequantize_groups, is_power_of_two

FlushPolicy = Literal["kivi", "block", "window"]


@dataclass(frozen=True)
class TokenSpan:
    """Where a chunk handed to ``quantize_keys``/``quantize_values`` sits in the cache.

    ``rows``: the batch rows the chunk holds (long tensor, one entry per chunk row, indices into
    the batch the cache was built for); ``start``: stream index of the chunk's first token, i.e. how
    many tokens of these rows are already packed (pad tokens are never stored, so index 0 is each
    row's first real token). Given only to methods with ``wants_token_span = True``, for per-sequence
    state (e.g. tokens kept in full precision) or position-dependent transforms (pre-RoPE keys).
    """

    rows: Tensor
    start: int


_REGISTRY: dict[str, type["KVMethod"]] = {}

#: packages imported on first lookup so that their ``@register_method`` decorators run
METHOD_PACKAGES = ["methods"]


def register_method(name: str):
    """Class decorator: make a KVMethod constructible as ``build_method(name, ...)``."""

    def wrap(cls: type[KVMethod]) -> type[KVMethod]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method name {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_methods() -> list[str]:
    for package in METHOD_PACKAGES:
        importlib.import_module(package)
    return sorted(_REGISTRY)


def build_method(name: str, **hyperparameters) -> "KVMethod":
    """Build a registered method, e.g. ``build_method("oscar", k_bits=2, group_size=32)``.

    Unknown names and unknown or invalid hyperparameters raise ValueError before any work.
    """
    known = available_methods()
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV method {name!r}; available: {', '.join(known)}")
    cls = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(hyperparameters) - fields)
    if unknown:
        raise ValueError(f"method {name!r} has no hyperparameter(s) {unknown}; it has {sorted(fields)}")
    return cls(**hyperparameters)


@dataclass
class KVMethod:
    """Base class: hyperparameters shared by every method plus the hooks the cache calls.

    k, v are [B, H_kv, T, D] in the model dtype, post-RoPE unless a method says otherwise.
    """

    name: ClassVar[str] = "base"
    #: whether the method rotates with a Walsh-Hadamard transform (needs a power-of-two head_dim)
    uses_hadamard: ClassVar[bool] = False
    #: whether quantize_keys groups tokens (per-channel), so flushed chunks must be multiples of G
    keys_per_channel: ClassVar[bool] = False
    #: whether quantize_keys / quantize_values take a ``span: TokenSpan`` keyword from the cache
    wants_token_span: ClassVar[bool] = False

    #: check that quantize_keys / quantize_values get finite values (NaN or inf would spread over
    #: whole groups); not a hyperparameter: ``method.check_finite = False`` skips it (one reduction and
    #: a host sync per call on a GPU), and it is skipped while a CUDA graph is being captured
    check_finite: ClassVar[bool] = True

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = bounded(32, ge=1)
    residual_length: int = bounded(128, ge=0)
    flush: FlushPolicy = "kivi"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for what in ("keys", "values"):
            fn = cls.__dict__.get(f"quantize_{what}")
            if fn is not None and not getattr(fn, "checks_input", False):
                setattr(cls, f"quantize_{what}", _checking_input(fn, what))

    def __post_init__(self) -> None:
        check_options(self, self.name)
        for field_name in ("k_bits", "v_bits"):
            bits = getattr(self, field_name)
            if bits not in SUPPORTED_BITS:
                raise ValueError(f"{self.name}: {field_name}={bits} is not supported; use 1..8 (or 16 = unquantized)")
        if self.keys_per_channel and (self.residual_length % self.group_size or self.residual_length == 0):
            raise ValueError(
                f"{self.name}: residual_length={self.residual_length} must be a positive multiple of "
                f"group_size={self.group_size}: per-channel key groups of G tokens are cut from flushed blocks"
            )
        if self.flush == "window" and self.keys_per_channel:
            raise ValueError(f"{self.name}: flush='window' quantizes keys one token at a time, which per-channel "
                             f"key groups of {self.group_size} tokens cannot take; use 'kivi' or 'block'")

    def check_input(self, x: Tensor, what: str) -> None:
        """Raise ValueError unless ``x`` (keys or values handed to quantize_*) is a floating-point
        [B, H_kv, T, D] tensor (T = 0: an empty chunk), T a multiple of G for per-channel keys, and (with
        ``check_finite``) finite."""
        where = f"{self.name}.quantize_{what}"
        check_kv_tensor(x, where)
        if what == "keys" and self.keys_per_channel and self.k_bits < 16 and x.shape[2] % self.group_size:
            raise ValueError(f"{where}: per-channel key groups of G={self.group_size} tokens need T to be a "
                             f"multiple of G, got T={x.shape[2]}")
        if self.check_finite and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            # a sum is NaN/inf when an element is (and, rarely, when it overflows): count only then
            if not bool(torch.isfinite(x.sum(dtype=torch.float32))):
                bad = int((~torch.isfinite(x)).sum())
                if bad:
                    raise ValueError(f"{where}: {bad} of {x.numel()} values are NaN or inf; they would spread "
                                     "over their whole quantization groups")

    # -- checks against a model, before its weights are loaded ---------------------------------
    def check_model(self, head_dim: int, num_kv_heads: int) -> None:
        """Raise ValueError if the method cannot run on a model of this attention shape."""
        if self.uses_hadamard and not is_power_of_two(head_dim):
            raise ValueError(f"{self.name} rotates with a Hadamard transform: head_dim must be a power of two, got {head_dim}")
        if not self.keys_per_channel and head_dim % self.group_size and self.k_bits < 16:
            raise ValueError(f"{self.name}: group_size={self.group_size} must divide head_dim={head_dim} (per-token groups)")
        if head_dim % self.group_size and self.v_bits < 16:
            raise ValueError(f"{self.name}: group_size={self.group_size} must divide head_dim={head_dim} (per-token value groups)")

    # -- offline -----------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> None:
        """Offline, once per model: weight fusion, calibration. Default: nothing."""

    # -- online ------------------------------------------------------------------------------
    def transform_query(self, q: Tensor, layer_idx: int) -> Tensor:
        """Query [B, H_q, T, D] into the space the cached keys live in. Default: identity."""
        return q

    def transform_key(self, k: Tensor, layer_idx: int) -> Tensor:
        """Full-precision (residual) keys [B, H_kv, T, D] into the same space. Default: identity."""
        return k

    def quantize_keys(self, k: Tensor, layer_idx: int) -> PackedTensor:
        raise NotImplementedError

    def quantize_values(self, v: Tensor, layer_idx: int) -> PackedTensor:
        raise NotImplementedError

    def dequantize(self, packed: PackedTensor) -> Tensor:
        """Packed keys or values -> [B, H_kv, T, D] in the attention space, in the stored dtype."""
        return dequantize_groups(packed)

    def hyperparameters(self) -> dict:
        return dataclasses.asdict(self)


def _checking_input(quantize, what: str):
    """``quantize`` (a subclass's quantize_keys / quantize_values) with :meth:`KVMethod.check_input` first."""

    @functools.wraps(quantize)
    def checked(self, x: Tensor, layer_idx: int, *args, **kwargs) -> PackedTensor:
        self.check_input(x, what)
        return quantize(self, x, layer_idx, *args, **kwargs)

    checked.checks_input = True
    return checked
