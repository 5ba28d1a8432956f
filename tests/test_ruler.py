"""RULER through NVIDIA's package: our samples are its prepare.py's, our cleaning of predictions is its evaluate.py's
(and, slow, our scores its summary's), the task's refusals before the weights load, the scoring of a stand-in model
that echoes the prompt, a tiny cell through the runner (samples made once, resumed from its log), and the tables."""

from __future__ import annotations

import ast
import csv
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evals import build_task
from evals import ruler_package as package
from evals.ruler import Ruler, ruler_tables
from oscar.lm import prompt_length
from oscar.paths import REPO_ROOT as REPO

#: the generators that need no NLTK and no 6-million-word list: about 0.3 s a run
QUICK_TASKS = ["vt", "cwe", "fwe"]


@pytest.fixture(scope="module")
def tokenizer():
    from oscar.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    package.tokenizer_folder(tokenizer, folder)
    return folder


def prepare_py_samples(name: str, tokenizer_dir: Path, length: int, num_samples: int, out: Path) -> list[dict]:
    """The samples of the package's own entry point, prepare.py (seed 42), run as its entrypoint runs it."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if package.punkt_root() is not None:
        env["NLTK_DATA"] = str(package.punkt_root())
    subprocess.run([sys.executable, str(package.require_package() / "data" / "prepare.py"), "--save_dir", str(out),
                    "--benchmark", "synthetic", "--task", name, "--tokenizer_path", str(tokenizer_dir),
                    "--tokenizer_type", "hf", "--max_seq_length", str(length), "--model_template_type", "base",
                    "--num_samples", str(num_samples)], env=env, check=True, capture_output=True, timeout=900)
    path = out / name / "validation.jsonl"
    assert path.exists(), f"prepare.py wrote no {path} (it prints a failed generator's error and goes on)"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_samples_are_prepare_py_s_for_seed_42(tokenizer_dir, tmp_path):
    ours = package.generate("vt", tokenizer_dir, 1024, 3, 42)
    assert ours == prepare_py_samples("vt", tokenizer_dir, 1024, 3, tmp_path)
    assert len({r["input"] for r in ours}) == 3 and all(r["length"] <= 1024 for r in ours)
    assert package.generate("vt", tokenizer_dir, 1024, 3, 7) != ours  # the seed is ours to set


@pytest.mark.slow
@pytest.mark.parametrize("name", package.TASKS)
def test_every_task_s_samples_are_prepare_py_s(name, tokenizer_dir, tmp_path):
    length = 2048 if name.startswith("qa") else 1024  # QA's smallest haystack (10 documents) needs ~1,700 tokens
    assert package.generate(name, tokenizer_dir, length, 2, 42) == prepare_py_samples(name, tokenizer_dir, length, 2,
                                                                                      tmp_path)


def _their_postprocess():
    """evaluate.py's postprocess_pred, compiled alone from its source (importing the script parses arguments)."""
    tree = ast.parse((package.require_package() / "eval" / "evaluate.py").read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "postprocess_pred")
    namespace = {"re": re}
    exec(compile(ast.Module(body=[function], type_ignores=[]), "evaluate.py", "exec"), namespace)
    return namespace["postprocess_pred"]


def test_postprocess_is_evaluate_py_s():
    theirs = _their_postprocess()
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0x00, 0x21)] + list("aZ9-é\x7f\u2028 ")
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(500)]
    for text in texts + [None, "", "  \t\n"]:
        assert package.postprocess(text) == theirs(text, {}), repr(text)


@pytest.mark.slow
def test_scores_are_evaluate_py_s_summary(tmp_path):
    """evaluate.py run on prediction files: its summary.csv holds our task scores. It never uses punkt but downloads
    it when absent: an empty punkt folder keeps it offline."""
    (tmp_path / "nltk" / "tokenizers" / "punkt").mkdir(parents=True)
    preds = tmp_path / "pred"
    preds.mkdir()
    cases = {"niah_multivalue": ([["1", "2"], ["3", "4"]], [" the numbers are 1 and\x022", "4"]),
             "vt": ([["AB", "CD"], ["EF"]], ["ab, cd", "nothing"]), "cwe": ([["x", "y", "z"]], ["X\tY"]),
             "qa_1": ([["Paris", "paris, France"], ["1999"]], ["  PARIS  ", "in 1998"])}
    for name, (references, predictions) in cases.items():
        with (preds / f"{name}.jsonl").open("w") as f:
            for i, (ref, pred) in enumerate(zip(references, predictions)):
                f.write(json.dumps(dict(index=i, input="", outputs=ref, pred=pred, others={})) + "\n")
    subprocess.run([sys.executable, str(package.require_package() / "eval" / "evaluate.py"), "--data_dir", str(preds),
                    "--benchmark", "synthetic"], env={**os.environ, "NLTK_DATA": str(tmp_path / "nltk")}, check=True,
                   capture_output=True, timeout=600, cwd=package.require_package() / "eval")
    table = list(csv.reader((preds / "summary.csv").open()))
    theirs = dict(zip(table[1][1:], map(float, table[2][1:])))
    assert theirs == {name: package.task_score(name, predictions, references)
                      for name, (references, predictions) in cases.items()}
    assert theirs["vt"] == 50.0 and theirs["niah_multivalue"] == 75.0


# ----------------------------------------------------------------------------- refusals


def test_options_are_refused_when_the_task_is_built():
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['niah_single_4'\]; RULER's 13 are"):
        build_task("ruler", tasks=["niah_single_4"])
    with pytest.raises(ValueError, match=r"task.lengths must name each length once"):
        build_task("ruler", lengths=[4096, 4096])
    with pytest.raises(ValueError, match=r"task.tasks must name each task once \(got \[\]\)"):
        build_task("ruler", tasks=[])
    with pytest.raises(ValueError, match=r"ruler: scheduler=true batches by length and memory; batch_size=2"):
        build_task("ruler", scheduler=True, batch_size=2)


def test_lengths_past_the_model_and_below_a_template(tokenizer):
    task = Ruler(tasks=["vt"], lengths=[64, 1024])
    with pytest.raises(ValueError, match=r"task.lengths \[1024\] exceed the model's max_length 512"):
        task.check_context(512)
    with pytest.raises(ValueError, match=r"task.lengths \[1024\] run past the model's 1000 positions"):
        task.check_positions(1000)
    needed = package.template_tokens("vt", tokenizer)
    assert 64 < needed < 200
    with pytest.raises(ValueError, match=rf"task.lengths \[64\] are shorter than vt's template and answer \({needed} "):
        task.check_tokenizer(tokenizer)


def test_a_length_below_the_smallest_haystack_stops_the_generator(tokenizer):
    """Above the template, below the first haystack step of the generator (which would retry a sample forever):
    VT's in-context example alone fills 300 tokens (its search measures no step); at 600 its first step is too long."""
    with pytest.raises(ValueError, match=r"task.lengths \[300\] is too short for vt: its generator's smallest "
                                         r"haystack does not fit"):
        Ruler(tasks=["vt"], lengths=[300], num_samples=1).check_tokenizer(tokenizer)
    with pytest.raises(ValueError, match=r"task.lengths \[600\] is too short for vt: its generator's smallest "
                                         r"haystack needs (\d+) tokens") as refusal:
        Ruler(tasks=["vt"], lengths=[600], num_samples=1).check_tokenizer(tokenizer)
    needed = int(re.search(r"needs (\d+)", str(refusal.value)).group(1))
    assert 600 < needed < 1024
    Ruler(tasks=["vt"], lengths=[needed + 40], num_samples=1).check_tokenizer(tokenizer)


class _Sent(list):
    send = list.append


def test_the_search_watch_stops_a_search_that_found_nothing():
    """The generators' own lines: a search ending at a size of 0, or without measuring a step, is too short (with
    the first step's length where there was one); FWE's search prints no steps; VT's second search starts afresh."""
    def watch(*lines):
        sent = _Sent()
        sink = package._SearchWatch(sent)
        for line in lines:
            print(line, file=sink)
        return [detail for _, detail in sent]

    step = "Max length {} | Current length {} | Haystack: {}"
    found = watch(step.format(4096, 851, 500), step.format(4096, 4512, 1000), "Num haystack: 500")
    assert found == [step.format(4096, 851, 500), step.format(4096, 4512, 1000), "Num haystack: 500"]
    assert watch("num_example_words: 1365") == ["num_example_words: 1365"]
    with pytest.raises(package.TooShort) as short:
        watch(step.format(600, 849, 10), "Num noises: 0")
    assert short.value.needed == 849
    with pytest.raises(package.TooShort) as short:
        watch(step.format(500, 300, 5), step.format(500, 520, 10), "Num noises: 5", "Num noises: 10")
    assert short.value.needed is None
    with pytest.raises(package.TooShort) as short:
        watch(step.format(500, 300, 5), "Num noises: 5", "Max length 700 | Current length 849 | Noises: 10",
              "Num noises: 0")
    assert short.value.needed == 849


def test_a_failing_or_silent_generator_is_an_error(tmp_path, monkeypatch, tokenizer_dir):
    """A generator that raises names its error and last lines; one that prints nothing for STALL_SECONDS (retrying
    forever) is stopped."""
    script = tmp_path / "generator.py"
    monkeypatch.setattr(package, "generator_script", lambda name: script)
    script.write_text("print('loading the word lists')\nraise KeyError('type_needle_v')\n")
    with pytest.raises(RuntimeError, match=r"generator.py failed making vt at length 1024: KeyError: 'type_needle_v'; "
                                           r"its output ended: loading the word lists"):
        package.generate("vt", tokenizer_dir, 1024, 1, 42)
    script.write_text("import time\nprint('Max length 1024 | Current length 500 | Noises: 10')\ntime.sleep(600)\n")
    monkeypatch.setattr(package, "STALL_SECONDS", 2)
    with pytest.raises(RuntimeError, match=r"generator.py printed nothing for 2 s making vt at length 1024 \(a "
                                           r"generator retrying forever\)"):
        package.generate("vt", tokenizer_dir, 1024, 1, 42)


def test_fwe_whose_answer_runs_past_the_positions_is_refused(tokenizer):
    """FWE fits its prompt alone in the length, so its 50 answer tokens can run past the model's positions: SmolLM2's
    8,192 at 8K (each other task fits its prompt and answer in the length)."""
    task = Ruler(tasks=["fwe"], lengths=[8192], num_samples=1)
    (sample,) = task.samples(tokenizer)[("fwe", 8192)]
    tokens = prompt_length(tokenizer, sample["input"])
    assert 8192 - 50 < tokens <= 8192
    task.check_context(8192)
    task.check_positions(8192)
    with pytest.raises(ValueError, match=rf"fwe's sample 0 at length 8192 has a {tokens}-token prompt and generates "
                                         r"50 tokens, past the model's 8192 positions \(FWE fills the length"):
        task.check_tokenizer(tokenizer)
    task.check_positions(tokens + 50)
    task.check_tokenizer(tokenizer)


# ----------------------------------------------------------------------------- scoring and running


class Echo:
    """A stand-in model answering with its prompt (which holds every reference) or with nothing."""

    def __init__(self, tokenizer, silent: bool = False):
        self.tokenizer, self.silent, self.name, self.max_length, self.positions = tokenizer, silent, "echo", 4096, None
        self.batches = []

    def generate(self, prompts, max_new_tokens, chat=False):
        self.batches.append((len(prompts), max_new_tokens))
        return ["" if self.silent else p for p in prompts]


def test_an_echo_scores_100_and_silence_0(tokenizer, tmp_path):
    task = Ruler(tasks=QUICK_TASKS, lengths=[1024], num_samples=3, batch_size=2)
    echo = Echo(tokenizer)
    result = task.run(echo, tmp_path / "echo")
    assert echo.batches == [(2, 30), (1, 30), (2, 120), (1, 120), (2, 50), (1, 50)]
    assert result.metrics == {"vt@1024": 100.0, "cwe@1024": 100.0, "fwe@1024": 100.0, "average@1024": 100.0,
                              "average": 100.0}
    assert {(r["subset"], r["n"]) for r in result.rows} == {("vt@1024", 3), ("cwe@1024", 3), ("fwe@1024", 3),
                                                            ("average@1024", 3), ("average", 3)}
    silent = task.run(Echo(tokenizer, silent=True), tmp_path / "silent")
    assert set(silent.metrics.values()) == {0.0}


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_a_tiny_ruler_cell_through_the_runner(tmp_path, monkeypatch):
    """tiny-llama, KIVI, VT at 1K tokens: rows, a resumable log, samples made once (preflight and run share them)."""
    from oscar.lm import KVModel
    from oscar.results import read_rows
    from oscar.runner import execute, preflight

    made = []
    generate = package.generate
    monkeypatch.setattr(package, "generate", lambda *args: made.append(args) or generate(*args))
    cfg = _compose(["model=tiny-llama", "method=kivi", "task=ruler", "task.tasks=[vt]", "task.lengths=[1024]",
                    "task.num_samples=2", "task.batch_size=2", "task.seed=5", "logger=files",
                    f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}"])
    plan = preflight(cfg, build_task)
    metrics = execute(cfg, plan)
    assert len(made) == 1
    rows = {r["subset"]: r for r in read_rows(tmp_path / "rows.csv") if r["metric"] == "score"}
    assert set(rows) == {"vt@1024", "average@1024", "average"} and rows["vt@1024"]["n"] == "2"
    assert rows["vt@1024"]["task_config"] == "batch_size=2 lengths=1024 num_samples=2 seed=5 tasks=vt"
    assert 0 <= metrics["average"] <= 100 and metrics["average"] == metrics["vt@1024"]
    records = [json.loads(line) for line in (plan.run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["key"] for r in records] == ["vt@1024#0", "vt@1024#1"]
    assert all(r["prompt_tokens"] <= 1024 - 30 and len(r["outputs"]) == 5 for r in records)

    (plan.run_dir / "metrics.json").unlink()  # killed after its last sample: the run resumes from its log
    monkeypatch.setattr(KVModel, "generate", lambda *a, **k: pytest.fail("a logged sample was generated again"))
    resumed = execute(cfg, preflight(cfg, build_task))
    assert {k: v for k, v in resumed.items() if k in rows} == {k: v for k, v in metrics.items() if k in rows}


def test_the_scheduler_gives_each_sample_its_batch_one_prediction(tmp_path):
    """tiny-llama, KIVI, VT and CWE at 1K (30 and 120 answer tokens: rows end at different steps and are refilled):
    every task's samples at once through the scheduler give the predictions and scores of batch 1 on a CPU."""
    from oscar.runner import execute, preflight

    logs, run_dirs = {}, set()
    for scheduler in ("false", "true"):
        cfg = _compose(["model=tiny-llama", "method=kivi", "task=ruler", "task.tasks=[vt,cwe]", "task.lengths=[1024]",
                        "task.num_samples=3", "task.seed=5", f"task.scheduler={scheduler}",
                        *(["task.batch_tokens=4096"] if scheduler == "true" else []), "logger=files",
                        f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}"])
        plan = preflight(cfg, build_task)
        execute(cfg, plan)
        run_dirs.add(plan.run_dir)
        records = [json.loads(line) for line in (plan.run_dir / "predictions.jsonl").read_text().splitlines()]
        logs[scheduler] = {r["key"]: (r["pred"], r["score"]) for r in records}
    assert len(run_dirs) == 2  # two runs: the scheduler is part of the run's identity
    assert len(logs["true"]) == 6 and logs["true"] == logs["false"]
    assert len({pred for pred, _ in logs["true"].values()}) > 1  # the samples' predictions differ


# ----------------------------------------------------------------------------- tables


def _row(method, subset, value, run_id, tasks=""):
    config = json.dumps(dict(name=method, k_bits=2, v_bits=2, group_size=32, residual_length=128), sort_keys=True)
    return dict(model="smollm2-135m", method=method, bits=2, group_size=32, residual_length=128, task="ruler",
                subset=subset, metric="score", value=value, n=5, run_id=run_id, config=config, task_config=tasks)


def test_runs_split_over_tasks_and_lengths_form_one_line_per_method(tmp_path):
    rows = [_row("kivi", "vt@4096", 40.0, "a", "tasks=vt,qa_1"), _row("kivi", "qa_1@4096", 20.0, "a", "tasks=vt,qa_1"),
            _row("kivi", "average@4096", 30.0, "a", "tasks=vt,qa_1"), _row("kivi", "average", 30.0, "a"),
            _row("kivi", "cwe@4096", 90.0, "b", "tasks=cwe"), _row("kivi", "average@4096", 90.0, "b"),
            _row("kivi", "average", 90.0, "b", "tasks=cwe"),
            _row("oscar", "vt@4096", 60.0, "c"), _row("oscar", "average@4096", 60.0, "c"),
            _row("oscar", "vt@8192", 30.0, "c"), _row("oscar", "average@8192", 30.0, "c"),
            _row("oscar", "average", 45.0, "c")]
    merged = Ruler.merge_rows(rows)
    averages = {(r["method"], r["subset"]): (r["value"], r["n"]) for r in merged if r["subset"].startswith("average")}
    # a line's average@4096 over its own tasks; the headline average over the one cell both lines have (vt@4096)
    assert averages == {("kivi", "average@4096"): (50.0, 3), ("kivi", "average"): (40.0, 1),
                        ("oscar", "average@4096"): (60.0, 1), ("oscar", "average@8192"): (30.0, 1),
                        ("oscar", "average"): (60.0, 1)}
    alone = {(r["subset"], r["n"]): r["value"] for r in Ruler.merge_rows([r for r in rows if r["method"] == "oscar"])
             if r["subset"].startswith("average")}
    assert alone == {("average@4096", 1): 60.0, ("average@8192", 1): 30.0, ("average", 2): 45.0}  # every cell shared
    tables = ruler_tables(merged)
    assert tables[4096] == (["model", "method", "vt", "cwe", "qa_1", "avg", "avg of the 1 shared"],
                            [["smollm2-135m", "kivi", 40.0, 90.0, 20.0, 50.0, 40.0],
                             ["smollm2-135m", "oscar", 60.0, None, None, 60.0, 60.0]])
    assert tables[8192] == (["model", "method", "vt", "avg"], [["smollm2-135m", "oscar", 30.0, 30.0]])
    # another model's lines share their own tasks: each line's shared average is over its model's
    other = [{**r, "model": "gemma3-270m"} for r in Ruler.merge_rows(
        [_row("kivi", "vt@4096", 10.0, "d"), _row("kivi", "cwe@4096", 30.0, "d"),
         _row("oscar", "vt@4096", 50.0, "e"), _row("oscar", "cwe@4096", 70.0, "e")])]
    header, body = ruler_tables(merged + other)[4096]
    assert header[-1] == "avg of the shared"
    assert {(line[0], line[1]): line[-1] for line in body} == {
        ("smollm2-135m", "kivi"): 40.0, ("smollm2-135m", "oscar"): 60.0, ("gemma3-270m", "kivi"): 20.0,
        ("gemma3-270m", "oscar"): 60.0}
    written = Ruler.report(merged, tmp_path)
    assert sorted(p.name for p in written) == ["ruler_4096.md", "ruler_4096.tex", "ruler_8192.md", "ruler_8192.tex"]
    table = (tmp_path / "tables" / "ruler_4096.md").read_text()
    assert "| smollm2-135m | kivi | 40.00 | 90.00 | 20.00 | 50.00 | 40.00 |" in table
