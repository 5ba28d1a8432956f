"""NIAH task: scoring rule, sentence-boundary insertion, prompt length, per-cell resume, the whole
pipeline on the tiny model, and a stub model that reads the needle back (score 100)."""

from __future__ import annotations

import json

import pytest

from evals import build_task
from evals.niah import (CLASSIC_NEEDLE, NeedleInAHaystack, contains_fact, insert_at_sentence, rouge1_recall,
                        sentence_end_tokens)


@pytest.fixture(scope="module")
def tiny():
    from oscar import build_method
    from oscar.lm import KVModel
    from oscar.models import load_model

    model, tokenizer = load_model("tiny-llama", device="cpu")
    return KVModel(model, tokenizer, build_method("oscar", residual_length=32), name="tiny-llama", max_length=4096)


class ReadsTheNeedle:
    """A stand-in model that answers with the needle sentence when it is in the prompt."""

    def __init__(self, tokenizer):
        self.tokenizer, self.name, self.max_length, self.positions, self.calls = tokenizer, "stub", 4096, None, 0

    def format_prompt(self, prompt, chat):
        return prompt

    def generate(self, prompts, max_new_tokens, chat=False):
        self.calls += 1
        return [CLASSIC_NEEDLE["text"] if CLASSIC_NEEDLE["text"] in p else "I do not know." for p in prompts]


def test_rouge1_recall_matches_rouge_score():
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=False)
    needle = CLASSIC_NEEDLE["text"]
    for response in ["\n\nThe best thing to do in San Francisco is to eat a sandwich and sit in Dolores Park.",
                     "What is the best thing to do in San Francisco? The answer is:", "Dolores Park, Dolores Park!",
                     "nothing at all"]:
        assert rouge1_recall(needle, response) == pytest.approx(scorer.score(needle, response)["rouge1"].recall)
    assert rouge1_recall(needle, needle) == 1.0


def test_contains_fact_ignores_case_and_punctuation():
    assert contains_fact(CLASSIC_NEEDLE["answer"], "To EAT a sandwich, and sit in Dolores-Park!")
    assert not contains_fact(CLASSIC_NEEDLE["answer"], "sit in Dolores Park and eat a sandwich")


def test_insertion_moves_back_to_a_sentence_end():
    period = 0
    tokens = [5, 6, period, 7, 8, 9, period, 10, 11, 12]
    assert insert_at_sentence(tokens, 0, {period}) == 0
    assert insert_at_sentence(tokens, 100, {period}) == len(tokens)
    assert insert_at_sentence(tokens, 60, {period}) == 3           # 6 -> back to just after the first period
    assert insert_at_sentence(tokens, 70, {period}) == 7           # already just after a period
    assert insert_at_sentence([5, 6, 7], 50, {period}) == 0        # no sentence end before: the start


@pytest.mark.parametrize("depth", [0, 25, 50, 100])
def test_prompt_length_and_needle_position(tiny, depth, data_file):
    task = NeedleInAHaystack(haystack_dir=str(data_file("pg_essays")))
    tok = tiny.tokenizer
    ends = sentence_end_tokens(tok)
    assert tok.encode(".", add_special_tokens=False)[0] in ends and tok.encode("\n", add_special_tokens=False)[0] not in ends
    haystack = task.haystack_tokens(tok, 1024)
    prompt = task.build_prompt(tok, haystack, 1024, depth, CLASSIC_NEEDLE, ends)
    assert abs(len(tok.encode(prompt, add_special_tokens=False)) - 1024) <= 8
    context = prompt.split("\n\nQuestion:")[0]
    before, after = context.split(CLASSIC_NEEDLE["text"])
    if depth == 0:
        assert before == ""
    elif depth == 100:
        assert after == ""
    else:
        assert before.rstrip()[-1] in ".!?"
        assert abs(len(before) / len(before + after) - depth / 100) < 0.05


def test_check_reports_a_missing_haystack(tmp_path):
    with pytest.raises(FileNotFoundError, match="haystack"):
        build_task("niah", haystack_dir=str(tmp_path / "nowhere")).check()
    with pytest.raises(ValueError, match="depths"):
        build_task("niah", depths=[150]).check()


def test_stub_that_reads_the_needle_scores_100_and_resumes(tiny, tmp_path):
    stub = ReadsTheNeedle(tiny.tokenizer)
    task = NeedleInAHaystack(lengths=[256, 512], depths=[0, 50, 100])
    result = task.run(stub, tmp_path)
    assert stub.calls == 6
    assert result.metrics["score"] == 100.0 and result.metrics["exact"] == 100.0
    assert {r["subset"] for r in result.rows} == {f"{l}@{d}" for l in (256, 512) for d in (0, 50, 100)} | {"all"}
    assert result.figures[0].exists() and result.figures[0].stat().st_size > 1000

    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    (tmp_path / "predictions.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])  # killed mid-write
    again = NeedleInAHaystack(lengths=[256, 512], depths=[0, 50, 100]).run(stub, tmp_path)
    assert stub.calls == 8                                     # only the cut line and the missing cell
    assert again.metrics == result.metrics


def test_tiny_model_end_to_end(tiny, tmp_path):
    task = NeedleInAHaystack(lengths=[160, 320], depths=[0, 100], max_new_tokens=4)
    result = task.run(tiny, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 4
    assert all(abs(r["prompt_tokens"] - r["length"]) <= 8 for r in records)
    cells = [r for r in result.rows if r["subset"] != "all" and r["metric"] == "score"]
    assert result.metrics["score"] == pytest.approx(sum(r["value"] for r in cells) / 4)
    assert (tmp_path / "niah_heatmap.png").exists()
    with pytest.raises(ValueError, match="max_length"):
        NeedleInAHaystack(lengths=[8192]).run(tiny, tmp_path / "too_long")
