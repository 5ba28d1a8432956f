"""OSCAR (method ``spectral``): the offline rotation, its calibration, the clip and the quantizers,
the sink prefix and the ``window`` recent window, each against a simple reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from methods.spectral import (RELEASED_LLOYD_MAX_LEVELS, bit_reversal, clip_rows, query_covariance, spectral_rotation,
                              weighted_value_covariance)
from oscar import build_method
from oscar.attention import record_attention
from oscar.lm import KVModel
from oscar.method import TokenSpan
from oscar.paths import REPO_ROOT as REPO
from oscar.quant import hadamard_matrix
from tests.conftest import build_tiny
from tests.test_quant import kv_like


@pytest.fixture(scope="module")
def tokenizer():
    from oscar.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def calibration(tmp_path_factory, tokenizer, data_file) -> str:
    """The calibration script's rotations for tiny-llama, from a short text."""
    from scripts.calibrate_rotatekv import squad_text
    from scripts.calibrate_spectral import calibrate

    result = calibrate(build_tiny("tiny-llama"), tokenizer, squad_text(data_file("qa/ruler_squad_v2_dev.json")),
                       windows=2, seq_len=96)
    path = tmp_path_factory.mktemp("calibration") / "tiny-llama" / "spectral.pt"
    path.parent.mkdir()
    torch.save(result, path)
    return str(path)


def spectral(calibration: str, model=None, **hp):
    method = build_method("spectral", calibration=calibration, **hp)
    if model is not None:
        method.prepare_model(model)
    return method


# ----------------------------------------------------------------------------- the rotation


def test_bit_reversal():
    assert bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert sorted(bit_reversal(64).tolist()) == list(range(64))


def test_spectral_rotation_is_eigenvectors_then_hadamard_then_bit_reversed_eigen_order():
    d = 16
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    eigenvalues = torch.rand(d, generator=g, dtype=torch.float64) * 10
    cov = basis @ torch.diag(eigenvalues) @ basis.T
    r, e = spectral_rotation(cov)
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(e, eigenvalues.sort().values, atol=1e-10)
    u = torch.linalg.eigh(cov).eigenvectors
    uh = u @ hadamard_matrix(d, torch.float64)
    descending = torch.argsort(e, descending=True).tolist()
    br = bit_reversal(d).tolist()
    for i in range(d):  # position br[i] holds the i-th largest eigen-direction (after the Hadamard mix)
        assert torch.allclose(r[:, br[i]], uh[:, descending[i]], atol=1e-10)


def test_query_covariance_groups_the_query_heads_of_each_kv_head():
    q = torch.randn(2, 6, 5, 8, generator=torch.Generator().manual_seed(1))  # 6 query heads, 3 per KV head
    total, rows = query_covariance(q, num_kv_heads=2)
    assert rows == 2 * 3 * 5
    for h in range(2):
        ref = sum(q[b, j].double().T @ q[b, j].double() for b in range(2) for j in range(3 * h, 3 * h + 3))
        assert torch.allclose(total[h], ref, atol=1e-9)


def test_value_covariance_weights_tokens_by_their_query_score():
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    a = torch.randn(2, 8, 8, generator=g, dtype=torch.float64)
    query_cov = a @ a.transpose(1, 2)
    cov = weighted_value_covariance(k, v, query_cov)
    for h in range(2):
        w = torch.stack([k[t, h].double() @ query_cov[h] @ k[t, h].double() for t in range(40)])
        w = w / w.mean()
        ref = sum(w[t] * torch.outer(v[t, h].double(), v[t, h].double()) for t in range(40)) / 40
        assert torch.allclose(cov[h], ref, atol=1e-9)


def test_clip_is_a_quantile_of_each_rows_magnitudes():
    row = torch.tensor([[0.1, -5.0, 0.3, 2.0, -0.2, 0.05, 1.0, -0.7]])
    # index int(0.75 * 8) = 6 of sorted |x| = [.05 .1 .2 .3 .7 1 2 5] -> threshold 2.0
    assert torch.equal(clip_rows(row, 0.75), torch.tensor([[0.1, -2.0, 0.3, 2.0, -0.2, 0.05, 1.0, -0.7]]))
    assert torch.equal(clip_rows(row, 1.0), row)  # index capped at D - 1: the max, nothing clipped
    assert torch.equal(clip_rows(row, 0.0), row)  # off


# ----------------------------------------------------------------------------- quantizers


def released_uniform_int2(x: torch.Tensor, group: int) -> torch.Tensor:
    """The released uniform path, written from its description: per group scale (max-min)/3, zero -min/s,
    q = floor(x/s + zero + 0.5), x_hat = (q - zero) s, in float64 (rows already clipped)."""
    g = x.double().unflatten(-1, (-1, group))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 3
    zero = -lo / scale
    q = torch.floor(g / scale + zero + 0.5).clamp(0, 3)
    return ((q - zero) * scale).flatten(-2)


@pytest.mark.parametrize("group", [16, 64])
def test_uniform_int2_matches_the_released_formula(calibration, group):
    method = spectral(calibration, residual_length=0, sink_tokens=0, group_size=group)
    v = kv_like(1, 2, 40, 64, seed=3)  # values: not rotated by the method
    ours = method.dequantize(method.quantize_values(v, 0))
    ref = released_uniform_int2(clip_rows(v.float(), 0.92), group)
    assert torch.allclose(ours.double(), ref, atol=1e-5)
    packed = method.quantize_values(v, 0)
    assert packed.buffers["scale"].dtype == torch.float32 and packed.buffers["scale"].shape == (1, 2, 40, 64 // group)
    assert packed.nbytes == 2 * 40 * (64 // 4 + 2 * 4 * 64 // group)  # codes + fp32 scale/zero, no sinks


@pytest.mark.parametrize("levels", ["released", "exact"])
def test_lloyd_max_codes_are_standardized_cells_and_levels(calibration, levels):
    method = spectral(calibration, residual_length=0, sink_tokens=0, group_size=32, codebook="lloyd_max",
                      lloyd_max_levels=levels)
    v = kv_like(1, 1, 30, 64, seed=4)
    x = clip_rows(v.float(), 0.92).unflatten(-1, (2, 32))
    mean, std = x.mean(-1, keepdim=True), x.std(-1, unbiased=False, keepdim=True)
    z = (x - mean) / std
    q = (z >= -0.9816).long() + (z >= 0).long() + (z >= 0.9816).long()
    table = torch.tensor(RELEASED_LLOYD_MAX_LEVELS if levels == "released" else (-1.5104, -0.4528, 0.4528, 1.5104))
    ref = (mean + std * table[q]).flatten(-2)
    assert torch.allclose(method.dequantize(method.quantize_values(v, 0)), ref, atol=1e-3)
    assert torch.allclose(torch.tensor(RELEASED_LLOYD_MAX_LEVELS[2:]), torch.tensor([0.5837, 1.7511]), atol=1e-4)


def test_lloyd_max_refuses_other_bit_widths():
    with pytest.raises(ValueError, match="Lloyd-Max"):
        build_method("spectral", codebook="lloyd_max", k_bits=3)


def test_sink_prefix_is_kept_exactly_and_the_rest_is_quantized(calibration):
    method = spectral(calibration, build_tiny("tiny-llama"), sink_tokens=5)
    k = kv_like(1, 2, 12, 64, seed=5)
    rotated = method.transform_key(k, 1)
    first = method.dequantize(method.quantize_keys(k[:, :, :8], 1, span=TokenSpan(torch.tensor([0]), 0)))
    later = method.dequantize(method.quantize_keys(k[:, :, 8:], 1, span=TokenSpan(torch.tensor([0]), 8)))
    assert torch.equal(first[:, :, :5], rotated[:, :, :5])
    assert not torch.allclose(first[:, :, 5:], rotated[:, :, 5:8], atol=1e-3)
    assert not torch.allclose(later, rotated[:, :, 8:], atol=1e-3)  # past the prefix: nothing exact


def test_rotated_keys_quantize_as_the_raw_ones(calibration):
    """quantize_rotated_keys (what a cache holding the rotated window flushes) writes quantize_keys' buffers."""
    method = spectral(calibration, build_tiny("tiny-llama"), sink_tokens=3)
    k = kv_like(2, 2, 10, 64, seed=6).to(torch.bfloat16)
    span = TokenSpan(torch.tensor([0, 1]), 0)
    own, rotated = method.quantize_keys(k, 1, span=span), method.quantize_rotated_keys(method.transform_key(k, 1), span)
    assert own.buffers.keys() == rotated.buffers.keys()
    assert all(torch.equal(own.buffers[name], rotated.buffers[name]) for name in own.buffers)


# ----------------------------------------------------------------------------- calibration and the model


def test_missing_calibration_names_the_command(tmp_path):
    method = build_method("spectral", calibration=str(tmp_path / "some-model" / "spectral.pt"))
    with pytest.raises(FileNotFoundError, match="scripts/calibrate_spectral.py --model some-model"):
        method.check_model(head_dim=64, num_kv_heads=2)


def test_config_builds_with_oscars_defaults():
    conf = OmegaConf.load(REPO / "conf" / "method" / "spectral.yaml")
    conf.model = {"name": "smollm2-135m"}
    options = OmegaConf.to_container(conf, resolve=True)
    options.pop("model")
    method = build_method(options.pop("name"), **options)
    assert (method.k_bits, method.group_size, method.residual_length, method.sink_tokens) == (2, 128, 256, 64)
    assert (method.k_clip_ratio, method.v_clip_ratio, method.flush) == (0.96, 0.92, "window")
    assert method.calibration == "results/calibration/smollm2-135m/spectral.pt"
    assert method.group(64) == 64


@torch.no_grad()
def test_calibrated_rotations_are_orthogonal_and_diagonalize_the_query_covariance(calibration, tokenizer, data_file):
    calib = torch.load(calibration)
    assert calib["k_rotation"].shape == calib["v_rotation"].shape == (2, 64, 64) and calib["tokens"] == 192
    eye = torch.eye(64)
    for r in (*calib["k_rotation"], *calib["v_rotation"]):
        assert torch.allclose(r @ r.T, eye, atol=1e-5)
    # an independent estimate of layer 0's query second moment, from one recorded window
    from scripts.calibrate_rotatekv import squad_text

    model = build_tiny("tiny-llama")
    lm = KVModel(model, tokenizer, build_method("fp16"))
    ids = tokenizer(squad_text(data_file("qa/ruler_squad_v2_dev.json")), return_tensors="pt",
                    add_special_tokens=False)["input_ids"][:, :192].view(2, 96)
    cov = torch.zeros(64, 64, dtype=torch.float64)
    for window in ids:
        with record_attention(model) as records:
            model(window[None], cache=lm.new_cache())
        q = records[0][0]["query"][0].double()  # [4, T, D]; 2 query heads per KV head
        cov += sum(q[h].T @ q[h] for h in range(4))
    cov /= 2 * 96 * 2 * 2  # tokens x query heads per KV head, averaged over the 2 KV heads
    assert torch.allclose(calib["k_eigenvalues"][0].double(), torch.linalg.eigvalsh(cov), rtol=1e-3, atol=1e-5)


@torch.no_grad()
def test_at_16_bits_the_rotations_leave_the_logits_unchanged(calibration):
    """K rotated on both sides of q.k, V folded into v_proj / o_proj: nothing changes in exact arithmetic."""
    reference = build_tiny("tiny-llama")
    model = copy.deepcopy(reference)
    method = spectral(calibration, k_bits=16, v_bits=16, residual_length=32)
    from oscar.attention import attach
    from oscar.cache import QuantizedKVCache

    method.prepare_model(model)
    attach(model, method)
    ids = torch.randint(3, 1000, (1, 90), generator=torch.Generator().manual_seed(6))
    ref_cache, cache = DynamicCache(), QuantizedKVCache.for_model(model, method, quantize_prefill=True)
    assert torch.allclose(model(ids[:, :80], cache=cache).logits, reference(ids[:, :80], cache=ref_cache).logits,
                          atol=1e-4)
    for t in range(80, 90):
        ours, ref = model(ids[:, t:t + 1], cache=cache).logits, reference(ids[:, t:t + 1], cache=ref_cache).logits
        assert torch.allclose(ours, ref, atol=1e-4), (t, (ours - ref).abs().max())
    with pytest.raises(ValueError, match="already rotated"):
        method.prepare_model(model)


@torch.no_grad()
def test_window_policy_keeps_exactly_the_last_r_keys_and_values(calibration, tokenizer):
    lm = KVModel(build_tiny("tiny-llama"), tokenizer, spectral(calibration, residual_length=32, sink_tokens=4))
    cache = lm.new_cache()
    ids = torch.randint(3, 1000, (1, 50), generator=torch.Generator().manual_seed(7))
    lm.model(ids, cache=cache)
    for step in range(3):
        counts = cache.token_counts(0)
        assert counts["keys_residual"] == counts["values_residual"] == 32
        assert counts["keys_packed"] == counts["values_packed"] == 50 + step - 32
        lm.model(torch.tensor([[5]]), cache=cache)
    with pytest.raises(ValueError, match="window"):
        build_method("oscar", flush="window")  # per-channel keys cannot flush one token at a time


def test_two_bits_stays_close_to_full_precision_on_a_real_prompt(calibration, tokenizer):
    """INT2 with the sink prefix and the recent window: decode logits close to fp16's, not equal."""
    prompt = ("The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide from the "
              "hunters who have followed it since the early morning along the river. ") * 3
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = {}
    for name in ("fp16", "spectral"):
        method = build_method("fp16") if name == "fp16" else spectral(calibration, residual_length=16, sink_tokens=8)
        lm = KVModel(build_tiny("tiny-llama"), tokenizer, method)
        cache = lm.new_cache()
        with torch.no_grad():
            lm.model(ids, cache=cache)
            out[name] = lm.model(torch.tensor([[7]]), cache=cache).logits
    err = ((out["spectral"] - out["fp16"]).norm() / out["fp16"].norm()).item()
    assert 0 < err < 0.5 and math.isfinite(err)
