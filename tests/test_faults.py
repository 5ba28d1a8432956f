"""Faults a new user runs into (issues 13 and 23): corrupted results rows and prediction logs, changed data
under a finished run, runs that score nothing or a non-finite number, prompts a model cannot take, W&B on the
console, rows.csv with non-finite values, stray carriage returns or a method column that contradicts its config,
a damaged converted-model cache, Ctrl-C."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir

from evals import build_task
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
    first = plan(_compose(*args), build_task)
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "metrics.json").write_text("{}")               # finished
    copy = tmp_path / "b" / "wiki.jsonl"
    copy.parent.mkdir()
    shutil.copy(text, copy)
    moved = plan(_compose(*args[:1], f"task.path={copy}", *args[2:]), build_task)
    assert moved.run_id != first.run_id  # the path is an option
    again = plan(_compose(*args), build_task)
    assert again.run_id == first.run_id and again.finished
    text.write_text("\n".join(lines[:10]) + "\n")                   # the data changed under the finished run
    changed = preflight(_compose(*args), build_task)
    assert changed.run_id != first.run_id and not changed.finished


def test_a_run_that_scores_no_sample_is_an_error(tmp_path, monkeypatch, data_file):
    """Defect 3: an empty subset gave a 'finished' run with metrics {} and exit code 0."""
    from evals.perplexity import DEFAULT_WIKITEXT, Perplexity

    data_file(DEFAULT_WIKITEXT)  # the task's check reads the default text before the run

    monkeypatch.setattr(Perplexity, "run", lambda self, lm, run_dir: TaskResult(metrics={}, rows=[]))
    cfg = _compose("model=tiny-llama", "task=perplexity", "task.window=64", "method=fp16", "logger=files",
                   f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}")
    with pytest.raises(RuntimeError, match="perplexity: the run scored no samples"):
        execute(cfg, preflight(cfg, build_task))
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
    p = plan(cfg, build_task)
    p.run_dir.mkdir(parents=True)
    result = TaskResult(metrics={"score": 50.0}, rows=[dict(subset="all", metric="score", value=50.0, n=9)])
    with caplog.at_level(logging.INFO):
        _mirror_to_wandb(cfg, p, result, [tidy("oscar", "niah", 50.0, p.run_id)])
    out, err = capfd.readouterr()
    assert "wandb:" not in out + err, (out + err)[-2000:]
    (offline,) = (p.run_dir / "wandb").glob("offline-run-*")
    assert "wandb sync" in caplog.text and str(offline) in caplog.text


# ----------------------------------------------------------------------------- issue 23: the second round


def test_non_finite_values_are_skipped_naming_file_and_line(tmp_path, caplog):
    """Defect 3: `inf` showed as a NIAH grid average, `nan` turned a cell into a dash, without a warning."""
    path = tmp_path / "rows.csv"
    bad = [{**tidy("kivi", "niah", 0, f"r{i}"), "value": value} for i, value in enumerate(["inf", "nan", "-inf"], 2)]
    append_rows(path, [tidy("fp16", "niah", 90.0, "r1"), *bad])
    with caplog.at_level(logging.WARNING):
        assert [r["run_id"] for r in read_rows(path)] == ["r1"]
    for line, value in ((3, "inf"), (4, "nan"), (5, "-inf")):
        assert f"{path}:{line}: malformed row skipped (value '{value}' is not finite)" in caplog.text


def test_a_run_whose_metric_is_not_finite_is_an_error_naming_it(tmp_path, monkeypatch, data_file):
    """Defect 3: a NaN metric would be written as a finished run's row; it is an error naming the metric."""
    from evals.perplexity import DEFAULT_WIKITEXT, Perplexity

    data_file(DEFAULT_WIKITEXT)
    nan = float("nan")
    monkeypatch.setattr(Perplexity, "run", lambda self, lm, run_dir: TaskResult(
        metrics={"perplexity": nan, "tokens": 10},
        rows=[dict(subset="wikitext-2", metric="perplexity", value=nan, n=10),
              dict(subset="wikitext-2", metric="bits_per_byte", value=float("inf"), n=10)]))
    cfg = _compose("model=tiny-llama", "task=perplexity", "task.window=64", "method=fp16", "logger=files",
                   f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}")
    with pytest.raises(RuntimeError, match=r"perplexity: metric\(s\) perplexity, perplexity \(wikitext-2\), "
                                           r"bits_per_byte \(wikitext-2\) not a finite number \(NaN or inf\)"):
        execute(cfg, preflight(cfg, build_task))
    assert not list((tmp_path / "runs").rglob("metrics.json")) and not (tmp_path / "rows.csv").exists()


def test_a_bare_carriage_return_is_reported_at_its_line(tmp_path, caplog):
    """Defect 8: a bare \\r split a row in two for the reader ("line 16" of a 9-line file, wrong field counts)."""
    path = tmp_path / "rows.csv"
    append_rows(path, [tidy("fp16", "niah", float(i), f"r{i}") for i in range(8)])
    lines = path.read_bytes().split(b"\r\n")
    for i in (3, 6):
        lines[i] = lines[i].replace(b",niah,", b",ni\rah,", 1)
    path.write_bytes(b"\r\n".join(lines))
    assert path.read_bytes().count(b"\n") == 9                      # a 9-line file
    with caplog.at_level(logging.WARNING):
        back = read_rows(path)
    assert sorted(r["run_id"] for r in back) == ["r0", "r1", "r3", "r4", "r6", "r7"]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"{path}:{line}: malformed row skipped (a carriage return inside the line)" for line in (4, 7)]


def test_the_table_line_is_the_config_and_a_disagreeing_method_column_is_named(tmp_path, caplog):
    """Defect 7: a row whose method column said oscar but whose config was KIVI's merged the two methods under one
    label and one method's line disappeared. Rows without a config cannot be placed on a line: skipped, named."""
    from scripts.make_tables import methods_table

    def cell(method: str, config: str, length: int, value: float, run_id: str) -> dict:
        return {**tidy(method, "niah", value, run_id), "subset": f"{length}@0", "config": config}

    kivi, oscar = json.dumps({"name": "kivi"}), json.dumps({"name": "oscar"})
    path = tmp_path / "rows.csv"
    append_rows(path, [cell("kivi", kivi, 1024, 80.0, "a"), cell("oscar", oscar, 1024, 85.0, "b"),
                       cell("oscar", kivi, 2048, 70.0, "c"),        # the method column disagrees with the config
                       cell("fp16", "", 1024, 99.0, "d"), cell("ott", "", 1024, 60.0, "e")])  # old rows: no config
    with caplog.at_level(logging.WARNING):
        rows = read_rows(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:4: method column 'oscar' disagrees with the row's config (method 'kivi'); read as 'kivi'"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        table = methods_table(rows, task="niah")
    for line in ("| smollm2-135m | kivi | – | 75.00 |", "| smollm2-135m | oscar | 85.00 | – |"):
        assert line in table, table
    assert "fp16" not in table and "ott" not in table, table
    skipped = [r.getMessage() for r in caplog.records]
    assert skipped == [f"row of run {run!r}: malformed row skipped (no method configuration (the config column is "
                       "empty))" for run in ("d", "e")], skipped


@pytest.fixture
def conversions(tmp_path, monkeypatch):
    """converted_gguf_dir with the cache in tmp_path and a stand-in conversion (a small safetensors model) that
    counts its calls: the cache's checks without minutes of de-quantizing."""
    from safetensors.torch import save_file

    from oscar import models

    monkeypatch.setenv("OSCAR_KV_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert(spec, out):
        calls.append(spec.name)
        save_file({"w": torch.arange(4096, dtype=torch.float32)}, out / "model.safetensors")
        (out / "config.json").write_text('{"model_type": "llama"}')

    monkeypatch.setattr(models, "_convert_gguf", convert)
    return lambda: models.converted_gguf_dir(models.load_spec("smollm2-135m")), calls


def _damage_message(caplog, what: str) -> None:
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    message = record.getMessage()
    assert message.startswith("smollm2-135m: the converted model in ") and f"is damaged ({what}" in message and \
        message.endswith("); converting it again"), message
    caplog.clear()


def test_a_damaged_converted_model_is_converted_again_with_one_line(conversions, caplog):
    """Defect 4: a truncated or garbage-headed model.safetensors in the cache failed after loading with a bare
    SafetensorError; the cache is checked against the size and SHA-256 recorded at conversion."""
    convert, calls = conversions
    folder = convert()
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    assert calls == ["smollm2-135m"] and convert() == folder and len(calls) == 1  # reused: checked, not converted

    with caplog.at_level(logging.WARNING):
        weights.write_bytes(weights.read_bytes()[:size // 2])        # cut short
        convert()
        _damage_message(caplog, f"model.safetensors has {size // 2:,} bytes, {size:,} when it was written")
        data = weights.read_bytes()
        weights.write_bytes(b"\xff" * 8 + data[8:])                   # same size, garbage header
        convert()
        _damage_message(caplog, "model.safetensors does not have the SHA-256 recorded when it was written")
        (folder / "config.json").unlink()
        convert()
        _damage_message(caplog, "config.json is missing")
    assert len(calls) == 4 and weights.stat().st_size == size
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # nothing left aside


def test_a_converted_model_made_before_manifests_is_checked_by_its_structure(conversions, caplog):
    """A cache converted by an older version has no manifest: sound weights are adopted (a manifest recorded, no
    conversion), a header longer than the file is converted again."""
    from oscar.manifest import MANIFEST

    convert, calls = conversions
    folder = convert()
    (folder / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        assert convert() == folder and len(calls) == 1 and (folder / MANIFEST).exists()
        (folder / MANIFEST).unlink()
        weights = folder / "model.safetensors"
        weights.write_bytes((10 ** 9).to_bytes(8, "little") + weights.read_bytes()[8:])
        convert()
    _damage_message(caplog, "model.safetensors: header length 1,000,000,000 past the file's")
    assert len(calls) == 2


RESUME_LINE = "interrupted: the run is not finished; run the same command again to resume it"


def test_ctrl_c_is_one_line_saying_the_same_command_resumes(monkeypatch, caplog):
    """Defect 9: SIGINT printed a full KeyboardInterrupt traceback; run.py logs one line and exits with 130."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_py", REPO / "run.py")
    run_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_py)

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_py, "run", interrupted)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as stop:
        run_py.main(_compose("logger=files"))                          # a config given: no Hydra app around it
    assert stop.value.code == 130
    assert [r.getMessage() for r in caplog.records] == [RESUME_LINE + " (finished samples are kept, nothing is "
                                                        "computed twice)"]


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_the_same_command_resumes(tmp_path):
    """Defect 9 through the real command line (SIGINT in the middle of a NIAH grid): one line, exit code 130, and
    the same command then finishes the run without recomputing the cells already done."""
    import signal
    import subprocess
    import sys
    import time

    command = [sys.executable, "run.py", "model=tiny-llama", "method=fp16", "task.lengths=[96]",
               f"task.depths=[{','.join(str(d) for d in range(0, 101, 2))}]", "task.max_new_tokens=8", "logger=files",
               f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}"]
    proc = subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not list((tmp_path / "runs").rglob("predictions.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)
    (log_file,) = (tmp_path / "runs").rglob("predictions.jsonl")
    while not log_file.read_text().count("\n") and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    assert RESUME_LINE in out, out[-2000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-2000:]
    done = log_file.read_text().count("\n")
    assert 1 <= done < 51 and not list((tmp_path / "runs").rglob("metrics.json"))
    again = subprocess.run(command, cwd=REPO, text=True, capture_output=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    records = []
    for line in log_file.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:                                  # a line cut by the interrupt: recomputed
            pass
    assert len(records) == 51 and len({r["key"] for r in records}) == 51  # no cell computed twice
