"""Tiny random-weight vision/omni models end to end on real images and audio (mm/ in the data folder)."""

from __future__ import annotations

import copy
import functools
import sys

import pytest
import torch

from oscar import available_methods, build_method
from oscar.lm import KVModel
from oscar.models import ModelUnavailableError, load_model
from oscar.multimodal import (AUDIO, IMAGE, TEXT, MMSample, load_audio, load_image, mm_generate, mm_inputs,
                              token_modalities)
from tests.conftest import need_data, spectral_calibration

MODELS = ["tiny-qwen3-vl", "tiny-llava", "tiny-qwen3-omni"]
METHODS = {"fp16": {}, "kivi": dict(residual_length=32), "oscar": dict(residual_length=32)}


@functools.lru_cache(maxsize=None)
def loaded(name: str):
    return load_model(name, device="cpu")


def kv_model(name: str, method: str = "fp16", **hp) -> KVModel:
    """A fresh copy of the tiny model (methods change weights) bound to ``method``."""
    model, processor = loaded(name)
    if method == "spectral":
        hp = {"calibration": spectral_calibration(name), **hp}
    return KVModel(copy.deepcopy(model), processor, build_method(method, **{**METHODS.get(method, {}), **hp}),
                   name=name)


class RealMedia:
    """The real page images, word crops and speech clip, each loaded on first use; a test whose file is
    in no data folder is skipped (tests/conftest.need_data)."""

    FILES = dict(page="mm/docvqa/documents/ffbg0227_2.png", page2="mm/docvqa/documents/ffhx0227_1.png",
                 word="mm/ocr_words/demo_1.png", word2="mm/ocr_words/demo_7.png", speech="mm/audio/jfk.flac")

    def __init__(self):
        self.loaded = {}

    def __getitem__(self, key: str):
        if key not in self.loaded:
            path = need_data(self.FILES[key])
            self.loaded[key] = load_audio(path) if key == "speech" else load_image(path)
        return self.loaded[key]


@pytest.fixture(scope="module")
def mm() -> RealMedia:
    return RealMedia()


def real_sample(name: str, mm: dict, second: bool = False) -> MMSample:
    """DocVQA page + question (Qwen3-VL), OCR word crop + OCRBench question (LLaVA), speech (Omni)."""
    if name == "tiny-qwen3-vl":
        return MMSample("What is the name of the University?" if second else "what is the page no or page mentioned ?",
                        images=[mm["page2" if second else "page"]])
    if name == "tiny-llava":
        return MMSample("what is written in the image?", images=[mm["word2" if second else "word"]])
    clip = mm["speech"][: 16_000 * 6] if second else mm["speech"]
    return MMSample("What does the speaker ask?" if second else "Transcribe the speech.", audios=[clip])


def test_processors_need_no_torchvision():
    for name in MODELS:
        _, processor = loaded(name)
        assert getattr(processor, "video_processor", None) is None
        assert "Pil" in type(processor.image_processor).__name__
    assert "torchvision" not in sys.modules


def test_audio_is_mono_16khz(mm):
    speech = mm["speech"]
    assert speech.ndim == 1 and speech.dtype.name == "float32"
    assert 10.5 < len(speech) / 16_000 < 11.5  # the 11 s clip, resampled from 44.1 kHz stereo


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("name", MODELS)
def test_generate_stores_every_multimodal_token(name, method, mm):
    lm = kv_model(name, method)
    gen = mm_generate(lm, [real_sample(name, mm)], max_new_tokens=4)
    ids = gen.inputs["input_ids"]
    modality = token_modalities(lm, ids)[0]
    special = IMAGE if name != "tiny-qwen3-omni" else AUDIO
    n_mm, n_in = int((modality == special).sum()), ids.shape[1]
    assert n_mm > 100 and (modality == TEXT).sum() > 5
    assert isinstance(gen.texts[0], str) and gen.new_tokens.shape == (1, 4)
    stored = n_in + gen.new_tokens.shape[1] - 1  # the last generated token is never fed back
    assert gen.cache.get_seq_length() == stored
    first_mm = int((modality == special).nonzero()[0])
    for layer in range(len(gen.cache.layers)):
        counts = gen.cache.token_counts(layer)
        assert counts["keys_packed"] + counts["keys_residual"] == stored
        assert counts["values_packed"] + counts["values_residual"] == stored
        if method != "fp16":  # quantized: everything but the last R-window is packed, image/audio tokens included
            assert counts["keys_residual"] < lm.method.residual_length
            assert counts["keys_packed"] >= n_in - lm.method.residual_length > first_mm


@pytest.mark.parametrize("name", MODELS)
def test_quantized_cache_memory_covers_the_whole_sequence(name, mm):
    sample = real_sample(name, mm)
    lm = kv_model(name, "fp16")
    full = mm_generate(lm, [sample], max_new_tokens=2).cache
    quant = mm_generate(kv_model(name, "oscar"), [sample], max_new_tokens=2).cache
    text = lm.model.config.get_text_config()
    values_per_token = len(full.layers) * 2 * text.num_key_value_heads * text.head_dim
    assert full.nbytes == full.get_seq_length() * values_per_token * 4  # fp32 K and V of every token
    assert quant.nbytes < full.nbytes / 4  # 2-bit codes + scales + norms + a 32-token fp32 window


@pytest.mark.parametrize("name", MODELS)
def test_fp16_through_the_quantized_cache_equals_transformers_cache(name, mm):
    """Positions (M-RoPE with mm_token_type_ids, rope deltas) reach the model unchanged."""
    sample = real_sample(name, mm)
    ours = mm_generate(kv_model(name, "fp16"), [sample], max_new_tokens=5).new_tokens
    model, processor = loaded(name)  # untouched: no hook, transformers' own cache
    plain = KVModel(copy.deepcopy(model), processor, build_method("fp16"), name=name)  # for its processor handling
    enc = mm_inputs(plain, [sample])
    if name != "tiny-llava":
        assert "mm_token_type_ids" in enc or "feature_attention_mask" in enc
    reference = model.generate(**enc, max_new_tokens=5, do_sample=False,
                               pad_token_id=plain.tokenizer.pad_token_id)[:, enc["input_ids"].shape[1]:]
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("name", MODELS)
def test_padded_batch_of_two_equals_single_runs(name, mm):
    lm = kv_model(name, "oscar")  # R = 32: decoding flushes inside both rows' own token groups
    a, b = real_sample(name, mm), real_sample(name, mm, second=True)
    batch = mm_generate(lm, [a, b], max_new_tokens=6)
    mask = batch.inputs["attention_mask"]
    assert (mask.sum(-1)[0] != mask.sum(-1)[1]), "the two prompts should differ in length (padding exercised)"
    singles = [mm_generate(lm, [s], max_new_tokens=6).new_tokens[0] for s in (a, b)]
    assert torch.equal(batch.new_tokens[0], singles[0])
    assert torch.equal(batch.new_tokens[1], singles[1])


def test_rope_deltas_do_not_leak_between_samples(mm):
    lm = kv_model("tiny-qwen3-vl", "oscar")
    a, b = real_sample("tiny-qwen3-vl", mm), real_sample("tiny-qwen3-vl", mm, second=True)
    alone = mm_generate(kv_model("tiny-qwen3-vl", "oscar"), [b], max_new_tokens=6).new_tokens
    mm_generate(lm, [a], max_new_tokens=6)
    assert torch.equal(mm_generate(lm, [b], max_new_tokens=6).new_tokens, alone)


@pytest.mark.parametrize("name, kind", [("tiny-qwen3-vl", "qwen3_vl"), ("tiny-llava", "llava_next"),
                                        ("tiny-qwen3-omni", "qwen3_omni")])
def test_hub_loader_reads_a_local_checkpoint(name, kind, tmp_path, mm):
    """The real loading path (from_pretrained + processor from files) on a saved tiny checkpoint."""
    model, processor = loaded(name)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    spec = dict(name=f"local-{name}", source="hub", kind=kind, path=str(tmp_path), dtype="float32")
    from_disk, disk_processor = load_model(spec, device="cpu")
    assert "Pil" in type(disk_processor.image_processor).__name__
    assert type(disk_processor).__name__ == type(processor).__name__
    sample = real_sample(name, mm)
    ours = mm_generate(KVModel(from_disk, disk_processor, build_method("fp16"), name="local"), [sample], 4).new_tokens
    assert torch.equal(ours, mm_generate(kv_model(name), [sample], 4).new_tokens)


def test_hub_loader_offline_error_is_clear(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = dict(name="qwen3-vl-missing", source="hub", kind="qwen3_vl", hf_id="Qwen/Qwen3-VL-does-not-exist")
    with pytest.raises(ModelUnavailableError, match="model.path"):
        load_model(spec, device="cpu")


def test_text_only_model_is_refused_by_multimodal_generation(mm):
    model, tokenizer = load_model("tiny-llama", device="cpu")
    lm = KVModel(model, tokenizer, build_method("fp16"), name="tiny-llama")
    with pytest.raises(ValueError, match="text-only"):
        mm_generate(lm, [real_sample("tiny-qwen3-vl", mm)], max_new_tokens=2)


@pytest.mark.parametrize("method", sorted(set(available_methods()) - set(METHODS) - {"rotatekv"}))
def test_every_other_method_stores_audio_and_text_tokens(method, mm):
    lm = kv_model("tiny-qwen3-omni", method, residual_length=32)
    sample = MMSample("What is said?", audios=[mm["speech"][: 16_000 * 4]])
    gen = mm_generate(lm, [sample], max_new_tokens=3)
    stored = gen.inputs["input_ids"].shape[1] + 2
    counts = gen.cache.token_counts(0)
    assert gen.cache.get_seq_length() == stored == counts["keys_packed"] + counts["keys_residual"]
    assert counts["keys_packed"] > 0


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen3-omni"])
def test_rotatekv_refuses_multimodal_rope_models(name):
    """RotateKV re-applies 1-D RoPE to pre-RoPE keys: M-RoPE (3-D positions) models are refused, the
    error saying why and what to use instead."""
    model, processor = load_model(name, device="cpu")
    with pytest.raises(ValueError, match=r"multi-axis \(M-RoPE\) positions.*assumes 1-D positions") as refusal:
        KVModel(model, processor, build_method("rotatekv", reorder=False), name=name)
    assert "TextRotaryEmbedding" in str(refusal.value) and "use another method" in str(refusal.value)
    for other in ("kivi", "oscar"):
        assert other in str(refusal.value)


def test_omni_hub_loader_takes_the_thinker_of_a_full_checkpoint(tmp_path, mm):
    """Qwen3-Omni checkpoints hold thinker + talker: the loader keeps the thinker (text out)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    thinker, processor = loaded("tiny-qwen3-omni")
    full = Qwen3OmniMoeForConditionalGeneration(
        Qwen3OmniMoeConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False))
    full.thinker.load_state_dict(thinker.state_dict())
    full.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    spec = dict(name="local-omni", source="hub", kind="qwen3_omni", path=str(tmp_path), dtype="float32")
    from_disk, disk_processor = load_model(spec, device="cpu")
    assert type(from_disk).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    sample = real_sample("tiny-qwen3-omni", mm)
    ours = mm_generate(KVModel(from_disk, disk_processor, build_method("fp16"), name="local"), [sample], 4).new_tokens
    assert torch.equal(ours, mm_generate(kv_model("tiny-qwen3-omni"), [sample], 4).new_tokens)
