"""scripts/bench_user_path.py on a CPU (tiny-llama, tiny shapes): every part writes its rows, ratios against fp16 of
the same run, decode rows after real prefills. The H200 numbers are results/efficiency/user_path*.csv."""

from __future__ import annotations

import argparse
import csv
import math

from scripts.bench_user_path import run, shape


def test_user_path_rows_on_a_cpu(tmp_path):
    args = argparse.Namespace(out=tmp_path, model="tiny-llama", prefill=[shape("96x2")], decode=[shape("64x1")],
                              chunk=32, kernels=[], mirrors=["kivi"], steps=2, budget=600.0)
    run(args)
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
