"""oscar.paths: where data is looked for (OSCAR_DATA, ../shared/data, the user cache), in that order, and
the error that names the file, every place looked and `make data` when it is nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from evals import build_task
from oscar import paths
from oscar.paths import DataNotFoundError, data_cache, data_file, data_roots, find_data, resolve_data, user_cache

NAME = "text/sample.txt"


@pytest.fixture
def roots(tmp_path, monkeypatch) -> dict[str, Path]:
    """Three empty data roots standing in for $OSCAR_DATA, ../shared/data and the cache."""
    made = {k: tmp_path / k for k in ("override", "shared", "xdg")}
    for folder in made.values():
        folder.mkdir()
    monkeypatch.setenv("OSCAR_DATA", str(made["override"]))
    monkeypatch.setattr(paths, "SHARED_DATA", made["shared"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(made["xdg"]))
    monkeypatch.delenv("OSCAR_KV_CACHE", raising=False)
    return {**made, "cache": made["xdg"] / "oscar-kv" / "data"}


def put(root: Path, name: str = NAME, text: str = "x") -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_roots_in_order(roots):
    assert data_roots() == [roots["override"], roots["shared"], roots["cache"]]


def test_first_root_holding_the_file_wins_file_by_file(roots):
    in_cache = put(roots["cache"], text="cache")
    assert data_file(NAME) == in_cache
    in_shared = put(roots["shared"], text="shared")
    assert data_file(NAME) == in_shared
    in_override = put(roots["override"], text="override")
    assert data_file(NAME).read_text() == "override" and data_file(NAME) == in_override
    # another file only in the cache is still found there (no root hides the others)
    other = put(roots["cache"], "qa/other.json")
    assert data_file("qa/other.json") == other


def test_folders_resolve_like_files(roots):
    put(roots["shared"], "mm/docvqa/val.json")
    assert find_data("mm/docvqa") == roots["shared"] / "mm" / "docvqa"


def test_missing_names_the_file_every_place_and_make_data(roots):
    with pytest.raises(DataNotFoundError) as info:
        data_file(NAME)
    message = str(info.value)
    for root in ("override", "shared", "cache"):
        assert str(roots[root] / NAME) in message
    assert "make data" in message and "OSCAR_DATA" in message
    assert isinstance(info.value, FileNotFoundError)


def test_cache_location_follows_xdg_and_oscar_kv_cache(roots, monkeypatch, tmp_path):
    assert data_cache() == roots["xdg"] / "oscar-kv" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: relative values are ignored
    assert user_cache() == Path.home() / ".cache" / "oscar-kv"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert user_cache() == Path.home() / ".cache" / "oscar-kv"
    monkeypatch.setenv("OSCAR_KV_CACHE", str(tmp_path / "kv"))
    assert data_cache() == tmp_path / "kv" / "data"


def test_unset_override_is_skipped(roots, monkeypatch):
    monkeypatch.delenv("OSCAR_DATA")
    assert data_roots() == [roots["shared"], roots["cache"]]


def test_task_paths_absolute_data_folder_then_repository(roots, tmp_path):
    absolute = put(tmp_path, "elsewhere.txt")
    assert resolve_data(str(absolute)) == absolute
    with pytest.raises(DataNotFoundError, match="not found"):
        resolve_data(str(tmp_path / "missing.txt"))
    in_cache = put(roots["cache"])
    assert resolve_data(NAME) == in_cache
    assert resolve_data("conf/config.yaml") == paths.REPO_ROOT / "conf" / "config.yaml"  # not data: the repo root
    with pytest.raises(DataNotFoundError, match=r"make data"):
        resolve_data("text/nowhere.jsonl")


def test_missing_default_text_fails_before_the_model_with_make_data(roots):
    for task in ("perplexity", "kv_error"):
        with pytest.raises(DataNotFoundError, match=r"text/wikitext-2-raw-v1.test.rows.jsonl.*make data"):
            build_task(task).check()
    with pytest.raises(DataNotFoundError, match="make data"):
        build_task("niah", haystack_dir="pg_essays").check()


def test_data_root_config_key_is_searched_first(roots, monkeypatch, tmp_path):
    from oscar import runner

    own = tmp_path / "own"
    put(own, "text/wikitext-2-raw-v1.test.rows.jsonl", '{"text": "a b c"}\n')
    monkeypatch.setenv("OSCAR_DATA", "")  # restored after the test: execute() sets it from data_root

    class Loaded(Exception):
        pass

    def reached_the_model(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr("oscar.lm.load_model", reached_the_model)  # the binder (load_kv_model) loads
    with initialize_config_dir(config_dir=str(paths.REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny-llama", "task=perplexity", "task.window=2", "logger=files",
                                           f"runs_dir={tmp_path / 'runs'}", f"data_root={own}"])  # a 3-token text
    with pytest.raises(Loaded):  # the task's check found the text in data_root, so the model load came next
        runner.execute(cfg, runner.preflight(cfg, build_task))
    assert find_data("text/wikitext-2-raw-v1.test.rows.jsonl") == own / "text" / "wikitext-2-raw-v1.test.rows.jsonl"
