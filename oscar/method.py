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
every subclass's ``quantize_keys`` / ``quantize_values`` becomes :meth:`KVMethod.cache_quantizer` of it: its input
is checked first (:meth:`KVMethod.check_input`: a floating [B, H, T, D] tensor, whole key groups for
per-channel keys, finite values unless ``method.check_finite = False``) and it is called as every cache calls it,
``(x, layer_idx, span=...)``, the span handed on to the methods that declare ``uses_span``.

Methods hold no per-sequence state between calls: what a method remembers about a sequence (OTT's outlier
pool, RotateKV's sink positions) is a :class:`SequenceState` that the cache owns per layer and hands back in
every call (``span.state``), so one method instance serves several caches at once; what a method learns
from the model (``prepare_model``: rotations, calibrated orders) is constant per model.

Ownership: every ``prepare_model`` call records the model as prepared for that method object
(:func:`prepared_method`, weakly: a model can be freed); a method that keeps something per model (RotateKV's sink
hooks) keeps it apart per model and lets go of it in ``release_model``, and what it derives from a model to run
(RoPE tables, calibrated orders on their devices) serves every model of one shape (:class:`ServedModels`).
oscar.preparation prepares and restores models through these; a cache checks them at its first forward
(oscar.attention.check_prepared).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import warnings
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from torch import Tensor

from oscar.flush import Flush, flush_policy
from oscar.options import bounded, check_options
from oscar.quant import SUPPORTED_BITS, PackedTensor, check_kv_tensor, dequantize_groups, is_power_of_two
from oscar.registry import Registry

FlushPolicy = Literal["kivi", "block", "window"]


class _DeferredChecks:
    """The non-finite counts of the inputs checked inside one :func:`deferred_finite_checks` block, kept on their
    devices (stacked per device every 256 inputs, so a long decode holds a few tensors, not one per call)."""

    def __init__(self) -> None:
        self.inputs: list[tuple[str, int]] = []  # (where, values) per input
        self.pending: list[tuple[int, Tensor]] = []  # (input index, count) not stacked yet
        self.stacked: list[tuple[list[int], Tensor]] = []  # (input indices, their counts on one device)

    def add(self, where: str, x: Tensor) -> None:
        self.pending.append((len(self.inputs), (~torch.isfinite(x)).sum()))
        self.inputs.append((where, x.numel()))
        if len(self.pending) == 256:
            self._stack()

    def _stack(self) -> None:
        by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
        for index, count in self.pending:
            by_device.setdefault(count.device, []).append((index, count))
        self.stacked += [([i for i, _ in group], torch.stack([c for _, c in group])) for group in by_device.values()]
        self.pending = []

    def raise_first(self) -> None:
        """Read every count (one host sync per device and 256 inputs) and raise for the first input that had any."""
        self._stack()
        bad = [0] * len(self.inputs)
        for indices, counts in self.stacked:
            for i, n in zip(indices, counts.tolist()):
                bad[i] = n
        for (where, numel), n in zip(self.inputs, bad):
            _raise_if_not_finite(where, numel, n)


#: the open :func:`deferred_finite_checks` block's counts
_DEFERRED_CHECKS: ContextVar[_DeferredChecks | None] = ContextVar("deferred_finite_checks", default=None)


@contextmanager
def deferred_finite_checks():
    """Inside the block, :meth:`KVMethod.check_input` counts an input's NaN/inf values where the input is (on the
    GPU: no host sync per call) and the block's end reads every count at once, raising the same ValueError as the
    check at once would for the first input that had any. What the engine's prefill and decode loop run
    (oscar.engine): their hundreds of quantizer calls would otherwise each stall the host."""
    checks = _DeferredChecks()
    token = _DEFERRED_CHECKS.set(checks)
    try:
        yield
    finally:
        _DEFERRED_CHECKS.reset(token)
    checks.raise_first()


def _raise_if_not_finite(where: str, numel: int, bad: int) -> None:
    if bad:
        raise ValueError(f"{where}: {bad} of {numel} values are NaN or inf; they would spread over their whole "
                         "quantization groups")


@dataclass(frozen=True)
class TokenSpan:
    """Where a chunk handed to ``quantize_keys``/``quantize_values`` sits in the cache, and the state it reads.

    ``rows``: the batch rows the chunk holds (long tensor, one entry per chunk row, indices into the batch the
    cache was built for); ``start``: stream index of the chunk's first token, i.e. how many tokens of these rows
    are already packed (pad tokens are never stored, so index 0 is each row's first real token): an int, or a [b]
    device tensor when each row starts elsewhere (a one-token flush inside the decode step, see ``in_step``);
    ``state``: the cache layer's per-sequence state (:class:`SequenceState` tensors, indexed by batch row);
    ``kept_elsewhere``: the caller stores the tokens the method keeps exactly itself (the CuPy cache's exact slots),
    so the quantizer leaves them out of its PackedTensor (oscar.exact.with_kept) and needs no host read for them;
    ``fixed_shapes``: the kept tokens' buffers take one slot per token of the chunk, as inside the step (no host read
    of their count: a caller that dequantizes the chunk at once, or only needs the layout).
    A method that declares ``uses_span = True`` gets it as the ``span`` keyword of its quantize_* from every cache
    (position-dependent transforms, tokens kept in full precision); the others are called without it.
    """

    rows: Tensor
    start: int | Tensor
    state: dict[str, Tensor] | None = None
    kept_elsewhere: bool = False
    fixed_shapes: bool = False

    @property
    def in_step(self) -> bool:
        """The call may be captured in a CUDA graph (per-row starts): fixed output shapes, no host sync."""
        return isinstance(self.start, Tensor)


class SequenceState:
    """Per-sequence state a method keeps for one cache layer (OTT's outlier pools, RotateKV's sink positions).

    The cache owns it (one per layer and batch) and hands its tensors to every quantize call of the layer
    (``TokenSpan.state``); the method makes them (:meth:`KVMethod.new_state`: named device tensors, batch row on
    dim 0) and updates them in place, so one method instance serves any number of caches at once. Allocated once
    per (batch, heads, device) and refilled in place by ``reset``: a captured decode step that reads it stays valid
    for the next batch.
    """

    def __init__(self, method: "KVMethod"):
        self.method = method
        self.tensors: dict[str, Tensor] = {}
        self._shape: tuple | None = None

    def allocate(self, batch: int, num_kv_heads: int, device) -> dict[str, Tensor]:
        """The state of a batch of ``batch`` rows: made on first use (or for another shape), else as it is. Devices
        compare by index ("cuda" is the current device, as a tensor made there names it: cuda:0)."""
        shape = (batch, num_kv_heads, torch.empty(0, device=device).device)
        if shape != self._shape:
            self.tensors = self.method.new_state(*shape)
            self._shape = shape
        return self.tensors

    def reset(self) -> None:
        """Back to a fresh state (new sequences), in place."""
        if self._shape is not None:
            for name, fresh in self.method.new_state(*self._shape).items():
                self.tensors[name].copy_(fresh)

    def span_from_start(self, x: Tensor) -> TokenSpan:
        """The span of a chunk x [B, H, T, D] holding the first tokens of batch rows 0..B-1, over a copy of the
        state: a quantize call given it sees this state and leaves it as it is."""
        copy = {name: t.clone() for name, t in self.tensors.items()}
        return TokenSpan(torch.arange(x.shape[0], device=x.device), 0, copy)


def layer_state(cache, layer_idx: int) -> SequenceState | None:
    """The per-sequence state ``cache`` keeps for layer ``layer_idx`` (None: a cache that keeps none)."""
    find = getattr(cache, "sequence_state", None)
    return None if find is None else find(layer_idx)


#: the method object each model was last prepared for (``KVMethod.prepare_model``), weakly keyed by the model
_PREPARED_FOR: "weakref.WeakKeyDictionary[torch.nn.Module, KVMethod]" = weakref.WeakKeyDictionary()


def prepared_method(model: torch.nn.Module) -> "KVMethod | None":
    """The method object whose ``prepare_model`` ran on ``model`` last (None: none ran, or it was restored)."""
    return _PREPARED_FOR.get(model)


def prepares_some_model(method: "KVMethod") -> bool:
    """Whether ``method`` is the one some live model was prepared for."""
    return any(owner is method for owner in list(_PREPARED_FOR.values()))


def interchangeable(prepared: "KVMethod", other: "KVMethod") -> bool:
    """Whether a cache of method object ``other`` may serve a model prepared for (or attending through) ``prepared``:
    the same object, or, for a method that leaves the model as it is (``needs_prepared_model`` false: fp16, KIVI,
    OTT, TurboQuant+), an object of the same class and hyperparameters (two ``KVModel``s of one fp16 model, say)."""
    if prepared is other:
        return True
    if type(prepared) is not type(other) or prepared.needs_prepared_model:
        return False
    settings = [f.name for f in dataclasses.fields(prepared) if f.init]
    return all(getattr(prepared, name) == getattr(other, name) for name in settings)


def release(model: torch.nn.Module) -> None:
    """Forget what ``model`` was prepared for: its method lets go of what it keeps for the model
    (``release_model``: RotateKV's sink hooks). The weights are the caller's (oscar.preparation.restore)."""
    owner = _PREPARED_FOR.pop(model, None)
    if owner is not None:
        owner.release_model(model)


def _recording(prepare):
    """A class's ``prepare_model`` that records the model as prepared for the method object afterwards."""
    @functools.wraps(prepare)
    def prepare_model(self, model: torch.nn.Module) -> None:
        prepare(self, model)
        _PREPARED_FOR[model] = self

    prepare_model.records = True
    return prepare_model


class ServedModels:
    """The live models whose prepare_model built a method object's model-derived state (RoPE tables, calibrated
    orders on the layers' devices), weakly held, and the signature they share (shapes, RoPE, devices).

    The state is built once and shared while models of one signature are served; a model of another signature is
    refused while one is (two RoPEs or shapes cannot share it, and replacing it would free tensors a captured decode
    step of the first model reads)."""

    def __init__(self) -> None:
        self._models: weakref.WeakSet = weakref.WeakSet()
        self.signature = None

    def admit(self, method: "KVMethod", model: torch.nn.Module, signature) -> bool:
        """Add ``model``; True when the state must be (re)built for it: no state of this signature exists yet."""
        others = [m for m in list(self._models) if m is not model]
        if others and signature != self.signature:
            raise ValueError(f"{method.name}: this method object already serves a {type(others[0]).__name__} of "
                             "another shape, RoPE or placement; build a second one for this model "
                             f"(build_method({method.name!r}, ...))")
        fresh = signature != self.signature
        self._models.add(model)
        self.signature = signature
        return fresh

    def discard(self, model: torch.nn.Module) -> None:
        self._models.discard(model)


#: KV methods by name; the first lookup imports every module of the ``methods`` package (their ``@register_method``)
METHODS: Registry["KVMethod"] = Registry("KV method", ["methods"], options="hyperparameter")


def register_method(name: str):
    """Class decorator: make a KVMethod constructible as ``build_method(name, ...)`` (a name taken: ValueError)."""
    return METHODS.register(name)


def available_methods() -> list[str]:
    """The registered method names, sorted."""
    return METHODS.names()


def method_class(name: str) -> type["KVMethod"]:
    """The class registered as ``name``; ValueError naming the available methods otherwise."""
    return METHODS.get(name)


def build_method(name: str, **hyperparameters) -> "KVMethod":
    """Build a registered method, e.g. ``build_method("oscar", k_bits=2, group_size=32)``.

    Unknown names and unknown or invalid hyperparameters raise ValueError before any work.
    """
    return METHODS.build(name, hyperparameters)


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
    #: whether quantize_keys / quantize_values take the chunk's ``span`` keyword (a :class:`TokenSpan`: its rows,
    #: stream index and per-sequence state); the others are called without it (:meth:`cache_quantizer`)
    uses_span: ClassVar[bool] = False

    #: check that quantize_keys / quantize_values get finite values (NaN or inf would spread over
    #: whole groups); not a hyperparameter: ``method.check_finite = False`` skips it (one reduction and
    #: a host sync per call on a GPU, one per block inside :func:`deferred_finite_checks`), and it is skipped
    #: while a CUDA graph is being captured
    check_finite: ClassVar[bool] = True

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = bounded(32, ge=1)
    residual_length: int = bounded(128, ge=0)
    flush: FlushPolicy = "kivi"

    def __init_subclass__(cls, **kwargs) -> None:
        """The quantize_keys / quantize_values a subclass defines become :meth:`cache_quantizer` of them; its
        prepare_model records the model it prepared (:func:`prepared_method`)."""
        super().__init_subclass__(**kwargs)
        for what in ("keys", "values"):
            quantize = cls.__dict__.get(f"quantize_{what}")
            if quantize is not None and not getattr(quantize, "checks_input", False):
                setattr(cls, f"quantize_{what}", cls.cache_quantizer(quantize, what))
        prepare = cls.__dict__.get("prepare_model")
        if prepare is not None and not getattr(prepare, "records", False):
            cls.prepare_model = _recording(prepare)

    @classmethod
    def cache_quantizer(cls, quantize, what: str):
        """``quantize`` (the class's quantize_keys or quantize_values for ``what`` = "keys" or "values", taking
        ``(x, layer_idx)``, or ``(x, layer_idx, span)`` where the class declares ``uses_span``) as every cache and
        tool calls it: ``(x, layer_idx, span=None)``, :meth:`check_input` first, the span handed on only to a
        method that uses it."""
        uses_span = cls.uses_span

        @functools.wraps(quantize)
        def checked(self, x: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
            self.check_input(x, what)
            return quantize(self, x, layer_idx, span=span) if uses_span else quantize(self, x, layer_idx)

        checked.checks_input = True
        return checked

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
        if not self.check_finite or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        deferred = _DEFERRED_CHECKS.get()
        if deferred is not None:  # counted where x is, read once when the block ends
            deferred.add(where, x)
            return
        # a sum is NaN/inf when an element is (and, rarely, when it overflows): count only then
        if not bool(torch.isfinite(x.sum(dtype=torch.float32))):
            _raise_if_not_finite(where, x.numel(), int((~torch.isfinite(x)).sum()))

    # -- checks against a model, before its weights are loaded ---------------------------------
    def check_model(self, head_dim: int, num_kv_heads: int) -> None:
        """Raise ValueError if the method cannot run on a model of this attention shape."""
        if self.uses_hadamard and not is_power_of_two(head_dim):
            raise ValueError(f"{self.name} rotates with a Hadamard transform: head_dim must be a power of two, "
                             f"got {head_dim}")
        if not self.keys_per_channel and head_dim % self.group_size and self.k_bits < 16:
            raise ValueError(f"{self.name}: group_size={self.group_size} must divide head_dim={head_dim} "
                             "(per-token groups)")
        if head_dim % self.group_size and self.v_bits < 16:
            raise ValueError(f"{self.name}: group_size={self.group_size} must divide head_dim={head_dim} "
                             "(per-token value groups)")

    def check_config(self, config, model: str | None = None) -> None:
        """Raise ValueError if the method cannot run on a model of this transformers ``config`` (registered as
        ``model``, named in messages): :meth:`check_model` on its attention shape; a method that reads a calibration
        file opens and shape-checks it here too. Called before the weights load."""
        self.check_model(*attention_shape(config))

    def data_files(self) -> list[Path]:
        """The local files the method reads (a calibration file), whose contents are part of a run's identity
        (oscar.identity); a file that is missing is listed all the same (the checks refuse it). Default: none."""
        return []

    # -- offline -----------------------------------------------------------------------------
    @_recording
    def prepare_model(self, model: torch.nn.Module) -> None:
        """Offline, once per model: weight fusion, calibration. Default: nothing. Records the model as prepared for
        this object (:func:`prepared_method`); a model another method prepared is the caller's to restore first
        (oscar.preparation.prepare does)."""

    def __copy__(self) -> "KVMethod":
        """A copy is a new method object of the same hyperparameters, prepared for no model (what a method keeps per
        model, or builds from one, belongs to the object that prepared it; copying a prepared model copies none)."""
        return dataclasses.replace(self)

    def __deepcopy__(self, memo: dict) -> "KVMethod":
        return dataclasses.replace(self)

    def release_model(self, model: torch.nn.Module) -> None:
        """Let go of what prepare_model keeps for ``model`` besides its weights (hooks on it). Default: nothing."""

    @property
    def needs_prepared_model(self) -> bool:
        """Whether the method's cache is only correct on a model prepared for it: the method prepares the model
        (``prepare_model``: folded weights, hooks) or transforms queries or keys (the attention hook)."""
        cls = type(self)
        return (cls.prepare_model is not KVMethod.prepare_model or cls.transform_query is not KVMethod.transform_query
                or cls.transform_key is not KVMethod.transform_key)

    # -- per-sequence state (owned by the cache, see SequenceState) ------------------------------
    def new_state(self, batch: int, num_kv_heads: int, device) -> dict[str, Tensor]:
        """Fresh per-sequence state of one cache layer: named tensors with the batch row on dim 0. Default: none."""
        return {}

    @property
    def hadamard_space(self) -> bool:
        """Whether transform_query and transform_key are exactly ``oscar.quant.hadamard`` (so that a backend may do
        both of a decode step in one kernel). Default: no."""
        return False

    @property
    def flush_policy(self) -> Flush:
        """The ``flush`` policy over this method's residual window (oscar.flush): what every cache consults."""
        return flush_policy(self.flush, self.residual_length)

    @property
    def keeps_state(self) -> bool:
        return type(self).new_state is not KVMethod.new_state

    def chunk_span(self, x: Tensor, span: TokenSpan | None) -> TokenSpan:
        """``span``, or for a chunk x [B, H, T, D] quantized on its own (no cache, or no state given): rows 0..B-1
        with a fresh state, from ``span.start`` (0 without a span)."""
        if span is not None and span.state is not None:
            return span
        b, h = x.shape[:2]
        return TokenSpan(torch.arange(b, device=x.device), 0 if span is None else span.start,
                         self.new_state(b, h, x.device))

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


def attention_shape(config) -> tuple[int, int]:
    """(head_dim, num_kv_heads) of the language model in a transformers ``config``."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return head_dim, getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def read_calibration(method: str, path: Path, fix: str, keys: tuple[str, ...]) -> dict:
    """The calibration dict a method saved with torch.save at ``path``, holding ``keys``; a file that cannot be read
    (cut short, not a torch file) or lacks a key is a ValueError naming it, what it is and ``fix`` (the command that
    makes it)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{method}: calibration file {path} cannot be read ({e.strerror or e}); make it again with "
                         f"{fix}") from None
    try:
        with warnings.catch_warnings():  # torch's notes on pickle protocols: the error below says what the file is
            warnings.simplefilter("ignore", UserWarning)
            calib = torch.load(io.BytesIO(data), map_location="cpu")
    except Exception:  # noqa: BLE001 - a truncated or foreign file fails in many ways (zip, pickle, weights_only)
        raise ValueError(f"{method}: {path} is not a calibration file ({_what_file(data)}); make it again with "
                         f"{fix}") from None
    missing = [k for k in keys if not isinstance(calib, dict) or k not in calib]
    if missing:
        raise ValueError(f"{method}: {path} is not a {method} calibration (it lacks {missing}); make one with {fix}")
    return calib


def _what_file(data: bytes) -> str:
    """What a file torch.load refused is, in words (torch's own message is about its unpickling options)."""
    import zipfile

    if not data:
        return "an empty file"
    if zipfile.is_zipfile(io.BytesIO(data)):
        return "a torch file holding objects other than tensors and plain values"
    return "a torch file cut short" if data.startswith(b"PK\x03\x04") else "not a torch file"


def check_calibrated_model(method: str, path: Path, calib: dict, model: str | None) -> None:
    """Refuse, in one line, a calibration whose ``model`` field (written by scripts/calibrate_<method>.py) names
    another model than the run's ``model`` (None: not known here; a file without the field: not checked). Models of
    one shape take each other's calibration without error, but it was fitted to the other's activations."""
    made_for = calib.get("model")
    if model is not None and isinstance(made_for, str) and made_for != model:
        raise ValueError(f"{method}: {path} was calibrated for {made_for}, not {model}; make {model}'s with "
                         f"`python scripts/calibrate_{method}.py --model {model}` (the default method.calibration "
                         "reads it)")
