"""LongBench-E pipeline on a small LongBench-format fixture built from the real HotpotQA / SQuAD data:
loading, prompts, middle truncation, chat-template rule, batching with left padding, resume, scoring
and the per-subset / bucket / average rows."""

from __future__ import annotations

import json

import pytest

from evals import build_task
from evals.longbench import LongBenchE, bucket_of, load_rows, middle_truncate, summarize
from scripts.longbench_fixture import build_fixture

FIXTURE_SUBSETS = ["hotpotqa_e", "multifieldqa_en_e", "passage_count_e", "passage_retrieval_en_e"]


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("longbench")
    build_fixture(out, per_subset=3, words=[120, 300, 4100])
    return out


@pytest.fixture(scope="module")
def tiny():
    from oscar import build_method
    from oscar.lm import KVModel
    from oscar.models import load_model

    model, tokenizer = load_model("tiny-llama", device="cpu")
    return KVModel(model, tokenizer, build_method("kivi", residual_length=32), name="tiny-llama", max_length=4096)


class KnowsTheAnswers:
    """Stand-in model that answers each fixture prompt with its first gold answer."""

    def __init__(self, tiny, rows):
        self.tokenizer, self.method, self.max_length, self.calls = tiny.tokenizer, tiny.method, 4096, 0
        self.rows, self.positions = rows, None
        self.stored_bytes = self.stored_tokens = 0  # no cache: KVModel's counters of stored KV bytes stay 0

    def generate(self, prompts, max_new_tokens, chat=False):
        self.calls += 1
        return [next(r["answers"][0] for r in self.rows if r["context"][:80] in p) for p in prompts]


def test_fixture_has_the_longbench_row_format(fixture_dir):
    for subset in FIXTURE_SUBSETS:
        rows = load_rows(subset, str(fixture_dir), "unused")
        assert len(rows) == 3
        for row in rows:
            assert set(row) >= {"input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"}
            assert row["length"] == len(row["context"].split()) and row["answers"]
        assert bucket_of(rows[2]["length"]) == "4-8k"


def test_middle_truncation_keeps_both_ends(tiny):
    tok = tiny.tokenizer
    text = " ".join(f"w{i}" for i in range(600))
    cut, truncated = middle_truncate(tok, text, 100)
    ids = tok.encode(text, add_special_tokens=False)
    assert truncated and abs(len(tok.encode(cut, add_special_tokens=False)) - 100) <= 2
    assert cut.startswith(tok.decode(ids[:50])) and cut.endswith(tok.decode(ids[-50:]))
    assert middle_truncate(tok, "short text", 100) == ("short text", False)


@pytest.mark.parametrize("chat_template", ["always", "never"])
def test_a_prompt_is_cut_to_what_the_model_reads_with_its_new_tokens(tiny, chat_template, monkeypatch):
    """With max_input_length null a prompt keeps the model's max_length tokens only where the model also holds the
    chat template (or special tokens) and the subset's new tokens: the prompt as read fits both limits, and is cut
    no further than the halves' re-tokenization needs."""
    import copy

    from evals.longbench_prompts import MAX_NEW_TOKENS
    from oscar.lm import KVModel, prompt_length

    lm = copy.copy(tiny)
    text = " ".join(f"w{i}" for i in range(900))
    task = LongBenchE(chat_template=chat_template)
    for max_length, positions in ((300, 4096), (300, 700), (4096, None)):
        lm.max_length = max_length
        monkeypatch.setattr(KVModel, "positions", positions)
        room = min(max_length, (positions or 10**9) - MAX_NEW_TOKENS["gov_report"])
        kept, cut = task.truncated(lm, "gov_report_e", text)
        read = prompt_length(lm.tokenizer, kept, chat_template == "always")
        assert read <= room and (read >= room - 3 if cut else kept == text), (max_length, positions, read, room)
        assert cut == (max_length == 300)
    lm.max_length = 1
    with pytest.raises(ValueError, match="gov_report_e: the model's max_length 1 and positions None leave no room"):
        task.truncated(lm, "gov_report_e", text)


@pytest.mark.parametrize("chat_template", ["always", "never"])
def test_prompts_measured_together_are_cut_as_one_by_one(tiny, chat_template, monkeypatch):
    """truncated_all (two batched tokenizer calls, then truncated for those that do not fit) gives each text what
    truncated gives it: texts that fit, one right at the limit, and ones cut; and requests_for's batched
    tokenization gives each prompt the ids a single call gives it."""
    import copy

    from evals.scheduler import Job, requests_for
    from oscar.lm import KVModel, prompt_length

    lm = copy.copy(tiny)
    lm.max_length = 300
    monkeypatch.setattr(KVModel, "positions", None)
    chat = chat_template == "always"
    task = LongBenchE(chat_template=chat_template)
    limit = next(n for n in range(400, 0, -1)
                 if prompt_length(lm.tokenizer, " ".join(f"w{i}" for i in range(n)), chat) <= 300)
    texts = [" ".join(f"w{i}" for i in range(n)) for n in (5, limit // 2, limit, limit + 1, 3 * limit, limit // 3)]
    together = task.truncated_all(lm, "gov_report_e", texts)
    assert together == [task.truncated(lm, "gov_report_e", text) for text in texts]
    assert [cut for _, cut in together] == [False, False, False, True, True, False]
    assert task.truncated_all(lm, "gov_report_e", []) == []
    lm.max_length = 1
    with pytest.raises(ValueError, match="gov_report_e: the model's max_length 1 and positions None leave no room"):
        task.truncated_all(lm, "gov_report_e", ["a"])
    lm.max_length = 300
    lm.max_length = 10_000  # the prompts as cut, with and without the template
    jobs = [Job(str(i), text, 8, chat=i % 2 == 0) for i, (text, _) in enumerate(together)]
    requests = requests_for(lm, jobs)
    assert [r.key for r in requests] == list(range(len(jobs)))
    assert [list(r.input_ids) for r in requests] == [
        lm.tokenizer(lm.format_prompt(job.prompt, job.chat), add_special_tokens=not job.chat)["input_ids"]
        for job in jobs]


def test_chat_template_rule(tiny):
    task = LongBenchE()
    assert task.uses_chat("hotpotqa_e", tiny.tokenizer)
    assert not any(task.uses_chat(s, tiny.tokenizer) for s in ["trec_e", "triviaqa_e", "samsum_e", "lcc_e", "repobench-p_e"])
    assert LongBenchE(chat_template="always").uses_chat("trec_e", tiny.tokenizer)
    assert not LongBenchE(chat_template="never").uses_chat("hotpotqa_e", tiny.tokenizer)


def test_check_errors(fixture_dir):
    with pytest.raises(ValueError, match="unknown subset"):
        build_task("longbench_e", subsets=["hotpotqa"]).check()
    with pytest.raises(FileNotFoundError, match="trec_e.jsonl"):
        build_task("longbench_e", subsets=["trec_e"], data_dir=str(fixture_dir)).check()


def test_offline_hub_load_is_a_clear_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="task.data_dir"):
        load_rows("hotpotqa_e", None, "Xnhyacinth/LongBench")


def test_perfect_answers_score_100_and_rows_add_up(fixture_dir, tiny, tmp_path):
    rows = [r for s in FIXTURE_SUBSETS for r in load_rows(s, str(fixture_dir), "unused")]
    stub = KnowsTheAnswers(tiny, rows)
    task = LongBenchE(subsets=FIXTURE_SUBSETS, data_dir=str(fixture_dir), batch_size=2)
    result = task.run(stub, tmp_path)
    assert stub.calls == 4 * 2                                   # 3 samples per subset in batches of 2
    assert result.metrics["average"] == 100.0
    assert {r["subset"] for r in result.rows} >= {*FIXTURE_SUBSETS, "average", "0-4k", "4-8k"}
    assert result.metrics["hotpotqa_e@4-8k"] == 100.0

    again = LongBenchE(subsets=FIXTURE_SUBSETS, data_dir=str(fixture_dir)).run(stub, tmp_path)
    assert stub.calls == 8 and again.metrics == result.metrics  # resumed: nothing recomputed


def test_summary_definitions():
    scored = {"a_e": [{"score": 100.0, "length": 100}, {"score": 0.0, "length": 5000}],
              "b_e": [{"score": 50.0, "length": 200}]}
    m = summarize(scored).metrics
    assert m["a_e"] == 50.0 and m["b_e"] == 50.0 and m["average"] == 50.0
    assert m["a_e@0-4k"] == 100.0 and m["a_e@4-8k"] == 0.0
    assert m["0-4k"] == 75.0                                     # mean of a_e@0-4k (100) and b_e@0-4k (50)
    assert m["4-8k"] == 0.0 and "8k+" not in m
    unknown = summarize({"a_e": [{"score": 50.0, "length": None}, {"score": 0.0, "length": 9000}]}).metrics
    assert unknown["a_e"] == 25.0 and "a_e@0-4k" not in unknown and unknown["a_e@8k+"] == 0.0  # no length, no bucket


def test_tiny_model_pipeline_truncates_and_batches(fixture_dir, tiny, tmp_path):
    options = dict(subsets=["hotpotqa_e", "passage_count_e"], data_dir=str(fixture_dir), limit=2,
                   max_input_length=600)
    single = LongBenchE(**options, batch_size=1).run(tiny, tmp_path / "b1")
    batched = LongBenchE(**options, batch_size=2).run(tiny, tmp_path / "b2")
    records = [json.loads(l) for l in (tmp_path / "b1" / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 4 and any(r["truncated"] for r in records) and not all(r["truncated"] for r in records)
    assert all(r["chat"] for r in records)
    preds = lambda d: [json.loads(l)["pred"] for l in (tmp_path / d / "predictions.jsonl").read_text().splitlines()]  # noqa: E731
    assert preds("b1") == preds("b2")                            # left padding changes nothing
    assert single.metrics == batched.metrics
