"""Vision-language and omni models: loading, processors, and generation through the quantized cache.

Three model kinds register with :func:`oscar.models.register_loader`:

- ``qwen3_vl``    Qwen3-VL (Qwen3VLForConditionalGeneration): images as ``<|image_pad|>`` runs with
                  3-D (M-RoPE) positions; the processor returns ``mm_token_type_ids``, which must reach
                  ``generate`` or the positions are silently wrong.
- ``llava_next``  LLaVA-1.6 (LlavaNextForConditionalGeneration): anyres image tiles as ``<image>`` runs,
                  1-D positions.
- ``qwen3_omni``  Qwen3-Omni's thinker (Qwen3OmniMoeThinkerForConditionalGeneration): text out only
                  (the talker is never built or is dropped), audio as Whisper log-mel features.

``source: hub`` loads the real checkpoint (a clear :class:`~oscar.models.ModelUnavailableError`
offline); ``source: config`` builds a tiny random-weight model from ``spec.config`` with a tokenizer
made offline from ``spec.tokenizer`` (SmolLM2's) plus the multimodal special tokens.

Processors never need torchvision: images go through the PIL image processors and the processors
are built without a video processor (:class:`ImageTextProcessor` subclasses).

The loader returns ``(model, processor)``; :class:`~oscar.lm.KVModel` keeps the processor in
``lm.info["processor"]`` and its text tokenizer in ``lm.tokenizer``, so text-only code is unchanged.
Tasks build :class:`MMSample` lists and call :func:`mm_generate`: one fresh quantized cache per
batch (``rope_deltas`` cleared first: they live on the model), left padding, every language-model
token (text, image, audio) stored through the KV method.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from oscar.cache import QuantizedKVCache
from oscar.lm import KVModel, cache_argument
from oscar.models import (ModelSpec, build_config, hub_location, load_tokenizer, place, pretrained_placement,
                          register_loader, register_skeleton)
from oscar.placement import Placement, empty_model, root_hook

log = logging.getLogger(__name__)

#: modality codes of language-model tokens (``token_modalities``)
TEXT, IMAGE, AUDIO, VIDEO = 0, 1, 2, 3
MODALITY_NAMES = {TEXT: "text", IMAGE: "image", AUDIO: "audio", VIDEO: "video"}

SAMPLING_RATE = 16_000  # Whisper features (Qwen3-Omni's audio encoder)

#: special tokens of the Qwen family (name -> token); the omni processor reads them off the tokenizer
QWEN_MM_TOKENS = dict(image_token="<|image_pad|>", video_token="<|video_pad|>", audio_token="<|audio_pad|>",
                      vision_bos_token="<|vision_start|>", vision_eos_token="<|vision_end|>",
                      audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>")
LLAVA_IMAGE_TOKEN = "<image>"

# Chat templates of the tiny models (the real checkpoints ship their own): the Qwen ChatML layout
# with vision/audio placeholders in content order, and LLaVA-1.6-Vicuna's "USER: <image>\n... ASSISTANT:".
QWEN_TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAVA_TINY_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


# ----------------------------------------------------------------------------- inputs


@dataclass
class MMSample:
    """One prompt: text plus the images (PIL) and audio clips (mono float32 at 16 kHz) it refers to.

    The chat template places images, then audio, then the text in one user turn.
    """

    text: str
    images: list = field(default_factory=list)
    audios: list[np.ndarray] = field(default_factory=list)

    def messages(self) -> list[dict]:
        content = ([{"type": "image"} for _ in self.images] + [{"type": "audio"} for _ in self.audios]
                   + [{"type": "text", "text": self.text}])
        return [{"role": "user", "content": content}]


def load_image(path: str | Path):
    """An RGB PIL image (page scans are often grayscale or palette images)."""
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("RGB")


def load_audio(path: str | Path, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """Mono float32 samples at ``sampling_rate`` (channels averaged, resampled with soxr): [N]."""
    import soundfile as sf
    import soxr

    wav, sr = sf.read(str(path), dtype="float32", always_2d=True)
    wav = wav.mean(axis=1)
    if sr != sampling_rate:
        wav = soxr.resample(wav, sr, sampling_rate)
    return np.ascontiguousarray(wav, dtype=np.float32)


# ----------------------------------------------------------------------------- processors


def _image_text_processor(base: type):
    """``base`` (a transformers processor) without its video processor: no torchvision needed."""
    class ImageTextProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageTextProcessor.__name__ = ImageTextProcessor.__qualname__ = f"{base.__name__}NoVideo"
    return ImageTextProcessor


def _omni_processor_class():
    """Qwen3-Omni's processor without a video processor (image, audio and text only)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor
    from transformers.processing_utils import OmniModalProcessorMixin

    class Qwen3OmniProcessorNoVideo(Qwen3OmniMoeProcessor):
        def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
            OmniModalProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer,
                                             chat_template=chat_template)
            for name in QWEN_MM_TOKENS:
                setattr(self, name, getattr(tokenizer, name))
            for name in ("image_token", "audio_token", "video_token"):
                setattr(self, f"{name}_id", getattr(tokenizer, f"{name}_id"))

    return Qwen3OmniProcessorNoVideo


def qwen3_vl_processor_class():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return _image_text_processor(Qwen3VLProcessor)


def _image_size(extra: dict) -> dict | None:
    """Qwen's pixel budget (``min_pixels``/``max_pixels`` in spec.extra) as the image processor's size."""
    if extra.get("min_pixels") is None and extra.get("max_pixels") is None:
        return None
    return {"shortest_edge": extra.get("min_pixels") or 56 * 56, "longest_edge": extra.get("max_pixels")}


def _pil_image_processor(location: str, spec: ModelSpec):
    from transformers import AutoImageProcessor

    kwargs = {"size": size} if (size := _image_size(spec.extra)) else {}
    return AutoImageProcessor.from_pretrained(location, revision=spec.revision, backend="pil", **kwargs)


def _hub_processor(cls, location: str, spec: ModelSpec):
    """A processor from a checkpoint folder or hub id, with the PIL image processor swapped in."""
    processor = cls.from_pretrained(location, revision=spec.revision)
    processor.image_processor = _pil_image_processor(location, spec)
    return processor


# ----------------------------------------------------------------------------- tiny tokenizers


def tiny_tokenizer(spec: ModelSpec, named: dict[str, str], extra_tokens: list[str], chat_template: str):
    """The base tokenizer of ``spec.tokenizer`` plus multimodal special tokens, built offline.

    ``named`` tokens become tokenizer attributes (``tok.image_token``, ``tok.image_token_id``), as
    the Qwen processors expect; ``extra_tokens`` are only added to the vocabulary.
    """
    from transformers import AutoTokenizer

    base = load_tokenizer(spec.tokenizer or "smollm2-135m")
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=dict(named))
    new = list(dict.fromkeys([*named.values(), *extra_tokens]))
    tok.add_special_tokens({"extra_special_tokens": new}, replace_extra_special_tokens=False)
    tok.chat_template = chat_template
    return tok


def _config_with_tokens(spec: ModelSpec, tokenizer, token_ids: dict[str, str]):
    """``spec.config`` with the vocabulary size and the special-token ids of ``tokenizer``."""
    cfg = dict(spec.config or {})
    text = dict(cfg.get("text_config") or {})
    text["vocab_size"] = len(tokenizer)
    cfg["text_config"] = text
    for key, token in token_ids.items():
        cfg[key] = tokenizer.convert_tokens_to_ids(token)
    return build_config(ModelSpec(**{**spec.__dict__, "config": cfg}))


def _random_model(cls, config, spec: ModelSpec, dtype: torch.dtype):
    """Seeded random weights (on the CPU, whatever the placement: the same weights for every device map).
    ``spec.extra.norm_gain_sigma`` > 0 draws the language model's RMSNorm
    gains from exp(sigma * N(0, 1)) instead of ones: with unit gains QK-norm gives every key the same
    norm sqrt(H * D), and the token-norm statistics of a tiny model would be degenerate."""
    torch.manual_seed(spec.seed)
    model = cls._from_config(config, dtype=dtype)
    sigma = spec.extra.get("norm_gain_sigma", 0.0)
    if sigma:
        with torch.no_grad():
            for module in model.get_decoder().modules():
                if type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
                    module.weight.copy_(torch.exp(sigma * torch.randn_like(module.weight)))
    return model


# ----------------------------------------------------------------------------- model kinds
# Per kind: the model class for a config, the tiny model's tokenizer and config (source: config), the loader and
# the skeleton (the same class and config on the meta device, on which a device_map is planned).

QWEN_VL_TOKEN_IDS = dict(image_token_id="image_token", video_token_id="video_token",
                         vision_start_token_id="vision_bos_token", vision_end_token_id="vision_eos_token")
OMNI_TOKEN_IDS = dict(image_token_id="image_token", video_token_id="video_token", audio_token_id="audio_token",
                      audio_start_token_id="audio_bos_token", vision_start_token_id="vision_bos_token")


def _qwen3_vl_tokenizer(spec: ModelSpec):
    named = {k: QWEN_MM_TOKENS[k] for k in ("image_token", "video_token", "vision_bos_token", "vision_eos_token")}
    return tiny_tokenizer(spec, named, [], QWEN_TINY_TEMPLATE)


def _llava_tokenizer(spec: ModelSpec):
    return tiny_tokenizer(spec, {}, [LLAVA_IMAGE_TOKEN], LLAVA_TINY_TEMPLATE)


def _omni_tokenizer(spec: ModelSpec):
    return tiny_tokenizer(spec, QWEN_MM_TOKENS, [], QWEN_TINY_TEMPLATE)


def _qwen3_vl_config(spec: ModelSpec, tok):
    return _config_with_tokens(spec, tok, {k: QWEN_MM_TOKENS[v] for k, v in QWEN_VL_TOKEN_IDS.items()})


def _llava_config(spec: ModelSpec, tok):
    return _config_with_tokens(spec, tok, dict(image_token_id=LLAVA_IMAGE_TOKEN))


def _omni_config(spec: ModelSpec, tok):
    return _config_with_tokens(spec, tok, {k: QWEN_MM_TOKENS[v] for k, v in OMNI_TOKEN_IDS.items()})


def _qwen3_vl_class(config):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration


def _llava_class(config):
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration


def _omni_class(config):
    """The thinker for a thinker config; the full model (talker and code2wav never built) for a full checkpoint."""
    from transformers import Qwen3OmniMoeForConditionalGeneration
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    if config.model_type == "qwen3_omni_moe_thinker":
        return Qwen3OmniMoeThinkerForConditionalGeneration
    config.enable_audio_output = False
    return Qwen3OmniMoeForConditionalGeneration


#: kind -> (model class for a config, tiny tokenizer, tiny config)
KINDS = {"qwen3_vl": (_qwen3_vl_class, _qwen3_vl_tokenizer, _qwen3_vl_config),
         "llava_next": (_llava_class, _llava_tokenizer, _llava_config),
         "qwen3_omni": (_omni_class, _omni_tokenizer, _omni_config)}


def _model_config(spec: ModelSpec, config, tok=None):
    """(model class, config) of a spec: the checkpoint's ``config`` (:func:`oscar.models.build_config`), or the tiny
    one with ``tok``'s special tokens."""
    class_for, tokenizer_for, config_for = KINDS[spec.kind]
    config = config if spec.source != "config" else config_for(spec, tok or tokenizer_for(spec))
    return class_for(config), config


def _skeleton(spec: ModelSpec, dtype: torch.dtype, config):
    cls, config = _model_config(spec, config)
    return empty_model(lambda: cls._from_config(config, dtype=dtype))


for _kind in KINDS:
    register_skeleton(_kind)(_skeleton)


def _load(spec: ModelSpec, device, dtype: torch.dtype, config, tok=None):
    """The model of ``spec`` in ``dtype`` on ``device`` (or its placement): the checkpoint, or seeded random
    weights; Qwen3-Omni's full checkpoint gives its thinker."""
    cls, config = _model_config(spec, config, tok)
    if spec.source == "config":
        return place(_random_model(cls, config, spec, dtype), device, dtype)
    extra = {} if config.model_type != "qwen3_omni_moe" else dict(enable_audio_output=False)
    model = cls.from_pretrained(hub_location(spec), dtype=dtype, revision=spec.revision, **extra,
                                **pretrained_placement(device))
    if hasattr(model, "thinker"):  # the talker and code2wav were never built (their weights skipped)
        model = model.thinker
        if isinstance(device, Placement):  # placed with the full model, whose root hook the thinker lacks
            model.hf_device_map = {k.removeprefix("thinker."): v for k, v in device.device_map.items()}
            if device.sharded:
                root_hook(model, device)
    return place(model, device, dtype)


def _qwen_image_processor(config, spec: ModelSpec):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = config.vision_config
    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                    temporal_patch_size=vision.temporal_patch_size,
                                    **({"size": s} if (s := _image_size(spec.extra)) else {}))


# ----------------------------------------------------------------------------- loaders


@register_loader("qwen3_vl")
def load_qwen3_vl(spec: ModelSpec, device, dtype: torch.dtype, config):
    processor_cls = qwen3_vl_processor_class()
    if spec.source != "config":
        return _load(spec, device, dtype, config), _hub_processor(processor_cls, hub_location(spec), spec)
    tok = _qwen3_vl_tokenizer(spec)
    model = _load(spec, device, dtype, config, tok)
    processor = processor_cls(image_processor=_qwen_image_processor(model.config, spec), tokenizer=tok,
                              chat_template=QWEN_TINY_TEMPLATE)
    return model, processor


@register_loader("llava_next")
def load_llava_next(spec: ModelSpec, device, dtype: torch.dtype, config):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    if spec.source != "config":
        return _load(spec, device, dtype, config), _hub_processor(LlavaNextProcessor, hub_location(spec), spec)
    tok = _llava_tokenizer(spec)
    model = _load(spec, device, dtype, config, tok)
    config = model.config
    vision = config.vision_config
    tile = vision.image_size
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                                 image_grid_pinpoints=config.image_grid_pinpoints)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=vision.patch_size,
                                   vision_feature_select_strategy=config.vision_feature_select_strategy,
                                   chat_template=LLAVA_TINY_TEMPLATE, image_token=LLAVA_IMAGE_TOKEN,
                                   num_additional_image_tokens=1)  # CLIP's CLS token
    return model, processor


@register_loader("qwen3_omni")
def load_qwen3_omni(spec: ModelSpec, device, dtype: torch.dtype, config):
    """Qwen3-Omni's thinker only: it generates the text; audio output (the talker) is off."""
    from transformers import WhisperFeatureExtractor

    processor_cls = _omni_processor_class()
    if spec.source != "config":
        return _load(spec, device, dtype, config), _hub_processor(processor_cls, hub_location(spec), spec)
    tok = _omni_tokenizer(spec)
    model = _load(spec, device, dtype, config, tok)
    features = WhisperFeatureExtractor(feature_size=model.config.audio_config.num_mel_bins,
                                       sampling_rate=SAMPLING_RATE)
    processor = processor_cls(image_processor=_qwen_image_processor(model.config, spec), feature_extractor=features,
                              tokenizer=tok, chat_template=QWEN_TINY_TEMPLATE)
    return model, processor


# ----------------------------------------------------------------------------- generation


def processor_of(lm: KVModel):
    """The multimodal processor of ``lm``; a clear error for a text-only model."""
    processor = lm.info.get("processor")
    if processor is None:
        raise ValueError(f"{lm.name} is a text-only model: this task needs a vision-language or omni model "
                         f"(e.g. model=tiny-qwen3-vl, model=qwen3-vl-8b, model=qwen3-omni-30b-a3b)")
    return processor


def supports(lm: KVModel, modality: str) -> bool:
    """Whether ``lm``'s processor takes ``modality`` ("image" or "audio")."""
    processor = lm.info.get("processor")
    attribute = {"image": "image_processor", "audio": "feature_extractor"}[modality]
    return processor is not None and getattr(processor, attribute, None) is not None


def is_multimodal(lm: KVModel) -> bool:
    return lm.info.get("processor") is not None


def mm_inputs(lm: KVModel, samples: list[MMSample]):
    """Processor outputs for a left-padded batch, on the model's device, floats in the model dtype.

    Keeps everything the model needs (``mm_token_type_ids``, ``image_grid_thw``, ``image_sizes``,
    ``feature_attention_mask``): dropping any of them gives silently wrong positions or features.
    """
    processor = processor_of(lm)
    texts = [processor.apply_chat_template(s.messages(), tokenize=False, add_generation_prompt=True) for s in samples]
    images = [img for s in samples for img in s.images]
    audios = [a for s in samples for a in s.audios]
    kwargs = {}
    if images:
        if not supports(lm, "image"):
            raise ValueError(f"{lm.name} takes no images")
        kwargs["images"] = images
    if audios:
        if not supports(lm, "audio"):
            raise ValueError(f"{lm.name} takes no audio")
        kwargs["audio"] = audios
    enc = processor(text=texts, padding=True, padding_side="left", return_tensors="pt", **kwargs)
    dtype = next(lm.model.parameters()).dtype
    return enc.to(lm.device).to(dtype)  # BatchFeature.to(dtype) casts the floating tensors only


def token_modalities(lm: KVModel, input_ids: Tensor) -> Tensor:
    """Modality code (TEXT, IMAGE, AUDIO, VIDEO) of every language-model token: [B, T] -> [B, T]."""
    processor = processor_of(lm)
    codes = torch.full_like(input_ids, TEXT)
    for code, attribute in ((IMAGE, "image_token_id"), (AUDIO, "audio_token_id"), (VIDEO, "video_token_id")):
        token_id = getattr(processor, attribute, None)
        if token_id is not None:
            codes[input_ids == token_id] = code
    return codes


def reset_rope_deltas(model: torch.nn.Module) -> None:
    """Forget the multimodal RoPE offsets a previous sample left on the model."""
    for module in model.modules():
        if hasattr(module, "rope_deltas"):
            module.rope_deltas = None


@dataclass
class MMGeneration:
    texts: list[str]
    inputs: dict  # what the processor returned (input_ids [B, T], attention_mask, pixel/audio features)
    cache: QuantizedKVCache  # the cache after generation (nbytes, token_counts)
    new_tokens: Tensor  # [B, max_new] generated ids (pad after a sample's eos)


@torch.no_grad()
def mm_generate(lm: KVModel, samples: list[MMSample], max_new_tokens: int, stop_at_newline: bool = False,
                quantize_prefill: bool = False) -> MMGeneration:
    """Greedy answers for a batch of multimodal prompts, through a fresh quantized cache."""
    enc = mm_inputs(lm, samples)
    reset_rope_deltas(lm.model)
    cache = lm.new_cache(enc["attention_mask"], quantize_prefill)
    tok = lm.tokenizer
    out = lm.model.generate(**enc, **cache_argument(lm.model, cache), max_new_tokens=max_new_tokens,
                            do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[:, enc["input_ids"].shape[1]:]
    texts = tok.batch_decode(new, skip_special_tokens=True)
    texts = [t.strip().split("\n")[0] if stop_at_newline else t.strip() for t in texts]
    return MMGeneration(texts, dict(enc), cache, new)
