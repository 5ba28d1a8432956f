"""Faults a new user runs into (issue 13): corrupted results rows and prediction logs, changed data
under a finished run, runs that score nothing, prompts a model cannot take, W&B on the console."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from hydra import compose, initialize_config_dir

from evals.base import TaskResult
from oscar import build_method
from oscar.lm import KVModel
from oscar.paths import REPO_ROOT as REPO
from oscar.results import PredictionLog, append_rows, read_rows
from oscar.runner import execute, plan, preflight



def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def tidy(method: str, task: str, value: float, run_id: str, task_config: str = "") -> dict:
    return dict(model="smollm2-135m", method=method, bits=2, group_size=32, residual_length=128, task=task,
                subset="all", metric="score", value=value, n=3, run_id=run_id, config=json.dumps({"name": method}),
                task_config=task_config)


# ----------------------------------------------------------------------------- results/rows.csv


def test_append_after_a_last_line_without_newline_keeps_rows_apart(tmp_path, caplog):
    """Defect 2: the next run's first row was glued onto a last line left without its newline."""
    path = tmp_path / "rows.csv"
    append_rows(path, [tidy("oscar", "perplexity", 19.5, "a", "max_windows=2")])
    path.write_bytes(path.read_bytes().rstrip(b"\r\n"))          # an edit (or a kill) took the newline
    append_rows(path, [tidy("fp16", "niah", 88.0, "b")])
    with caplog.at_level(logging.WARNING):
        back = {r["run_id"]: r for r in read_rows(path)}
    assert not caplog.records
    assert back["a"]["task_config"] == "max_windows=2" and back["a"]["value"] == 19.5
    assert back["b"]["method"] == "fp16" and back["b"]["value"] == 88.0
    assert len(path.read_text().splitlines()) == 3


def test_reader_skips_malformed_rows_naming_file_and_line(tmp_path, caplog):
    """Defects 2 and 6: a glued line (24 fields) and a garbage line are skipped with a warning naming
    file and line, instead of a silently wrong row or a failure of every later command."""
    path = tmp_path / "rows.csv"
    good = [tidy("fp16", "niah", 90.0, "r1"), tidy("kivi", "niah", 80.0, "r2"), tidy("oscar", "niah", 85.0, "r3")]
    append_rows(path, good)
    lines = path.read_text().splitlines()                          # header, r1, r2, r3
    glued = lines[1] + lines[2]                                    # what the old appender wrote: two rows on one line
    path.write_text("\r\n".join([lines[0], glued, "garbage line, no value,", lines[3]]) + "\r\n")
    with caplog.at_level(logging.WARNING):
        back = read_rows(path)
    assert [r["run_id"] for r in back] == ["r3"]
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"{path}:2: malformed row skipped" in m and "25 fields" in m for m in messages), messages
    assert any(f"{path}:3: malformed row skipped" in m for m in messages), messages
    append_rows(path, [tidy("oscar", "niah", 86.0, "r4")])         # appending still works
    assert {r["run_id"] for r in read_rows(path)} == {"r3", "r4"}


def test_a_value_that_is_not_a_number_is_skipped(tmp_path, caplog):
    path = tmp_path / "rows.csv"
    append_rows(path, [tidy("fp16", "niah", 90.0, "r1"), {**tidy("kivi", "niah", 0, "r2"), "value": ""}])
    with caplog.at_level(logging.WARNING):
        assert [r["run_id"] for r in read_rows(path)] == ["r1"]
    assert f"{path}:3: malformed row skipped (value '' is not a number)" in caplog.text


def test_prediction_log_ignores_lines_that_are_not_records(tmp_path, caplog):
    """Defect 10: non-record lines in predictions.jsonl crashed the resume with a bare traceback."""
    path = tmp_path / "predictions.jsonl"
    path.write_text('[1, 2]\n{"no_key": 1}\n"text"\n{"key": "a", "score": 1}\n{"key": "b", "sc')
    with caplog.at_level(logging.WARNING):
        done = PredictionLog(path).done
    assert list(done) == ["a"]
    for line in (1, 2, 3):
        assert f"{path}:{line}: not a prediction record" in caplog.text
    assert f"{path}:5" not in caplog.text                           # a cut last line is the normal kill


# ----------------------------------------------------------------------------- run ids and finished runs


def test_run_id_covers_the_data_files(tmp_path, data_file):
    """Defect 3: a run on changed data was skipped as finished (the id did not depend on the data)."""
    text = tmp_path / "a" / "wiki.jsonl"
    text.parent.mkdir()
    lines = data_file("text/wikitext-2-raw-v1.test.rows.jsonl").read_text().splitlines()[:20]
    text.write_text("\n".join(lines) + "\n")
    args = ["task=perplexity", f"task.path={text}", f"runs_dir={tmp_path / 'runs'}", "model=tiny-llama"]
    first = plan(_compose(*args))
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "metrics.json").write_text("{}")               # finished
    copy = tmp_path / "b" / "wiki.jsonl"
    copy.parent.mkdir()
    shutil.copy(text, copy)
    assert plan(_compose(*args[:1], f"task.path={copy}", *args[2:])).run_id != first.run_id  # the path is an option
    again = plan(_compose(*args))
    assert again.run_id == first.run_id and again.finished
    text.write_text("\n".join(lines[:10]) + "\n")                   # the data changed under the finished run
    changed = preflight(_compose(*args))
    assert changed.run_id != first.run_id and not changed.finished


def test_a_run_that_scores_no_sample_is_an_error(tmp_path, monkeypatch, data_file):
    """Defect 3: an empty subset gave a 'finished' run with metrics {} and exit code 0."""
    from evals.perplexity import DEFAULT_WIKITEXT, Perplexity

    data_file(DEFAULT_WIKITEXT)  # the task's check reads the default text before the run

    monkeypatch.setattr(Perplexity, "run", lambda self, lm, run_dir: TaskResult(metrics={}, rows=[]))
    cfg = _compose("model=tiny-llama", "task=perplexity", "task.window=64", "method=fp16", "logger=files",
                   f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}")
    with pytest.raises(RuntimeError, match="perplexity: the run scored no samples"):
        execute(cfg)
    assert not list((tmp_path / "runs").rglob("metrics.json")) and not (tmp_path / "rows.csv").exists()


# ----------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def tiny_lm(tiny):
    model, tokenizer = tiny
    return KVModel(model, tokenizer, build_method("fp16"), name="tiny-llama", max_length=4096)


@pytest.mark.parametrize("prompts, message", [
    ([""], r"generate: prompts\[0\] is empty"),                     # defect 14, alone
    (["The capital of France is", ""], r"generate: prompts\[1\] is empty"),  # defect 14, in a batch
    ([], r"prompts must be a non-empty list of strings"),
    ("a string, not a list", r"prompts must be a non-empty list of strings"),
    ([42], r"prompts\[0\] is a int, not a string"),
])
def test_generate_refuses_empty_prompts(tiny_lm, prompts, message):
    with pytest.raises(ValueError, match=message):
        tiny_lm.generate(prompts, max_new_tokens=2)


def test_generate_refuses_a_prompt_longer_than_max_length(tiny_lm):
    """Defect 5: a 9,001-token prompt ran on a model with max_length 4,096 with only a warning."""
    long = " hello" * 9001
    with pytest.raises(ValueError, match=r"prompts\[1\] has \d+ tokens, more than the model's max_length 4096"):
        tiny_lm.generate(["short", long], max_new_tokens=2)


def test_generate_refuses_generation_past_the_model_positions(tiny):
    model, tokenizer = tiny
    lm = KVModel(model, tokenizer, build_method("fp16"), name="tiny-llama", max_length=10_000)
    n = len(tokenizer(" hello" * 8180)["input_ids"])
    assert n <= 8192
    with pytest.raises(ValueError, match=rf"prompts\[0\] has {n} tokens \+ 32 new ones, past the model's 8192"):
        lm.generate([" hello" * 8180], max_new_tokens=32)


# ----------------------------------------------------------------------------- W&B on the console


def test_wandb_is_quiet_on_the_console_but_keeps_its_files(tmp_path, capfd, caplog):
    pytest.importorskip("wandb")
    from oscar.runner import _mirror_to_wandb

    cfg = _compose("logger=default", f"runs_dir={tmp_path / 'runs'}")
    p = plan(cfg)
    p.run_dir.mkdir(parents=True)
    result = TaskResult(metrics={"score": 50.0}, rows=[dict(subset="all", metric="score", value=50.0, n=9)])
    with caplog.at_level(logging.INFO):
        _mirror_to_wandb(cfg, p, result, [tidy("oscar", "niah", 50.0, p.run_id)])
    out, err = capfd.readouterr()
    assert "wandb:" not in out + err, (out + err)[-2000:]
    (offline,) = (p.run_dir / "wandb").glob("offline-run-*")
    assert "wandb sync" in caplog.text and str(offline) in caplog.text
