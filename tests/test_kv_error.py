"""KV diagnostics: errors vs full precision, bits from real buffers, TNI/sink statistics, resume."""

import copy
import json
import math

import pytest
import torch

import evals.kv_error as kv_error_module
from evals import build_task
from evals.kv_error import (ReferenceCache, causal_attention, layer_diagnostics, relative_error, tni_stats,
                            token_norms)
from oscar import build_method
from oscar.attention import record_attention
from oscar.lm import KVModel, cache_argument
from oscar.weights import attention_modules

LENGTH = 256


def run_kv_error(tiny, corpus, run_dir, method, **hp):
    model, tokenizer = tiny
    lm = KVModel(copy.deepcopy(model), tokenizer, build_method(method, **hp))
    task = build_task("kv_error", path=str(corpus), length=LENGTH, heatmap_tokens=16)
    task.check()
    return task.run(lm, run_dir)


def mean_rows(result) -> dict[str, float]:
    return {r["metric"]: r["value"] for r in result.rows if r["subset"] == "mean"}


def test_fp16_has_no_error_and_stores_model_dtype(tiny, corpus, tmp_path):
    result = run_kv_error(tiny, corpus, tmp_path, "fp16")
    means = mean_rows(result)
    assert means["k_rel_err"] == means["v_rel_err"] == means["attn_rel_err"] == 0.0
    assert means["k_bits_per_value"] == means["v_bits_per_value"] == 32.0  # tiny-llama runs in float32
    subsets = {r["subset"] for r in result.rows}
    assert subsets == {"layer0", "layer1", "mean"}
    assert {r["metric"] for r in result.rows} == set(kv_error_module.METRICS)
    assert all(r["n"] == LENGTH for r in result.rows)
    for figure in result.figures:
        assert figure.stat().st_size > 1000 and figure.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("method", ["kivi", "oscar"])
def test_errors_positive_and_shrink_with_bits(tiny, corpus, tmp_path, method):
    two = mean_rows(run_kv_error(tiny, corpus, tmp_path / "2", method))
    four = mean_rows(run_kv_error(tiny, corpus, tmp_path / "4", method, k_bits=4, v_bits=4))
    for metric in ("k_rel_err", "v_rel_err", "attn_rel_err"):
        assert 0 < four[metric] < two[metric] < 1.5, metric
    # TNI statistics describe the raw keys: the same whatever the bits
    assert four["tni_ratio_mean"] == two["tni_ratio_mean"] >= 1


def test_reference_attention_matches_the_model(tiny, corpus):
    """The attention recomputed from the recorded q, K, V equals the model's own (GQA, causal mask,
    scaling), in OScaR's rotated space too."""
    model, tokenizer = tiny
    lm = KVModel(copy.deepcopy(model), tokenizer, build_method("oscar"))
    ids = torch.tensor(tokenizer(corpus.read_text()[:4000])["input_ids"][:LENGTH])
    cache = ReferenceCache(lm.method)
    with torch.no_grad(), record_attention(lm.model) as records:
        lm.model(input_ids=ids[None], **cache_argument(lm.model, cache))
    for attn in attention_modules(lm.model):
        i = attn.layer_idx
        k, v = cache.raw[i]
        record = records[i][0]
        assert torch.allclose(record["key"], lm.method.transform_key(k, i))
        _, out = causal_attention(record["query"], lm.method.transform_key(k, i), v, attn.scaling)
        assert torch.allclose(out.transpose(1, 2), record["output"], atol=1e-5, rtol=1e-4)


def test_bits_per_value_from_real_buffers():
    """OScaR 2-bit, G=32, D=64, H_kv=2: codes 2 bits + scale and zero per (channel, 32 tokens) in the
    model dtype + one fp32 norm per token over H_kv * D values; values: per-token groups of 32 channels."""
    torch.manual_seed(0)
    method = build_method("oscar", k_bits=2, v_bits=2, group_size=32)
    b, h, t, d = 1, 2, 128, 64
    for dtype in (torch.float32, torch.float16):
        k, v = torch.randn(b, h, t, d, dtype=dtype), torch.randn(b, h, t, d, dtype=dtype)
        q = torch.randn(b, 2 * h, t, d)
        stats = layer_diagnostics(method, 0, q, k, v, d ** -0.5, 0.5, 8)
        param_bits = 8 * torch.finfo(dtype).bits // 8
        assert stats["k_bits_per_value"] == 2 + 2 * param_bits / 32 + 32 / (h * d)
        assert stats["v_bits_per_value"] == 2 + 2 * param_bits / 32
        packed = method.quantize_keys(k, 0)
        assert packed.nbytes == t * h * d * 2 // 8 + 2 * h * (t // 32) * d * param_bits // 8 + 4 * t


def test_tni_ratio_and_sinks_on_constructed_keys():
    torch.manual_seed(0)
    t, g = 64, 32
    norms = torch.linspace(1, 2, t)[None]
    norms[0, 5] = 0.25
    mean, worst = tni_stats(norms, g)
    first, second = norms[0, :g].max() / 0.25, norms[0, g:].max() / norms[0, g:].min()
    assert worst == pytest.approx(first.item())
    assert mean == pytest.approx((first + second).item() / 2)

    # keys with one low-norm token; queries so small that attention is uniform over visible tokens
    k = torch.randn(1, 2, t, 64)
    k[:, :, 0] *= 0.05
    v = torch.randn(1, 2, t, 64)
    q = 1e-6 * torch.randn(1, 4, t, 64)
    stats = layer_diagnostics(build_method("kivi"), 0, q, k, v, 0.125, 0.5, 8)
    assert stats["sink_tokens"] == 1 and stats["sink_positions"] == [0]
    harmonic = sum(1 / (i + 1) for i in range(t))  # query i gives token 0 a share 1/(i+1)
    assert stats["sink_attention_mass"] == pytest.approx(harmonic / t, rel=1e-4)
    median = token_norms(k).median()
    assert stats["norm_over_median"][0] == pytest.approx((token_norms(k)[0, 0] / median).item())


def test_relative_error_is_scale_free():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 8)
    noise = 0.1 * torch.randn_like(x)
    assert relative_error(x + noise, x) == pytest.approx(relative_error(10 * (x + noise), 10 * x), rel=1e-6)
    assert relative_error(x + noise, x) == pytest.approx((noise.norm() / x.norm()).item(), rel=1e-5)


def test_resume_skips_the_model_when_every_layer_is_logged(tiny, corpus, tmp_path, monkeypatch):
    first = run_kv_error(tiny, corpus, tmp_path, "oscar")
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["key"] for r in records] == ["layer0", "layer1"]

    def no_forward(*args, **kwargs):
        raise AssertionError("the reference pass ran although every layer was logged")

    monkeypatch.setattr(kv_error_module, "reference_pass", no_forward)
    again = run_kv_error(tiny, corpus, tmp_path, "oscar")
    assert again.metrics == first.metrics and again.rows == first.rows


def test_length_is_cut_to_whole_groups(tiny, corpus, tmp_path):
    model, tokenizer = tiny
    lm = KVModel(copy.deepcopy(model), tokenizer, build_method("kivi", group_size=64, residual_length=128))
    result = build_task("kv_error", path=str(corpus), length=200).run(lm, tmp_path)
    assert result.metrics["tokens"] == 192
    assert math.isfinite(result.metrics["attn_rel_err"])


def test_clear_errors_before_any_model(tmp_path):
    with pytest.raises(FileNotFoundError):
        build_task("kv_error", path=str(tmp_path / "missing.txt")).check()
    with pytest.raises(ValueError, match="sink_fraction"):
        build_task("kv_error", sink_fraction=1.5).check()
    with pytest.raises(ValueError, match="length"):
        build_task("kv_error", length=1).check()
