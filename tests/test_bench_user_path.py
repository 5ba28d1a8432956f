"""scripts/bench_user_path.py on a CPU (tiny-llama, tiny shapes): every part writes its rows, ratios against fp16 of
the same run, decode rows after real prefills, methods that fold a value rotation one after another on one model.
The H200 numbers are results/efficiency/user_path*.csv."""

from __future__ import annotations

import argparse
import copy
import csv
import logging
import math

import torch

from oscar.weights import value_output_parameters
from scripts import efficiency_figures
from scripts.bench_e2e import prepare_fresh
from scripts.bench_generate import _method
from scripts.bench_user_path import decode_profile, host_table, run, shape, sync_sites
from tests.conftest import build_tiny


def test_user_path_rows_on_a_cpu(tmp_path, caplog):
    args = argparse.Namespace(out=tmp_path, model="tiny-llama", prefill=[shape("96x2")], decode=[shape("64x1")],
                              chunk=32, kernels=[], mirrors=["kivi", "oscar", "spectral"], steps=2,
                              budget=600.0, profile=True)
    with caplog.at_level(logging.INFO, logger="bench_user_path"):
        run(args)
    profiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile of ")]
    assert len(profiles) == 4 and all("Self CPU" in text and "aten::" in text for text in profiles)
    rows = list(csv.DictReader((tmp_path / "user_path.csv").open()))
    parts = [(r["part"], r["method"], r["chunk"]) for r in rows]
    assert ("hf_forward", "fp16", "0") in parts
    assert ("prefill", "fp16", "0") in parts and ("prefill", "fp16", "32") in parts  # whole and chunked
    assert ("prefill", "kivi", "32") in parts and ("decode", "kivi", "32") in parts
    for r in rows:
        if r["method"] == "fp16" and r["part"] in ("prefill", "decode"):
            assert float(r["vs_fp16"]) == 1.0
        if r["part"] == "decode":
            assert float(r["ms_per_token"]) > 0 and not math.isnan(float(r["vs_fp16"]))
    assert ("decode", "spectral", "32") in parts  # after OScaR's Hadamard fold on the same model
    written = efficiency_figures.build(tmp_path)  # make tables: the table and the figure of these rows
    assert tmp_path / "figure_user_path.png" in written and (tmp_path / "figure_user_path.png").stat().st_size > 0
    assert "kivi (torch)" in (tmp_path / "tables.md").read_text()


def test_sync_sites_count_lines_of_synchronizing_operations():
    """The profile's host-sync lines: one count per synchronizing warning, repository paths relative to it, other
    warnings ignored."""
    import warnings

    from oscar.paths import REPO_ROOT

    def warning(message, filename, lineno):
        return warnings.WarningMessage(message, UserWarning, filename, lineno)

    here = str(REPO_ROOT / "kernels" / "cupy_flush.py")
    caught = [warning("called a synchronizing CUDA operation", here, 70),
              warning("called a synchronizing CUDA operation", here, 70),
              warning("called a synchronizing CUDA operation", "/usr/lib/torch/functional.py", 9),
              warning("deprecated argument", here, 12)]
    assert sync_sites(caught) == {"kernels/cupy_flush.py:70": 2, "torch/functional.py:9": 1}


def test_decode_profile_splits_a_step_into_gpu_busy_and_idle_time():
    """The decode profile's head line: every op's own GPU time summed per step, against the step's wall clock."""
    from types import SimpleNamespace

    class Averages(list):  # torch.profiler's key_averages: events with their own device time (us), and a table
        def table(self, sort_by, row_limit):
            return f"ops by {sort_by}, {row_limit} rows"

    events = Averages([SimpleNamespace(self_device_time_total=3000.0), SimpleNamespace(self_device_time_total=1000.0)])
    text = decode_profile(events, steps=2, wall_ms=5.0, top=7)
    assert text.splitlines() == ["decode steps: 5.00 ms/step wall, GPU busy 2.00 ms/step (40%; idle 3.00 ms/step)",
                                 "ops by self_device_time_total, 7 rows"]


def test_step_events_split_a_decode_into_steps_and_the_time_between_them():
    """StepEvents: each step's own time (its events' span) and the gaps between one step's end and the next one's
    start, from recorded event pairs (here stand-ins whose elapsed_time subtracts timestamps in ms)."""
    from scripts.bench_user_path import StepEvents

    class Event:
        def __init__(self, at):
            self.at = at

        def elapsed_time(self, later):
            return later.at - self.at

    events = StepEvents()
    assert events.split() == {}  # a CPU run records none
    events.pairs = [(Event(0.0), Event(8.0)), (Event(9.0), Event(17.0)), (Event(20.0), Event(29.0))]
    assert events.split() == {"step_ms": 25.0 / 3, "between_ms": 2.0}


def test_host_table_lists_functions_by_their_own_time_with_repository_paths():
    import cProfile

    from oscar.paths import REPO_ROOT

    host = cProfile.Profile()
    with host:
        assert shape("32768x4") == (32768, 4)
    text = host_table(host, 5)
    assert "tottime" in text and "scripts/bench_user_path.py" in text and str(REPO_ROOT) not in text


def test_each_method_folds_into_the_weights_as_built():
    """OScaR's Hadamard, then OSCAR's rotation, then OScaR again on one model: each leaves the value and output
    projections exactly as that method alone leaves a fresh copy of the model."""
    model = build_tiny("tiny-llama")
    fresh = copy.deepcopy(model)
    oscar, spectral = _method("oscar", model), _method("spectral", model)
    for method in (oscar, spectral, oscar):
        prepare_fresh(model, method)
        alone = copy.deepcopy(fresh)
        method.prepare_model(alone)
        want = value_output_parameters(alone)
        for name, p in value_output_parameters(model).items():
            assert torch.equal(p, want[name]), (method.name, name)
    assert not all(torch.equal(p, q) for p, q in zip(value_output_parameters(model).values(),
                                                   value_output_parameters(fresh).values()))
