"""Golden tests for the multimodal benchmarks' scoring: ANLS, OCRBench, MMAU-Pro (hand-checked cases)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from evals.docvqa import anls, levenshtein
from evals.mmau_pro import follows_instruction, match_choice, open_metrics, parse_judge_scores
from evals.ocrbench import ocrbench_hit, ocrbench_scores


# ----------------------------------------------------------------------------- ANLS


@pytest.mark.parametrize("prediction, answers, expected", [
    ("2", ["2", "page 2"], 1.0),
    (" VANDERBILT   University ", ["Vanderbilt university", "VANDERBILT UNIVERSITY"], 1.0),  # case + spaces
    ("page2", ["page 2"], 1 - 1 / 6),               # one insertion over 6 characters
    ("123,110", ["$123,110"], 1 - 1 / 8),           # one deletion over 8 characters
    ("Vanderbilt", ["Vanderbilt university"], 0.0),  # NL = 11/21 = 0.52 >= 0.5: no credit
    ("ab", ["cb"], 0.0),                             # NL = 0.5 exactly: no credit (NL < threshold only)
    ("abc", ["abd", "xyz"], 1 - 1 / 3),              # best over the gold answers
    ("", ["1986"], 0.0),
])
def test_anls_hand_checked(prediction, answers, expected):
    assert anls(prediction, answers) == pytest.approx(expected)


def test_levenshtein_matches_rapidfuzz():
    from rapidfuzz.distance import Levenshtein

    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("ab c$1") for _ in range(rng.randint(0, 9)))
        b = "".join(rng.choice("ab c$1") for _ in range(rng.randint(0, 9)))
        assert levenshtein(a, b) == Levenshtein.distance(a, b)


# ----------------------------------------------------------------------------- OCRBench


@pytest.mark.parametrize("prediction, answers, dataset, hit", [
    ("The word is CENTRE.", "CENTRE", "IIIT5K", 1),            # containment, case-insensitive
    ("centre", ["CENTRE"], "IIIT5K", 1),
    ("CENTER", "CENTRE", "IIIT5K", 0),
    ("Total:\n$12.50", ["total: $12.50"], "SROIE", 1),          # newlines read as spaces
    ("y_{2}=-1", ["y _ { 2 } = - 1\n", "y_2 = - 1\n"], "HME100k", 1),  # math: spaces removed
    ("Y_{2}=-1", ["y _ { 2 } = - 1\n"], "HME100k", 0),          # math: case-sensitive
    ("x = 1", ["x=1"], "HME100k", 1),
])
def test_ocrbench_hit_hand_checked(prediction, answers, dataset, hit):
    assert ocrbench_hit(prediction, answers, dataset) == hit


def test_ocrbench_scores_sum_components(data_file):
    questions = json.loads(data_file("mm/ocrbench/OCRBench.json").read_text())
    # answer every question correctly except the math ones: 900 of 1000
    records = [dict(q, prediction=q["answers"] if isinstance(q["answers"], str) else q["answers"][0])
               for q in questions]
    for r in records:
        if r["dataset_name"] == "HME100k":
            r["prediction"] = "no formula"
    scores = ocrbench_scores(records)
    assert scores["all"] == (900, 1000)
    assert scores["Text Recognition"] == (300, 300)
    assert scores["Scene Text-centric VQA"] == (200, 200)
    assert scores["Doc-oriented VQA"] == (200, 200)
    assert scores["Key Information Extraction"] == (200, 200)
    assert scores["Handwritten Mathematical Expression Recognition"] == (0, 100)


# ----------------------------------------------------------------------------- MMAU-Pro


def test_judge_scores_parsed_as_the_benchmark():
    verdict = ("CORRECTNESS: 4 - mostly right\nRELEVANCE: 5 - on topic\nCOMPLETENESS: 3 - misses one point\n"
               "CLARITY: 4 - clear\nOVERALL: 4.5 - good")
    assert parse_judge_scores(verdict) == dict(correctness=4, relevance=5, completeness=3, clarity=4, overall=4.5)
    # OVERALL exactly 3 (or missing) is replaced by the mean of the criteria
    assert parse_judge_scores(verdict.replace("OVERALL: 4.5", "OVERALL: 3"))["overall"] == 4.0
    assert parse_judge_scores(verdict.split("OVERALL")[0])["overall"] == 4.0
    # nothing parsable: every criterion reads 3
    assert parse_judge_scores("I cannot judge this.") == dict(correctness=3, relevance=3, completeness=3, clarity=3,
                                                              overall=3)


def test_open_metrics():
    metrics = open_metrics([4.0, 3.0, 5.0, 2.0])
    assert metrics["open"] == pytest.approx(100 * 3.5 / 5)
    assert metrics["good_rate"] == pytest.approx(50.0)


@pytest.mark.parametrize("response, identifier, kwargs, passed", [
    ("one two three", "Number Words (at most)", {"N": 5}, True),
    ("one two three four five six", "Number Words (at most)", {"N": 5}, False),
    ("a b c d", "Number Words (range)", {"N1": 2, "N2": 4}, True),
    ("HELLO WORLD", "All Uppercase", {}, True),
    ("Hello world", "All Uppercase", {}, False),
    ("<<Rain>> It is raining.", "Title", {}, True),
    ("* first\n* second", "Number Bullets", {"N": 2}, True),
    ("* first\n* second\n* third", "Number Bullets", {"N": 2}, False),
    ("Done.\nP.S. see you", "Postscript", {"postscript_marker": "P.S."}, True),
    ("The bird sings. The dog barks? Yes!", "Number Sentences (at least)", {"N": 3}, True),
    ("The bird sings.", "Number Sentences (at least)", {"N": 3}, False),
    ("rain and thunder", "Include Keywords", {"keywords": "rain, thunder"}, True),
    ("rain only", "Include Keywords", {"keywords": "rain, thunder"}, False),
    ("rain, rain and RAIN", "Keyword Frequency", {"keyword": "rain", "N": 3}, True),
    ("no commas here", "No Commas", {}, True),
    ('"quoted answer"', "Quotation", {}, True),
    ("first answer ****** second answer", "Two Responses", {}, True),
    ("same ****** same", "Two Responses", {}, False),
    ("Sure, here it is: birds sing.", "Start Checker", {"start_phrase": "Sure here"}, True),
    ("part one *** part two", "Number Paragraphs", {"N": 2}, True),
    ("SEC 1 a SEC 2 b", "Multiple Sections", {"N": 2, "section_splitter": "SEC"}, True),
    ("SEC 1 a SEC 2 b", "Multiple Sections", {"N": 3, "section_splitter": "SEC"}, False),
    ("I [name] live in [city]", "Number Placeholder", {"N": 2}, True),
    ("an *important* and *bold* part", "Minimum Number Highlighted Section", {"N": 2}, True),
    ("anything", "Unknown Check", {}, False),
])
def test_instruction_following_checks(response, identifier, kwargs, passed):
    assert follows_instruction(response, identifier, kwargs) is passed
    assert follows_instruction(response, identifier, json.dumps(kwargs)) is passed  # parquet may hold JSON text


def test_repeat_prompt_uses_the_question():
    assert follows_instruction("Say hello twice. hello hello", "Repeat Prompt", {}, question="Say hello twice.")
    assert not follows_instruction("hello hello", "Repeat Prompt", {}, question="Say hello twice.")


@pytest.mark.parametrize("prediction, expected", [
    ("A woman", "A woman"),                          # exact
    ("B", "A woman"), ("(C) An adult man", "An adult man"), ("D.", "A teenager"),  # option letters
    ("The speaker is a woman.", "A woman"),          # the only choice contained
    ("woman", "A woman"),                            # fuzzy (token-set ratio)
])
def test_match_choice(prediction, expected):
    assert match_choice(prediction, ["A child", "A woman", "An adult man", "A teenager"]) == expected


def test_match_choice_containment_prefers_the_unique_match():
    assert match_choice("It is a man speaking", ["Man", "Woman", "Child", "Robot"]) == "Man"


def test_match_choice_by_embedding():
    def letters(texts):  # bag-of-letters embedding: a stand-in for NV-Embed-v2
        return np.array([[t.lower().count(c) for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts], dtype=float)

    assert match_choice("violin music", ["Drums", "Violin", "Siren"], embed=letters) == "Violin"
