"""The task interface: a dataclass of options with ``check`` (before any model load) and ``run``
(the benchmark on a KVModel), registered by name like the methods.

Before the model loads, the runner builds the task (every option typed and range-checked by
``oscar.options`` in ``Task.__post_init__``), calls ``check()`` (data files opened and parsed, the hub
reached or refused) and ``check_context(max_length)`` (lengths against the model's), and hashes
``data_files()`` into the run id, so a run on changed data is a new run."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from oscar.lm import KVModel
from oscar.options import check_options

_TASKS: dict[str, type["Task"]] = {}



def register_task(name: str):
    def wrap(cls):
        cls.name = name
        _TASKS[name] = cls
        return cls

    return wrap


def available_tasks() -> list[str]:
    """Names of the registered tasks (every module of the ``evals`` package is imported once)."""
    import evals

    for module in pkgutil.iter_modules(evals.__path__):
        importlib.import_module(f"evals.{module.name}")
    return sorted(_TASKS)


def build_task(name: str, **options) -> "Task":
    known = available_tasks()
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(known)}")
    cls = _TASKS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {unknown}; it has {sorted(fields)}")
    return cls(**options)


@dataclass
class TaskResult:
    """``metrics``: flat name -> value (metrics.json); ``rows``: tidy rows with keys subset, metric,
    value, n (the runner adds model/method/run_id); ``figures``: files written into the run folder."""

    metrics: dict[str, float]
    rows: list[dict]
    figures: list[Path] = field(default_factory=list)


@dataclass
class Task:
    name: ClassVar[str] = "base"

    def __post_init__(self) -> None:
        check_options(self, self.name)

    def check(self) -> None:
        """Raise a clear error (missing or malformed data file, unreachable hub) before any model is loaded."""

    def check_context(self, max_length: int) -> None:
        """Raise a clear error if the task would feed a model of ``max_length`` tokens longer inputs."""

    def data_files(self) -> list[Path]:
        """The local files the run reads (hashed into the run id); [] for hub data."""
        return []

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        raise NotImplementedError
