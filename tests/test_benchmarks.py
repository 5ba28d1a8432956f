"""The benchmarks package: one command lists and runs the questions; the harness's row schema (provenance first),
atomic CSV writes, code version, timing, budget and the copy bandwidth measured once; the report's tables per run;
docs/extending.md's steps for a new question, followed on a copy of the package; and results/efficiency as the
committed list of questions, its README what ``make tables`` draws from their CSVs."""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys

import pytest

import benchmarks
from benchmarks import harness, report
from benchmarks.__main__ import main
from oscar.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "extending.md"


def test_help_lists_every_question_by_its_first_line(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    found = benchmarks.questions()
    assert set(found) >= {"kernel", "user_path", "long_context", "prefill_census", "multi_gpu", "eval_throughput",
                          "multimodal", "input_checks"}
    assert not {"harness", "filled", "profiling", "report"} & set(found)  # helpers define no run
    for name, module in found.items():
        assert f"  {name:16s} {module.__doc__.strip().splitlines()[0]}" in out


def test_an_unknown_question_is_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["no_such_question"])
    err = capsys.readouterr().err
    assert "unknown question 'no_such_question'" in err and "user_path" in err and "Traceback" not in err


def test_a_kernel_question_without_a_gpu_says_so_in_one_line(tmp_path):
    from kernels.runtime import cupy_available

    if cupy_available():
        pytest.skip("this machine has a GPU and CuPy")
    with pytest.raises(SystemExit, match="kernel: needs a CUDA GPU and CuPy"):
        main(["kernel", "--out", str(tmp_path), "--quick"])
    assert not (tmp_path / "kernel.csv").exists()


def test_an_8b_architecture_without_a_gpu_says_so_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="llama-3.1-8b: the random-weight 8B architectures are built on a GPU"):
        main(["user_path", "--out", str(tmp_path)])
    assert not (tmp_path / "user_path.csv").exists()


def test_rows_lead_with_provenance_and_each_write_is_whole(tmp_path, monkeypatch):
    bench = harness.Run("toy", ["--steps", "3", "--out", str(tmp_path)], tmp_path, fields=["b", "a"], device="cpu")
    bench.add(dict(a=1, b=2))
    bench.add(dict(a=3, c=4))
    with (tmp_path / "toy.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["question", "gpu", "date", "code_version", "arguments", "b", "a", "c"]
    assert rows[0]["question"] == "toy" and rows[0]["gpu"].startswith("cpu") and rows[0]["arguments"] == "--steps 3"
    assert rows[0]["date"] == rows[1]["date"] and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00",
                                                                rows[0]["date"])
    before = (tmp_path / "toy.csv").read_bytes()

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        bench.add(dict(a=5))
    assert (tmp_path / "toy.csv").read_bytes() == before  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["toy.csv"]  # no temporary file left behind


def test_a_run_adds_its_rows_below_those_earlier_runs_wrote(tmp_path):
    """A second run of a question into the same folder keeps the first run's rows as they were, in the file's columns,
    and adds its own below them (a new measured field as a new column, empty in the earlier rows)."""
    first = harness.Run("toy", ["--steps", "1"], tmp_path, fields=["a"], device="cpu")
    first.add(dict(a=1))
    first.add(dict(a=2))
    before = (tmp_path / "toy.csv").read_text().splitlines()
    second = harness.Run("toy", ["--steps", "2"], tmp_path, fields=["a"], device="cpu")
    second.add(dict(a=3, c=4))
    lines = (tmp_path / "toy.csv").read_text().splitlines()
    assert lines[0] == before[0] + ",c" and [line + "," for line in before[1:]] == lines[1:3]
    with (tmp_path / "toy.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["arguments"], r["a"], r["c"]) for r in rows] == [("--steps 1", "1", ""), ("--steps 1", "2", ""),
                                                                ("--steps 2", "3", "4")]


@pytest.mark.parametrize("damage", ["cut", "merged"])
def test_a_malformed_csv_or_a_file_as_out_is_refused_before_anything_is_measured(tmp_path, damage):
    """A question's CSV with a row cut short or two rows run together, or ``--out`` naming a file: one line naming
    the path (and the line), before the run measures anything; the file is left as it was."""
    harness.Run("toy", [], tmp_path, device="cpu").add(dict(a=1, b=2))
    text = (tmp_path / "toy.csv").read_text()
    last = text.splitlines()[-1]
    added = last[: len(last) // 2] if damage == "cut" else last + "," + last
    damaged = text + added + "\n"
    (tmp_path / "toy.csv").write_text(damaged)
    fields = len(next(csv.reader([added])))  # what is left of the row's 7 fields, or two rows' 14
    with pytest.raises(SystemExit, match=rf"toy: .*toy\.csv:3: {fields} fields where the header has 7; mend or move"):
        harness.Run("toy", [], tmp_path, device="cpu")
    assert (tmp_path / "toy.csv").read_text() == damaged
    with pytest.raises(SystemExit, match="--out .*toy.csv is a file; it names the folder of toy.csv"):
        harness.Run("toy", [], tmp_path / "toy.csv", device="cpu")


def test_missing_data_and_abbreviated_options_are_one_line(tmp_path, capsys):
    """A question whose data is in no data folder ends in one line (not a traceback); an abbreviated option is refused,
    since the arguments a row records are the command that reproduces it."""
    module = tmp_path / "needs_data.py"
    module.write_text('''"""A question that reads a data file."""
from oscar.paths import DataNotFoundError


def add_arguments(parser):
    parser.add_argument("--steps", type=int, default=1)


def run(args, bench):
    raise DataNotFoundError("toy/data.md is in no data folder: run `make data`")
''')
    with pytest.raises(SystemExit, match=r"^needs_data: toy/data.md is in no data folder: run `make data`$"):
        main([str(module), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        main([str(module), "--step", "2", "--out", str(tmp_path / "out")])
    assert "unrecognized arguments: --step 2" in capsys.readouterr().err


def test_code_version_is_the_commit_and_says_dirty(tmp_path, monkeypatch):
    monkeypatch.delenv("OSCAR_CODE_VERSION", raising=False)

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True,
                            text=True).stdout.strip()[:10]
    assert harness.code_version(tmp_path) == commit
    (tmp_path / "a.py").write_text("x = 2\n")
    assert harness.code_version(tmp_path) == commit + "+dirty"
    elsewhere = tmp_path / "copy"  # a copy of the tree without git: what the measuring machine is told
    elsewhere.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert harness.code_version(elsewhere) == "unknown"
    monkeypatch.setenv("OSCAR_CODE_VERSION", "abc1234")
    assert harness.code_version(elsewhere) == "abc1234"
    assert harness.code_version(tmp_path) == "abc1234"  # set, it wins over a checkout's own (stale) commit


def test_copy_bandwidth_is_measured_once_a_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(harness, "copy_bandwidth", lambda device: calls.append(device) or 123.0)
    bench = harness.Run("toy", [], tmp_path, device="cpu")
    assert bench.copy_gbs == bench.copy_gbs == 123.0 and len(calls) == 1


def test_timing_on_a_cpu_and_the_budget(caplog):
    import time

    ms = harness.captured_ms(lambda: time.sleep(0.002), "cpu", replays=5)
    assert 2.0 <= ms < 50.0  # the median of perf_counter timings: the sleep, and no more than a shared machine adds
    assert harness.copy_bandwidth("cpu", 2**22) > 0.1
    budget = harness.Budget(0.0)
    with caplog.at_level("INFO", logger="benchmarks"):
        assert not budget.allows("the next cell")
    assert "skipped the next cell" in caplog.text
    assert harness.Budget().allows("anything")


def test_the_report_has_one_table_per_run_newest_first(tmp_path):
    """Two runs of a question in one CSV: each its own table with its command (the arguments of that run), the
    newest first, each naming its code version as written (digits keep their leading zeros); a question without its
    own table shows every measured column."""
    def row(date, arguments, case, us):
        return dict(question="input_checks", gpu="cpu", date=date, code_version="0038349", arguments=arguments,
                    case=case, quantize_us=us)

    with (tmp_path / "input_checks.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row("", "", "", 0)))
        writer.writeheader()
        writer.writerows([row("2026-01-01T00:00:00+00:00", "--repeats 1", "old", 1.5),
                          row("2026-02-01T00:00:00+00:00", "--repeats 2", "new", 2.5)])
    rows = report.read_rows(tmp_path / "input_checks.csv")
    assert [r["case"] for r in report.runs(rows)[0]] == ["new"] and len(report.runs(rows)) == 2
    assert rows[0]["code_version"] == "0038349" and rows[0]["quantize_us"] == 1.5  # a commit of digits stays text
    report.build(tmp_path)
    readme = (tmp_path / "README.md").read_text()
    assert "code 0038349" in readme
    assert readme.index("input_checks --repeats 2`") < readme.index("input_checks --repeats 1`")
    assert "| case | quantize_us |" in readme and "| new | 2.500 |" in readme


def test_the_report_skips_a_malformed_row_and_names_its_line(tmp_path, caplog):
    """A row cut short, two rows run together and a word where the column holds numbers: each skipped with a warning
    naming the file and line; the well-formed rows are drawn (the question's own table formats numbers)."""
    source = REPO_ROOT / "results" / "efficiency" / "eval_throughput.csv"
    lines = source.read_text().splitlines()
    header, good = lines[0], lines[1:4]
    column = header.split(",").index("column_min")
    worded = next(csv.reader([good[1]]))
    worded[column] = "fast"
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="").writerow(worded)
    text = "\n".join([header, good[0], good[1][:40], good[2] + "," + good[2], buffer.getvalue(), good[2]]) + "\n"
    (tmp_path / "eval_throughput.csv").write_text(text)
    with caplog.at_level("WARNING", logger="benchmarks.report"):
        rows = report.read_rows(tmp_path / "eval_throughput.csv")
        report.build(tmp_path)
    assert len(rows) == 2
    for line, why in ((3, "do not match the header"), (4, "do not match the header"), (5, "column_min not a number")):
        assert f"eval_throughput.csv:{line}: skipped: " in caplog.text and why in caplog.text
    assert "eval_throughput" in (tmp_path / "README.md").read_text()


def _measurement_step() -> str:
    """The code block of docs/extending.md's measurement section (the question module)."""
    section = DOC.read_text().split("## A measurement")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "docs/extending.md: one question module in the measurement steps"
    return "\n".join(line[3:] for line in blocks[0].splitlines()) + "\n"


FOLLOW = """
import sys
from benchmarks import report
from benchmarks.__main__ import main
main(["--help"])
main(["dequantize", "--out", sys.argv[1], "--tokens", "64", "--methods", "kivi", "oscar"])
report.build(sys.argv[1])
try:
    main(["dequantize", "--methods", "no-such-method"])
except SystemExit as e:
    print("exit", e.code)
"""


def test_the_documented_steps_add_a_question(tmp_path):
    """docs/extending.md, followed on a copy of the package: the module of step 1 as benchmarks/dequantize.py is
    listed by --help, runs through the command on the CPU (step 3), refuses a bad name in one line before it runs,
    and its README table is drawn (step 4)."""
    package = tmp_path / "benchmarks"
    shutil.copytree(REPO_ROOT / "benchmarks", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "dequantize.py").write_text(_measurement_step())
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", FOLLOW, str(out)], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO_ROOT}", OMP_NUM_THREADS="1"),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "  dequantize       Each method's torch dequantize of one chunk" in done.stdout
    rows = report.read_rows(out / "dequantize.csv")
    assert [r["method"] for r in rows] == ["kivi", "oscar"]
    assert all(r["question"] == "dequantize" and r["tokens"] == 64 and r["ms"] > 0 for r in rows)
    assert "`python -m benchmarks dequantize --tokens 64 --methods kivi oscar`" in (out / "README.md").read_text()
    assert "exit 2" in done.stdout and "unknown KV method 'no-such-method'" in done.stderr
    # a module being written elsewhere runs by its path
    elsewhere = tmp_path / "draft.py"
    elsewhere.write_text(_measurement_step())
    assert main([str(elsewhere), "--out", str(tmp_path / "draft"), "--tokens", "32", "--methods", "kivi"])
    assert report.read_rows(tmp_path / "draft" / "draft.csv")[0]["question"] == "draft"


def test_results_efficiency_is_a_list_of_questions_and_its_readme_is_current(tmp_path):
    """Each CSV there is a question's (its figure beside it, if any), a log is a question's profile
    (``<question>_profile.log``: where its time went) or the one test log per GPU suite, and the README is what
    ``make tables`` draws from those CSVs now."""
    folder = REPO_ROOT / "results" / "efficiency"
    names = benchmarks.questions()
    for path in folder.iterdir():
        assert path.stem in names or path.name in ("README.md", "test_gpu.log") or (
            path.suffix == ".csv" and path.stem.rsplit("_", 1)[0] in names) or (
            path.name.endswith("_profile.log") and path.name.removesuffix("_profile.log") in names), path.name
        if path.suffix == ".png":
            assert path.with_suffix(".csv").exists(), path.name
    for path in folder.glob("*.csv"):
        if path.stem in names:
            for row in report.read_rows(path):
                assert row["question"] == path.stem and row["gpu"] and row["date"] and row["code_version"]
    copy = tmp_path / "efficiency"
    shutil.copytree(folder, copy)
    report.build(copy)
    assert (copy / "README.md").read_text() == (folder / "README.md").read_text()


def test_kernel_tuning_table_sets_the_defaults_beside_the_fastest_knobs():
    """The kernel question's tuning rows: one line per (method, shape) with the default knob set's time (the row the
    sweep marked ``default``), the fastest set's time and knobs, their ratio and the fastest's share of the floor; a
    tune-only run (no decode rows) draws no empty decode table."""
    from benchmarks import kernel

    def row(method, batch, ms, knobs, role=None):
        return dict(part="tuning", method=method, bits=2, batch=batch, context=131072, ms=ms, floor_ms=0.02,
                    pct_floor=0.02 / ms, knobs=knobs, role=role)

    rows = [row("oscar", 1, 0.050, "nstage=2 min_blocks=16 max_splits=256", "default"),
            row("oscar", 1, 0.040, "nstage=3 min_blocks=20 max_splits=128"),
            row("kivi", 1, 0.060, "nstage=2 min_blocks=16 max_splits=256", "default"),
            row("kivi", 1, 0.070, "nstage=4 min_blocks=24 max_splits=512")]
    text = kernel.table(rows)
    assert text.startswith("Tuning") and "| method | bits |" not in text
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
             for line in text.splitlines() if line.startswith("| oscar") or line.startswith("| kivi")}
    assert lines["oscar"][3:7] == ["0.0500", "0.0400", "nstage=3 min_blocks=20 max_splits=128", "0.80x"]
    assert lines["oscar"][7] == "50%"
    assert lines["kivi"][3:7] == ["0.0600", "0.0600", "nstage=2 min_blocks=16 max_splits=256", "1.00x"]


def test_kernel_figure_draws_the_newest_run_with_decode_rows_past_a_newer_tune_only_run(tmp_path):
    """A ``--tune-only`` run newer than the last decode run does not leave the figure undrawn."""
    from benchmarks import kernel

    head = dict(question="kernel", gpu="H200", code_version="abc")
    decode = [dict(head, date="2026-12-01", arguments="", part="decode", method="oscar", bits=2, batch=1,
                   context=c, ms=0.01 * c / 1024, bf16_ms=0.04 * c / 1024) for c in (1024, 4096)]
    tuning = [dict(head, date="2026-12-06", arguments="--tune-only", part="tuning", method="oscar", bits=2, batch=1,
                   context=131072, ms=0.05)]
    assert kernel.figure(decode + tuning, tmp_path / "k.png") and (tmp_path / "k.png").stat().st_size > 10_000
    assert kernel.figure(tuning, tmp_path / "none.png") is False


def test_decode_latencies_keep_the_newest_run_and_name_what_older_runs_add(tmp_path, caplog):
    """The Pareto panel's latencies come from the newest run alone; a method only older runs measured is named."""
    columns = [*harness.HEAD, "part", "model", "method", "backend", "batch", "context", "ms_per_token"]
    measured = [("2026-12-01", "kivi", 3.0), ("2026-12-01", "oscar", 2.0), ("2026-12-01", "fp16", 1.0),
                ("2026-12-07", "oscar", 2.5), ("2026-12-07", "fp16", 1.5)]
    with (tmp_path / "user_path.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for date, method, ms in measured:
            writer.writerow(["user_path", "H100", date, "abc", "", "decode", "llama-3.1-8b", method,
                             "torch" if method == "fp16" else "cupy", 1, 32768, ms])
    with caplog.at_level("WARNING", logger="benchmarks.report"):
        table, what = report.decode_latencies("llama-3.1-8b-instruct", tmp_path)
    assert table == {"oscar": 2.5, "fp16": 1.5} and "[user_path.csv]" in what
    assert "left out kivi" in caplog.text and "2026-12-07" in caplog.text
