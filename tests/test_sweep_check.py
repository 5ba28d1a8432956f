"""A multirun checks every job before the first one starts (oscar.sweeps, the Hydra callback of conf/config.yaml):
a sweep with a refused job starts none and lists each refused job with its reason (exit code 2); a job that fails
while it runs does not stop the others, and the sweep names it at the end (exit code 1); the sweep's folder is logged
first and last. The jobs are numbered and ordered as Hydra's basic sweeper launches them."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from oscar.paths import REPO_ROOT
from oscar.sweeps import Job, SweepCheck, swept_values

TINY = ["task.depths=[0]", "task.max_new_tokens=4", "logger=files"]


def multirun(tmp_path: Path, *overrides: str, timeout: int = 600) -> tuple[int, str]:
    args = [sys.executable, "run.py", "-m", *overrides, f"runs_dir={tmp_path / 'runs'}",
            f"results_file={tmp_path / 'rows.csv'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    out = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                         env={"OMP_NUM_THREADS": "1", **os.environ})
    return out.returncode, out.stdout + out.stderr


def test_a_sweep_with_refused_jobs_starts_none_and_lists_them(tmp_path):
    """The README's group-size sweep on a model of head_dim 64: the 4 jobs with G=128 are refused (per-token value
    groups of 128 channels do not fit a 64-channel head), by Hydra's job numbers; nothing is run or written."""
    rc, text = multirun(tmp_path, "model=tiny-llama", "method=oscar,kivi", "method.group_size=32,64,128",
                        "method.residual_length=128,256", "task=niah", "task.lengths=[96]", *TINY)
    assert rc == 2, text[-3000:]
    assert "bad input, nothing was loaded: 4 of the 12 jobs of this sweep are refused, so none was started:" in text
    refused = re.findall(r"^  #(\d+) (.*?): (\w+): group_size=128 must divide head_dim=64", text, re.M)
    assert refused == [("4", "method=oscar method.group_size=128 method.residual_length=128", "oscar"),
                       ("5", "method=oscar method.group_size=128 method.residual_length=256", "oscar"),
                       ("10", "method=kivi method.group_size=128 method.residual_length=128", "kivi"),
                       ("11", "method=kivi method.group_size=128 method.residual_length=256", "kivi")]
    assert "Launching" not in text and "Traceback" not in text
    assert not (tmp_path / "runs").exists() and not (tmp_path / "sweep").exists()


def test_a_failed_job_does_not_stop_the_sweep_which_names_it_at_the_end(tmp_path):
    """Job #0 passes the preflight but fails after its weights load (a vision-language model's NIAH prompt is
    measured as the task builds it: 56 tokens cannot hold its 61-token needle prompt); job #1 still runs, and the
    sweep ends naming #0, exit code 1. The folder is logged at the start and at the end."""
    rc, text = multirun(tmp_path, "model=tiny-qwen3-vl", "method=fp16", "task.lengths=[56],[96]", *TINY)
    assert rc == 1, text[-3000:]
    sweep = tmp_path / "sweep"
    lines = [line for line in text.splitlines() if "sweep folder: " in line]
    assert len(lines) == 2 and all(f"sweep folder: {sweep}" in line for line in lines)
    assert "(2 jobs checked, 0 already finished" in lines[0] and f"python scripts/sweep_summary.py {sweep}" in lines[0]
    assert "1 of its 2 jobs did not finish" in lines[1]
    assert "\t#0 : model=tiny-qwen3-vl method=fp16 task.lengths=[56]" in text          # Hydra's job #0
    assert re.search(r"^  #0 task.lengths=\[56\]: no .*/metrics.json$", text, re.M)
    assert "this job failed, the sweep goes on with the others (HYDRA_FULL_ERROR=1 shows the traceback): " \
           "ValueError: niah: task.lengths [56] are shorter than" in text
    finished = list((tmp_path / "runs").rglob("metrics.json"))
    assert len(finished) == 1 and ",96@0," in (sweep / "rows.csv").read_text()

    rc, again = multirun(tmp_path, "model=tiny-qwen3-vl", "method=fp16", "task.lengths=[96]", *TINY)
    assert rc == 0, again[-3000:]
    assert "(1 jobs checked, 1 already finished" in again and "sweep folder: " in again.splitlines()[-1]


def test_jobs_are_listed_in_the_basic_sweepers_order(tmp_path):
    """sweep_params first, then the command line's overrides, the last key varying fastest (Hydra's
    BasicSweeper.split_arguments), and the swept values name each job."""
    from hydra.core.global_hydra import GlobalHydra

    from oscar.sweeps import job_config, sweep_jobs

    with initialize_config_dir(version_base="1.3", config_dir=str(REPO_ROOT / "conf")):
        config = compose("config", overrides=["+experiment=ablation", f"runs_dir={tmp_path}"],
                         return_hydra_config=True)
        with open_dict(config):  # what `run.py -m +experiment=ablation method.group_size=32,64` hands the callback
            config.hydra.overrides.task = ["+experiment=ablation", "method.group_size=32,64", f"runs_dir={tmp_path}"]
        assert GlobalHydra.instance().is_initialized()
        jobs = sweep_jobs(config)
        assert [swept for swept in swept_values(jobs)] == [
            f"method.rotate={r} method.scale={s} method.group_size={g}"
            for r in (True, False) for s in (True, False) for g in (32, 64)]
        assert job_config(config, jobs[-1]).method.group_size == 64 and "hydra" not in job_config(config, jobs[0])


def test_the_end_of_a_sweep_names_each_unfinished_job(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="oscar.sweeps")
    done, failed = tmp_path / "done", tmp_path / "failed"
    done.mkdir()
    (done / "metrics.json").write_text("{}")
    check = SweepCheck(tasks=None)
    check.jobs = [Job(0, "method=kivi", done), Job(1, "method=oscar", failed)]
    config = compose_sweep(tmp_path)
    with pytest.raises(SystemExit) as ended:
        check.on_multirun_end(config)
    assert ended.value.code == 1
    assert f"  #1 method=oscar: no {failed}/metrics.json" in caplog.text and "#0" not in caplog.text
    check.jobs = check.jobs[:1]
    check.on_multirun_end(config)                                         # every job finished: no exit
    assert f"sweep folder: {tmp_path / 'sweep'} (1 jobs finished" in caplog.text


def compose_sweep(tmp_path: Path):
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO_ROOT / "conf")):
        return compose("config", overrides=[f"hydra.sweep.dir={tmp_path / 'sweep'}"], return_hydra_config=True)
