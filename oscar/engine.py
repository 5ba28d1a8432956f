"""The decode engine: greedy generation over a backend's static cache, the decode step as one CUDA graph.

Per batch: the prompt is prefilled eagerly (in chunks of ``prefill_chunk`` tokens to bound activation memory,
or whole), then every new token costs one decode step of the whole model: ``prepare_step`` (masks), the
forward of one token per sequence (every layer's ``update`` writes into the static cache, its attention reads
it), the greedy pick, ``finish_step`` (in-step flushes, lengths + 1). With ``mode="graph"`` that step is
captured in a CUDA graph once per (batch size, capacity) and replayed for every token; with ``mode="eager"``
it runs as Python (the reference, and the only mode on a CPU). Between steps the host reads the picked
tokens (EOS and stop tokens end a sequence; generation stops when all have ended) and calls the cache's
``advance`` (host bookkeeping and the flushes it schedules), in both modes, so both compute the same numbers.

With ``fused_layers`` on, the prefill and the decode step run the model's RMSNorms, RoPE and SiLU MLP products as one
CUDA kernel each (kernels.fused_layers, offered through ``Backend.layer_fusion``): transformers' modules are swapped
for fused ones while a prefill or a step runs or is captured, and put back after; ``merged`` also runs each layer's
q/k/v and gate/up projections as one GEMM each. ``auto`` is merged for a model on one GPU where a backend offers
kernels for its layers (backend=cupy's for Llama and Qwen3 with CuPy installed; whatever the method and backend): the
fastest of the three at every measured shape (README, "Generation: the decode engine"). Eager and graph decoding fuse
alike, so they still give the same tokens; ``off`` is transformers' own modules.

A model split over several GPUs (``model.device_map``, oscar.placement) decodes eagerly: a CUDA graph records
the work of one device's stream, and a step whose layers run on two GPUs is not captured as one graph, so
``decode=auto`` picks eager for it and ``decode=graph`` is refused. Each layer's cache lives on its own GPU.

A cache and its graph are kept per batch size and reused by the next batch of the same size and capacity
(``capacity_step`` rounds capacities up so that batches of similar lengths share one); the storage is
allocated once per slot and never moves while it decodes. Continuous batching (oscar.continuous) decodes one slot
whose rows finish and are refilled from a queue between steps: :meth:`DecodeEngine.open_slot` gives it the slot
(every other one dropped), :meth:`DecodeEngine.staging` the one-row cache its new samples are prefilled in.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from oscar.attention import bind_cache
from oscar.backend import offered_layer_fusion
from oscar.cache import cache_argument
from oscar.method import KVMethod, deferred_finite_checks
from oscar.placement import model_devices
from oscar.static_cache import StaticCache, round_capacity
from oscar.transfer import shared_ints

log = logging.getLogger(__name__)

DECODE_MODES = ("auto", "eager", "graph")
FUSED_LAYERS = ("auto", "on", "merged", "off")


@contextlib.contextmanager
def rows_apart(device: torch.device):
    """The scope of a decode step on ``device``: on a CPU, without oneDNN (PyTorch's default kernels for bf16 and fp16
    matrix products there), whose products round a row differently with the batch size, so that a sample's greedy
    tokens would depend on the rows beside it (oscar.continuous); PyTorch's own kernels compute a row alike at every
    batch size (fp32 products, MKL's, can still differ by an fp32 ulp). Elsewhere nothing: a GPU's products round
    with the batch size whatever the library (oscar.continuous.compare_with_alone)."""
    mkldnn = torch.backends.mkldnn
    if device.type != "cpu" or not mkldnn.is_available() or not mkldnn.enabled:
        yield
        return
    mkldnn.enabled = False
    try:
        yield
    finally:
        mkldnn.enabled = True


def _devices(device: torch.device | str | list) -> list[torch.device]:
    return list(dict.fromkeys(torch.device(d) for d in (device if isinstance(device, (list, tuple)) else [device])))


def resolve_mode(mode: str, device: torch.device | str | list) -> str:
    """``auto`` -> graph on one CUDA device, eager elsewhere (a CPU, a model over several devices: ``device`` a
    list); graph there is refused."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
    devices = _devices(device)
    on_cuda = len(devices) == 1 and devices[0].type == "cuda"
    if mode == "auto":
        return "graph" if on_cuda else "eager"
    if mode == "graph" and len(devices) > 1:
        raise ValueError(f"decode=graph captures one GPU's work, and this model runs on {len(devices)} devices "
                         f"({', '.join(map(str, devices))}): a sharded model decodes eagerly (decode=eager or auto)")
    if mode == "graph" and not on_cuda:
        raise ValueError("decode=graph replays CUDA graphs and needs a CUDA device; use decode=eager (or auto)")
    return mode


def resolve_fused_layers(option: str, device: torch.device | str | list, offered: bool) -> str:
    """``auto`` -> merged for a model on one CUDA device (``device``, a list for a model over several) where a backend
    offers fused layers for it (``offered``), off elsewhere; ``on`` and ``merged`` are refused where they cannot run."""
    if option not in FUSED_LAYERS:
        raise ValueError(f"fused_layers must be one of {', '.join(FUSED_LAYERS)}, got {option!r}")
    devices = _devices(device)
    on_cuda = len(devices) == 1 and devices[0].type == "cuda"
    if option == "auto":
        return "merged" if on_cuda and offered else "off"
    if option != "off" and not on_cuda:
        raise ValueError(f"fused_layers={option} runs the decode step's layers as CUDA kernels on one GPU, and this "
                         f"model runs on {', '.join(map(str, devices))}: use fused_layers=off (or auto)")
    if option != "off" and not offered:
        raise ValueError(f"fused_layers={option}: no backend offers fused layers for this model here (the cupy "
                         "backend's kernels fuse Llama and Qwen3 layers, with CuPy installed: pip install cupy-cuda12x "
                         "or cupy-cuda13x); use fused_layers=off (or auto)")
    return option


@dataclass
class _Slot:
    """One batch size's static cache, its step's input/output buffers and (mode=graph) its captured step."""

    cache: StaticCache
    ids: Tensor  # [B, 1] the tokens the step feeds
    picked: Tensor  # [B] the greedy tokens the step picks
    warm: bool = False  # a step ran eagerly (lazy initialization done): the next one can be captured
    graph: torch.cuda.CUDAGraph | None = None
    logits: Tensor | None = None  # [B, vocab] float32: the step's last logits, where kept (open_slot)


@dataclass
class DecodeEngine:
    """Greedy decoding of ``model`` through ``backend``'s static caches (see the module docstring)."""

    model: nn.Module
    method: KVMethod
    backend: object  # oscar.backend.Backend
    mode: str = "auto"
    prefill_chunk: int | None = None
    #: the prefill's and decode step's fused layers (module docstring): auto, on, merged or off; resolved by
    #: ``resolve_fused_layers``
    fused_layers: str = "auto"
    #: capacities are rounded up to a multiple of this (and of the backend's window), so that batches of
    #: similar lengths reuse one allocation and one captured graph
    capacity_step: int = 256
    _slots: dict[int, _Slot] = field(default_factory=dict, repr=False)
    _staging: dict[int, StaticCache] = field(default_factory=dict, repr=False)  # one-row caches by capacity
    #: the static cache of the last ``generate`` (its stored bytes and tokens: ``nbytes``, ``token_counts``)
    last_cache: StaticCache | None = field(default=None, repr=False)
    #: the fused layers, prepared once (their ``active()`` scope, ``remove()``), None when off
    fusion: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        devices = model_devices(self.model)
        self.mode = resolve_mode(self.mode, devices)
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive number of tokens (or null), got {self.prefill_chunk}")
        make_fusion = offered_layer_fusion(getattr(self.model, "config", None))
        self.fused_layers = resolve_fused_layers(self.fused_layers, devices, make_fusion is not None)
        if self.fused_layers != "off":
            self.fusion = make_fusion(self.model, merge=self.fused_layers == "merged")

    def unfuse(self) -> None:
        """Undo the fused layers (their merged projections): the model exactly as it was given; the engine decodes
        with transformers' modules after."""
        if self.fusion is not None:
            self.fusion.remove()
        self.fusion, self.fused_layers = None, "off"
        self._slots.clear()  # their graphs recorded the fused step

    def capacity(self, prompt_tokens: int, max_new_tokens: int) -> int:
        multiple = self.backend.capacity_multiple(self.method)
        step = round_capacity(self.capacity_step, multiple)
        return round_capacity(prompt_tokens + max_new_tokens, step)

    def _slot(self, pad_lengths: list[int], capacity: int) -> _Slot | None:
        b = len(pad_lengths)
        slot = self._slots.get(b)
        if slot is not None and slot.cache.capacity == capacity:
            slot.cache.reset(pad_lengths)
            return slot
        self._slots.pop(b, None)  # a new capacity: drop the old storage and graph before allocating
        cache = self.backend.static_cache(self.model, self.method, pad_lengths, capacity)
        if cache is None:
            return None
        device = cache.lengths.device
        slot = _Slot(cache, torch.zeros(b, 1, dtype=torch.long, device=device),
                     torch.zeros(b, dtype=torch.long, device=device))
        self._slots[b] = slot
        return slot

    def drop_caches(self) -> None:
        """Forget every slot and staging cache (their storage is freed once nothing else holds it)."""
        self._slots.clear()
        self._staging.clear()
        self.last_cache = None

    def open_slot(self, rows: int, capacity: int, keep_logits: bool = False) -> _Slot:
        """The slot of ``rows`` rows of ``capacity`` tokens for continuous batching (oscar.continuous), after every
        other slot and staging cache is dropped (their storage freed before this one is allocated); ``keep_logits``:
        its step also keeps its logits in ``slot.logits`` [rows, vocab] (the graph is captured again when that
        changes). ValueError where the backend has no static cache for the method."""
        self.last_cache = None
        for b in [b for b in self._slots if b != rows]:
            del self._slots[b]
        self._staging = {c: cache for c, cache in self._staging.items() if c == capacity and rows > 1}
        slot = self._slot([0] * rows, capacity)
        if slot is None:
            raise ValueError(f"backend={self.backend.name} has no static cache for method={self.method.name}: "
                             "continuous batching needs the decode engine (backend=torch with mirror=true, or cupy)")
        if keep_logits != (slot.logits is not None):
            vocab = self.model.config.get_text_config().vocab_size
            slot.logits = torch.zeros(rows, vocab, device=slot.picked.device) if keep_logits else None
            slot.graph = None
        return slot

    def staging(self, capacity: int) -> StaticCache:
        """A one-row static cache of ``capacity`` tokens, fresh (reset), where continuous batching prefills a new
        sample before its rows move into the slot (StaticCache.adopt); kept for the next sample."""
        cache = self._staging.get(capacity)
        if cache is None:
            cache = self._staging[capacity] = self.backend.static_cache(self.model, self.method, [0], capacity)
        else:
            cache.reset([0])
        return cache

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, eos_token_ids: set[int],
                 stop_after_ids: set[int] = frozenset()) -> list[list[int]] | None:
        """Greedy continuations of a left-padded batch [B, T]: per row the new token ids, at most
        ``max_new_tokens``, ending with the first EOS (kept, as transformers' generate keeps it) or the first
        token of ``stop_after_ids`` (e.g. the tokens that hold a newline). None if the backend has no static
        cache for the method."""
        b, t = input_ids.shape
        pads = (attention_mask == 0).long().cumprod(-1).sum(-1).tolist()
        slot = self._slot(pads, self.capacity(t, max_new_tokens))
        if slot is None:
            return None
        self.last_cache = slot.cache
        logits = self._prefill(input_ids, attention_mask, slot.cache)
        return self.decode(slot, logits.argmax(-1), max_new_tokens, eos_token_ids, stop_after_ids)

    @torch.no_grad()
    def decode(self, slot: _Slot, picked: Tensor, max_new_tokens: int, eos_token_ids: set[int],
               stop_after_ids: set[int] = frozenset()) -> list[list[int]]:
        """The decode loop after a prefill: ``picked`` [B] are the first new tokens (see ``generate``)."""
        b = len(picked)
        bind_cache(self.model, slot.cache)  # the decode step's attention reads this cache's layers
        outputs: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        # the flushes' input checks are read once at the end: between steps the host prepares the next flush while
        # the GPU runs the step, and only reading the picked tokens waits for it
        with deferred_finite_checks():
            for step in range(max_new_tokens):
                tokens = picked.tolist()
                for i, token in enumerate(tokens):
                    if not done[i]:
                        outputs[i].append(token)
                        done[i] = token in eos_token_ids or token in stop_after_ids
                if all(done) or step == max_new_tokens - 1:
                    break
                if not slot.cache.decoding:
                    slot.cache.begin_decode()
                slot.ids.copy_(picked.view(b, 1))
                self._decode(slot)
                picked = slot.picked
        return outputs

    @torch.no_grad()
    def _prefill(self, input_ids: Tensor, attention_mask: Tensor, cache: StaticCache) -> Tensor:
        """Eager prefill of the prompt (chunked) straight into the static cache, whose layers attend the chunk
        themselves (the mask is the cache's placeholder, positions come from ``attention_mask``): logits of its last
        token, [B, vocab]."""
        bind_cache(self.model, cache)  # the layers' attention reads this cache
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        t = input_ids.shape[1]
        chunk = self.prefill_chunk or t
        # one host sync for the quantizers' input checks; each list of rows or offsets the layers index goes to the
        # device once (every layer of a chunk indexes the same ones)
        with self._fused(), deferred_finite_checks(), shared_ints():
            for start in range(0, t, chunk):
                end = min(t, start + chunk)
                out = self.model(input_ids=input_ids[:, start:end], attention_mask=cache.prefill_mask(),
                                 position_ids=positions[:, start:end], logits_to_keep=1,
                                 **cache_argument(self.model, cache))
        return out.logits[:, -1]

    def _step(self, slot: _Slot) -> None:
        """One decode step on the device: what the graph captures."""
        cache = slot.cache
        cache.prepare_step()
        out = self.model(input_ids=slot.ids, position_ids=cache.lengths.view(-1, 1), attention_mask=cache.decode_mask(),
                         logits_to_keep=1, **cache_argument(self.model, cache))
        torch.argmax(out.logits[:, -1], dim=-1, out=slot.picked)
        if slot.logits is not None:
            slot.logits.copy_(out.logits[:, -1])
        cache.finish_step()

    def _decode(self, slot: _Slot) -> None:
        """One decode step, then the cache's host bookkeeping after it (its counts, and the flushes it launches)."""
        self._decode_step(slot)
        slot.cache.advance()

    def _fused(self):
        """The scope of the fused layers (nothing when off): where a prefill or a step runs as Python or is captured."""
        return self.fusion.active() if self.fusion is not None else contextlib.nullcontext()

    def _decode_step(self, slot: _Slot) -> None:
        if self.mode == "eager" or not slot.warm:  # a new slot's first step runs eagerly: lazy initialization
            with self._fused(), rows_apart(slot.ids.device):
                self._step(slot)
            slot.warm = True
            return
        if slot.graph is None:  # capturing records the step without running it: the replay below runs it
            slot.graph = torch.cuda.CUDAGraph()
            with self._fused(), torch.cuda.graph(slot.graph):
                self._step(slot)
            log.debug("captured the decode step of batch %d, capacity %d", len(slot.ids), slot.cache.capacity)
        slot.graph.replay()
