"""One run: validate the whole configuration first, then load the model, run the task, write the run folder.

The runner is handed the tasks (``tasks``: a factory ``(name, **options) -> task``, run.py passes
``evals.build_task``): oscar imports nothing above it. :func:`preflight` checks everything before any weights load,
in this order: the run's own options (typed: ``rerun`` a boolean, ``dtype`` one of DTYPES, ``device`` available,
``seed`` in numpy's range, ``data_root`` an existing folder), the method and the task (every field typed and
range-checked, prompt templates fillable) and the model spec; then, unless the run is already finished, the task's
data (files opened and parsed as UTF-8, file and line named; a hub dataset reached or refused), the task against the
method (a kv_error window of at least one group), the output locations (writable, a results_file that is a regular
file with a tidy-row header, no file where the run's folder goes), the task's lengths against the model's
``max_length``, the model's config (a hub model reached or refused; a converted model's cache verified), the
placement of a ``model.device_map`` and the decode mode, the config against the task (its prompts within the model's
positions; by the model's tokenizer, a NIAH length that its needle does not fit, a corpus shorter than a perplexity
window or a kv_error window), then the method (head_dim a power of two for rotating methods, calibration files
opened and shape-checked, ...) and the backend against it: the :class:`oscar.lm.Binding` that :func:`execute` loads
(the spec parsed, the config built and the binding checked once per run).

A run's id is its identity's (oscar.identity.run_identity: every option that can change a number, the resolved
device type and dtype, the digests of the files it reads), so a run on changed data, calibration or weights is a
new run. A run whose metrics.json holds a JSON object is finished and skipped; an unreadable one (cut short by a
full disk) is not finished, with one warning naming it. ``rerun=true`` computes from scratch: the old folder is moved
aside and removed once the new run has finished. Tasks resume per sample inside an unfinished run through their
predictions.jsonl. A run that scores no sample, or whose metric is NaN or infinite, is an error, never a finished
run. A run whose task generates also records its KV caches' real stored bytes per token (:func:`storage_rows`, from
every sample's record) in its rows and metrics.json. Rows and metrics.json carry the run's provenance (code_version,
config_digest, date); the run folder's files are written whole or not at all (oscar.atomic).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import numbers
import os
import platform
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from oscar.atomic import write_json, write_text
from oscar.backend import Backend, build_backend, offered_layer_fusion
from oscar.engine import resolve_fused_layers, resolve_mode
from oscar.identity import device_type, identity_digest, run_files, run_identity, unconverted
from oscar.lm import Binding
from oscar.method import KVMethod, build_method
from oscar.models import Dtype, ModelSpec, build_config, default_device, load_tokenizer, max_positions, plan_placement
from oscar.options import bounded, check_options
from oscar.paths import DATA_ENV
from oscar.placement import Placement
from oscar.provenance import process_code_version, process_provenance
from oscar.results import append_rows, record_code_versions, results_file_problem, task_config_label

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
    config: dict
    device: str  # the run's device (device=auto resolved)
    runs_dir: Path
    identity: dict  # oscar.identity.run_identity; run_id, config_digest and run_dir follow from it
    # made by preflight (not for a finished run):
    binding: Binding | None = None  # the model's config, the method and the backend, checked together
    placement: Placement | None = None  # where a model.device_map puts the layers (None = one device)
    decode: str | None = None  # the decode mode: graph or eager
    fused_layers: str | None = None  # the decode step's fused layers: on, merged or off
    #: the metrics of the finished run in run_dir (:func:`finished_metrics`), None while it is not finished
    done: dict | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        self.done = finished_metrics(self.run_dir)

    @property
    def run_id(self) -> str:
        return identity_digest(self.identity)[:10]

    @property
    def config_digest(self) -> str:
        return identity_digest(self.identity)[:12]

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.task.name / self.spec.name / f"{self.method.name}-{self.run_id}"

    @property
    def finished(self) -> bool:
        """Whether the run folder holds the metrics of a finished run (read when planned)."""
        return self.done is not None

    def refresh_files(self) -> None:
        """Recompute the identity's file digests once every GGUF model the run reads is converted (converting it
        now), where the plan had a stand-in for one (oscar.identity.weights_digest), and whether that run is done."""
        if unconverted(self.identity["files"]):
            files = run_files(self.task, self.method, self.spec, convert=True)
            self.identity = run_identity(self.config, self.identity["resolved"]["device_type"], files)
            self.done = finished_metrics(self.run_dir)


def finished_metrics(run_dir: Path) -> dict | None:
    """The metrics of the finished run in ``run_dir``: its metrics.json, a JSON object; None when there is none, or
    when it cannot be read or holds something else (a write cut short by an older version: the run is not finished;
    one warning names the file)."""
    path = Path(run_dir) / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON (a 0-byte file)
        log.warning("%s cannot be read (%s): the run is not finished and runs again", path,
                    getattr(e, "strerror", None) or type(e).__name__)
        return None
    if not isinstance(metrics, dict):
        log.warning("%s holds no metrics (a JSON %s): the run is not finished and runs again", path,
                    type(metrics).__name__)
        return None
    return metrics


@dataclass
class RunOptions:
    """The top-level keys of conf/config.yaml (typed like the methods' and tasks' options)."""

    seed: int = bounded(0, ge=0, le=2**32 - 1)  # what numpy's and torch's generators take
    device: str = "auto"
    dtype: Dtype | None = None
    runs_dir: str = "runs"
    results_file: str = "runs/rows.csv"
    rerun: bool = False
    decode: Literal["auto", "graph", "eager"] = "auto"
    prefill_chunk: int | None = bounded(None, ge=1)
    fused_layers: Literal["auto", "on", "merged", "off"] = "auto"
    data_root: str | None = None
    show_tables: bool = False

    def __post_init__(self) -> None:
        check_options(self, "config")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device):
            raise ValueError(f"config: device must be auto, cpu, cuda, cuda:<index> or mps, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"config: device={self.device} but no CUDA GPU is visible here (device=auto picks the CPU)")
        if self.data_root and not Path(self.data_root).expanduser().is_dir():  # else a typo falls back silently
            what = "is not a folder" if Path(self.data_root).expanduser().exists() else "does not exist"
            raise ValueError(f"config: data_root={self.data_root} {what} (the data folders after it would be used "
                             "instead); give a folder of data, or data_root=null")


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


def plan(cfg: DictConfig, tasks: TaskFactory) -> RunPlan:
    """Build and check (types, ranges) the run's options, method, task (made by ``tasks``) and model spec, and the
    run's identity (with the digests of the files it reads); nothing is loaded, downloaded, converted or written."""
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
    device = default_device() if options.device == "auto" else options.device
    identity = run_identity(config, device_type(spec, device), run_files(task, method, spec))
    return RunPlan(method, task, spec, config, device, Path(cfg.runs_dir), identity)


def preflight(cfg: DictConfig, tasks: TaskFactory) -> RunPlan:
    """Every check that does not need the model's weights (see the module docstring); a finished run
    (to be skipped) stops after the plan, or, for a GGUF model converted here, once its id is known."""
    p = plan(cfg, tasks)
    if p.finished and not cfg.rerun:
        return p
    process_provenance()  # the code this process runs, read before anything loads (a later commit is not it)
    p.task.check()
    p.task.check_method(p.method)
    check_writable(Path(cfg.runs_dir), "runs_dir", folder=True)
    check_run_folder(Path(cfg.runs_dir), p.run_dir)
    check_writable(Path(cfg.results_file), "results_file", folder=False)
    problem = results_file_problem(Path(cfg.results_file))
    if problem:  # found now, not by the append after the whole run
        raise ValueError(f"results_file={cfg.results_file}: {problem}; fix the file, or write to another "
                         "(results_file=...)")
    p.task.check_context(p.spec.max_length)
    if p.spec.attention is not None:  # the declared shape first (build_config checks it): no conversion or download
        p.method.check_model(p.spec.attention["head_dim"], p.spec.attention["kv_heads"])
    config = build_config(p.spec)
    p.refresh_files()  # a GGUF model is converted now: its id holds the converted copy's digest from here on
    if p.finished and not cfg.rerun:
        return p
    p.placement = plan_placement(p.spec, cfg.dtype, config=config)  # a device_map that cannot hold the weights fails
    devices = p.placement.devices if p.placement else p.device
    p.decode = resolve_mode(cfg.decode, devices)
    offered = offered_layer_fusion(config) is not None
    p.fused_layers = resolve_fused_layers(cfg.get("fused_layers", "auto"), devices, offered)
    p.task.check_positions(max_positions(config))
    if p.task.checks_tokenizer() and p.spec.kind == "causal_lm":  # other kinds: checked as the task builds prompts
        p.task.check_tokenizer(_checking_tokenizer(p.spec))
    p.binding = Binding(p.spec, config, p.method, _backend(cfg.backend))
    p.task.check_backend(p.binding.backend, p.method)
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
        if not folder and not stat.S_ISREG(path.stat().st_mode):  # opening a FIFO would wait for a reader
            raise ValueError(f"{option}={path} is not a regular file (a FIFO, socket or device)")
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


def check_run_folder(runs_dir: Path, run_dir: Path) -> None:
    """Raise a clear error when a file stands where the run's folder ``run_dir`` (under ``runs_dir``: task, model,
    run) or one of the folders above it must go."""
    folder = Path(runs_dir)
    for name in Path(run_dir).relative_to(runs_dir).parts:
        folder = folder / name
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"runs_dir={runs_dir}: {folder} is a file, where the run's folder {run_dir} needs a "
                             "folder; move the file, or use another runs_dir")


def environment(device: str) -> dict:
    import transformers

    state, version = process_provenance()
    commit, dirty = state or (None, False)
    env = dict(git_commit=commit, git_dirty=dirty, code_version=version,
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


def provenance(p: RunPlan) -> dict[str, str]:
    """What a finished run's rows and metrics.json record of where they come from: ``code_version``
    (:func:`run_code_version`), ``config_digest`` (the run's identity) and ``date`` (now, UTC ISO-8601)."""
    return dict(code_version=run_code_version(p.run_dir), config_digest=p.config_digest,
                date=datetime.now(timezone.utc).replace(microsecond=0).isoformat())


def run_code_version(run_dir: Path) -> str:
    """The code a run's numbers come from: this process's (oscar.provenance.process_code_version), or, where a resumed
    run's prediction log holds samples that another version computed, every version comma-separated in the order
    they first computed a sample, this one last (a warning counts each one's samples; ``rerun=true`` computes them
    all with this code)."""
    current = process_code_version()
    named = current or "unrecorded"  # as PredictionLog stamps a record where no version can be read
    versions = record_code_versions(run_dir / "predictions.jsonl")
    if set(versions) <= {named}:
        return current
    log.warning("%s: its samples were computed by more than one version of the code (%s; this one is %s): its rows "
                "name them all; rerun=true computes every sample with this code", run_dir,
                ", ".join(f"{version}: {n}" for version, n in versions.items()), named)
    return ", ".join([v for v in versions if v != named] + [named])


def tidy_rows(p: RunPlan, rows: list[dict], origin: dict[str, str] | None = None) -> list[dict]:
    """The task's rows with the run's identity: model, method hyperparameters, the method config
    (JSON), the task options that differ from the task's defaults (``task_config``) and the run's
    :func:`provenance` (``origin``; made here when not given)."""
    m = p.method
    bits = m.k_bits if m.k_bits == m.v_bits else f"K{m.k_bits}V{m.v_bits}"
    base = dict(model=p.spec.name, method=m.name, bits=bits, group_size=m.group_size,
                residual_length=m.residual_length, task=p.task.name, run_id=p.run_id,
                config=json.dumps(p.config["method"], sort_keys=True),
                task_config=task_config_label(p.config["task"], task_defaults(p.task)), **(origin or provenance(p)))
    return [{**base, **row} for row in rows]


def execute(cfg: DictConfig, p: RunPlan) -> dict:
    """Run the cell of ``cfg`` from its :func:`preflight` ``p``; returns its metrics (read back from disk when the
    run was already done). With ``rerun=true`` an existing run folder is moved aside first (:func:`set_aside`) and
    removed once this run has finished."""
    if p.finished and not cfg.rerun:
        log.info("skipping finished run %s (rerun=true to compute again)", p.run_dir)
        return p.done

    aside = set_aside(p.run_dir) if cfg.rerun else None
    p.run_dir.mkdir(parents=True, exist_ok=True)
    write_text(p.run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    start = time.perf_counter()
    lm = p.binding.load(seed=cfg.seed, device=p.placement or p.device, dtype=cfg.dtype, decode=p.decode,
                        prefill_chunk=cfg.prefill_chunk, fused_layers=p.fused_layers)
    log.info("run %s: %s / %s / %s on %s (backend=%s, decode=%s, fused_layers=%s)", p.run_id, p.spec.name,
             p.method.name, p.task.name, p.device, p.binding.backend.name, p.decode, p.fused_layers)
    result = p.task.run(lm, p.run_dir)
    seconds = time.perf_counter() - start
    if not result.rows or all(r.get("n") == 0 for r in result.rows):
        raise RuntimeError(f"{p.task.name}: the run scored no samples (rows: {result.rows}); it is not marked "
                           f"finished. Check the task's data ({p.run_dir / 'predictions.jsonl'})")
    check_finite(p.task.name, result.metrics, result.rows)

    storage = storage_rows(result.stored)
    origin = provenance(p)
    rows = tidy_rows(p, result.rows + storage, origin)
    engine = dict(backend=p.binding.backend.describe(), decode=p.decode, prefill_chunk=cfg.prefill_chunk,
                  fused_layers=p.fused_layers, device_map=p.placement.device_map if p.placement else None)
    write_json(p.run_dir / "env.json", {**environment(p.device), **engine, "seconds": seconds}, indent=2)
    write_json(p.run_dir / "rows.json", rows, indent=2)
    append_rows(Path(cfg.results_file), rows)
    metrics = {**result.metrics, **{r["metric"]: r["value"] for r in storage}, **origin}
    write_json(p.run_dir / "metrics.json", metrics, indent=2, sort_keys=True)  # last: it marks the run finished
    p.done = metrics
    if aside is not None:
        for old in asides(p.run_dir):  # this rerun's, and those of earlier reruns that were interrupted
            shutil.rmtree(old, ignore_errors=True)
            log.info("rerun finished: removed the earlier run folder %s", old)
    _mirror_to_wandb(cfg, p, result, rows)
    log.info("finished %s in %.1f s: %s", p.run_dir, seconds, metrics)
    return metrics


def set_aside(run_dir: Path) -> Path | None:
    """Move an existing ``run_dir`` (finished or not) to ``<run_dir>.old-<pid>`` (``-<n>`` added where that is
    taken) so that a rerun computes into a fresh folder; the caller removes it (:func:`asides`) once the rerun has
    finished. Returns where it went (None: there was no folder)."""
    if not run_dir.exists():
        return None
    aside, n = run_dir.with_name(f"{run_dir.name}.old-{os.getpid()}"), 0
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.old-{os.getpid()}-{n}")
    run_dir.rename(aside)
    log.info("rerun: computing from scratch; the earlier run folder is kept as %s until this run finishes (if it "
             "is interrupted, `rm -rf %s && mv %s %s` restores it)", aside, run_dir, aside, run_dir)
    return aside


def asides(run_dir: Path) -> list[Path]:
    """The folders :func:`set_aside` moved ``run_dir`` to (this process's and earlier, interrupted reruns')."""
    return sorted(run_dir.parent.glob(f"{glob.escape(run_dir.name)}.old-*"))


def storage_rows(stored: tuple[float, float] | None) -> list[dict]:
    """The KV caches' real stored bytes per token over the run's generations (``stored``: the task's summed
    (bytes, tokens) of every sample's record, resumed samples included; a record holds its cache's
    ``KVModel.stored_bytes`` / ``stored_tokens``: every layer, packed buffers and full-precision windows, as each
    generation ended), as a tidy row (subset ``all``, metric ``kv_bytes_per_token``, n = the tokens); none for a
    task that generates nothing (perplexity reports its own, kv_error none) or records no bytes."""
    if not stored or not stored[1]:
        return []
    stored_bytes, tokens = stored
    n = int(tokens) if float(tokens).is_integer() else tokens
    return [dict(subset="all", metric=KV_BYTES_METRIC, value=stored_bytes / tokens, n=n)]


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
