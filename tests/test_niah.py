"""NIAH task: scoring rule (Unicode text included), sentence-boundary insertion, prompt lengths within their cells,
per-cell resume, the whole pipeline on the tiny model, and a stub model that reads the needle back (score 100)."""

from __future__ import annotations

import json

import pytest

from evals import build_task
from evals.niah import (CLASSIC_NEEDLE, NeedleInAHaystack, contains_fact, insert_at_sentence, rouge1_recall, words,
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
        from oscar import build_method

        self.tokenizer, self.name, self.max_length, self.positions, self.calls = tokenizer, "stub", 4096, None, 0
        self.stored_bytes = self.stored_tokens = 0  # no cache: KVModel's counters of stored KV bytes stay 0
        self.method = build_method("fp16")  # what the run's heatmap title names

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


# ----------------------------------------------------------------------------- Unicode text

SUSHI = {"text": "東京で一番いいことは寿司を食べることだ 🍣.", "question": "東京で一番いいことは?", "answer": "寿司を食べる"}


def test_words_are_unicode_letters_and_digits_each_character_where_scripts_have_no_spaces():
    assert words("The best thing_to do: 42!") == ["the", "best", "thing", "to", "do", "42"]
    assert words("寿司を食べる") == ["寿", "司", "を", "食", "べ", "る"]                 # Han and kana: a word each
    assert words("Ｆｕｌｌ ＷＩＤＴＨ ４２") == ["full", "width", "42"]                 # NFKC
    assert words("Straße café") == ["strasse", "café"]                                  # case-folded, accents kept
    assert words("हिन्दी भाषा") == ["हिन्दी", "भाषा"]                                  # combining marks stay in their word
    assert words("한국어 문장") == ["한국어", "문장"]                                    # Hangul is written with spaces
    assert words("ภาษา") == ["ภ", "า", "ษ", "า"]
    assert words("🍣\ufe0f 🍣. ... !?") == []                                         # emoji, punctuation: no words


def test_rouge_tokens_of_ascii_text_are_rouge_scores():
    tokenize = pytest.importorskip("rouge_score.tokenize")
    for text in ["The best thing_to do in S.F. is (to) eat 2 sandwiches!", "A-B c/d e's 3.14", "  ", "x__y 9a"]:
        assert words(text) == tokenize.tokenize(text, None)


def test_a_japanese_needle_is_scored_on_its_characters():
    """An unrelated response scored exact 100 (the answer had no ASCII word, and "" is in every text) and score 0."""
    unrelated = "I do not know the answer to that."
    assert not contains_fact(SUSHI["answer"], unrelated) and rouge1_recall(SUSHI["text"], unrelated) == 0.0
    assert contains_fact(SUSHI["answer"], "答えは寿司を食べることです。")
    assert not contains_fact(SUSHI["answer"], "寿司を作る")
    assert rouge1_recall(SUSHI["text"], SUSHI["text"]) == 1.0
    assert 0 < rouge1_recall(SUSHI["text"], "東京で寿司を食べる") < 1


def test_the_key_fact_is_matched_as_whole_words():
    assert contains_fact("4", "It is 4.") and not contains_fact("4", "It is 42.")
    assert not contains_fact(CLASSIC_NEEDLE["answer"], "beat a sandwich and sit in Dolores Parkway")


def test_the_run_scores_a_japanese_needle(tiny, tmp_path):
    stub = ReadsTheNeedle(tiny.tokenizer)
    stub.generate = lambda prompts, max_new_tokens, chat=False: ["I do not know the answer."] * len(prompts)
    result = NeedleInAHaystack(lengths=[256], depths=[50], needles=[SUSHI]).run(stub, tmp_path)
    assert result.metrics["score"] == 0.0 and result.metrics["exact"] == 0.0


# ----------------------------------------------------------------------------- lengths


def _tokenizers():
    """Every registered causal LM whose own tokenizer loads here (the tiny models borrow one of these)."""
    from oscar.models import available_models, load_spec

    return [name for name in available_models()
            if (spec := load_spec(name)).kind == "causal_lm" and spec.source != "config"]


@pytest.fixture(scope="module", params=_tokenizers())
def model_tokenizer(request):
    from oscar.models import ModelUnavailableError, load_tokenizer

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")  # a hub model not in the cache: skipped at once
    try:
        return request.param, load_tokenizer(request.param)
    except ModelUnavailableError as e:
        pytest.skip(str(e))
    finally:
        mp.undo()


@pytest.mark.parametrize("chat", [False, True])
def test_every_prompt_of_the_default_grid_is_within_its_length(model_tokenizer, chat, data_file):
    """Every cell of the default grid (conf/task/niah.yaml) for every model whose tokenizer is here: the prompt, as
    generate counts it, has at most L tokens and at least L - 8 (the haystack fills the rest)."""
    from oscar.lm import prompt_length

    name, tok = model_tokenizer
    if chat and not tok.chat_template:
        pytest.skip(f"{name}'s tokenizer has no chat template")
    task = NeedleInAHaystack(haystack_dir=str(data_file("pg_essays")), chat=chat)
    haystack, ends = task.haystack_tokens(tok, max(task.lengths)), sentence_end_tokens(tok)
    counts = {(length, depth): prompt_length(tok, task.build_prompt(tok, haystack, length, depth, needle, ends), chat)
              for length in task.lengths for depth in task.depths for needle in task.needles}
    assert len(counts) == 9
    assert all(length - 8 <= n <= length for (length, _), n in counts.items()), (name, counts)


def test_a_length_shorter_than_the_needle_is_refused_naming_the_minimum(model_tokenizer, data_file):
    """The classic needle at length 16 ran a prompt of about 60 tokens as cell 16; a 3,000-word needle at 256 one of
    3,000. The minimum named is the prompt without haystack; that length is accepted and fits."""
    from oscar.lm import prompt_length

    name, tok = model_tokenizer
    long = {"text": " ".join(["word"] * 3000) + ".", "question": "Which word?", "answer": "word"}
    for needle in (CLASSIC_NEEDLE, long):
        task = NeedleInAHaystack(lengths=[16, 256], needles=[needle], haystack_dir=str(data_file("pg_essays")))
        shortest = task.shortest_prompt(tok, needle)
        assert shortest > 16
        with pytest.raises(ValueError, match=rf"the minimum length is {shortest}$"):
            task.check_tokenizer(tok)
        NeedleInAHaystack(lengths=[shortest], needles=[needle]).check_tokenizer(tok)
        haystack, ends = task.haystack_tokens(tok, shortest), sentence_end_tokens(tok)
        assert prompt_length(tok, task.build_prompt(tok, haystack, shortest, 50, needle, ends)) <= shortest
        with pytest.raises(ValueError, match=r"length \d+ is shorter than the needle's prompt without haystack"):
            task.build_prompt(tok, haystack, shortest - 1, 50, needle, ends)


def test_a_chat_prompt_needs_a_chat_template(model_tokenizer):
    """Gemma 3 270M is a base model: chat=true failed in transformers after the weights loaded."""
    name, tok = model_tokenizer
    task = NeedleInAHaystack(chat=True)
    if tok.chat_template:
        task.check_tokenizer(tok)
    else:
        with pytest.raises(ValueError, match=r"niah: chat=true, but the model's tokenizer has no chat template"):
            task.check_tokenizer(tok)


def test_the_run_refuses_a_prompt_longer_than_its_cell(tiny, tmp_path, monkeypatch):
    """The run counts every prompt's tokens before generating: a prompt past its cell's length stops the run (a
    build_prompt that let one through would otherwise give a silently wrong cell)."""
    stub = ReadsTheNeedle(tiny.tokenizer)
    monkeypatch.setattr(NeedleInAHaystack, "build_prompt", lambda self, tok, haystack, length, *rest:
                        " hello" * (length + 20))
    with pytest.raises(RuntimeError, match=r"niah: the prompt of cell 256@50#0 has \d+ tokens, more than its length 256"):
        NeedleInAHaystack(lengths=[256], depths=[50]).run(stub, tmp_path)
    assert stub.calls == 0
