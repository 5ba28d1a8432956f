"""lm-eval adapter: `kvq` is registered, a local generation task runs end to end on the tiny model
(through lm-eval's evaluator, its CLI and our `lm_eval` task), loglikelihood scores only feel the
quantization with quantize_prefill=true, and what cannot run here (a missing GPU, a dataset neither cached nor
reachable) is refused in one line before the model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from evals import build_task  # noqa: E402
from evals.lm_eval_model import KVQuantLM  # noqa: E402
from oscar.paths import REPO_ROOT  # noqa: E402

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


def test_a_resumed_lm_eval_run_names_every_code_version_its_request_cache_holds(task_dir, tmp_path, monkeypatch):
    """lm-eval's request cache hands a resumed run the answers an earlier version of the code computed: its records
    name every version that answered into the cache, and the runner's count of versions reads them all."""
    import evals.lm_eval_model
    from oscar.results import record_code_versions

    task = build_task("lm_eval", tasks=["tiny_squad_gen"], limit=2, include_path=[str(task_dir)])
    task.check()
    versions = {}
    for version in ("aaaa111111", "bbbb222222", "bbbb222222"):
        monkeypatch.setattr(evals.lm_eval_model, "process_code_version", lambda: version)
        task.run(tiny_lm("kivi"), tmp_path)
        records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
        versions[version] = {tuple(r["code_version"]) for r in records}
    assert versions == {"aaaa111111": {("aaaa111111",)}, "bbbb222222": {("aaaa111111", "bbbb222222")}}
    assert record_code_versions(tmp_path / "predictions.jsonl") == {"aaaa111111": 2, "bbbb222222": 2}


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


# ----------------------------------------------------------------------------- before anything loads: device, data

MISSING_YAML = """task: tiny_hub_gen
dataset_path: oscar-kv-tests/no-such-dataset
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""


@pytest.fixture
def hub_offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for this test; the hub flags that the check sets are put back afterwards."""
    import datasets
    from huggingface_hub import constants

    from evals.lm_eval_model import hub_unreachable

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", datasets.config.HF_DATASETS_OFFLINE)
    hub_unreachable.cache_clear()
    yield
    hub_unreachable.cache_clear()


def test_check_refuses_a_task_whose_data_is_neither_cached_nor_reachable(task_dir, tmp_path, hub_offline):
    (tmp_path / "tiny_hub_gen.yaml").write_text(MISSING_YAML)
    task = build_task("lm_eval", tasks=["tiny_squad_gen", "tiny_hub_gen"], include_path=[str(task_dir), str(tmp_path)])
    with pytest.raises(FileNotFoundError) as refused:
        task.check()
    message = str(refused.value)
    assert "\n" not in message and "tiny_hub_gen" in message and "HF_HUB_OFFLINE is set" in message
    assert "tiny_squad_gen" not in message                                # a local dataset loads offline
    build_task("lm_eval", tasks=["tiny_squad_gen"], include_path=[str(task_dir)]).check()


def _clean_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CUDA"))}
    return {**env, "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1", **extra}


def test_run_py_refuses_an_unreachable_hub_dataset_in_one_line_before_loading(tmp_path):
    """The documented `run.py task=lm_eval 'task.tasks=[gsm8k]'` where the hub does not answer (a closed local port
    as its endpoint) and nothing is cached: exit 2, one line naming gsm8k, no run folder, no retries."""
    runs = tmp_path / "runs"
    out = subprocess.run([sys.executable, "run.py", "task=lm_eval", "task.tasks=[gsm8k]", "model=tiny-llama",
                          "logger=files", f"runs_dir={runs}", f"results_file={tmp_path / 'rows.csv'}",
                          f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300, env=_clean_env(tmp_path, HF_ENDPOINT="http://127.0.0.1:9"))
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    (line,) = [l for l in text.splitlines() if "bad input" in l]
    assert "nothing was loaded: lm_eval: the data of gsm8k is not in the local cache" in line
    assert "http://127.0.0.1:9 does not answer" in line and "Traceback" not in text
    assert not runs.exists() and not (tmp_path / "rows.csv").exists()


def test_cli_defaults_to_the_best_device_and_refuses_a_missing_one(task_dir, tmp_path):
    """`python -m evals.lm_eval_model --model kvq ...` without --device runs on the CPU of a machine without CUDA
    (lm-eval's own default is cuda:0); --device cuda there is one line, exit 2, before the model loads."""
    import torch

    command = [sys.executable, "-m", "evals.lm_eval_model", "--model", "kvq", "--model_args",
               "model=tiny-llama,method=oscar,residual_length=32", "--tasks", "tiny_squad_gen", "--include_path",
               str(task_dir), "--limit", "2"]
    env = _clean_env(tmp_path, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "tiny_squad_gen" in out.stdout and "exact_match" in out.stdout
    if not torch.cuda.is_available():
        refused = subprocess.run(command + ["--device", "cuda"], cwd=REPO_ROOT, capture_output=True, text=True,
                                 timeout=300, env=env)
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines() == [
            "bad input, nothing was loaded: kvq: --device cuda but no CUDA GPU is visible here (leave --device out "
            "for the best available device: cpu)"]


def test_a_request_cache_older_than_its_versions_file_counts_unrecorded(tmp_path, monkeypatch):
    """A run started before versions were kept has a request cache and no versions file: its answers' code is
    unknown, and says so; a versions file that is not a list of versions counts the same."""
    import evals.lm_eval_model

    monkeypatch.setattr(evals.lm_eval_model, "process_code_version", lambda: "v2")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert evals.lm_eval_model.cache_code_versions(fresh) == ["v2"]
    assert evals.lm_eval_model.cache_code_versions(fresh) == ["v2"]  # its own file read back
    (tmp_path / "lm_eval_cache_rank0.db").write_bytes(b"an earlier process's answers")
    assert evals.lm_eval_model.cache_code_versions(tmp_path) == ["unrecorded", "v2"]
    (tmp_path / "lm_eval_cache_versions.json").write_text('"v1"')
    assert evals.lm_eval_model.cache_code_versions(tmp_path) == ["unrecorded", "v2"]
