"""The runner checks once: a run parses its model spec, builds the model's config and checks the method and backend
against it (``check_binding``) once each, in its preflight, and loads the weights with that checked binding; a
finished run is skipped after its plan (the spec parsed, nothing built or checked)."""

from __future__ import annotations

import json
import sys

import pytest
from hydra import compose, initialize_config_dir

import oscar.lm
import oscar.models
from evals import build_task
from oscar.lm import Binding
from oscar.models import ModelSpec
from oscar.paths import REPO_ROOT
from oscar.runner import execute, preflight

MODEL = "tiny-llama"


@pytest.fixture
def calls(monkeypatch) -> dict[str, int]:
    """Counts, for the run's model only (the spec of the tokenizer it borrows is another model's): ``from_any`` calls
    that parse a name or a dict, specs made (``ModelSpec.__post_init__``: its checks), ``build_config`` and
    ``check_binding`` calls, and the models loaded with the binding's own config."""
    counts = dict(parsed=0, made=0, config=0, binding=0, loaded_with_checked_config=0)
    from_any, post_init = ModelSpec.from_any.__func__, ModelSpec.__post_init__
    build_config, check_binding, load = oscar.models.build_config, oscar.lm.check_binding, Binding.load

    def counted_from_any(cls, spec):
        made = from_any(cls, spec)
        counts["parsed"] += not isinstance(spec, ModelSpec) and made.name == MODEL
        return made

    def counted_post_init(self):
        post_init(self)
        counts["made"] += self.name == MODEL

    def counted_build_config(spec):
        counts["config"] += spec.name == MODEL
        return build_config(spec)

    def counted_check_binding(method, backend, config, model=None):
        counts["binding"] += model == MODEL
        return check_binding(method, backend, config, model)

    def counted_load(self, **options):
        lm = load(self, **options)
        counts["loaded_with_checked_config"] += lm.model.config is self.config
        return lm

    monkeypatch.setattr(ModelSpec, "from_any", classmethod(counted_from_any))
    monkeypatch.setattr(ModelSpec, "__post_init__", counted_post_init)
    monkeypatch.setattr(Binding, "load", counted_load)
    for module in [m for name, m in sys.modules.items() if name.split(".")[0] == "oscar"]:  # every bound name
        if getattr(module, "build_config", None) is build_config:
            monkeypatch.setattr(module, "build_config", counted_build_config)
        if getattr(module, "check_binding", None) is check_binding:
            monkeypatch.setattr(module, "check_binding", counted_check_binding)
    return counts


def test_a_run_checks_its_model_once_and_a_finished_run_is_skipped(calls, tmp_path):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={MODEL}", "method=oscar", "method.residual_length=64", "task=niah",
                                           "task.lengths=[256]", "task.depths=[50]", "task.max_new_tokens=4",
                                           "logger=files", f"runs_dir={tmp_path / 'runs'}",
                                           f"results_file={tmp_path / 'rows.csv'}"])
    metrics = execute(cfg, preflight(cfg, build_task))
    assert calls == dict(parsed=1, made=1, config=1, binding=1, loaded_with_checked_config=1)
    (run_dir,) = (tmp_path / "runs" / "niah" / MODEL).iterdir()
    assert json.loads((run_dir / "metrics.json").read_text()) == metrics

    for name in calls:
        calls[name] = 0
    again = preflight(cfg, build_task)  # finished: skipped, read back from disk
    assert again.finished and again.binding is None
    assert execute(cfg, again) == metrics
    assert calls == dict(parsed=1, made=1, config=0, binding=0, loaded_with_checked_config=0)
    assert len((tmp_path / "rows.csv").read_text().splitlines()) == 1 + len(json.loads((run_dir / "rows.json")
                                                                                       .read_text()))  # no new rows
