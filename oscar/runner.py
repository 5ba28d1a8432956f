"""One run: validate everything cheap first, then load the model, run the task, write the run folder.

Order matters: unknown names, bad hyperparameters, a model/method mismatch (head_dim not a power of
two for a rotating method) and missing data files all fail before any weights are loaded. A run
whose metrics.json exists is skipped (``rerun=true`` forces it); tasks resume per sample inside an
unfinished run through their predictions.jsonl.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from oscar.backend import build_backend
from oscar.engine import resolve_mode
from oscar.lm import KVModel
from oscar.method import KVMethod, build_method
from oscar.models import ModelSpec, attention_shape, build_config, default_device, load_model, plan_placement
from oscar.results import append_rows, task_config_label

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RunPlan:
    """Everything a run needs, validated, before the model is loaded."""

    method: KVMethod
    task: object
    spec: ModelSpec
    run_id: str
    run_dir: Path
    config: dict


def _options(node) -> tuple[str, dict]:
    options = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    return options.pop("name"), options


def run_id_for(config: dict) -> str:
    """A stable id of what determines the results: model, method, task, backend, seed, dtype (not where the model's
    layers are placed: ``model.device_map`` / ``max_memory`` change no number)."""
    keys = ("model", "method", "task", "backend", "seed", "dtype")
    chosen = {k: config.get(k) for k in keys}
    if isinstance(chosen["model"], dict):
        chosen["model"] = {k: v for k, v in chosen["model"].items() if k not in ("device_map", "max_memory")}
    blob = json.dumps(chosen, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def plan(cfg: DictConfig) -> RunPlan:
    from evals import build_task

    config = OmegaConf.to_container(cfg, resolve=True)
    method_name, method_options = _options(cfg.method)
    method = build_method(method_name, **method_options)
    task_name, task_options = _options(cfg.task)
    task = build_task(task_name, **task_options)
    spec = ModelSpec.from_any(config["model"])
    run_id = run_id_for(config)
    run_dir = Path(cfg.runs_dir) / task_name / spec.name / f"{method_name}-{run_id}"
    return RunPlan(method, task, spec, run_id, run_dir, config)


def environment(device: str) -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    import transformers

    env = dict(git_commit=git("rev-parse", "HEAD"), git_dirty=bool(git("status", "--porcelain")),
               python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               platform=platform.platform(), cpu_count=os.cpu_count(), device=device,
               torch_threads=torch.get_num_threads())
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def task_defaults(task) -> dict:
    """The defaults of the task dataclass's options (the same values as conf/task/<name>.yaml)."""
    defaults = {}
    for f in dataclasses.fields(task):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults


def tidy_rows(p: RunPlan, rows: list[dict]) -> list[dict]:
    """The task's rows with the run's identity: model, method hyperparameters, the method config
    (JSON) and the task options that differ from the task's defaults (``task_config``)."""
    m = p.method
    bits = m.k_bits if m.k_bits == m.v_bits else f"K{m.k_bits}V{m.v_bits}"
    base = dict(model=p.spec.name, method=m.name, bits=bits, group_size=m.group_size,
                residual_length=m.residual_length, task=p.task.name, run_id=p.run_id,
                config=json.dumps(p.config["method"], sort_keys=True),
                task_config=task_config_label(p.config["task"], task_defaults(p.task)))
    return [{**base, **row} for row in rows]


def execute(cfg: DictConfig) -> dict:
    """Run one cell; returns its metrics (read back from disk when the run was already done)."""
    p = plan(cfg)
    metrics_path = p.run_dir / "metrics.json"
    if metrics_path.exists() and not cfg.rerun:
        log.info("skipping finished run %s (rerun=true to compute again)", p.run_dir)
        return json.loads(metrics_path.read_text())
    p.task.check()
    config = build_config(p.spec)
    head_dim, num_kv_heads = attention_shape(config)
    p.method.check_model(head_dim, num_kv_heads)
    backend_name, backend_options = _options(cfg.backend)
    backend = build_backend(backend_name, **backend_options)
    backend.check(p.method)
    backend.check_model(config)
    backend.check_available()  # a missing GPU or package fails here, before the model loads

    device = default_device() if cfg.device == "auto" else cfg.device
    placement = plan_placement(p.spec, cfg.dtype)  # a model.device_map that cannot hold the weights fails here
    decode = resolve_mode(cfg.decode, placement.devices if placement else device)
    p.run_dir.mkdir(parents=True, exist_ok=True)
    (p.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    seed_everything(cfg.seed)
    start = time.perf_counter()
    model, tokenizer = load_model(p.spec, device=placement or device, dtype=cfg.dtype)
    lm = KVModel(model, tokenizer, p.method, name=p.spec.name, max_length=p.spec.max_length, backend=backend,
                 decode=decode, prefill_chunk=cfg.prefill_chunk)
    log.info("run %s: %s / %s / %s on %s (backend=%s, decode=%s)", p.run_id, p.spec.name, p.method.name,
             p.task.name, device, backend.name, decode)
    result = p.task.run(lm, p.run_dir)
    seconds = time.perf_counter() - start

    rows = tidy_rows(p, result.rows)
    engine = dict(backend=backend.describe(), decode=decode, prefill_chunk=cfg.prefill_chunk,
                  device_map=placement.device_map if placement else None)
    (p.run_dir / "env.json").write_text(json.dumps({**environment(device), **engine, "seconds": seconds}, indent=2))
    (p.run_dir / "rows.json").write_text(json.dumps(rows, indent=2))
    append_rows(Path(cfg.results_file), rows)
    metrics_path.write_text(json.dumps(result.metrics, indent=2, sort_keys=True))
    _mirror_to_wandb(cfg, p, result, rows)
    log.info("finished %s in %.1f s: %s", p.run_dir, seconds, result.metrics)
    return result.metrics


def _mirror_to_wandb(cfg: DictConfig, p: RunPlan, result, rows: list[dict]) -> None:
    if not cfg.logger.wandb.enabled:
        return
    try:
        import wandb
    except ImportError:
        log.warning("logger.wandb.enabled but wandb is not installed (pip install wandb); run files are kept")
        return
    run = wandb.init(project=cfg.logger.wandb.project, entity=cfg.logger.wandb.entity, mode=cfg.logger.wandb.mode,
                     dir=str(p.run_dir), name=f"{p.spec.name}/{p.method.name}/{p.task.name}/{p.run_id}",
                     config=p.config, reinit="finish_previous")
    run.log({k: v for k, v in result.metrics.items() if isinstance(v, (int, float))})
    columns = ["model", "method", "bits", "group_size", "residual_length", "task", "task_config", "subset", "metric",
               "value", "n"]
    run.log({"rows": wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})
    for fig in result.figures:
        run.log({Path(fig).stem: wandb.Image(str(fig))})
    run.finish()
