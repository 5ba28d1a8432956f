"""Faults a new user runs into: corrupted results rows and prediction logs, changed data
under a finished run, runs that score nothing or a non-finite number, prompts a model cannot take, W&B on the
console, rows.csv with non-finite values, stray carriage returns or a method column that contradicts its config,
a damaged converted-model cache, Ctrl-C."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from evals import build_task
from evals.base import TaskResult
from oscar import build_method
from oscar.lm import KVModel
from oscar.paths import REPO_ROOT as REPO
from oscar.results import ROW_FIELDS, PredictionLog, append_rows, read_rows
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
    """Defects 2 and 6: a glued line (two rows' fields, less one) and a garbage line are skipped with a warning naming
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
    glued_fields = 2 * len(ROW_FIELDS) - 1                         # the first row's last field holds the second's first
    assert any(f"{path}:2: malformed row skipped" in m and f"{glued_fields} fields" in m for m in messages), messages
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
    args = ["task=perplexity", f"task.path={text}", f"runs_dir={tmp_path / 'runs'}", "model=tiny-llama",
            "task.window=64"]
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


# ----------------------------------------------------------------------------- more faults


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


def test_a_converted_model_without_its_manifest_is_converted_again(conversions, caplog):
    """B9: a cached conversion without its manifest adopted damaged weights of a sound structure (a zeroed k_proj
    scored 0 and exited 0), then recorded a manifest of the damage. No manifest = not a finished conversion: it is
    converted again (one warning), and the fresh weights are what is used."""
    from safetensors.torch import load_file, save_file

    from oscar.manifest import MANIFEST

    convert, calls = conversions
    folder = convert()
    weights = folder / "model.safetensors"
    sound = load_file(weights)["w"]
    (folder / MANIFEST).unlink()
    save_file({"w": torch.zeros_like(sound)}, weights)              # damaged, structure intact
    with caplog.at_level(logging.WARNING):
        assert convert() == folder
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.getMessage() == (f"smollm2-135m: the converted model in {folder} has no manifest (a conversion cut "
                                   "short, or made before manifests): not known to be whole; converting it again")
    assert len(calls) == 2 and torch.equal(load_file(weights)["w"], sound) and (folder / MANIFEST).exists()


@pytest.mark.parametrize("manifest_text", ["", '{"files": ', '{"files": {"model.safetensors": {"size": "big"}}}',
                                           "[1, 2]"])
def test_an_unreadable_manifest_means_not_converted(conversions, caplog, manifest_text):
    """A manifest cut short or not a manifest: converted again, one warning naming the manifest's path."""
    from oscar.manifest import MANIFEST

    convert, calls = conversions
    folder = convert()
    (folder / MANIFEST).write_text(manifest_text)
    with caplog.at_level(logging.WARNING):
        assert convert() == folder
    _damage_message(caplog, f"{folder / MANIFEST} ")
    assert len(calls) == 2 and convert() == folder and len(calls) == 2  # its new manifest is sound


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


# ----------------------------------------------------------------------------- nothing half-written counts as done

#: the start of a child process that only appends rows: the oscar package without its __init__ (the methods and
#: torch, seconds to import), so the children start at once
LIGHT_OSCAR = f"""
import sys, types
package = types.ModuleType("oscar")
package.__path__ = [{str(REPO / "oscar")!r}]
sys.modules["oscar"] = package
"""
APPEND_ON_A_FULL_DISK = LIGHT_OSCAR + """
import json, resource, signal, sys
from pathlib import Path
from oscar.results import append_rows
path, room, rows = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as one on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + room, resource.RLIM_INFINITY))
try:
    append_rows(path, rows)
except OSError as e:
    print("failed:", e.strerror)
"""


def _append_on_a_full_disk(path, rows: list[dict], room: int) -> str:
    """append_rows in a process that can grow no file past ``path``'s size + ``room`` bytes; its output."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", APPEND_ON_A_FULL_DISK, str(path), str(room), json.dumps(rows)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _old_header_file(path, rows: list[dict]) -> None:
    """A results file written before ``task_config`` existed (its header one column shorter)."""
    import csv

    from oscar.results import ROW_FIELDS

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS[:ROW_FIELDS.index("task_config")], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def test_a_header_upgrade_on_a_full_disk_loses_no_row(tmp_path):
    """B7: appending to a file with an older header rewrote it in place (truncate, then write): on a full disk a
    committed row was lost and the last line cut. The rewrite is a new file renamed over the old one: it fails
    whole, the old file stays as it was, and no temporary file is left behind."""
    path = tmp_path / "rows.csv"
    _old_header_file(path, [tidy("kivi", "perplexity", 20.0 + i / 100, f"r{i}") for i in range(3000)])
    before = path.read_bytes()
    out = _append_on_a_full_disk(path, [tidy("oscar", "perplexity", 19.5, "new")], room=1000)  # the new column: +3000
    assert out.startswith("failed: File too large"), out
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["rows.csv"]
    append_rows(path, [tidy("oscar", "perplexity", 19.5, "new")])     # room again: upgraded, every row kept
    back = read_rows(path)
    assert len(back) == 3001 and {r["run_id"] for r in back} == {f"r{i}" for i in range(3000)} | {"new"}


def test_an_append_on_a_full_disk_leaves_no_cut_row(tmp_path, caplog):
    """An append that fails part-way (the disk filled) is cut back to the file's old end: no half row for the
    tables to read or skip."""
    path = tmp_path / "rows.csv"
    append_rows(path, [tidy("fp16", "niah", 90.0, "r1")])
    before = path.read_bytes()
    out = _append_on_a_full_disk(path, [tidy("kivi", "niah", 80.0 + i, f"r{i}") for i in range(2, 7)], room=300)
    assert out.startswith("failed: File too large"), out
    assert path.read_bytes() == before
    append_rows(path, [tidy("kivi", "niah", 80.0, "r2")])
    with caplog.at_level(logging.WARNING):
        assert [r["run_id"] for r in read_rows(path)] == ["r1", "r2"]
    assert not caplog.records


APPENDER = LIGHT_OSCAR + """
import sys
from oscar.results import append_rows
name, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    append_rows(path, [dict(model="m", method="kivi", bits=2, group_size=32, residual_length=128, task="niah",
                            subset="all", metric="score", value=i, n=1, run_id=f"{name}{i}", config="{}",
                            task_config=f"from {name}")])
"""


def _downgrade_header(path) -> None:
    """What an older version's appender leaves: the file rewritten in place under its lock, header without
    ``task_config`` (the lock taken on the file the path names, as every writer does)."""
    import csv
    import fcntl
    import os

    from oscar.results import ROW_FIELDS

    while True:
        with path.open("r+", newline="") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            if os.fstat(f.fileno()).st_ino != os.stat(path).st_ino:
                continue
            rows = list(csv.DictReader(f))
            f.seek(0)
            f.truncate()
            writer = csv.DictWriter(f, fieldnames=ROW_FIELDS[:ROW_FIELDS.index("task_config")], extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
            return


def test_concurrent_appenders_lose_nothing_across_header_upgrades(tmp_path):
    """A header upgrade renames a new file over the one other appenders may be waiting to lock: each re-opens the
    path once it holds the lock, so 2 processes x 150 appends, with the header made old again and again while they
    run (each time upgraded by the next append), keep every row exactly once."""
    import csv
    import subprocess
    import sys
    import time

    path = tmp_path / "results" / "rows.csv"
    path.parent.mkdir()
    n = 150
    _old_header_file(path, [tidy("fp16", "niah", 90.0, "first")])
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, name, str(path), str(n)], cwd=REPO,
                              stderr=(tmp_path / f"{name}.err").open("w")) for name in ("a", "b")]
    downgrades = 0
    while any(p.poll() is None for p in procs):
        if path.read_text().count("\n") > 1 + downgrades * 4:  # the appenders are running: make the header old
            _downgrade_header(path)
            downgrades += 1
        time.sleep(0.01)
    for name, p in zip("ab", procs):
        assert p.returncode == 0, (tmp_path / f"{name}.err").read_text()[-2000:]
    assert downgrades >= 3
    with path.open(newline="") as f:
        ids = [r["run_id"] for r in csv.DictReader(f)]
    assert sorted(ids) == sorted(["first"] + [f"{name}{i}" for name in "ab" for i in range(n)])
    assert [p.name for p in path.parent.iterdir()] == ["rows.csv"]


@pytest.mark.parametrize("script", ["calibrate_rotatekv", "calibrate_spectral"])
def test_a_calibration_that_fails_to_save_leaves_the_old_file(script, tmp_path, monkeypatch, data_file):
    """A calibration written with torch.save straight to its path was left cut short by a failed write (a full disk),
    and a later run refused it as unreadable: the scripts write it through oscar.atomic, so the file a run reads is
    the old one, whole, and nothing is left beside it."""
    import importlib
    import sys

    data_file("qa/ruler_squad_v2_dev.json")
    module = importlib.import_module(f"scripts.{script}")
    out = tmp_path / "tiny-llama" / "calib.pt"
    out.parent.mkdir()
    torch.save({"made": "before"}, out)
    before = out.read_bytes()

    def full_disk(obj, f, *args, **kwargs):  # half the file written, then the disk is full
        if hasattr(f, "write"):
            f.write(b"PK\x03\x04" + b"\x00" * 64)
        else:
            Path(f).write_bytes(b"PK\x03\x04" + b"\x00" * 64)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(sys, "argv", [script, "--model", "tiny-llama", "--windows", "1", "--seq-len", "64",
                                      "--out", str(out), "--device", "cpu"])
    with pytest.raises(OSError, match="No space left"):
        module.main()
    assert out.read_bytes() == before and [p.name for p in out.parent.iterdir()] == ["calib.pt"]


def test_prediction_records_with_missing_or_mistyped_fields_are_computed_again(tiny_lm, corpus, tmp_path, caplog):
    """A predictions.jsonl record with its key but a field missing or of another type crashed the resumed run after
    the weights loaded (KeyError, TypeError in the sums); it is left out with a warning naming file and line, its
    sample computed again, and the resumed run gives the uninterrupted run's numbers."""
    from evals.niah import NeedleInAHaystack

    cases = [(build_task("perplexity", path=str(corpus), window=64, max_windows=3), "window",
              [lambda r: {"key": r["key"]}, lambda r: {**r, "nll": "12.5"}]),
             (NeedleInAHaystack(lengths=[96], depths=[0, 50, 100], max_new_tokens=2), "cell",
              [lambda r: {k: v for k, v in r.items() if k != "score"}, lambda r: {**r, "exact": True}])]
    for task, what, damages in cases:
        fresh = task.run(tiny_lm, tmp_path / what / "fresh")
        log_file = tmp_path / what / "resumed" / "predictions.jsonl"
        log_file.parent.mkdir()
        fresh_log = tmp_path / what / "fresh" / "predictions.jsonl"
        records = [json.loads(line) for line in fresh_log.read_text().splitlines()]
        log_file.write_text("".join(json.dumps(damage(r)) + "\n" for damage, r in zip(damages, records))
                            + "".join(json.dumps(r) + "\n" for r in records[len(damages):]))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            resumed = task.run(tiny_lm, log_file.parent)
        assert resumed.metrics == pytest.approx(fresh.metrics), what
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        key0, key1 = records[0]["key"], records[1]["key"]
        first = "lacks 'start'" if what == "window" else "lacks 'score'"
        second = "has nll='12.5', not a number" if what == "window" else "has exact=True, not a number"
        assert warnings == [f"{log_file}:1: the record of {key0!r} {first}; ignored (its sample is computed again)",
                            f"{log_file}:2: the record of {key1!r} {second}; ignored (its sample is computed again)"]
        lines = log_file.read_text().splitlines()
        assert len(lines) == len(records) + 2                                 # the two samples, logged again
        caplog.clear()
        with caplog.at_level(logging.WARNING):                                # logged whole since: no warning
            assert task.run(tiny_lm, log_file.parent).metrics == pytest.approx(fresh.metrics)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(log_file.read_text().splitlines()) == len(records) + 2


def test_an_appender_that_waited_on_the_replaced_file_appends_to_the_new_one(tmp_path):
    """The race the atomic upgrade opens, made certain: two appenders wait on the lock of a file with an older
    header; the first to get it renames the upgraded file over it; the second, holding the lock of a file no longer
    at the path, must append to the new one (it re-opens the path), or its row is lost."""
    import fcntl
    import threading
    import time

    path = tmp_path / "rows.csv"
    _old_header_file(path, [tidy("fp16", "niah", 90.0, "first")])
    held = path.open("r+")
    fcntl.flock(held, fcntl.LOCK_EX)                                  # a writer busy with the file
    appenders = [threading.Thread(target=append_rows, args=(path, [tidy("kivi", "niah", 80.0, name)]))
                 for name in ("a", "b")]
    for thread in appenders:
        thread.start()
    time.sleep(1.0)                                                    # both opened the file and wait on its lock
    held.close()
    for thread in appenders:
        thread.join(timeout=60)
    assert {r["run_id"] for r in read_rows(path)} == {"first", "a", "b"}


# ----------------------------------------------------------------------------- the run folder's state files

#: a NIAH run on the random-weight Llama whose 4 cells (2 lengths x 2 depths) store different KV bytes per token
TINY_GRID = ["model=tiny-llama", "method=oscar", "method.residual_length=64", "task=niah", "task.lengths=[160,288]",
             "task.depths=[0,50]", "task.max_new_tokens=4", "logger=files"]


def _full_disk_at(monkeypatch, name: str) -> None:
    """os.fsync fails with ENOSPC (the disk filled) while a temporary file of ``name`` is written."""
    import errno
    import os

    fsync = os.fsync

    def full(fd):
        if f".{name}." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", full)


def test_a_full_disk_at_the_metrics_write_leaves_the_run_unfinished(tmp_path, monkeypatch):
    """Case B6: metrics.json written in place left a 0-byte file when the disk filled: the run counted as finished and
    every rerun died with a bare JSONDecodeError. Written whole or not at all, the run is not finished, and the same
    command finishes it from its predictions."""
    args = [*TINY_GRID, "task.lengths=[160]", f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'r.csv'}"]
    _full_disk_at(monkeypatch, "metrics.json")
    p = preflight(_compose(*args), build_task)
    with pytest.raises(OSError, match="No space left"):
        execute(_compose(*args), p)
    assert not (p.run_dir / "metrics.json").exists() and not list(p.run_dir.glob(".metrics.json.*"))
    assert (p.run_dir / "rows.json").exists() and not plan(_compose(*args), build_task).finished
    monkeypatch.undo()                                               # space again
    resumed = preflight(_compose(*args), build_task)
    metrics = execute(_compose(*args), resumed)
    assert json.loads((p.run_dir / "metrics.json").read_text()) == metrics and metrics["score"] >= 0
    assert plan(_compose(*args), build_task).finished


@pytest.mark.parametrize("left", ["", "{\"score\": 5", "[1, 2]"])
def test_a_cut_or_foreign_metrics_json_means_not_finished_with_one_warning(tmp_path, caplog, left):
    """Case B6: a metrics.json left 0-byte (or cut, or not an object) by an older version: not finished, one warning
    naming it, and the run computes (its predictions resumed) and writes a whole one."""
    args = [*TINY_GRID, "task.lengths=[160]", "task.depths=[0]", f"runs_dir={tmp_path / 'runs'}",
            f"results_file={tmp_path / 'r.csv'}"]
    first = plan(_compose(*args), build_task)
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "metrics.json").write_text(left)
    with caplog.at_level(logging.WARNING, logger="oscar.runner"):
        p = preflight(_compose(*args), build_task)
    assert not p.finished
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{first.run_dir / 'metrics.json'} ") and "the run is not finished and runs again" in warning
    metrics = execute(_compose(*args), p)
    assert json.loads((p.run_dir / "metrics.json").read_text()) == metrics and "score" in metrics


def killed_after_two_samples(args: list[str], monkeypatch) -> None:
    """Run the configuration of ``args`` and interrupt it (KeyboardInterrupt) once two samples are logged."""
    write, written = PredictionLog.write, []

    def killed_after_two(self, key, record):
        write(self, key, record)
        written.append(key)
        if len(written) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(PredictionLog, "write", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        execute(_compose(*args), preflight(_compose(*args), build_task))
    monkeypatch.setattr(PredictionLog, "write", write)


def test_a_resumed_run_reports_the_kv_bytes_of_every_sample(tmp_path, monkeypatch):
    """Case B8: kv_bytes_per_token counted only the last process's generations (after kill -9 and resume 11,826.7
    over 1,831 tokens against 12,810.0 uninterrupted). Each record holds its sample's stored bytes and tokens, and
    the run's figure comes from all of them."""
    whole = [*TINY_GRID, f"runs_dir={tmp_path / 'whole'}", f"results_file={tmp_path / 'whole.csv'}"]
    uninterrupted = execute(_compose(*whole), preflight(_compose(*whole), build_task))

    split = [*TINY_GRID, f"runs_dir={tmp_path / 'split'}", f"results_file={tmp_path / 'split.csv'}"]
    killed_after_two_samples(split, monkeypatch)
    p = preflight(_compose(*split), build_task)
    resumed = execute(_compose(*split), p)
    records = [json.loads(line) for line in (p.run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 4 and len({r["stored_bytes"] / r["stored_tokens"] for r in records}) > 1
    assert resumed["kv_bytes_per_token"] == pytest.approx(uninterrupted["kv_bytes_per_token"], rel=1e-12)
    kv_row = lambda f: next(r for r in read_rows(f) if r["metric"] == "kv_bytes_per_token")  # noqa: E731
    assert kv_row(tmp_path / "split.csv")["n"] == kv_row(tmp_path / "whole.csv")["n"] == str(
        sum(r["stored_tokens"] for r in records))


@pytest.fixture
def process_code(monkeypatch):
    """``process_code(version)``: the code version a new process would read (oscar.provenance.process_provenance read
    again); ``monkeypatch`` undoes it, and the process's own is read afresh after the test."""
    import oscar.provenance

    def set_version(version: str) -> None:
        monkeypatch.setattr(oscar.provenance, "code_version", lambda root=None: version)
        oscar.provenance.process_provenance.cache_clear()

    yield set_version
    oscar.provenance.process_provenance.cache_clear()


def test_a_run_resumed_by_other_code_names_every_version_its_samples_came_from(tmp_path, process_code, monkeypatch,
                                                                               caplog):
    """A run killed after two samples and finished by a later commit: each record names the code that computed it,
    and the rows and metrics.json name both versions (not the last one alone), with a warning that counts them."""
    args = [*TINY_GRID, f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}"]
    process_code("aaaa111111")
    killed_after_two_samples(args, monkeypatch)
    process_code("bbbb222222+dirty")
    p = preflight(_compose(*args), build_task)
    with caplog.at_level(logging.WARNING):
        metrics = execute(_compose(*args), p)
    records = [json.loads(line) for line in (p.run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["code_version"] for r in records] == ["aaaa111111"] * 2 + ["bbbb222222+dirty"] * 2
    both = "aaaa111111, bbbb222222+dirty"
    assert metrics["code_version"] == both and {r["code_version"] for r in read_rows(tmp_path / "rows.csv")} == {both}
    assert "more than one version of the code (aaaa111111: 2, bbbb222222+dirty: 2; this one is bbbb222222+dirty)" \
        in caplog.text

    shutil.rmtree(p.run_dir)  # the same code finishing its own samples names itself alone
    process_code("aaaa111111")
    killed_after_two_samples(args, monkeypatch)
    assert execute(_compose(*args), preflight(_compose(*args), build_task))["code_version"] == "aaaa111111"


def test_the_versions_of_a_log_are_read_from_the_records_its_task_reads(tmp_path):
    """record_code_versions reads the records PredictionLog would (a JSON object with a string key, the last of each
    key): lines it leaves out count for no version, a version that is not a string (an edit) counts as unrecorded,
    a list counts each of its versions once, and a version with a comma is one version."""
    from oscar.results import record_code_versions

    log_file = tmp_path / "predictions.jsonl"
    lines = [{"key": "a", "code_version": "v1"}, {"foo": 1}, {"key": 5, "code_version": "v9"}, ["a"], "text",
             {"key": "b", "code_version": 7}, {"key": "c", "code_version": ["v1", "v2", "v2"]},
             {"key": "d", "code_version": "x, y "}, {"key": "a", "code_version": "v2"}, {"key": "e"}]
    log_file.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{cut sho")
    assert record_code_versions(log_file) == {"v2": 2, "unrecorded": 2, "v1": 1, "x, y": 1}
    assert record_code_versions(tmp_path / "none.jsonl") == {}


def test_a_commit_made_while_a_run_goes_does_not_rename_its_numbers(tmp_path, process_code, monkeypatch):
    """The code a process runs is the code it imported: the version read before the weights load names every record,
    row and env.json of the run, though the checkout moves on to another commit after it."""
    import oscar.provenance

    args = [*TINY_GRID, f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}"]
    process_code("aaaa111111")
    p = preflight(_compose(*args), build_task)
    monkeypatch.setattr(oscar.provenance, "code_version", lambda root=None: "cccc333333")  # committed meanwhile
    metrics = execute(_compose(*args), p)
    records = [json.loads(line) for line in (p.run_dir / "predictions.jsonl").read_text().splitlines()]
    env = json.loads((p.run_dir / "env.json").read_text())
    assert {r["code_version"] for r in records} == {"aaaa111111"} == {r["code_version"] for r in read_rows(
        tmp_path / "rows.csv")} == {metrics["code_version"], env["code_version"]}


def test_records_without_stored_bytes_leave_the_figure_out_with_one_warning(tmp_path, caplog):
    """A run resumed from records written before they held their stored bytes reports no kv_bytes_per_token (half
    the samples' bytes would be a wrong figure), and says that rerun=true computes it."""
    args = [*TINY_GRID, "task.lengths=[160]", f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'r.csv'}"]
    p = preflight(_compose(*args), build_task)
    execute(_compose(*args), p)
    log_file = p.run_dir / "predictions.jsonl"
    old = [{k: v for k, v in json.loads(line).items() if k not in ("stored_bytes", "stored_tokens")}
           for line in log_file.read_text().splitlines()]
    log_file.write_text("".join(json.dumps(r) + "\n" for r in old))
    (p.run_dir / "metrics.json").unlink()
    with caplog.at_level(logging.WARNING):
        metrics = execute(_compose(*args), preflight(_compose(*args), build_task))
    assert "kv_bytes_per_token" not in metrics and "score" in metrics
    assert f"{log_file}: 2 of 2 records hold no stored KV bytes (written by an older version): kv_bytes_per_token " \
           "is left out; rerun=true computes it" in caplog.text
