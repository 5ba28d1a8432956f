"""The multi_gpu question on a CPU: the architectures' plans over two H200s from their configs (weights per
GPU, KV bytes per sequence equal to what the reference cache stores), and the dry run's whole measurement loop on a
tiny model placed by the same planner, read back by the efficiency table."""

from __future__ import annotations

import pytest
import torch

import oscar
from oscar import build_method
from oscar.placement import GiB
from benchmarks import multi_gpu as bench
from benchmarks import report
from benchmarks.__main__ import main
from tests.conftest import build_tiny


@pytest.fixture(scope="module")
def plans():
    """(skeleton, placement) per architecture over 2 GPUs of 139 GiB (planned, not allocated)."""
    out = {}
    for name, fields in bench.ARCHITECTURES.items():
        config = bench.config_of(fields)
        empty = bench.skeleton(config)
        out[name] = (config, empty, bench.place(empty, 2, 139.0, name=name, check_devices=False))
    return out


def test_both_architectures_split_over_two_gpus_with_room_for_the_cache(plans):
    config, empty, placement = plans["llama-3.1-70b"]
    assert placement.weight_bytes / GiB == pytest.approx(131.42, abs=0.01)  # 70.55B parameters in bf16
    layers = bench.layer_plan(empty, placement)
    assert len(layers) == 80 and bench._layers_per_gpu(layers) == "40/40"
    config, empty, placement = plans["qwen3-omni-30b-a3b"]
    assert 55 < placement.weight_bytes / GiB < 62  # the thinker: ~31B parameters with its audio and vision towers
    layers = bench.layer_plan(empty, placement)
    assert len(layers) == 48 and set(layers) == {torch.device("cuda", 0), torch.device("cuda", 1)}
    for _, _, p in plans.values():
        assert max(p.bytes_per_device.values()) < 0.55 * p.weight_bytes  # balanced: each GPU keeps cache room


def test_kv_bytes_per_sequence_are_what_the_reference_cache_stores():
    """The prediction (the method's quantizers on one group, the residual window in full precision) equals the
    real stored bytes of the reference cache after a prefill of the same length, for fp16 and OScaR."""
    model = build_tiny("tiny-llama")
    ids = torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(0))
    for name in ("fp16", "oscar"):
        with oscar.apply(model, build_method(name)) as make_cache, torch.no_grad():
            cache = make_cache()
            model(input_ids=ids, cache=cache, use_cache=True)
        assert bench.kv_bytes_per_sequence(model.config, name, 300, torch.float32) == cache.nbytes
    llama = bench.config_of(bench.ARCHITECTURES["llama-3.1-70b"])
    assert bench.kv_bytes_per_sequence(llama, "fp16", 32768) == 10 * GiB  # 80 layers x 2 x 8 heads x 128 x 2 B
    assert 5.2 < bench.kv_bytes_per_sequence(llama, "fp16", 131072) / bench.kv_bytes_per_sequence(
        llama, "oscar", 131072) < 5.4


def test_the_predicted_batch_is_bounded_by_the_gpu_that_fills_first(plans):
    config, empty, placement = plans["qwen3-omni-30b-a3b"]
    layers = bench.layer_plan(empty, placement)
    per_sequence = bench.kv_bytes_per_sequence(config, "fp16", 131072)
    batch = bench.predicted_batch(placement, per_sequence, 139.0, layers)
    for device in placement.devices:  # the batch fits every GPU, one more does not fit some GPU
        share = sum(d == device for d in layers) / len(layers)
        free = 139 * GiB - placement.bytes_per_device[str(device)] - bench.HEADROOM
        assert batch * per_sequence * share <= free
    assert any((batch + 1) * per_sequence * sum(d == device for d in layers) / len(layers)
               > 139 * GiB - placement.bytes_per_device[str(device)] - bench.HEADROOM for device in placement.devices)


def test_the_dry_run_measures_a_tiny_model_and_the_table_reads_it(tmp_path):
    main(["multi_gpu", "--dry-run", "--out", str(tmp_path), "--models", "llama-3.1-70b"])
    plan = report.read_rows(tmp_path / "multi_gpu_plan.csv")
    assert [(r["model"], r["context"], r["gpus"]) for r in plan] == [("llama-3.1-70b", 32768, 2),
                                                                     ("llama-3.1-70b", 131072, 2)]
    assert plan[0]["weights_gib"] == pytest.approx(131.42, abs=0.01) and plan[0]["question"] == "multi_gpu"
    rows = report.read_rows(tmp_path / "multi_gpu_dry_run.csv")
    assert [r["cell"] for r in rows] == ["batch1", "batch1", "max_batch", "bf16_max_batch", "max_batch"]
    assert not (tmp_path / "multi_gpu.csv").exists()  # a dry run never writes the results file
    (tmp_path / "multi_gpu_dry_run.csv").rename(tmp_path / "multi_gpu.csv")
    report.build(tmp_path)
    table = (tmp_path / "README.md").read_text()
    assert "## multi_gpu" in table and "| tiny-llama | 300 | batch1 | oscar (torch) | 1 |" in table
