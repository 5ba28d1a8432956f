"""The prefill_census question: the dispatch-mode count of operations and bytes (against hand counts), and its rows on
tiny-llama (results/efficiency/prefill_census.csv is the 8B architecture's)."""

from __future__ import annotations

import csv
import logging

import pytest
import torch

from benchmarks.__main__ import main
from benchmarks.prefill_census import Census, prefix_bytes


def test_the_census_counts_computing_operations_and_their_bytes_once_each():
    a, b = torch.randn(1000), torch.randn(1000)
    scalar = torch.randn(1)
    with Census() as counted:
        c = a + b  # reads 2 x 4000 bytes, writes 4000
        c.view(10, 100).transpose(0, 1)  # views: no operation, no bytes
        d = a * scalar.expand(1000)  # a broadcast input counts its stored 4 bytes
        d.add_(d)  # an argument passed twice is read once; in place, it is written too
    assert counted.ops == 3
    assert counted.bytes == 3 * 4000 + (4000 + 4 + 4000) + 2 * 4000
    assert sum(counted.by_line.values()) == counted.bytes and sum(counted.ops_by_line.values()) == 3


def test_unknown_method_is_refused_before_any_model_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["prefill_census", "--out", str(tmp_path), "--model", "tiny-llama", "--methods", "no-such-method"])
    assert "kivi" in capsys.readouterr().err  # the error lists the known methods
    assert not (tmp_path / "prefill_census.csv").exists()


def test_census_rows_on_tiny_llama(tmp_path, caplog, monkeypatch):
    """KIVI's and RotateKV's four calls, each read back through a kernel on backend=cupy; then RotateKV's as a variant
    without its dequantize kernels would read its stored prefix: the read-back from its storage layouts counted, and
    its bytes over a chunked prefill projected."""
    from kernels.variants.rotatekv import RotateKVVariant

    args = ["--model", "tiny-llama", "--tokens", "64", "--batch", "2", "--prompt", "256", "--chunk", "64"]
    with caplog.at_level(logging.INFO, logger="benchmarks.prefill_census"):
        main(["prefill_census", "--out", str(tmp_path), "--methods", "kivi", "rotatekv", *args])
    rows = list(csv.DictReader((tmp_path / "prefill_census.csv").open()))
    by = {(r["method"], r["call"]): r for r in rows}
    assert [(r["method"], r["call"]) for r in rows] == [
        (method, f"{call}_{stream}") for method in ("kivi", "rotatekv") for stream in ("keys", "values")
        for call in ("quantize", "dequantize")]
    assert all(r["model"] == "tiny-llama" and r["question"] == "prefill_census" for r in rows)
    for r in rows:
        assert int(r["ops"]) > 0 and float(r["bytes_per_token"]) == pytest.approx(int(r["bytes"]) / (2 * 64))
    # a (de)quantize reads or writes the tokens and their codes at least: more than the chunk's own bytes
    assert all(float(r["passes"]) > 1 for r in rows)
    # RotateKV's keys undo RoPE, rotate and permute on the way in and out: more operations and bytes than KIVI's
    for call in ("quantize_keys", "dequantize_keys"):
        assert int(by["rotatekv", call]["ops"]) > int(by["kivi", call]["ops"])
        assert int(by["rotatekv", call]["bytes"]) > int(by["kivi", call]["bytes"])
    assert all(r["cupy_reads_packed"] == "True" for r in rows if r["call"].startswith("dequantize"))
    assert not any("torch read of the stored prefix" in r.getMessage() for r in caplog.records)

    monkeypatch.setattr(RotateKVVariant, "reads_packed", lambda self, stream: False)
    with caplog.at_level(logging.INFO, logger="benchmarks.prefill_census"):
        main(["prefill_census", "--out", str(tmp_path / "torch"), "--methods", "rotatekv", *args])
    rows = list(csv.DictReader((tmp_path / "torch" / "prefill_census.csv").open()))
    by = {(r["method"], r["call"]): r for r in rows}
    assert [r["call"] for r in rows] == ["quantize_keys", "load_packed_keys", "dequantize_keys", "quantize_values",
                                         "load_packed_values", "dequantize_values"]
    # the read-back moves packed codes and parameters alone
    read_back, dequantized = (float(by["rotatekv", f"{call}_values"]["passes"])
                              for call in ("load_packed", "dequantize"))
    assert 0 < read_back < dequantized
    assert by["rotatekv", "dequantize_keys"]["cupy_reads_packed"] == "False"
    assert by["rotatekv", "load_packed_keys"]["cupy_reads_packed"] == "False"
    # chunks 1..3 read 64, 128, 192 tokens of the prefix
    projected = prefix_bytes([{**r, "bytes_per_token": float(r["bytes_per_token"]),
                               "cupy_reads_packed": r["cupy_reads_packed"] == "True"} for r in rows], 256, 64)
    per_token = sum(float(by["rotatekv", f"{call}_{stream}"]["bytes_per_token"])
                    for call in ("load_packed", "dequantize") for stream in ("keys", "values"))
    assert list(projected) == ["rotatekv"] and projected["rotatekv"] == pytest.approx(384 * per_token)
    assert any("rotatekv: its torch read of the stored prefix" in r.getMessage() for r in caplog.records)


def test_a_chunk_of_no_tokens_is_refused_by_the_parser(tmp_path):
    with pytest.raises(SystemExit):
        main(["prefill_census", "--out", str(tmp_path), "--chunk", "0"])
    assert not (tmp_path / "prefill_census.csv").exists()
