"""Modality split of key norms (evals/modality.py): golden cases and a tiny omni model on real inputs."""

from __future__ import annotations

import json

import pytest
import torch

from evals import build_task
from evals.modality import DEFAULT_IMAGE, modality_runs, norm_jumps
from oscar import build_method
from oscar.lm import KVModel
from oscar.models import load_model
from oscar.multimodal import AUDIO, IMAGE, TEXT, MMSample, load_audio, load_image


def test_modality_runs():
    codes = torch.tensor([TEXT, TEXT, IMAGE, IMAGE, IMAGE, TEXT, AUDIO])
    assert modality_runs(codes) == [(TEXT, 0, 2), (IMAGE, 2, 5), (TEXT, 5, 6), (AUDIO, 6, 7)]


def test_norm_jump_at_a_modality_boundary():
    # 16 text tokens at norm 1, then 16 image tokens at norm 4: one boundary, a 2-octave jump
    norms = torch.cat([torch.ones(16), torch.full((16,), 4.0)])
    codes = torch.tensor([TEXT] * 16 + [IMAGE] * 16)
    jumps = norm_jumps(norms, codes, window=8)
    assert jumps["boundaries"] == 1
    assert jumps["jump_mean"] == pytest.approx(2.0) and jumps["jump_max"] == pytest.approx(2.0)
    # within runs the medians of the windows around every other position are below the jump
    assert jumps["within_mean"] < jumps["jump_mean"]


@pytest.mark.parametrize("method", ["fp16", "oscar"])
def test_kv_error_split_by_modality_on_the_tiny_omni_model(method, data_file, tmp_path):
    word, speech = data_file("mm/ocr_words/demo_1.png"), data_file("mm/audio/jfk.flac")
    model, processor = load_model("tiny-qwen3-omni", device="cpu")
    lm = KVModel(model, processor, build_method(method), name="tiny-qwen3-omni")
    sample = MMSample("What is written and what is said?", images=[load_image(word)],
                      audios=[load_audio(speech)[: 16_000 * 3]])
    result = build_task("kv_error").run_multimodal(lm, tmp_path, sample)
    split = json.loads((tmp_path / "modality_split.json").read_text())
    names = set(split[0]["modalities"])
    assert names == {"text", "image", "audio"}
    tokens = sum(s["tokens"] for s in split[0]["modalities"].values())
    assert result.metrics["tokens"] == tokens - tokens % lm.method.group_size
    assert split[0]["boundaries"] >= 4  # text | image | text | audio | text
    for name in names:
        err = result.metrics[f"k_rel_err/{name}"]
        assert err == 0.0 if method == "fp16" else 0.0 < err < 1.0
        assert result.metrics[f"key_norm_median/{name}"] > 0
    assert {f.name for f in result.figures} == {"token_norms.png", "kv_error_per_layer.png",
                                                "token_norms_by_modality.png"}
    assert all(f.stat().st_size > 0 for f in result.figures)


def test_kv_error_task_takes_the_multimodal_path(tmp_path, data_file):
    data_file(DEFAULT_IMAGE)  # the task's default prompt shows this page
    model, processor = load_model("tiny-qwen3-vl", device="cpu")
    lm = KVModel(model, processor, build_method("kivi"), name="tiny-qwen3-vl")
    result = build_task("kv_error").run(lm, tmp_path)
    assert (tmp_path / "token_norms_by_modality.png").exists()
    assert {"k_rel_err/text", "k_rel_err/image", "key_norm_over_text/image"} <= set(result.metrics)
    assert {"mean/text", "mean/image"} <= {r["subset"] for r in result.rows}
