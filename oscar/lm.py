"""A loaded model bound to a KV method and a backend: what every task receives.

A model spec, a method and a backend become a :class:`Binding` (:func:`bind`): the spec's config is built and the
method and backend are checked against it and this machine (:func:`check_binding`), once, before any weight loads;
:meth:`Binding.load` then sets the seed and loads the weights with that config. :func:`load_kv_model` does both (the
lm-eval adapter and the scripts use it); the runner makes the binding in its preflight and loads it later.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers.processing_utils import ProcessorMixin

from oscar.backend import Backend, TorchBackend, build_backend
from oscar.cache import cache_argument
from oscar.engine import DecodeEngine
from oscar.method import KVMethod, interchangeable
from oscar.models import ModelSpec, build_config, load_model, max_positions
from oscar.placement import Placement
from oscar.preparation import prepare, preparation, restore

__all__ = ["Binding", "KVModel", "bind", "cache_argument", "check_binding", "format_prompt", "load_kv_model",
           "prompt_length", "seed_everything"]


def check_prompts(prompts: list[str], lengths: list[int] | None = None, max_length: int | None = None,
                  max_new_tokens: int = 0, max_positions: int | None = None) -> list[str]:
    """Refuse, naming the prompt: a batch that is not a non-empty list of strings, an empty prompt, and
    (given the token ``lengths``) a prompt longer than ``max_length`` or one whose generation would run
    past the model's ``max_positions``. Nothing is truncated here: tasks cut their inputs by their own
    stated rules (LongBench keeps the first and last halves, lm-eval the last tokens). Returns ``prompts``."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"generate: prompts must be a non-empty list of strings, got {prompts!r:.80}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise ValueError(f"generate: prompts[{i}] is a {type(prompt).__name__}, not a string")
        if not prompt:
            raise ValueError(f"generate: prompts[{i}] is empty")
    if max_new_tokens < 0 or isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"generate: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    for i, n in enumerate(lengths or []):
        if max_length is not None and n > max_length:
            raise ValueError(f"generate: prompts[{i}] has {n} tokens, more than the model's max_length {max_length}; "
                             "shorten it (LongBench keeps its first and last halves: evals.longbench.middle_truncate)")
        if max_positions is not None and n + max_new_tokens > max_positions:
            raise ValueError(f"generate: prompts[{i}] has {n} tokens + {max_new_tokens} new ones, past the model's "
                             f"{max_positions} positions")
    return prompts


def format_prompt(tokenizer, prompt: str, chat: bool) -> str:
    """``prompt`` as the model reads it: as it is, or (``chat``) as one user turn of the tokenizer's chat template
    with the generation prompt."""
    if not chat:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=true, but the model's tokenizer has no chat template (a base model?): use chat=false")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def prompt_length(tokenizer, prompt: str, chat: bool = False) -> int:
    """The tokens :meth:`KVModel.generate` feeds the model for ``prompt`` (special tokens or chat template included)."""
    return len(tokenizer(format_prompt(tokenizer, prompt, chat), add_special_tokens=not chat)["input_ids"])


@dataclass
class KVModel:
    """``model`` with ``method`` attached through ``backend`` (offline weight changes done, attention routed:
    oscar.preparation.prepare, which restores a model that another method prepared first; ``restore()`` puts the
    model back as it was).

    Tasks only use this: ``new_cache`` for a fresh cache per batch of forward calls, ``generate`` for greedy
    decoding of raw or chat prompts with left padding, through the decode engine (``decode``: ``auto`` =
    CUDA-graph replay on a GPU, eager on a CPU; see oscar.engine) when the backend gives it a static cache,
    else through transformers' generate on ``new_cache``. A multimodal processor passed as ``tokenizer``
    moves to ``info["processor"]`` and its text tokenizer takes its place.
    """

    model: nn.Module
    tokenizer: object
    method: KVMethod
    name: str = "model"
    max_length: int = 4096
    info: dict = field(default_factory=dict)
    backend: Backend = field(default_factory=TorchBackend)
    decode: str = "auto"
    prefill_chunk: int | None = None
    fused_layers: str = "auto"  # the prefill's and decode step's fused layers (oscar.engine): auto, on, merged or off
    #: what the caches of the generations so far stored when each ended: real bytes (``nbytes``: packed buffers and
    #: full-precision windows, every layer) and tokens (one count per sequence and token, of one layer)
    stored_bytes: int = field(default=0, init=False)
    stored_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.tokenizer, ProcessorMixin):  # a multimodal processor (oscar.multimodal): keep it aside
            self.info.setdefault("processor", self.tokenizer)
            self.tokenizer = self.tokenizer.tokenizer
        self.backend.check(self.method)
        prepare(self.model, self.method, self.backend)  # a model another method prepared is restored first
        self.engine = DecodeEngine(self.model, self.method, self.backend, self.decode, self.prefill_chunk,
                                   self.fused_layers)
        if getattr(self.tokenizer, "pad_token", None) is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"
        self._newline_tokens: set[int] | None = None

    def restore(self) -> None:
        """Put the model back as it was before this KVModel prepared it (oscar.preparation.restore); this KVModel
        cannot generate after it."""
        restore(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self, attention_mask: torch.Tensor | None = None, quantize_prefill: bool = False):
        self.check_prepared()
        return self.backend.new_cache(self.model, self.method, attention_mask, quantize_prefill)

    def check_prepared(self) -> None:
        """Refuse (one line) when the model is no longer prepared for this KVModel's method (or one whose caches are
        interchangeable with it: oscar.method.interchangeable) and backend: restored, or prepared since by another
        KVModel or ``oscar.apply`` (its caches would be read without the method's query transform and value fold)."""
        done = preparation(self.model)
        if done is not None and interchangeable(done.method, self.method) and done.backend == self.backend:
            return
        if done is None:
            now = "not prepared"
        elif done.method.name == self.method.name:
            now = f"prepared for another {done.method.name} method object or backend"
        else:
            now = f"prepared for {done.method.name}"
        raise ValueError(f"this KVModel's model is {now} now (restored, or prepared again since): make a new KVModel "
                         f"for {self.method.name}")

    @property
    def positions(self) -> int | None:
        """The positions the model was built for (its config's ``max_position_embeddings``; None if unknown)."""
        return max_positions(self.model.config)

    def format_prompt(self, prompt: str, chat: bool) -> str:
        return format_prompt(self.tokenizer, prompt, chat)

    def eos_token_ids(self) -> set[int]:
        """The tokens that end a sequence: the model's generation config (as transformers' generate), else the
        tokenizer's EOS."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos) if isinstance(eos, (list, tuple)) else {eos}

    def newline_tokens(self) -> set[int]:
        """Every token whose text holds a newline (a sequence that picks one has its first line)."""
        if self._newline_tokens is None:
            vocab = range(len(self.tokenizer))
            texts = self.tokenizer.batch_decode([[i] for i in vocab])
            self._newline_tokens = {i for i, text in zip(vocab, texts) if "\n" in text}
        return self._newline_tokens

    def encode(self, prompts: list[str], max_new_tokens: int, chat: bool = False):
        """``prompts`` formatted and tokenized as one left-padded batch, after :func:`check_prompts`."""
        texts = [self.format_prompt(p, chat) for p in check_prompts(prompts)]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
        check_prompts(prompts, enc["attention_mask"].sum(-1).tolist(), self.max_length, max_new_tokens,
                      self.positions)
        return enc.to(self.device)

    @torch.no_grad()
    def generate(self, prompts: list[str], max_new_tokens: int, chat: bool = False,
                 stop_at_newline: bool = False) -> list[str]:
        """Greedy continuations of ``prompts`` (one batch, left-padded), decoded without the prompt."""
        self.check_prepared()
        enc = self.encode(prompts, max_new_tokens, chat)
        stop_after = self.newline_tokens() if stop_at_newline else set()
        new = self.engine.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens, self.eos_token_ids(),
                                   stop_after)
        cache = self.engine.last_cache
        if new is None:  # no static cache for this backend / method: transformers' generate (the reference)
            cache = self.new_cache(enc["attention_mask"])
            out = self.model.generate(**enc, **cache_argument(self.model, cache), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
            new = out[:, enc["input_ids"].shape[1]:]
        counts = cache.token_counts(0)
        self.stored_bytes += cache.nbytes
        self.stored_tokens += counts["keys_packed"] + counts["keys_residual"]
        decoded = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return [d.split("\n")[0] if stop_at_newline else d for d in decoded]


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's random generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_binding(method: KVMethod, backend: Backend, config, model: str | None = None) -> None:
    """Raise ValueError (RuntimeError for a missing GPU or package) unless ``method`` can run on a model of this
    transformers ``config`` (registered as ``model``; its calibration files checked) through ``backend`` on this
    machine; no weight is loaded."""
    method.check_config(config, model)
    backend.check(method)
    backend.check_model(config)
    backend.check_available()


@dataclass(frozen=True, eq=False)
class Binding:
    """A model ``spec``, its transformers ``config`` (:func:`oscar.models.build_config`), a ``method`` and a
    ``backend``, checked together when made (:func:`check_binding`); no weight is loaded until :meth:`load`."""

    spec: ModelSpec
    config: object
    method: KVMethod
    backend: Backend

    def __post_init__(self) -> None:
        check_binding(self.method, self.backend, self.config, self.spec.name)

    def load(self, *, seed: int = 0, device: str | Placement | None = None, dtype: str | None = None,
             decode: str = "auto", prefill_chunk: int | None = None, max_length: int | None = None,
             fused_layers: str = "auto") -> KVModel:
        """Seed (``seed``: weights built from a config, and every draw after), then load the weights with the checked
        config on ``device`` (None: the default device; a Placement from ``plan_placement`` for a model over several
        GPUs) in ``dtype`` (None: the spec's), decoding in ``decode`` mode with prefill chunks of ``prefill_chunk``
        tokens and ``fused_layers`` (oscar.engine); ``max_length``: the spec's unless given."""
        seed_everything(seed)
        model, tokenizer = load_model(self.spec, device=device, dtype=dtype, config=self.config)
        return KVModel(model, tokenizer, self.method, name=self.spec.name,
                       max_length=max_length or self.spec.max_length, backend=self.backend, decode=decode,
                       prefill_chunk=prefill_chunk, fused_layers=fused_layers)


def bind(spec: ModelSpec | dict | str, method: KVMethod, backend: Backend | str | None = None) -> Binding:
    """The :class:`Binding` of ``spec`` (a registered name, a spec or its dict), ``method`` and ``backend`` (default:
    torch; a name is built with its defaults): its config built, the three checked together."""
    spec = ModelSpec.from_any(spec)
    backend = TorchBackend() if backend is None else build_backend(backend) if isinstance(backend, str) else backend
    return Binding(spec, build_config(spec), method, backend)


def load_kv_model(spec: ModelSpec | dict | str, method: KVMethod, backend: Backend | str | None = None, *,
                  seed: int = 0, device: str | Placement | None = None, dtype: str | None = None,
                  decode: str = "auto", prefill_chunk: int | None = None, max_length: int | None = None,
                  fused_layers: str = "auto") -> KVModel:
    """The model of ``spec`` bound to ``method`` through ``backend``: :func:`bind`, then :meth:`Binding.load` with the
    other arguments."""
    return bind(spec, method, backend).load(seed=seed, device=device, dtype=dtype, decode=decode,
                                            prefill_chunk=prefill_chunk, max_length=max_length,
                                            fused_layers=fused_layers)
