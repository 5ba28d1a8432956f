"""Shared fixtures: tiny random-weight models built from the registry's configs, the data files
(found through oscar.paths; a test whose data is nowhere is skipped with a pointer to `make data`), and
any registered method ready to run on them (``make_method``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from oscar.paths import REPO_ROOT, find_data

#: any text will do for calibrating a method on a random-weight model: it only needs real tokens
CALIBRATION_TEXT = REPO_ROOT / "README.md"


def need_data(name: str) -> Path:
    """The data file or folder ``name`` (e.g. "qa/ruler_squad_v2_dev.json"); the test is skipped when it is
    in none of the data folders."""
    found = find_data(name)
    if found is None:
        pytest.skip(f"data {name} not found: run `make data` (or set OSCAR_DATA)")
    return found


@pytest.fixture(scope="session")
def data_file():
    """``data_file(name)``: the resolved path of a data file or folder, or a skip naming `make data`."""
    return need_data


def build_tiny(name: str = "tiny-llama", **overrides) -> torch.nn.Module:
    """A registry tiny model (random, seeded weights, no tokenizer), float32, eval mode."""
    from transformers import AutoModelForCausalLM

    from oscar.models import build_config, load_spec

    spec = load_spec(name)
    spec.config = {**spec.config, **overrides}
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(build_config(spec), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def spectral_calibration(model: str = "tiny-llama") -> str:
    """OSCAR's rotations for a tiny model, from scripts/calibrate_spectral.py on 2 x 64 tokens of the SQuAD
    paragraphs, in a temporary file (made once per test process): ``build_method("spectral", calibration=...)``."""
    from oscar.models import load_model, load_tokenizer
    from scripts.calibrate_rotatekv import squad_text
    from scripts.calibrate_spectral import calibrate

    result = calibrate(load_model(model, device="cpu")[0], load_tokenizer("smollm2-135m"),
                       squad_text(need_data("qa/ruler_squad_v2_dev.json")), windows=2, seq_len=64)
    path = Path(tempfile.mkdtemp(prefix="spectral-")) / model / "spectral.pt"
    path.parent.mkdir()
    torch.save(result, path)
    return str(path)


@pytest.fixture
def repo_copy(tmp_path):
    """copy(names, *ignore) -> ``tmp_path / "repo"`` holding those files and folders of the repository (without
    __pycache__ and what the ``ignore`` patterns match): a checkout a test may change."""
    def copy(names, *ignore: str) -> Path:
        repo = tmp_path / "repo"
        for name in names:
            source = REPO_ROOT / name
            if source.is_dir():
                shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("__pycache__", *ignore))
            else:
                (repo / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, repo / name)
        return repo
    return copy


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    return build_tiny("tiny-llama")


@pytest.fixture(scope="session")
def make_method(tmp_path_factory):
    """``make_method(name, **hyperparameters)``: the registered method, ready to run on tiny-llama. A method that
    reads a calibration file (a ``calibration`` field) gets one that its ``scripts/calibrate_<name>.py`` makes
    (``calibrate(model, tokenizer, text, windows, seq_len) -> dict``, saved with torch.save), once a session."""
    from oscar import build_method, method_class
    from oscar.models import load_tokenizer

    files: dict[str, str] = {}

    def make(name: str, **hyperparameters):
        fields = {f.name for f in dataclasses.fields(method_class(name))}
        if "calibration" in fields and "calibration" not in hyperparameters:
            if name not in files:
                script = importlib.import_module(f"scripts.calibrate_{name}")
                result = script.calibrate(build_tiny("tiny-llama"), load_tokenizer("smollm2-135m"),
                                          CALIBRATION_TEXT.read_text(), windows=2, seq_len=64)
                path = tmp_path_factory.mktemp("calibration") / f"{name}_tiny-llama.pt"
                torch.save(result, path)
                files[name] = str(path)
            hyperparameters["calibration"] = files[name]
        return build_method(name, **hyperparameters)

    return make


@pytest.fixture(scope="session")
def varied_tiny():
    """(model, tokenizer) of tiny-llama with weights of std 0.1: its greedy continuations vary token to token (at
    the default 0.02 they repeat one token, which would let a wrong cache pass). Copy the model before binding a
    method to it (KVModel folds weights)."""
    from oscar.models import load_model

    model, tokenizer = load_model("tiny-llama", device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.1)
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer) of the random-weight 2-layer Llama (4 query / 2 KV heads, head_dim 64)."""
    from oscar.models import load_model

    return load_model("tiny-llama", device="cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first rows of the real WikiText-2 test split (~1K tokens) as a small .jsonl."""
    path = tmp_path_factory.mktemp("wikitext") / "wikitext-head.jsonl"
    lines = need_data("text/wikitext-2-raw-v1.test.rows.jsonl").read_text().splitlines()[:30]
    path.write_text("\n".join(lines) + "\n")
    return path
