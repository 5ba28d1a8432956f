"""Shared fixtures: tiny random-weight models built from the registry's configs, and the shared data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA.exists():
        pytest.fail(f"shared data not found at {DATA} (expected beside the repository)")
    return DATA


def build_tiny(name: str = "tiny-llama", **overrides) -> torch.nn.Module:
    """A registry tiny model (random, seeded weights, no tokenizer), float32, eval mode."""
    from transformers import AutoModelForCausalLM

    from oscar.models import build_config, load_spec

    spec = load_spec(name)
    spec.config = {**spec.config, **overrides}
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(build_config(spec), dtype=torch.float32).eval()


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    return build_tiny("tiny-llama")


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer) of the random-weight 2-layer Llama (4 query / 2 KV heads, head_dim 64)."""
    from oscar.models import load_model

    return load_model("tiny-llama", device="cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first rows of the real WikiText-2 test split (~1K tokens) as a small .jsonl."""
    path = tmp_path_factory.mktemp("wikitext") / "wikitext-head.jsonl"
    lines = (DATA / "text" / "wikitext-2-raw-v1.test.rows.jsonl").read_text().splitlines()[:30]
    path.write_text("\n".join(lines) + "\n")
    return path
