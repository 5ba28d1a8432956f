"""LongBench metrics on hand-checked cases (each expected value worked out in the comment beside it)."""

from __future__ import annotations

import json

import pytest

from evals.longbench_metrics import (classification, code_similarity, count, first_code_line, normalize_answer, qa_f1,
                                     retrieval, rouge_l, score_sample)
from evals.longbench_prompts import MAX_NEW_TOKENS, PROMPTS


def test_prompts_and_lengths_are_the_official_ones(data_file):
    prompts = json.loads(data_file("longbench/dataset2prompt.json").read_text())
    maxlen = json.loads(data_file("longbench/dataset2maxlen.json").read_text())
    assert len(PROMPTS) == 13
    for name in PROMPTS:
        assert PROMPTS[name] == prompts[name]
        assert MAX_NEW_TOKENS[name] == maxlen[name]


def test_squad_normalization():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"


def test_qa_f1():
    assert qa_f1("The Eiffel Tower", "eiffel tower") == 1.0
    # prediction {paris, france} vs gold {paris}: precision 1/2, recall 1 -> F1 = 2/3
    assert qa_f1("Paris, France", "Paris") == pytest.approx(2 / 3)
    # 'in' 'paris' vs 'paris': P 1/2, R 1 -> 2/3; articles never count
    assert qa_f1("in the Paris", "Paris") == pytest.approx(2 / 3)
    assert qa_f1("London", "Paris") == 0.0
    assert qa_f1("", "Paris") == 0.0


def test_rouge_l():
    pytest.importorskip("rouge")
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0, abs=1e-6)
    # one sentence each, distinct words: hyp a b c d, ref a c b d -> LCS 3 of 4 -> P = R = F = 3/4
    assert rouge_l("a b c d", "a c b d") == pytest.approx(0.75, abs=1e-6)
    assert rouge_l("", "the cat") == 0.0                     # the rouge package raises on empty text: 0
    assert rouge_l("dog", "the cat") == pytest.approx(0.0, abs=1e-6)


def test_classification():
    classes = ["Location", "Number", "Description", "Human being", "Entity", "Abbreviation"]
    assert classification("Location", "Location", classes) == 1.0
    assert classification("Location or Number", "Number", classes) == 0.5     # two classes named: 1/2
    assert classification("Entity", "Location", classes) == 0.0
    # 'Human' is not a class; 'Human being' is: found once
    assert classification("Type: Human being", "Human being", classes) == 1.0
    # a class contained in the gold name is dropped: gold 'Numeric value', 'Numeric' named too -> 1/1
    assert classification("Numeric value", "Numeric value", ["Numeric", "Numeric value"]) == 1.0


def test_count_and_retrieval():
    assert count("There are 12 unique paragraphs.", "12") == 1.0
    assert count("12 or 13", "12") == 0.5
    assert count("no idea", "12") == 0.0
    assert retrieval("Paragraph 7", "Paragraph 7") == 1.0
    assert retrieval("Paragraph 7 or Paragraph 17", "Paragraph 7") == 0.5
    assert retrieval("Paragraph 3", "Paragraph 7") == 0.0


def test_code_similarity():
    assert first_code_line("\n# a comment\n```python\n    x = 1\ny = 2") == "    x = 1"
    assert code_similarity("x = 1\n", "x = 1") == 1.0
    # Indel ratio of "abcd" vs "abce": 1 - 2/8 = 0.75 -> 75 -> 0.75
    assert code_similarity("abcd", "abce") == 0.75
    # "ab" vs "abc": 1 - 1/5 = 0.8
    assert code_similarity("// only a comment\nab", "abc") == 0.8
    assert code_similarity("# nothing but comments", "abc") == 0.0


def test_score_sample_first_line_and_best_answer():
    # triviaqa: only the first line counts (after leading newlines)
    assert score_sample("triviaqa", "\n\nParis\nLondon London London", ["Paris"]) == 1.0
    assert score_sample("triviaqa", "London\nParis", ["Paris"]) == 0.0
    # hotpotqa scores the whole prediction, best over the gold answers
    assert score_sample("hotpotqa", "London\nParis", ["Paris", "London Paris"]) == 1.0
    assert score_sample("passage_count", "7", ["7"]) == 1.0
