"""run.py end to end on a tiny model: run folder, tidy rows, skip on resume, determinism."""

import json
import subprocess
import sys

from oscar.paths import REPO_ROOT as REPO


def run_py(*overrides: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "run.py", *overrides], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_cfg_job_prints_the_composed_config():
    out = run_py("--cfg", "job", "method=kivi")
    assert "name: kivi" in out.stdout and "residual_length: 128" in out.stdout and "name: niah" in out.stdout


def test_a_small_run_writes_its_folder_and_rows_and_is_skipped_then_reproduced(tmp_path, data_file):
    data_root = data_file("text/wikitext-2-raw-v1.test.rows.jsonl").parents[1]  # the folder that has the default text
    args = ["model=tiny-llama", "task=perplexity", "task.window=128", "task.max_windows=2", "method=oscar",
            "method.residual_length=64", "logger=files", f"runs_dir={tmp_path / 'runs'}",
            f"results_file={tmp_path / 'rows.csv'}", f"data_root={data_root}"]
    first = run_py(*args, "show_tables=true")
    (run_dir,) = (tmp_path / "runs" / "perplexity" / "tiny-llama").iterdir()
    for name in ("config.yaml", "predictions.jsonl", "metrics.json", "env.json"):
        assert (run_dir / name).exists(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    env = json.loads((run_dir / "env.json").read_text())
    assert env["device"] == "cpu" and env["torch"] and env["fused_layers"] == "off"  # a CPU: transformers' modules
    rows = (tmp_path / "rows.csv").read_text().splitlines()
    assert rows[0].startswith("model,method,bits,group_size,residual_length,task,subset,metric,value,n,run_id")
    assert any(",oscar,2,32,64,perplexity," in r for r in rows[1:])
    assert rows[0].endswith(",task_config,code_version,config_digest,date")
    assert all(",max_windows=2 window=128," in r for r in rows[1:])
    log = first.stderr + first.stdout
    assert "oscar" in log  # the methods table is logged: this run's first, then the merged view under its heading
    assert 0 <= log.index(f"this run ({run_dir})") < log.index("merged view: every row of tiny-llama / perplexity")

    second = run_py(*args)
    assert "skipping finished run" in second.stderr + second.stdout
    assert "merged view" not in second.stderr + second.stdout  # the tables only on request (show_tables)
    assert len((tmp_path / "rows.csv").read_text().splitlines()) == len(rows)

    run_py(*args, "rerun=true")
    again = json.loads((run_dir / "metrics.json").read_text())
    assert again.pop("date") >= metrics.pop("date") and again == metrics  # same config, identical metrics
