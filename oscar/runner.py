"""One run: validate the whole configuration first, then load the model, run the task, write the run folder.

The runner is handed the tasks (``tasks``: a factory ``(name, **options) -> task``, run.py passes
``evals.build_task``): oscar imports nothing above it. :func:`preflight` checks everything before any weights load,
in this order: the run's own options (typed: ``rerun`` a boolean, ``dtype`` one of DTYPES, ``device`` available),
the method and the task (every field typed and range-checked) and the model spec; then, unless the run is already
finished, the task's data (files opened and parsed, file and line named; a hub dataset reached or refused), the
output locations (writable), the task's lengths against the model's ``max_length``, the model's config (a hub model
reached or refused; a converted model's cache verified), the placement of a ``model.device_map`` and the decode
mode, the config against the task (its prompts within the model's positions; a NIAH length that its needle does not
fit, by the model's tokenizer), then the method (head_dim a power of two for rotating methods, calibration files
opened and shape-checked, ...) and the backend against it: the :class:`oscar.lm.Binding` that :func:`execute` loads
(the spec parsed, the config built and the binding checked once per run). A run whose metrics.json exists is
skipped (``rerun=true`` forces it); its id covers the data it reads (a digest of the task's local data files), so a
run on changed data is a new run. Tasks resume per sample inside an unfinished run through their predictions.jsonl.
A run that scores no sample, or whose metric is NaN or infinite, is an error, never a finished run. A run whose task
generates also records its KV caches' real stored bytes per token (:func:`storage_rows`) in its rows and
metrics.json.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import numbers
import os
import platform
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from oscar.backend import Backend, build_backend
from oscar.engine import resolve_mode
from oscar.lm import Binding
from oscar.method import KVMethod, build_method
from oscar.models import Dtype, ModelSpec, build_config, default_device, load_tokenizer, max_positions, plan_placement
from oscar.placement import Placement
from oscar.options import bounded, check_options
from oscar.paths import DATA_ENV, REPO_ROOT
from oscar.results import append_rows, task_config_label

log = logging.getLogger(__name__)

#: what :func:`preflight` raises for bad input (ModelUnavailableError is a RuntimeError, a missing or
#: unwritable file an OSError); run.py prints these as one line, without a traceback
BAD_INPUT = (ValueError, TypeError, OSError, RuntimeError, ImportError)
#: the metric of :func:`storage_rows`
KV_BYTES_METRIC = "kv_bytes_per_token"
#: ``tasks(name, **options) -> task``: how the runner builds the run's task (run.py passes ``evals.build_task``). A
#: task is a dataclass of options with the checks (``check``, ``check_context``, ``check_positions``,
#: ``checks_tokenizer`` / ``check_tokenizer``), ``data_files`` and ``run(lm, run_dir)`` of ``evals.base.Task``
TaskFactory = Callable[..., object]


@dataclass
class RunPlan:
    """Everything a run needs, validated, before the model is loaded."""

    method: KVMethod
    task: object
    spec: ModelSpec
    run_id: str
    run_dir: Path
    config: dict
    device: str  # the run's device (device=auto resolved)
    # made by preflight (not for a finished run):
    binding: Binding | None = None  # the model's config, the method and the backend, checked together
    placement: Placement | None = None  # where a model.device_map puts the layers (None = one device)
    decode: str | None = None  # the decode mode: graph or eager

    @property
    def finished(self) -> bool:
        return (self.run_dir / "metrics.json").exists()


@dataclass
class RunOptions:
    """The top-level keys of conf/config.yaml (typed like the methods' and tasks' options)."""

    seed: int = 0
    device: str = "auto"
    dtype: Dtype | None = None
    runs_dir: str = "runs"
    results_file: str = "runs/rows.csv"
    rerun: bool = False
    decode: Literal["auto", "graph", "eager"] = "auto"
    prefill_chunk: int | None = bounded(None, ge=1)
    data_root: str | None = None
    show_tables: bool = False

    def __post_init__(self) -> None:
        check_options(self, "config")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device):
            raise ValueError(f"config: device must be auto, cpu, cuda, cuda:<index> or mps, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"config: device={self.device} but no CUDA GPU is visible here (device=auto picks the CPU)")


@dataclass
class WandbOptions:
    """logger.wandb (conf/logger/*.yaml)."""

    enabled: bool = True
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "oscar-kv"
    entity: str | None = None
    quiet: bool = True

    def __post_init__(self) -> None:
        check_options(self, "logger.wandb")


def _options(node) -> tuple[str, dict]:
    options = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    return options.pop("name"), options


def data_digest(files: list[Path]) -> str | None:
    """SHA-1 (12 hex digits) of the files' names and contents, in the given order (a missing file counts
    as missing: ``Task.check`` refuses it); None for no files."""
    if not files:
        return None
    digest = hashlib.sha1()
    for path in map(Path, files):
        if not path.is_file():
            digest.update(f"{path.name}\0missing\0".encode())
            continue
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def run_id_for(config: dict, data: str | None = None) -> str:
    """A stable id of what determines the results: model, method, task, backend, seed, dtype and the
    digest of the task's local data files (``data``; absent for hub data); not where the model's layers are
    placed (``model.device_map`` / ``max_memory`` change no number), nor the ``path`` of a model that is not a
    hub model (always null there: the spec refuses another value; left out so their ids stay those of the runs
    made before their configs had the key)."""
    keys = ("model", "method", "task", "backend", "seed", "dtype")
    identity = {k: config.get(k) for k in keys}
    if isinstance(identity["model"], dict):
        model = identity["model"]
        unhashed = ("device_map", "max_memory") + (("path",) if model.get("source", "hub") != "hub" else ())
        identity["model"] = {k: v for k, v in model.items() if k not in unhashed}
    if data is not None:
        identity["data"] = data
    blob = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def plan(cfg: DictConfig, tasks: TaskFactory) -> RunPlan:
    """Build and check (types, ranges) the run's options, method, task (made by ``tasks``) and model spec, and the
    run id (with the digest of the task's data files); nothing is loaded, downloaded or written."""
    if cfg.get("data_root"):  # searched before ../shared/data and the cache (oscar.paths), here and in subprocesses
        os.environ[DATA_ENV] = str(Path(cfg.data_root).expanduser().absolute())
    config = OmegaConf.to_container(cfg, resolve=True)
    options = RunOptions(**{f.name: config.get(f.name, f.default) for f in dataclasses.fields(RunOptions)})
    WandbOptions(**config.get("logger", {}).get("wandb", {}))
    method_name, method_options = _options(cfg.method)
    method = build_method(method_name, **method_options)
    task_name, task_options = _options(cfg.task)
    task = tasks(task_name, **task_options)
    spec = ModelSpec.from_any(config["model"])
    run_id = run_id_for(config, data_digest(task.data_files()))
    run_dir = Path(cfg.runs_dir) / task_name / spec.name / f"{method_name}-{run_id}"
    device = default_device() if options.device == "auto" else options.device
    return RunPlan(method, task, spec, run_id, run_dir, config, device)


def preflight(cfg: DictConfig, tasks: TaskFactory) -> RunPlan:
    """Every check that does not need the model's weights (see the module docstring); a finished run
    (to be skipped) stops after the plan."""
    p = plan(cfg, tasks)
    if p.finished and not cfg.rerun:
        return p
    p.task.check()
    check_writable(Path(cfg.runs_dir), "runs_dir", folder=True)
    check_writable(Path(cfg.results_file), "results_file", folder=False)
    p.task.check_context(p.spec.max_length)
    if p.spec.attention is not None:  # the declared shape first (build_config checks it): no conversion or download
        p.method.check_model(p.spec.attention["head_dim"], p.spec.attention["kv_heads"])
    config = build_config(p.spec)
    p.placement = plan_placement(p.spec, cfg.dtype, config=config)  # a device_map that cannot hold the weights fails
    p.decode = resolve_mode(cfg.decode, p.placement.devices if p.placement else p.device)
    p.task.check_positions(max_positions(config))
    if p.task.checks_tokenizer() and p.spec.kind == "causal_lm":  # other kinds: checked as the task builds prompts
        p.task.check_tokenizer(_checking_tokenizer(p.spec))
    p.binding = Binding(p.spec, config, p.method, _backend(cfg.backend))
    return p


#: spec (its JSON) -> tokenizer, for the preflight's checks: loaded once per process (a sweep's jobs share it; the
#: checks only read it), the last few kept
_TOKENIZERS: dict[str, object] = {}


def _checking_tokenizer(spec: ModelSpec):
    key = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if key not in _TOKENIZERS:
        if len(_TOKENIZERS) >= 4:
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        _TOKENIZERS[key] = load_tokenizer(spec)
    return _TOKENIZERS[key]


def check_writable(path: Path, option: str, folder: bool) -> None:
    """Raise a clear error unless ``path`` (a file, or a folder with ``folder``) can be written, or
    created where it does not exist yet. Nothing is written or created."""
    path = Path(path)
    if path.exists():
        if folder != path.is_dir():
            raise ValueError(f"{option}={path} is {'a file' if folder else 'a folder'}, not {'a folder' if folder else 'a file'}")
        if not folder:
            try:
                open(path, "a").close()  # append mode, nothing written: the file is unchanged
            except OSError as e:
                raise PermissionError(f"{option}={path} is not writable ({e.strerror})") from None
            return
        parent = path
    else:
        parent = next(p for p in path.absolute().parents if p.exists())
        if not parent.is_dir():
            raise ValueError(f"{option}={path}: {parent} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise PermissionError(f"{option}={path}: cannot write in {parent} ({e.strerror})") from None


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


def execute(cfg: DictConfig, p: RunPlan) -> dict:
    """Run the cell of ``cfg`` from its :func:`preflight` ``p``; returns its metrics (read back from disk when the
    run was already done)."""
    metrics_path = p.run_dir / "metrics.json"
    if p.finished and not cfg.rerun:
        log.info("skipping finished run %s (rerun=true to compute again)", p.run_dir)
        return json.loads(metrics_path.read_text())

    p.run_dir.mkdir(parents=True, exist_ok=True)
    (p.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    start = time.perf_counter()
    lm = p.binding.load(seed=cfg.seed, device=p.placement or p.device, dtype=cfg.dtype, decode=p.decode,
                        prefill_chunk=cfg.prefill_chunk)
    log.info("run %s: %s / %s / %s on %s (backend=%s, decode=%s)", p.run_id, p.spec.name, p.method.name,
             p.task.name, p.device, p.binding.backend.name, p.decode)
    result = p.task.run(lm, p.run_dir)
    seconds = time.perf_counter() - start
    if not result.rows or all(r.get("n") == 0 for r in result.rows):
        raise RuntimeError(f"{p.task.name}: the run scored no samples (rows: {result.rows}); it is not marked "
                           f"finished. Check the task's data ({p.run_dir / 'predictions.jsonl'})")
    check_finite(p.task.name, result.metrics, result.rows)

    storage = storage_rows(lm)
    rows = tidy_rows(p, result.rows + storage)
    engine = dict(backend=p.binding.backend.describe(), decode=p.decode, prefill_chunk=cfg.prefill_chunk,
                  device_map=p.placement.device_map if p.placement else None)
    (p.run_dir / "env.json").write_text(json.dumps({**environment(p.device), **engine, "seconds": seconds}, indent=2))
    (p.run_dir / "rows.json").write_text(json.dumps(rows, indent=2))
    append_rows(Path(cfg.results_file), rows)
    metrics = {**result.metrics, **{r["metric"]: r["value"] for r in storage}}
    metrics_path.write_text(json.dumps(metrics, indent=2, sort_keys=True))
    _mirror_to_wandb(cfg, p, result, rows)
    log.info("finished %s in %.1f s: %s", p.run_dir, seconds, metrics)
    return metrics


def storage_rows(lm) -> list[dict]:
    """The KV cache's real stored bytes per token over the run's generations (``KVModel.stored_bytes`` /
    ``stored_tokens``: every layer, packed buffers and full-precision windows, as each generation ended), as a
    tidy row (subset ``all``, metric ``kv_bytes_per_token``, n = the tokens); none for a task that generated
    nothing in this process (perplexity, kv_error, a run resumed after its last sample)."""
    if not lm.stored_tokens:
        return []
    return [dict(subset="all", metric=KV_BYTES_METRIC, value=lm.stored_bytes / lm.stored_tokens, n=lm.stored_tokens)]


def check_finite(task: str, metrics: dict, rows: list[dict]) -> None:
    """Raise RuntimeError naming every metric (of ``metrics``, and of ``rows`` by subset) whose value is NaN or
    infinite: such a run is not finished and writes no row."""
    def finite(value) -> bool:
        return isinstance(value, numbers.Real) and math.isfinite(value)

    bad = [name for name, value in metrics.items() if isinstance(value, numbers.Real) and not finite(value)]
    bad += [f"{r.get('metric')} ({r.get('subset')})" for r in rows if not finite(r.get("value"))]
    if bad:
        raise RuntimeError(f"{task}: metric(s) {', '.join(dict.fromkeys(bad))} not a finite number (NaN or inf); the "
                           "run is not marked finished and writes no row")


def _backend(node) -> Backend:
    """The run's backend, built (options typed); the binding checks it with the method and the model's config."""
    name, options = _options(node)
    backend = build_backend(name, **options)
    check_options(backend, f"backend={name}")
    return backend


def _mirror_to_wandb(cfg: DictConfig, p: RunPlan, result, rows: list[dict]) -> None:
    if not cfg.logger.wandb.enabled:
        return
    try:
        import wandb
    except ImportError:
        log.warning("logger.wandb.enabled but wandb is not installed (pip install wandb); run files are kept")
        return
    quiet = cfg.logger.wandb.get("quiet", True)
    run = wandb.init(project=cfg.logger.wandb.project, entity=cfg.logger.wandb.entity, mode=cfg.logger.wandb.mode,
                     dir=str(p.run_dir), name=f"{p.spec.name}/{p.method.name}/{p.task.name}/{p.run_id}",
                     config=p.config, reinit="finish_previous", settings=wandb.Settings(silent=quiet))
    run.log({k: v for k, v in result.metrics.items() if isinstance(v, (int, float))})
    columns = ["model", "method", "bits", "group_size", "residual_length", "task", "task_config", "subset", "metric",
               "value", "n"]
    run.log({"rows": wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})
    for fig in result.figures:
        run.log({Path(fig).stem: wandb.Image(str(fig))})
    sync_dir, offline = run.settings.sync_dir, cfg.logger.wandb.mode == "offline"
    run.finish()
    if quiet and offline:
        log.info("W&B offline run in %s (upload: wandb sync %s)", sync_dir, sync_dir)
