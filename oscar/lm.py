"""A loaded model bound to a KV method and a backend: what every task receives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.processing_utils import ProcessorMixin

from oscar.backend import Backend, TorchBackend
from oscar.cache import cache_argument
from oscar.engine import DecodeEngine
from oscar.method import KVMethod

__all__ = ["KVModel", "cache_argument"]


@dataclass
class KVModel:
    """``model`` with ``method`` attached through ``backend`` (offline weight changes done, attention routed).

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

    def __post_init__(self) -> None:
        if isinstance(self.tokenizer, ProcessorMixin):  # a multimodal processor (oscar.multimodal): keep it aside
            self.info.setdefault("processor", self.tokenizer)
            self.tokenizer = self.tokenizer.tokenizer
        self.backend.check(self.method)
        self.method.prepare_model(self.model)
        self.backend.attach(self.model, self.method)
        self.engine = DecodeEngine(self.model, self.method, self.backend, self.decode, self.prefill_chunk)
        if getattr(self.tokenizer, "pad_token", None) is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"
        self._newline_tokens: set[int] | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self, attention_mask: torch.Tensor | None = None, quantize_prefill: bool = False):
        return self.backend.new_cache(self.model, self.method, attention_mask, quantize_prefill)

    def format_prompt(self, prompt: str, chat: bool) -> str:
        if not chat:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

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

    @torch.no_grad()
    def generate(self, prompts: list[str], max_new_tokens: int, chat: bool = False,
                 stop_at_newline: bool = False) -> list[str]:
        """Greedy continuations of ``prompts`` (one batch, left-padded), decoded without the prompt."""
        texts = [self.format_prompt(p, chat) for p in prompts]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat).to(self.device)
        stop_after = self.newline_tokens() if stop_at_newline else set()
        new = self.engine.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens, self.eos_token_ids(),
                                   stop_after)
        if new is None:  # no static cache for this backend / method: transformers' generate (the reference)
            cache = self.new_cache(enc["attention_mask"])
            out = self.model.generate(**enc, **cache_argument(self.model, cache), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
            new = out[:, enc["input_ids"].shape[1]:]
        decoded = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return [d.split("\n")[0] if stop_at_newline else d for d in decoded]
