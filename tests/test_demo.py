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
    assert lines[6] == ("oscar: niah score 72.00 (90% of fp16's 80.00), niah exact 50.00 (83% of fp16's 60.00); "
                        "6.4x fewer KV bytes per token than fp16's float32 cache, 3.2x fewer than a 16-bit cache. "
                        "kivi: niah score 40.00 (50%), niah exact 20.00 (33%); 6.0x and 3.0x fewer.")
    assert lines[7] == ("fp16 stores K and V unquantized in the model's dtype: 4 bytes per value (float32, the "
                        "model's dtype on a CPU), 30 layers x 3 KV heads x 64, K and V.")  # 46,080 / (2 x 30 x 3 x 64)
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


def test_a_runs_heatmap_names_its_model_and_method(tmp_path):
    """The heatmap each NIAH run writes (what the demo points to) says whose grid it is, model and method, and what
    its colours measure; a missing cell is blank, not 'nan'."""
    from evals.niah import heatmap_figure, method_words, plot_heatmap

    assert method_words(build_method("oscar")) == "oscar K2 V2 G=32 R=128"
    assert method_words(build_method("kivi", k_bits=1, v_bits=2, group_size=64)) == "kivi K1 V2 G=64 R=128"
    assert method_words(build_method("fp16")) == "fp16"
    scores = {(1024, 0.0): 100.0, (1024, 50.0): 14.3, (2048, 0.0): 42.9}
    fig = heatmap_figure(scores, "NIAH smollm2-135m / oscar K2 V2 G=32 R=128")
    image_ax, bar_ax = fig.axes
    assert image_ax.get_title() == "NIAH smollm2-135m / oscar K2 V2 G=32 R=128"
    assert bar_ax.get_ylabel() == "score (ROUGE-1 recall of the needle, %)"
    assert sorted(t.get_text() for t in image_ax.texts) == ["100", "14", "43"]   # (2048, 50) is blank
    path = plot_heatmap(scores, tmp_path / "niah_heatmap.png", "t")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_make_demo_computes_its_sweep_and_shows_its_summary_only():
    """`make demo` runs its sweep and prints its summary: no rebuild of every table, figure and Pareto probe of the
    committed results (`make tables`), which it never shows."""
    import subprocess

    from oscar.paths import REPO_ROOT

    plan = subprocess.run(["make", "-n", "demo"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    steps = [line for line in plan.stdout.splitlines() if ".venv/bin/python" in line]
    assert [line.split()[1] for line in steps] == ["run.py", "scripts/sweep_summary.py"]
    assert "-m method=fp16,kivi,oscar hydra.sweep.dir=multirun/demo" in steps[0]
