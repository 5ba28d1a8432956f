"""The user_path question on a CPU (tiny-llama, tiny shapes): every part writes its rows, ratios against fp16 of the
same run, decode rows after real prefills, the roofline columns from real stored bytes and the run's copy bandwidth,
the largest-batch rows, methods that fold a value rotation one after another on one model; the README table and the
figure ``make tables`` draws of them."""

from __future__ import annotations

import copy
import csv
import logging
import math

import pytest
import torch

from benchmarks import report, user_path
from benchmarks.__main__ import main
from benchmarks.harness import bench_method, prepare_fresh
from benchmarks.profiling import StepEvents, decode_profile, host_table, sync_sites
from oscar.weights import value_output_parameters
from tests.conftest import build_tiny


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> tuple[list[dict], object]:
    out = tmp_path_factory.mktemp("user_path")
    main(["user_path", "--out", str(out), "--model", "tiny-llama", "--prefill", "96x2", "--decode", "64x1",
          "--chunk", "32", "--kernels", "--mirrors", "kivi", "oscar", "spectral", "--steps", "2",
          "--max-batch-context", "64", "--memory", "0.004"])
    with (out / "user_path.csv").open() as f:
        return list(csv.DictReader(f)), out


def test_user_path_rows_on_a_cpu(rows):
    rows, _ = rows
    parts = [(r["part"], r["method"], r["chunk"]) for r in rows]
    assert ("hf_forward", "fp16", "0") in parts
    assert ("prefill", "fp16", "0") in parts and ("prefill", "fp16", "32") in parts  # whole and chunked
    assert ("prefill", "kivi", "32") in parts and ("decode", "kivi", "32") in parts
    assert ("decode", "spectral", "32") in parts  # after OScaR's Hadamard fold on the same model
    for r in rows:
        assert r["question"] == "user_path" and r["gpu"].startswith("cpu") and r["code_version"]
        assert "--model tiny-llama" in r["arguments"] and "--out" not in r["arguments"]
        if r["method"] == "fp16" and r["part"] in ("prefill", "decode", "max_batch"):
            assert float(r["vs_fp16"]) == 1.0
        if r["part"] == "decode":
            assert float(r["ms_per_token"]) > 0 and not math.isnan(float(r["vs_fp16"]))
            assert r["fused_layers"] == "off" and float(r["vs_unfused"]) == 1.0  # a CPU: transformers' modules


def test_roofline_columns_from_the_stored_bytes_and_the_runs_copy_bandwidth(rows):
    """fp16's decode rows carry the bytes a step reads (the weights a step reads in full, the cache's stored bytes)
    against the run's one copy bandwidth; a mirror's rows carry none (it reads its BF16 mirror, not what it stores)."""
    rows, _ = rows
    model = build_tiny("tiny-llama")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: the head reads the whole table
    assert user_path.weights_read(model, 2) == weights
    fp16 = [r for r in rows if r["method"] == "fp16" and r["part"] in ("decode", "max_batch")]
    assert len(fp16) == 3 and len({r["copy_gbs"] for r in fp16}) == 1
    for r in fp16:
        kv = float(r["kv_gib"]) * 2**30
        assert float(r["read_gb"]) * 1e9 == pytest.approx(weights + kv)
        assert float(r["floor_ms"]) == pytest.approx(float(r["read_gb"]) * 1e3 / float(r["copy_gbs"]))
        assert float(r["floor_frac"]) == pytest.approx(float(r["floor_ms"]) / float(r["ms_per_token"]))
        assert float(r["gbs"]) == pytest.approx(float(r["floor_frac"]) * float(r["copy_gbs"]))
        assert kv >= 2 * 2 * 2 * 64 * 4 * 64 * int(r["batch"])  # 2 layers x K, V x 2 heads x 64 x fp32 x 64 tokens
    assert all(r["read_gb"] == "" for r in rows if r["method"] == "kivi")


def test_the_largest_batches_and_their_ratios(rows):
    """Each configuration's largest batch from its allocated cache and the memory given (4 MiB here), verified by
    decoding; each method also at fp16's largest batch; throughput over fp16's, time per token over fp16's."""
    rows, _ = rows
    largest = {r["method"]: r for r in rows if r["part"] == "max_batch"}
    at_fp16 = {r["method"]: r for r in rows if r["part"] == "at_fp16_max_batch"}
    assert set(largest) == {"fp16", "kivi", "oscar", "spectral"} and set(at_fp16) == {"kivi", "oscar", "spectral"}
    fp16 = largest["fp16"]
    assert int(fp16["batch"]) > 1
    for method, r in at_fp16.items():
        assert r["batch"] == fp16["batch"]
        assert float(r["vs_fp16"]) == pytest.approx(float(fp16["ms_per_token"]) / float(r["ms_per_token"]))
        own = largest[method]
        assert float(own["vs_fp16"]) == pytest.approx(float(own["tokens_per_s"]) / float(fp16["tokens_per_s"]))


def test_the_report_draws_the_runs_table_and_figure(rows):
    _, out = rows
    written = report.build(out)
    assert out / "user_path.png" in written and (out / "user_path.png").stat().st_size > 0
    readme = (out / "README.md").read_text()
    assert "## user_path" in readme and "kivi (torch)" in readme and "`python -m benchmarks user_path --model " \
        "tiny-llama" in readme
    assert "| max_batch | fp16 (torch) |" in readme


def test_a_bad_shape_or_method_is_refused_before_any_model_is_built(capsys):
    for bad in (["--prefill", "32x0"], ["--prefill", "abc"], ["--kernels", "no-such-method"]):
        with pytest.raises(SystemExit):
            main(["user_path", "--model", "tiny-llama", *bad])
        assert "error:" in capsys.readouterr().err


def test_fused_layers_the_cpu_cannot_run_are_refused_before_any_model_is_built(monkeypatch):
    """The tiny models are built on the CPU: fused decode-step layers (CUDA kernels) refused by the option's name."""
    monkeypatch.setattr(user_path, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit, match=r"--fused-layers both: fused_layers=on runs the decode step's layers as CUDA "
                                         r"kernels on one GPU, and this model runs on cpu"):
        main(["user_path", "--model", "tiny-llama", "--fused-layers", "both"])


def test_decode_rows_compare_with_fp16_and_with_themselves_unfused_at_the_same_setting():
    """vs_fp16 against fp16's decode row of the same fused setting; vs_unfused against the configuration's own row
    with the fused layers off (NaN where it has none)."""
    def decode(method, fused, ms):
        return dict(part="decode", method=method, backend="cupy" if method != "fp16" else "torch", batch=1,
                    context=32768, chunk=0, fused_layers=fused, ms_per_token=ms)

    rows = user_path.with_ratios([decode("fp16", "on", 10.0), decode("fp16", "off", 12.0), decode("oscar", "on", 5.0),
                                  decode("oscar", "off", 8.0), decode("oscar", "merged", 4.0),
                                  decode("kivi", "on", 6.0)])
    got = {(r["method"], r["fused_layers"]): (r["vs_fp16"], r["vs_unfused"]) for r in rows}
    assert got[("oscar", "on")] == (2.0, 1.6) and got[("oscar", "off")] == (1.5, 1.0)
    assert got[("fp16", "on")] == (1.0, 1.2) and got[("oscar", "merged")][1] == 2.0
    assert math.isnan(got[("oscar", "merged")][0]) and math.isnan(got[("kivi", "on")][1])  # fp16 not merged; no off


def test_prefill_rows_compare_at_their_chunk_and_fused_setting():
    """A prefill row's vs_fp16 is fp16's seconds at the same chunk and fused setting over its own; vs_unfused its own
    configuration's at the same chunk with the fused layers off; transformers' forward against fp16's first
    whole-prompt prefill."""
    def prefill(method, fused, chunk, seconds, part="prefill"):
        return dict(part=part, method=method, backend="cupy" if method != "fp16" else "torch", batch=1,
                    context=32768, chunk=chunk, fused_layers=fused, seconds=seconds)

    rows = user_path.with_ratios([prefill("fp16", None, 0, 3.0, "hf_forward"), prefill("fp16", "merged", 0, 2.0),
                                  prefill("fp16", "merged", 8192, 2.5), prefill("fp16", "off", 8192, 3.0),
                                  prefill("oscar", "merged", 8192, 2.0), prefill("oscar", "off", 8192, 4.0),
                                  prefill("oscar", "merged", 0, 1.0)])
    got = {(r["part"], r["method"], r["fused_layers"], r["chunk"]): (r["vs_fp16"], r["vs_unfused"]) for r in rows}
    assert got[("hf_forward", "fp16", None, 0)][0] == 3.0 / 2.0
    assert got[("prefill", "fp16", "merged", 8192)] == (1.0, 3.0 / 2.5)
    assert got[("prefill", "oscar", "merged", 8192)] == (2.5 / 2.0, 2.0)
    assert got[("prefill", "oscar", "off", 8192)] == (3.0 / 4.0, 1.0)
    assert got[("prefill", "oscar", "merged", 0)][0] == 2.0 and math.isnan(got[("prefill", "oscar", "merged", 0)][1])


def test_profile_logs_where_the_prefill_time_goes(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="benchmarks.user_path"):
        main(["user_path", "--out", str(tmp_path), "--model", "tiny-llama", "--prefill", "64x1", "--decode",
              "--chunk", "32", "--kernels", "--mirrors", "kivi", "--steps", "2", "--max-batch-context", "0",
              "--profile"])
    profiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile of ")]
    assert len(profiles) == 2 and all("Self CPU" in text and "aten::" in text for text in profiles)


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
        assert user_path.shape("32768x4") == (32768, 4)
    text = host_table(host, 5)
    assert "tottime" in text and "benchmarks/user_path.py" in text and str(REPO_ROOT) not in text


def test_each_method_folds_into_the_weights_as_built():
    """OScaR's Hadamard, then OSCAR's rotation, then OScaR again on one model: each leaves the value and output
    projections exactly as that method alone leaves a fresh copy of the model."""
    model = build_tiny("tiny-llama")
    fresh = copy.deepcopy(model)
    oscar, spectral = bench_method("oscar", model), bench_method("spectral", model)
    for method in (oscar, spectral, oscar):
        prepare_fresh(model, method)
        alone = copy.deepcopy(fresh)
        method.prepare_model(alone)
        want = value_output_parameters(alone)
        for name, p in value_output_parameters(model).items():
            assert torch.equal(p, want[name]), (method.name, name)
    assert not all(torch.equal(p, q) for p, q in zip(value_output_parameters(model).values(),
                                                   value_output_parameters(fresh).values()))


def test_a_decode_step_splits_its_gpu_time_by_what_each_kernel_does():
    """split_step: cuBLAS's GEMMs, the decode attention, the methods' cache kernels, the fused layers and torch's own
    ops (the rest) each get their GPU time and operations a step; top_kernels lists them by time."""
    from types import SimpleNamespace

    from benchmarks.profiling import split_step, top_kernels

    names_us = [("nvjet_tst_64x8_64x16_2x1_v_bz_splitK_TNT", 300.0), ("sm90_xmma_gemm_bf16bf16_bf16f32", 96.0),
                ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", 4.0), ("decode_attention", 80.0),
                ("combine", 10.0), ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>", 40.0),
                ("finish_step", 6.0), ("quantize_keys", 4.0), ("rms_norm", 5.0), ("add_rms_norm", 4.0),
                ("rotary", 3.0), ("silu_mul", 2.0), ("void at::native::vectorized_elementwise_kernel<4, ...>", 7.0),
                ("Memcpy DtoD (Device -> Device)", 1.0)]
    ops = [SimpleNamespace(name=n, device_time_total=us) for n, us in names_us]
    split = split_step(ops, steps=2)
    assert split["kernels_per_step"] == pytest.approx(len(ops) / 2)
    expected_ms = dict(gemm=0.2, attention=0.065, cache=0.005, layers=0.007, torch=0.004)
    expected_kernels = dict(gemm=1.5, attention=1.5, cache=1.0, layers=2.0, torch=1.0)
    for part in expected_ms:
        assert split[f"{part}_ms"] == pytest.approx(expected_ms[part]), part
        assert split[f"{part}_kernels"] == pytest.approx(expected_kernels[part]), part
    assert sum(split[f"{p}_kernels"] for p in expected_ms) == pytest.approx(split["kernels_per_step"])
    lines = top_kernels(ops, steps=2, top=3).splitlines()
    assert len(lines) == 3 and "gemm" in lines[0] and "nvjet" in lines[0] and "decode_attention" in lines[2]
    assert lines[0].split()[0] == "0.150"


def test_recorded_ops_are_the_operations_torch_parses():
    """recorded_ops reads a finished profile's raw events: per operation name, the count and total time torch's own
    FunctionEvents give (CPU operations here; GPU operations take the same route, filtered by their device), and no
    GPU operation where none ran."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.profiling import recorded_ops

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            x = torch.tanh(x @ x * 0.01)
    got_count, got_us = Counter(), Counter()
    for op in recorded_ops(prof, "cpu"):
        got_count[op.name] += 1
        got_us[op.name] += op.device_time_total
    want_count, want_us = Counter(), Counter()
    for event in prof.events():
        want_count[event.name] += 1
        want_us[event.name] += event.cpu_time_total
    assert got_count == want_count and got_count["aten::tanh"] == 20
    assert all(got_us[name] == pytest.approx(want_us[name], rel=1e-6) for name in want_us)
    assert recorded_ops(prof, "cuda") == []


def test_the_table_and_figure_show_a_steps_split(tmp_path):
    """A decode row with its step split reads 'attention / gemm / cache / layers / torch' ms in the table and draws
    the fourth panel; a row without one reads '–'."""
    row = dict(model="llama-3.1-8b", part="decode", method="oscar", backend="cupy", fused_layers="merged", batch=1,
               context=131072, chunk=8192, ms_per_token=8.0, gemm_ms=5.5, attention_ms=1.25, cache_ms=0.25,
               layers_ms=0.5, torch_ms=0.3, gemm_gbs=2900.0, floor_ms=6.2, floor_frac=0.77, vs_fp16=1.5,
               gpu="NVIDIA H100", date="2026-12-06T00:00:00")
    assert user_path.step_split(row) == "1.25 / 5.50 / 0.25 / 0.50 / 0.30"
    assert user_path.step_split(dict(row, gemm_ms=math.nan)) == "–"
    table = user_path.table([row])
    assert "| GPU ms: attention / gemm / cache / layers / torch |" in table
    assert "| 1.25 / 5.50 / 0.25 / 0.50 / 0.30 | 2900 |" in table
    user_path.figure([row, dict(row, method="fp16", backend="torch", gemm_ms=5.6)], tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_the_figure_draws_the_newest_of_the_runs_with_the_most_methods():
    """A newer run of fewer methods (a profile of two) does not replace the picture of a run of every method; a newer
    run of as many methods does."""
    def run(date, methods):
        return [dict(part="decode", method=m, backend="cupy", gpu="NVIDIA H100", date=date, code_version="c",
                     arguments=date) for m in methods]

    full, profile = run("2026-12-06", ["fp16", "oscar", "kivi"]), run("2026-12-08", ["fp16", "spectral"])
    assert user_path.pictured_run(full + profile) == full
    newer = run("2026-12-09", ["fp16", "oscar", "rotatekv"])
    assert user_path.pictured_run(full + profile + newer) == newer
