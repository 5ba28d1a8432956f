"""A loaded model bound to a KV method: what every task receives."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.processing_utils import ProcessorMixin

from oscar.attention import attach
from oscar.cache import QuantizedKVCache
from oscar.method import KVMethod


def cache_argument(model: nn.Module, cache) -> dict:
    """The forward/generate keyword for a cache: ``cache`` since transformers 5.2x, ``past_key_values``
    before (where ``cache=`` would be silently ignored and the model would build its own cache)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


@dataclass
class KVModel:
    """``model`` with ``method`` attached (offline weight changes done, attention hook in place).

    Tasks only use this: ``new_cache`` for a fresh quantized cache per batch, ``generate`` for
    greedy decoding of raw or chat prompts with left padding. A multimodal processor passed as
    ``tokenizer`` moves to ``info["processor"]`` and its text tokenizer takes its place.
    """

    model: nn.Module
    tokenizer: object
    method: KVMethod
    name: str = "model"
    max_length: int = 4096
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.tokenizer, ProcessorMixin):  # a multimodal processor (oscar.multimodal): keep it aside
            self.info.setdefault("processor", self.tokenizer)
            self.tokenizer = self.tokenizer.tokenizer
        self.method.prepare_model(self.model)
        attach(self.model, self.method)
        if getattr(self.tokenizer, "pad_token", None) is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self, attention_mask: torch.Tensor | None = None, quantize_prefill: bool = False) -> QuantizedKVCache:
        return QuantizedKVCache.for_model(self.model, self.method, attention_mask, quantize_prefill)

    def format_prompt(self, prompt: str, chat: bool) -> str:
        if not chat:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    @torch.no_grad()
    def generate(self, prompts: list[str], max_new_tokens: int, chat: bool = False,
                 stop_at_newline: bool = False) -> list[str]:
        """Greedy continuations of ``prompts`` (one batch, left-padded), decoded without the prompt."""
        texts = [self.format_prompt(p, chat) for p in prompts]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat).to(self.device)
        cache = self.new_cache(enc["attention_mask"])
        out = self.model.generate(**enc, **cache_argument(self.model, cache), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
        decoded = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [d.split("\n")[0] if stop_at_newline else d for d in decoded]
