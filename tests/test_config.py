"""Config composition of every group, the README's and the error messages' examples, and clear
errors before any model is loaded (tests/test_bad_inputs.py holds the full table)."""

import itertools
import re
import shlex

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from evals import available_tasks, build_task
from oscar import build_method
from oscar.models import ModelSpec, available_models, hub_location
from oscar.paths import REPO_ROOT as REPO
from oscar.runner import execute, plan, preflight

CONF = REPO / "conf"


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _options(node) -> tuple[str, dict]:
    options = OmegaConf.to_container(node, resolve=True)
    return options.pop("name"), options


def _group(name: str) -> list[str]:
    return sorted(p.stem for p in (CONF / name).glob("*.yaml"))


def test_default_config_is_the_embedded_default():
    cfg = _compose()
    assert (cfg.model.name, cfg.method.name, cfg.task.name) == ("smollm2-135m", "oscar", "niah")


@pytest.mark.parametrize("method", _group("method"))
def test_every_method_config_builds_its_method(method):
    name, options = _options(_compose(f"method={method}").method)
    assert build_method(name, **options).name == method


@pytest.mark.parametrize("task", _group("task"))
def test_every_task_config_builds_its_task(task):
    name, options = _options(_compose(f"task={task}").task)
    assert name in available_tasks()
    assert build_task(name, **options).name == task


@pytest.mark.parametrize("model", _group("model"))
def test_every_model_config_is_a_valid_spec(model):
    spec = ModelSpec.from_any(OmegaConf.to_container(_compose(f"model={model}").model, resolve=True))
    assert spec.name == model and model in available_models()


@pytest.mark.parametrize("group", ["backend", "logger"])
def test_other_groups_compose(group):
    for option in _group(group):
        assert _compose(f"{group}={option}")[group] is not None


@pytest.mark.parametrize("overrides, error", [
    (["method=kivi", "method.residual_length=100"], "multiple of group_size"),
    (["method=oscar", "method.k_bits=12"], "k_bits=12"),
    (["method=oscar", "+method.bogus=1"], "no hyperparameter"),
    (["task=perplexity", "task.path=/nonexistent/wiki.jsonl"], "/nonexistent/wiki.jsonl"),
    (["model=tiny-llama", "model.config.head_dim=48", "model.config.hidden_size=192"], "power of two"),
    (["model=tiny-llama", "method=spectral"], "scripts/calibrate_spectral.py --model tiny-llama"),
])
def test_bad_input_fails_before_the_model_loads(overrides, error, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr("oscar.lm.load_model", no_loading)  # the binder (load_kv_model) loads
    cfg = _compose("logger=files", f"runs_dir={tmp_path}", f"results_file={tmp_path / 'rows.csv'}", *overrides)
    with pytest.raises(Exception, match=error):
        execute(cfg, preflight(cfg, build_task))


def test_hub_model_without_network_fails_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    cfg = _compose("model=qwen3-8b", "logger=files", f"runs_dir={tmp_path}")
    with pytest.raises(RuntimeError, match="qwen3-8b: Qwen/Qwen3-8B is not in the local cache"):
        execute(cfg, preflight(cfg, build_task))


def test_run_id_depends_on_hyperparameters_only():
    a = plan(_compose("method=oscar", "runs_dir=x"), build_task)
    b = plan(_compose("method=oscar", "runs_dir=y", "rerun=true"), build_task)
    c = plan(_compose("method=oscar", "method.group_size=64"), build_task)
    assert a.run_id == b.run_id != c.run_id


def readme_commands() -> list[list[str]]:
    """The arguments of every `python run.py ...` line of the README's code blocks (continuations joined)."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    return [shlex.split(re.sub(r"#.*", "", line))[2:] for line in text.splitlines()
            if line.strip().startswith("python run.py")]


def test_every_readme_command_composes_and_builds():
    """Each README example (each job of a sweep) composes and builds its method, task and model spec."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    commands = [c for c in readme_commands() if "--cfg" not in c and "..." not in c]
    assert len(commands) >= 3
    for args in commands:
        overrides = OverridesParser.create().parse_overrides([a for a in args if a != "-m"])
        choices = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                   else [o.input_line] for o in overrides]
        for job in itertools.product(*choices):
            cfg = _compose(*job)
            name, options = _options(cfg.method)
            build_method(name, **options)
            task_name, task_options = _options(cfg.task)
            build_task(task_name, **task_options)
            ModelSpec.from_any(OmegaConf.to_container(cfg.model, resolve=True))


def _hint_overrides(message: str) -> list[str]:
    """The `key=value` overrides an error message suggests."""
    return re.findall(r"\b((?:model|method|task|backend)(?:\.\w+)?=[\w/.-]+)", message)


def test_the_offline_error_suggests_model_path_which_works(monkeypatch, tmp_path):
    """Defect 11: `model.path=...`, as the README and the offline error write it, is a key of the model schema."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(RuntimeError) as refusal:
        plan_and_check(_compose("model=qwen3-8b"))
    (hint,) = _hint_overrides(str(refusal.value))
    assert hint.startswith("model.path=")
    spec = ModelSpec.from_any(OmegaConf.to_container(_compose("model=qwen3-8b", f"model.path={tmp_path}").model))
    assert hub_location(spec) == str(tmp_path)


@pytest.mark.parametrize("overrides", [
    ["method=rotatekv", "method.calibration=/nonexistent/calibration.pt"],   # suggests method.reorder=false
    ["task=perplexity", "task.path=/nonexistent/wiki.jsonl"],                # suggests task.path=null
])
def test_the_overrides_an_error_suggests_compose_and_clear_it(overrides):
    with pytest.raises(Exception) as refusal:
        plan_and_check(_compose("model=tiny-llama", *overrides))
    hints = _hint_overrides(str(refusal.value))
    assert hints, str(refusal.value)
    cfg = _compose("model=tiny-llama", *overrides, *hints)
    name, options = _options(cfg.method)
    build_method(name, **options).check_model(head_dim=64, num_kv_heads=2)
    if hints[0] != "task.path=null":  # the hub split cannot be loaded here: composing is what is checked
        plan(cfg, build_task)


def plan_and_check(cfg):
    from oscar.method import attention_shape
    from oscar.models import build_config

    p = plan(cfg, build_task)
    p.task.check()
    p.method.check_model(*attention_shape(build_config(p.spec)))
    return p


def test_a_gguf_shipped_in_chunks_is_assembled_once_and_checked(tmp_path, monkeypatch):
    import hashlib

    from oscar.models import ModelUnavailableError, assemble_chunks

    monkeypatch.setenv("OSCAR_KV_CACHE", str(tmp_path / "cache"))
    parts = []
    for i, data in enumerate([b"GGUF" + bytes(range(200)), bytes(reversed(range(256))), b"tail"]):
        parts.append(tmp_path / f"m.gguf.part{i:02d}")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(whole).hexdigest()}  m.gguf\n")
    spec = ModelSpec(name="chunked", source="gguf", gguf_package="pkg", gguf_file="m.gguf")
    path = assemble_chunks(spec, parts, sums)
    assert path.read_bytes() == whole and path == tmp_path / "cache" / "gguf" / "m.gguf"
    path.unlink()
    sums.write_text(f"{hashlib.sha256(b'other').hexdigest()}  m.gguf\n")
    with pytest.raises(ModelUnavailableError, match="SHA-256"):
        assemble_chunks(spec, parts, sums)
    assert not path.exists() and not list(path.parent.iterdir())  # no partial file left behind


@pytest.mark.parametrize("name", [n for n in available_models() if ModelSpec.from_any(n).attention])
def test_a_declared_attention_shape_is_the_configs(name):
    """A spec's ``attention`` (what make tables reads without the weights) equals its config's, checked where the
    config can be read here without a download or a GGUF conversion (every run's build_config checks it too)."""
    from oscar.models import build_config, config_attention
    from oscar.paths import user_cache

    spec = ModelSpec.from_any(name)
    if spec.source == "gguf" and not (user_cache() / name / "config.json").exists():
        pytest.skip(f"{name}: not converted here yet (a run of it converts it once)")
    if spec.source == "hub":
        try:
            from huggingface_hub import snapshot_download

            snapshot_download(spec.hf_id, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the local hub cache
            pytest.skip(f"{name}: {spec.hf_id} is not in the local hub cache")
    assert spec.attention == config_attention(build_config(spec))
