"""Sweeps and scale-out: every experiment config composes; a two-job multirun through the
submitit_local launcher; a killed run restarted with the same command recomputes nothing finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oscar.paths import REPO_ROOT as REPO

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def sweep_values(params) -> dict[str, list[str]]:
    """Each swept key's values as Hydra's basic sweeper expands them (lists, ranges, glob over a group)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(REPO / "conf")))
    parser = OverridesParser.create(config_loader=loader)
    values = {}
    for key, value in params.items():
        (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides([f"{key}={value}"]), None)
        values[key] = [job[0].split("=", 1)[1] for job in jobs]
    return values


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_with_a_sweep(experiment):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = compose("config", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
    params = dict(cfg.hydra.sweeper.params)
    assert params, f"{experiment}: no hydra.sweeper.params"
    for key, values in sweep_values(params).items():
        assert len(values) >= 2, f"{experiment}: {key} sweeps a single value"


def test_expected_sweeps():
    from hydra import compose, initialize_config_dir

    from oscar import available_methods

    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        gxr = compose("config", overrides=["+experiment=sweep_gxr"], return_hydra_config=True)
        ablation = compose("config", overrides=["+experiment=ablation"], return_hydra_config=True)
        table1 = compose("config", overrides=["+experiment=table1"], return_hydra_config=True)
    assert gxr.hydra.sweeper.params["method.group_size"] == "32,64,128"
    assert ablation.method.name == "oscar" and set(ablation.hydra.sweeper.params) == {"method.rotate", "method.scale"}
    assert table1.task.name == "longbench_e"
    assert sweep_values(table1.hydra.sweeper.params)["method"] == available_methods()  # Table 1: every method


def tiny_niah_args(tmp_path: Path) -> list[str]:
    return ["model=tiny-llama", "task=niah", "task.lengths=[96,160]", "task.depths=[0,50,100]",
            "task.max_new_tokens=4", "logger=files", f"runs_dir={tmp_path / 'runs'}",
            f"results_file={tmp_path / 'rows.csv'}", f"hydra.run.dir={tmp_path / 'hydra'}",
            f"hydra.sweep.dir={tmp_path / 'multirun'}"]


def test_two_job_multirun_through_submitit_local(tmp_path):
    args = [sys.executable, "run.py", "-m", *tiny_niah_args(tmp_path), "task.lengths=[96]", "method=fp16,kivi",
            "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=20"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = (tmp_path / "rows.csv").read_text()
    assert ",fp16," in rows and ",kivi," in rows
    assert len(list((tmp_path / "runs" / "niah" / "tiny-llama").glob("*/metrics.json"))) == 2
    sweep_rows = (tmp_path / "multirun" / "rows.csv").read_text()  # the sweep's own table (run.py logs it)
    assert ",fp16," in sweep_rows and ",kivi," in sweep_rows
    assert list((tmp_path / "multirun").rglob("*submitit*")) or list((tmp_path / "multirun").rglob("*.pkl"))


def test_killed_run_resumes_without_recomputing(tmp_path):
    command = [sys.executable, "run.py", *tiny_niah_args(tmp_path), "method=oscar", "method.residual_length=32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    deadline = time.time() + 600
    predictions = None
    while time.time() < deadline and proc.poll() is None:
        found = list((tmp_path / "runs").rglob("predictions.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 2:
            predictions = found[0]
            break
        time.sleep(0.2)
    assert predictions is not None and proc.poll() is None, "the run finished or failed before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [json.loads(l) for l in predictions.read_text().splitlines() if l.endswith("}")]
    assert not (predictions.parent / "metrics.json").exists()

    subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env, check=True)
    after = [json.loads(l) for l in predictions.read_text().splitlines() if l.strip().endswith("}")]
    keys = [r["key"] for r in after]
    assert sorted(set(keys)) == sorted(f"{l}@{d}#0" for l in (96, 160) for d in (0, 50, 100))
    assert all(keys.count(r["key"]) == 1 for r in before)          # finished cells were not recomputed
    assert after[:len(before)] == before
    assert (predictions.parent / "metrics.json").exists()

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env, check=True)
    assert "skipping finished run" in again.stderr + again.stdout
