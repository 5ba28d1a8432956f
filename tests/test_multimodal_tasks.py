"""The multimodal tasks end to end on the local fixtures with tiny random-weight models."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from evals import build_task
from evals.mm_common import DataUnavailableError
from evals.mmau_pro import AIF, OPEN
from oscar import build_method
from oscar.lm import KVModel
from oscar.models import load_model


def kv_model(name: str, method: str = "oscar") -> KVModel:
    model, processor = load_model(name, device="cpu")
    return KVModel(model, processor, build_method(method, residual_length=32) if method != "fp16"
                   else build_method("fp16"), name=name)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_docvqa_on_real_pages(data_file, tmp_path):
    pages = [f"documents/{page}.png" for page in ("ffbg0227_2", "ffhx0227_1", "ffjw0228_11")]  # the 3 rows read
    for name in ("val_v1.0.small.json", *pages):
        data_file(f"mm/docvqa/{name}")  # skip unless they are somewhere; the task finds mm/docvqa the same way
    task = build_task("docvqa", data_dir="mm/docvqa", questions="val_v1.0.small.json",
                      limit=3, max_new_tokens=3, batch_size=2)
    task.check()
    result = task.run(kv_model("tiny-qwen3-vl"), tmp_path)
    records = lines(tmp_path / "predictions.jsonl")
    assert len(records) == 3 and all(r["input_tokens"] > 200 for r in records)  # page image tokens + question
    assert 0.0 <= result.metrics["anls"] <= 100.0
    assert result.rows == [{"subset": "validation", "metric": "anls", "value": result.metrics["anls"], "n": 3}]


def test_ocrbench_on_word_crops_resumes(data_file, tmp_path):
    words = data_file("mm/ocr_words/labels.jsonl").parent
    for image in ("demo_1.png", "demo_2.jpg"):  # the two rows it reads (limit=2)
        data_file(f"mm/ocr_words/{image}")
    task = build_task("ocrbench", data_dir=str(words), questions="labels.jsonl",
                      limit=2, max_new_tokens=3)
    task.check()
    lm = kv_model("tiny-llava", "kivi")
    first = task.run(lm, tmp_path)
    assert first.metrics["accuracy"] == 100.0 * first.metrics["score"] / 2
    assert {r["subset"] for r in first.rows} >= {"all", "Text Recognition", "Regular Text Recognition"}
    # a finished prediction is never recomputed: the log stays as it was
    before = (tmp_path / "predictions.jsonl").read_text()
    again = task.run(lm, tmp_path)
    assert (tmp_path / "predictions.jsonl").read_text() == before and again.metrics == first.metrics


def test_ocrbench_missing_images_fail_before_the_model(data_file):
    task = build_task("ocrbench", data_dir=str(data_file("mm/ocrbench/OCRBench.json").parent))  # no images
    with pytest.raises(DataUnavailableError, match="images missing"):
        task.check()


def test_image_task_refuses_a_text_only_model(data_file, tmp_path):
    task = build_task("docvqa", data_dir=str(data_file("mm/docvqa/val_v1.0.small.json").parent),
                      questions="val_v1.0.small.json", limit=1)
    model, tokenizer = load_model("tiny-llama", device="cpu")
    with pytest.raises(ValueError, match="text-only"):
        task.run(KVModel(model, tokenizer, build_method("fp16"), name="tiny-llama"), tmp_path)


@pytest.fixture
def mmau_dir(data_file, tmp_path):
    """A small MMAU-Pro folder in the hub layout: test.parquet + audio (the real speech clip)."""
    folder = tmp_path / "mmau"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "jfk.flac").symlink_to(data_file("mm/audio/jfk.flac"))
    rows = [
        dict(id="mc1", question="Who is speaking?", choices=["A man", "A woman", "A child"], answer="A man",
             category="speech", audio_path=["data/jfk.flac"], task_identifier=None, kwargs=None),
        dict(id="open1", question="What does the speaker ask of his listeners?",
             choices=[], answer="To ask what they can do for their country.", category=OPEN,
             audio_path=["data/jfk.flac"], task_identifier=None, kwargs=None),
        dict(id="aif1", question="Summarize the speech in at most 50 words.", choices=[], answer="",
             category=AIF, audio_path=["data/jfk.flac"], task_identifier="Number Words (at most)",
             kwargs=json.dumps({"N": 50})),
    ]
    pd.DataFrame(rows).to_parquet(folder / "test.parquet")
    return folder


def test_mmau_pro_scores_every_category(mmau_dir, tmp_path):
    task = build_task("mmau_pro", data_dir=str(mmau_dir), max_new_tokens=4, max_new_tokens_choice=3,
                      judge="tiny-llama", judge_max_new_tokens=4)
    task.check()
    result = task.run(kv_model("tiny-qwen3-omni"), tmp_path)
    records = {r["key"]: r for r in lines(tmp_path / "predictions.jsonl")}
    assert set(records) == {"mc1", "open1", "aif1"} and all(r["input_tokens"] > 140 for r in records.values())
    # 4 new tokens are at most 4 words: the word-limit instruction is followed
    assert result.metrics["aif"] == 100.0
    assert result.metrics["accuracy/speech"] in (0.0, 100.0)
    judge = lines(tmp_path / "judge.jsonl")
    assert len(judge) == 1 and judge[0]["judge"] == "tiny-llama"
    assert result.metrics["open"] == pytest.approx(100 * judge[0]["overall"] / 5)
    assert {"subset": f"{OPEN}/judge=tiny-llama", "metric": "good_rate", "value": result.metrics["good_rate"],
            "n": 1} in result.rows
    weighted = (result.metrics["aif"] + result.metrics["accuracy/speech"] + result.metrics["open"]) / 3
    assert result.metrics["weighted"] == pytest.approx(weighted)


def test_mmau_pro_judge_verdicts_are_scored(mmau_dir, tmp_path):
    """Scoring with a stand-in judge whose verdicts are known."""
    task = build_task("mmau_pro", data_dir=str(mmau_dir), categories=[OPEN])
    records = [dict(key="open1", question="q", answer="a", prediction="p", category=OPEN, choices=[],
                    task_identifier=None, kwargs=None)]
    result = task.score(records, tmp_path, judge_fn=lambda prompts: ["CORRECTNESS: 5\nRELEVANCE: 4\nCOMPLETENESS: 4\n"
                                                                   "CLARITY: 5\nOVERALL: 4.5"] * len(prompts))
    assert result.metrics["open"] == pytest.approx(90.0) and result.metrics["good_rate"] == 100.0
