"""lm-eval adapter: `kvq` is registered, a local generation task runs end to end on the tiny model
(through lm-eval's evaluator and through our `lm_eval` task), and loglikelihood scores only feel the
quantization with quantize_prefill=true."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from evals import build_task  # noqa: E402
from evals.lm_eval_model import KVQuantLM  # noqa: E402

SQUAD = "qa/ruler_squad_v2_dev.json"  # in the data folder (oscar.paths)

TASK_YAML = """task: tiny_squad_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def tiny_lm(method: str):
    from oscar import build_method
    from oscar.lm import KVModel
    from oscar.models import load_model

    model, tokenizer = load_model("tiny-llama", device="cpu")
    return KVModel(model, tokenizer, build_method(method, residual_length=32), name="tiny-llama", max_length=1024)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, data_file) -> Path:
    """A local lm-eval generation task over 4 real SQuAD 2.0 questions."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    paragraph = json.loads(data_file(SQUAD).read_text())["data"][0]["paragraphs"][0]
    docs = [{"context": paragraph["context"], "question": q["question"], "answer": q["answers"][0]["text"]}
            for q in paragraph["qas"] if not q["is_impossible"]][:4]
    (folder / "tiny_squad.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny_squad_gen.yaml").write_text(TASK_YAML.format(data=folder / "tiny_squad.jsonl"))
    return folder


def test_kvq_is_registered():
    from lm_eval.api.registry import get_model

    assert get_model("kvq") is KVQuantLM


def test_generation_task_through_lm_eval(task_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    adapter = KVQuantLM(lm=tiny_lm("oscar"))
    results = lm_eval.simple_evaluate(model=adapter, tasks=["tiny_squad_gen"], limit=3,
                                      task_manager=TaskManager(include_path=str(task_dir)))
    assert 0.0 <= results["results"]["tiny_squad_gen"]["exact_match,none"] <= 1.0
    samples = results["samples"]["tiny_squad_gen"]
    assert len(samples) == 3 and all("\n" not in s["resps"][0][0] for s in samples)   # cut at `until`


def test_lm_eval_task_in_our_runner(task_dir, tmp_path):
    task = build_task("lm_eval", tasks=["tiny_squad_gen"], limit=2, include_path=[str(task_dir)])
    task.check()
    result = task.run(tiny_lm("kivi"), tmp_path)
    assert [(r["subset"], r["metric"]) for r in result.rows] == [("tiny_squad_gen", "exact_match")]
    assert len((tmp_path / "predictions.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "lm_eval_cache").exists() or any(tmp_path.glob("lm_eval_cache*"))
    assert result.stored[0] > 0 and result.stored[1] > 0           # the generations' stored KV bytes and tokens
    assert task.data_files() == sorted(task_dir.iterdir())         # the local task files: part of the run's identity


class Request:
    def __init__(self, *args):
        self.args = args


def test_loglikelihood_feels_quantization_only_with_quantized_prefill(data_file):
    text = json.loads(data_file(SQUAD).read_text())["data"][0]["paragraphs"][0]["context"]
    requests = [Request(text[:600], text[600:700])]
    full = KVQuantLM(lm=tiny_lm("fp16")).loglikelihood(requests)[0][0]
    plain = KVQuantLM(lm=tiny_lm("kivi")).loglikelihood(requests)[0][0]
    quantized = KVQuantLM(lm=tiny_lm("kivi"), quantize_prefill=True).loglikelihood(requests)[0][0]
    assert plain == pytest.approx(full, rel=1e-5)          # no decode phase: the method never acts
    assert abs(quantized - full) > 1e-3 * abs(full)         # quantized prefill changes the scores
    rolling = KVQuantLM(lm=tiny_lm("fp16")).loglikelihood_rolling([Request(text[:400])])[0]
    assert rolling < 0
