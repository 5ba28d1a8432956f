"""Contexts past the model's own positions: a model spec's ``config`` overrides the fields of a hub or converted
config (e.g. an extended RoPE: conf/model/llama-3.1-8b-instruct-1m.yaml), and the NIAH preflight then accepts the
lengths those positions allow and still refuses the longer ones, before any weight loads."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from evals import build_task
from oscar.models import ModelSpec, build_config, load_spec, max_positions
from oscar.paths import REPO_ROOT
from oscar.runner import preflight


def test_spec_config_overrides_a_local_hub_config(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=4096).save_pretrained(tmp_path)
    plain = ModelSpec(name="local", source="hub", path=str(tmp_path))
    extended = ModelSpec(name="local", source="hub", path=str(tmp_path),
                         config={"max_position_embeddings": 1 << 20, "attention_dropout": 0.25})
    assert max_positions(build_config(plain)) == 4096
    config = build_config(extended)
    assert max_positions(config) == 1 << 20 and config.attention_dropout == 0.25 and config.hidden_size == 64


def test_the_1m_model_spec_extends_llama_31():
    spec = load_spec("llama-3.1-8b-instruct-1m")
    assert spec.hf_id == load_spec("llama-3.1-8b-instruct").hf_id
    assert spec.config["max_position_embeddings"] == spec.max_length == 1 << 20
    assert spec.config["rope_scaling"]["rope_type"] == "llama3"


def _plan(*overrides):
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base=None):
        return preflight(compose("config", overrides=["model=tiny-llama", "method=oscar", *overrides]), build_task)


def test_niah_lengths_follow_the_extended_positions():
    with pytest.raises(ValueError, match="positions"):  # tiny-llama's own 8192 positions
        _plan("task.lengths=[16384]", "model.max_length=16384")
    plan = _plan("task.lengths=[262144]", "task.depths=[50]", "model.max_length=262144",
                 "model.config.max_position_embeddings=300000")
    assert plan.spec.max_length == 262144
    with pytest.raises(ValueError, match="positions"):
        _plan("task.lengths=[262144]", "model.max_length=262144", "model.config.max_position_embeddings=200000")
