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
from scripts.bench_user_path import run, shape, sync_sites
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
