"""Perplexity task: protocol against a direct transformers computation, quantization, data, resume."""

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import evals.perplexity as perplexity_module
from evals import build_task
from evals.perplexity import DEFAULT_WIKITEXT, load_text_rows
from oscar import build_method
from oscar.lm import KVModel
from oscar.models import load_model
from oscar.paths import REPO_ROOT as REPO
from oscar.paths import resolve_data

WINDOW = 192


def kv_model(tiny, method: str, **hp) -> KVModel:
    model, tokenizer = tiny
    return KVModel(copy.deepcopy(model), tokenizer, build_method(method, **hp))


def run_perplexity(lm, corpus, run_dir, **options):
    task = build_task("perplexity", path=str(corpus), **{"window": WINDOW, **options})
    task.check()
    return task.run(lm, run_dir)


def test_default_path_is_found_in_the_data_folders(data_file):
    expected = data_file(DEFAULT_WIKITEXT)
    assert resolve_data(DEFAULT_WIKITEXT) == expected
    build_task("perplexity").check()
    rows = load_text_rows(DEFAULT_WIKITEXT)
    assert len(rows) == 4358 and rows[1] == " = Robert Boulter = \n"


def test_fp16_matches_transformers_cross_entropy(tiny, corpus, tmp_path):
    model, tokenizer = tiny
    reference = copy.deepcopy(model)
    result = run_perplexity(kv_model(tiny, "fp16"), corpus, tmp_path, max_windows=2)

    ids = torch.tensor(tokenizer("\n\n".join(load_text_rows(str(corpus))))["input_ids"])
    assert len(ids) >= 2 * WINDOW
    with torch.no_grad():
        losses = [reference(input_ids=ids[None, i * WINDOW:(i + 1) * WINDOW],
                            labels=ids[None, i * WINDOW:(i + 1) * WINDOW]).loss for i in range(2)]
    expected = math.exp(torch.stack(losses).mean().item())
    assert result.metrics["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert result.metrics["n_tokens"] == 2 * (WINDOW - 1)
    config = model.config
    full_precision = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # K + V, fp32
    assert result.rows == [dict(subset="wikitext-head", metric="perplexity", value=result.metrics["perplexity"],
                                n=2 * (WINDOW - 1)),
                           dict(subset="wikitext-head", metric="kv_bytes_per_token", value=full_precision,
                                n=2 * WINDOW)]


def test_kv_bytes_are_the_caches_stored_bytes(tiny, corpus, tmp_path):
    """A 1-bit cache stores fewer bytes than a 2-bit one; each window's record holds the cache's nbytes after it,
    and a run resumed from records without them (an older log) has no bytes row instead of a wrong one."""
    stored = {}
    for bits in (1, 2):
        lm = kv_model(tiny, "kivi", k_bits=bits, v_bits=bits, residual_length=32)
        result = run_perplexity(lm, corpus, tmp_path / str(bits), max_windows=2)
        records = [json.loads(line) for line in (tmp_path / str(bits) / "predictions.jsonl").read_text().splitlines()]
        ids = perplexity_module.tokenize_corpus(lm, str(corpus))[:WINDOW]
        assert records[0]["kv_bytes"] == perplexity_module.window_nll(lm, ids)[1]
        stored[bits] = result.metrics["kv_bytes_per_token"]
        assert stored[bits] == sum(r["kv_bytes"] for r in records) / (2 * WINDOW)
    assert stored[1] < stored[2]
    log = tmp_path / "1" / "predictions.jsonl"
    log.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "kv_bytes"}) + "\n"
                           for line in log.read_text().splitlines()))
    again = run_perplexity(kv_model(tiny, "kivi", k_bits=1, v_bits=1, residual_length=32), corpus, tmp_path / "1",
                           max_windows=2)
    assert [r["metric"] for r in again.rows] == ["perplexity"] and "kv_bytes_per_token" not in again.metrics


def test_sixteen_bit_oscar_equals_fp16_and_two_bit_differs(tiny, corpus, tmp_path):
    """Rotation and value fusion are lossless (16-bit keys are stored unscaled): only the bits change the perplexity."""
    fp16 = run_perplexity(kv_model(tiny, "fp16"), corpus, tmp_path / "fp16", max_windows=2).metrics["perplexity"]
    lossless = run_perplexity(kv_model(tiny, "oscar", k_bits=16, v_bits=16), corpus, tmp_path / "oscar16",
                              max_windows=2).metrics["perplexity"]
    two_bit = run_perplexity(kv_model(tiny, "oscar"), corpus, tmp_path / "oscar2", max_windows=2).metrics["perplexity"]
    assert lossless == pytest.approx(fp16, rel=1e-5)
    assert abs(two_bit / fp16 - 1) > 1e-4


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", device="cpu", dtype="float32")


def test_two_bit_perplexity_not_below_fp16_on_smollm2(smollm2, corpus, tmp_path):
    """On the real model (random tiny models predict near-uniformly, where noise moves perplexity either
    way): 2-bit KIVI and OScaR cost perplexity, 4-bit OScaR less than 2-bit."""
    model, tokenizer = smollm2
    ppl = {}
    for label, name, hp in [("fp16", "fp16", {}), ("kivi", "kivi", {}), ("oscar", "oscar", {}),
                            ("oscar4", "oscar", dict(k_bits=4, v_bits=4))]:
        lm = KVModel(copy.deepcopy(model), tokenizer, build_method(name, **hp))
        ppl[label] = run_perplexity(lm, corpus, tmp_path / label, window=256, max_windows=1).metrics["perplexity"]
    assert ppl["kivi"] >= ppl["fp16"] * (1 - 1e-3)
    assert ppl["oscar"] >= ppl["fp16"] * (1 - 1e-3)
    assert ppl["oscar4"] < ppl["oscar"]


def test_quantize_prefill_puts_quantized_keys_in_attention(tiny, corpus, tmp_path, monkeypatch):
    """Every window uses a fresh cache with quantize_prefill=True."""
    lm = kv_model(tiny, "oscar")
    calls = []
    new_cache = lm.new_cache

    def spy(*args, **kwargs):
        calls.append(kwargs.get("quantize_prefill"))
        return new_cache(*args, **kwargs)

    monkeypatch.setattr(lm, "new_cache", spy)
    run_perplexity(lm, corpus, tmp_path, max_windows=3)
    assert calls == [True, True, True]


def test_txt_file_gives_the_same_text(tiny, corpus, tmp_path):
    text_file = tmp_path / "wikitext-head.txt"
    text_file.write_text("\n\n".join(load_text_rows(str(corpus))))
    lm = kv_model(tiny, "fp16")
    from_jsonl = run_perplexity(lm, corpus, tmp_path / "a", max_windows=2).metrics
    from_txt = run_perplexity(lm, text_file, tmp_path / "b", max_windows=2).metrics
    assert from_txt == from_jsonl


def test_resume_computes_only_missing_windows(tiny, corpus, tmp_path, monkeypatch):
    lm = kv_model(tiny, "kivi", residual_length=32)
    first = run_perplexity(lm, corpus, tmp_path, max_windows=3)
    log = tmp_path / "predictions.jsonl"
    lines = log.read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["window0", "window1", "window2"]
    log.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # killed while writing window1

    computed = []
    window_nll = perplexity_module.window_nll

    def counting(lm_, ids):
        computed.append(len(ids))
        return window_nll(lm_, ids)

    monkeypatch.setattr(perplexity_module, "window_nll", counting)
    resumed = run_perplexity(lm, corpus, tmp_path, max_windows=3)
    assert len(computed) == 2  # window1 (cut line) and window2; window0 is read back
    assert resumed.metrics == pytest.approx(first.metrics, rel=1e-12)
    run_perplexity(lm, corpus, tmp_path, max_windows=3)
    assert len(computed) == 2


def test_clear_errors_before_any_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        build_task("perplexity", path=str(tmp_path / "missing.jsonl")).check()
    bad = tmp_path / "text.csv"
    bad.write_text("a,b\n")
    with pytest.raises(ValueError, match=".jsonl"):
        build_task("perplexity", path=str(bad)).check()
    with pytest.raises(ValueError, match="window"):
        build_task("perplexity", window=1).check()
    with pytest.raises(ValueError, match="max_windows"):
        build_task("perplexity", max_windows=0).check()


def test_too_long_window_is_refused(tiny, corpus, tmp_path):
    lm = kv_model(tiny, "fp16")
    with pytest.raises(ValueError, match="fewer than one window"):
        run_perplexity(lm, corpus, tmp_path, window=4096)
    # the model's max_length (4096 here, as NIAH uses it), not its 8192 positions, bounds the window
    with pytest.raises(ValueError, match="exceeds the model's max_length 4096"):
        run_perplexity(lm, corpus, tmp_path, window=6000)


def test_hub_dataset_offline_fails_with_a_clear_message(tmp_path):
    code = ("from evals import build_task\n"
            "try:\n    build_task('perplexity', path=None).check()\nexcept RuntimeError as e:\n    print('ERROR', e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.startswith("ERROR could not load the hub dataset wikitext/wikitext-2-raw-v1"), out.stderr[-2000:]
    assert "path=" in out.stdout
