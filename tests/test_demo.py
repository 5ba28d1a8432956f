"""What `make demo` reports: the caches' real stored bytes per token (KVModel -> the run's rows), and the sweep's
summary block (scripts/sweep_summary.py): headline numbers, bytes and their ratio to fp16, the sentence, the figures."""

from __future__ import annotations

import copy
import json

import pytest

from oscar import build_method
from oscar.lm import KVModel
from oscar.results import append_rows
from oscar.runner import KV_BYTES_METRIC, storage_rows
from scripts.sweep_summary import main, summary

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


@pytest.fixture(scope="module")
def tiny():
    from oscar.models import load_model

    return load_model("tiny-llama", device="cpu")


def test_generate_adds_up_the_real_bytes_each_cache_stored(tiny):
    """fp16 stores every token of every layer's K and V as is (tiny-llama: 2 layers x 2 KV heads x 64, float32);
    KIVI's packed bytes and residual window are what its cache reports (``nbytes``), over every generation."""
    model, tokenizer = tiny
    prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
    fp16 = KVModel(copy.deepcopy(model), tokenizer, build_method("fp16"))
    fp16.generate([PROMPT], 5)
    assert fp16.stored_tokens == prompt_tokens + 4                      # the last new token is never fed back
    assert fp16.stored_bytes == fp16.stored_tokens * 2 * 2 * 2 * 64 * 4
    kivi = KVModel(copy.deepcopy(model), tokenizer, build_method("kivi", residual_length=32))
    kivi.generate([PROMPT], 5)
    first = kivi.engine.last_cache.nbytes
    kivi.generate([PROMPT, PROMPT[:60]], 5)                              # a padded batch of two
    assert kivi.stored_bytes == first + kivi.engine.last_cache.nbytes
    assert kivi.stored_bytes < fp16.stored_bytes * kivi.stored_tokens / fp16.stored_tokens / 3
    (row,) = storage_rows((kivi.stored_bytes, kivi.stored_tokens))
    assert row == dict(subset="all", metric=KV_BYTES_METRIC, value=kivi.stored_bytes / kivi.stored_tokens,
                       n=kivi.stored_tokens)
    assert storage_rows(None) == storage_rows((0, 0)) == []  # nothing generated, or nothing recorded


def _sweep(tmp_path, scores: dict[str, tuple[float, float, float]]) -> list[dict]:
    """Rows of a NIAH sweep on smollm2-135m, each method a run of 2 cells: (score, exact, bytes per token)."""
    rows = []
    for method, (score, exact, per_token) in scores.items():
        config = json.dumps({"name": method, **build_method(method).hyperparameters()}, sort_keys=True)
        base = dict(model="smollm2-135m", method=method, bits=2, group_size=32, residual_length=128, task="niah",
                    run_id=f"id-{method}", config=config, task_config="")
        for metric, value in (("score", score), ("exact", exact)):
            rows += [{**base, "subset": cell, "metric": metric, "value": value, "n": 1}
                     for cell in ("1024@0", "2048@0")]
            rows.append({**base, "subset": "all", "metric": metric, "value": value, "n": 2})
        rows.append({**base, "subset": "all", "metric": KV_BYTES_METRIC, "value": per_token, "n": 3000})
        folder = tmp_path / "runs" / "niah" / "smollm2-135m" / f"{method}-id-{method}"
        folder.mkdir(parents=True)
        (folder / "niah_heatmap.png").write_bytes(b"png")
    append_rows(tmp_path / "sweep" / "rows.csv", rows)
    return rows


def test_summary_block_reads_the_sweep(tmp_path, capsys):
    _sweep(tmp_path, {"fp16": (80.0, 60.0, 46080.0), "kivi": (40.0, 20.0, 7680.0), "oscar": (72.0, 50.0, 7200.0)})
    assert main([str(tmp_path / "sweep"), "--runs-dir", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "niah on smollm2-135m: 3 run(s) of this sweep"
    assert lines[1] == "| method | niah score | niah exact | KV bytes / token | vs fp16 |"
    assert lines[3:6] == ["| fp16 | 80.00 | 60.00 | 46,080 | 1.00x |", "| kivi | 40.00 | 20.00 | 7,680 | 0.17x |",
                          "| oscar | 72.00 | 50.00 | 7,200 | 0.16x |"]
    assert lines[6] == ("oscar reaches niah score 72.00, 90% of fp16's 80.00, with 6.4x fewer KV bytes per token; "
                        "kivi 40.00 (50%) with 6.0x fewer.")
    assert lines[7] == ("fp16: K and V unquantized in the model's dtype, 4 bytes per value (30 layers x 3 KV heads "
                        "x 64, K and V).")                              # 46,080 / (2 x 30 x 3 x 64): float32
    assert lines[8] == f"Figures: {tmp_path}/runs/niah/smollm2-135m/{{fp16-id-fp16,kivi-id-kivi,oscar-id-oscar}}/" \
                       "niah_heatmap.png"
    assert len(lines) == 9


def test_summary_without_fp16_or_bytes_says_so(tmp_path):
    rows = [r for r in _sweep(tmp_path, {"kivi": (40.0, 20.0, 7680.0), "oscar": (72.0, 50.0, 7200.0)})
            if r["metric"] != KV_BYTES_METRIC]
    text = summary(rows, tmp_path / "runs").splitlines()
    assert "| kivi | 40.00 | 20.00 | – | – |" in text
    assert "No fp16 line in this sweep to compare with; the best niah score: oscar 72.00." in text
    assert any(line.startswith("KV bytes –: the run stored no figure") for line in text)
    assert main([str(tmp_path / "nothing")]) == 1
