"""LongBench's metrics (THUDM LongBench ``metrics.py`` / ``eval.py``, the same definitions lm-eval's
longbench tasks use), each ``metric(prediction, ground_truth, all_classes) -> float in [0, 1]``.

A sample scores the max over its gold answers; trec, triviaqa and samsum score only the first line of
the prediction (after leading newlines), as LongBench's ``eval.py`` does. ROUGE-L is the ``rouge``
package's (LongBench's dependency); code similarity is fuzzywuzzy's rounded ``ratio`` (rapidfuzz's
Indel ratio, rounded like fuzzywuzzy) on the first line that is not empty and not a comment.
"""

from __future__ import annotations

import re
import string
from collections import Counter

PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower case, drop punctuation and articles, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: list[str], ground_truth: list[str]) -> float:
    common = sum((Counter(prediction) & Counter(ground_truth)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, ground_truth: str, all_classes=None) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def rouge_l(prediction: str, ground_truth: str, all_classes=None) -> float:
    """ROUGE-L F of the ``rouge`` package (sentences split on '.'); 0 where it raises (empty text)."""
    try:
        from rouge import Rouge
    except ImportError as e:
        raise ImportError("LongBench's ROUGE-L needs the `rouge` package: pip install rouge==1.0.1") from e
    try:
        return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except (ValueError, RecursionError):
        return 0.0


def classification(prediction: str, ground_truth: str, all_classes=None) -> float:
    """1/k when the gold class is among the k class names found in the prediction (names contained in
    the gold name are dropped, with the original's in-place removal while iterating)."""
    matches = [name for name in all_classes if name in prediction]
    for name in matches:
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_of_numbers_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def count(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Share of the numbers in the prediction that equal the gold count."""
    return _share_of_numbers_equal(prediction, str(ground_truth))


def retrieval(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Share of the numbers in the prediction that equal the gold paragraph id ("Paragraph 7")."""
    return _share_of_numbers_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def first_code_line(prediction: str) -> str:
    for line in prediction.split("\n"):
        if line.strip() and "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_similarity(prediction: str, ground_truth: str, all_classes=None) -> float:
    from rapidfuzz import fuzz

    return round(fuzz.ratio(first_code_line(prediction), ground_truth)) / 100


METRIC_OF = {
    "qasper": qa_f1, "multifieldqa_en": qa_f1, "hotpotqa": qa_f1, "2wikimqa": qa_f1, "triviaqa": qa_f1,
    "gov_report": rouge_l, "multi_news": rouge_l, "samsum": rouge_l,
    "trec": classification, "passage_count": count, "passage_retrieval_en": retrieval,
    "lcc": code_similarity, "repobench-p": code_similarity,
}
FIRST_LINE_ONLY = {"trec", "triviaqa", "samsum"}


def score_sample(dataset: str, prediction: str, answers: list[str], all_classes=None) -> float:
    """LongBench's per-sample score in [0, 1] for ``dataset`` (name without ``_e``)."""
    if dataset in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRIC_OF[dataset]
    return max((metric(prediction, answer, all_classes) for answer in answers), default=0.0)
