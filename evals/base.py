"""The task interface: a dataclass of options with ``check`` (before any model load) and ``run``
(the benchmark on a KVModel), registered by name like the methods.

Before the model loads, the runner builds the task (every option typed and range-checked by
``oscar.options`` in ``Task.__post_init__``), calls ``check()`` (data files opened and parsed, the hub
reached or refused), ``check_method(method)`` (options against the KV method), ``check_context(max_length)``
(lengths against the model's), ``check_positions`` and, where a task overrides it, ``check_tokenizer`` (its
prompts or corpus against the model's tokenizer), and hashes ``data_files()`` into the run id, so a run on
changed data is a new run.

For the tables (`make tables`, evals/tables.py) a task declares its headline numbers (``headline``: the
columns of the methods table, each with its direction), the options that only choose grid cells
(``grid_options``), how its summary rows merge over runs (``merge_rows``) and its own tables and figures
(``report``); the paper's numbers for it are in evals/paper.yaml."""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from oscar.lm import KVModel
from oscar.options import check_options
from oscar.registry import Registry
from oscar.results import parse_task_config, task_config_label

#: tasks by name; the first lookup imports every module of the ``evals`` package (their ``@register_task``)
TASKS: Registry["Task"] = Registry("task", ["evals"])


def register_task(name: str):
    """Class decorator: make a Task buildable as ``build_task(name, ...)`` (a name taken: ValueError)."""
    return TASKS.register(name)


def available_tasks() -> list[str]:
    """The registered task names, sorted."""
    return TASKS.names()


def task_class(name: str) -> type["Task"] | None:
    """The registered task ``name`` (None for a name no module registers, e.g. rows of a removed task)."""
    return TASKS.find(name)


def build_task(name: str, **options) -> "Task":
    """Build a registered task; unknown names and options raise ValueError before any work."""
    return TASKS.build(name, options)


def check_template(task: str, option: str, template: str, fields: tuple[str, ...]) -> None:
    """Refuse a prompt template that ``template.format(**{field: ...})`` cannot fill: a field other than ``fields``
    (a name, a positional ``{0}`` or ``{}``, JSON's braces), an unmatched brace, or one of ``fields`` missing."""
    escape = "write a literal brace as {{ or }}"
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"{task}: {option} {template!r} is not a format string ({e}); {escape}") from None
    unknown = list(dict.fromkeys(n for n in names if n not in fields))
    if unknown:
        shown = ", ".join("{" + n + "}" for n in unknown)
        raise ValueError(f"{task}: {option} has the field(s) {shown}, but only "
                         f"{' and '.join('{' + f + '}' for f in fields)} are filled in; {escape}")
    missing = [f for f in fields if f not in names]
    if missing:
        raise ValueError(f"{task}: {option} needs {' and '.join('{' + f + '}' for f in fields)}")
    try:
        template.format(**{f: "" for f in fields})
    except (KeyError, IndexError, ValueError, AttributeError) as e:  # a field inside a format spec, ...
        raise ValueError(f"{task}: {option} {template!r} cannot be filled ({type(e).__name__}: {e}); "
                         f"{escape}") from None


@dataclass
class TaskResult:
    """``metrics``: flat name -> value (metrics.json); ``rows``: tidy rows with keys subset, metric,
    value, n (the runner adds model/method/run_id); ``figures``: files written into the run folder."""

    metrics: dict[str, float]
    rows: list[dict]
    figures: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Headline:
    """A headline number of a task: ``metric`` of ``subset`` (None: of every subset that has it), better when
    higher unless ``higher_is_better`` is False (errors, perplexity)."""

    metric: str
    subset: str | None = None
    higher_is_better: bool = True


@dataclass
class Task:
    name: ClassVar[str] = "base"
    #: the columns of the methods table (none: every metric of a summary subset: all, average, mean)
    headline: ClassVar[tuple[Headline, ...]] = ()
    #: options that only choose which cells of a grid run (each row names its cell in ``subset``): runs that
    #: differ only there share a table line
    grid_options: ClassVar[tuple[str, ...]] = ()
    #: how table labels say an option's value (its text in ``task_config``) in words, e.g. max_windows:
    #: "16" -> "16 windows"; options not here read "<option> <value>"
    option_words: ClassVar[dict[str, Callable[[str], str]]] = {}

    def __post_init__(self) -> None:
        check_options(self, self.name)

    def check(self) -> None:
        """Raise a clear error (missing or malformed data file, unreachable hub) before any model is loaded."""

    def check_context(self, max_length: int) -> None:
        """Raise a clear error if the task would feed a model of ``max_length`` tokens longer inputs."""

    def check_method(self, method) -> None:
        """Raise a clear error if the task cannot run with this KV ``method`` (an oscar.method.KVMethod: e.g. a
        length shorter than one of its groups). Checked before the weights load."""

    def check_positions(self, max_positions: int | None) -> None:
        """Raise a clear error if a prompt and the tokens generated after it would run past the model's
        ``max_positions`` (its config's; None: unknown). Checked before the weights load."""

    def check_tokenizer(self, tokenizer) -> None:
        """Raise a clear error if the task's prompts cannot be built for this model's ``tokenizer`` (a NIAH length
        shorter than its needle). Checked before the weights load, only for tasks that override it."""

    @classmethod
    def checks_tokenizer(cls) -> bool:
        """Whether :meth:`check_tokenizer` checks anything (the runner loads the tokenizer only then)."""
        return cls.check_tokenizer is not Task.check_tokenizer

    def data_files(self) -> list[Path]:
        """The local files the run reads (hashed into the run id); [] for hub data."""
        return []

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        raise NotImplementedError

    # -- tables (make tables) ------------------------------------------------------------------
    @classmethod
    def default_options(cls) -> dict[str, str]:
        """The options' defaults as text, as a ``task_config`` writes values (``oscar.results.task_config_label``)."""
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        return parse_task_config(task_config_label(defaults, {}))

    @classmethod
    def merge_rows(cls, rows: list[dict]) -> list[dict]:
        """The tidy rows (of every task) with this task's summary rows recomputed over its runs. Default: as
        they are."""
        return rows

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """This task's own tables and figures under ``out`` (tables/, figures/) from the tidy rows (of every
        task, summaries merged); returns the files written. Default: none (the methods table shows the
        headline)."""
        return []
