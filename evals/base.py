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
(``grid_options``, ``grid_cell``), which subsets it can read (``subset_problem``), what a value is taken over
(``sample_words``: columns never mix two), which rows a table reads (``shown``), how its summary rows merge
over runs (``merge_rows``) and its own tables and figures (``report``); the paper's numbers for it are in
evals/paper.yaml."""

from __future__ import annotations

import dataclasses
import logging
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from oscar.lm import KVModel
from oscar.options import check_options
from oscar.registry import Registry
from oscar.results import parse_task_config, task_config_label

log = logging.getLogger(__name__)

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
    value, n (the runner adds model/method/run_id); ``figures``: files written into the run folder;
    ``stored``: (bytes, tokens) the KV caches of every generation of the run stored (:func:`stored_total` of its
    records, samples of earlier processes of a resumed run included), from which the runner reports
    ``kv_bytes_per_token``; None for a task that generates nothing or cannot say."""

    metrics: dict[str, float]
    rows: list[dict]
    figures: list[Path] = field(default_factory=list)
    stored: tuple[float, float] | None = None


#: what a generating task's record holds of its sample's KV cache (KVModel.stored_bytes / stored_tokens)
STORED_FIELDS = ("stored_bytes", "stored_tokens")


def stored_counts(lm: KVModel) -> tuple[int, int]:
    """``lm``'s running (stored_bytes, stored_tokens): read before a generation, handed to :func:`stored_since`."""
    return lm.stored_bytes, lm.stored_tokens


def stored_since(lm: KVModel, before: tuple[int, int], share: int = 1) -> dict[str, int | float]:
    """A record's ``stored_bytes`` / ``stored_tokens``: what the caches of ``lm``'s generations since ``before``
    (:func:`stored_counts`) stored, divided by ``share`` (the samples of one batch split its cache evenly)."""
    counts = [now - then for now, then in zip(stored_counts(lm), before)]
    return dict(zip(STORED_FIELDS, counts if share == 1 else [count / share for count in counts]))


def stored_of(finished) -> dict[str, int]:
    """A record's ``stored_bytes`` / ``stored_tokens`` from a scheduled sample's ``oscar.continuous.Finished``: what
    its own cache row stored."""
    return dict(zip(STORED_FIELDS, (finished.stored_bytes, finished.stored_tokens)))


def stored_total(records: list[dict], where: Path | str) -> tuple[float, float] | None:
    """Summed (stored_bytes, stored_tokens) of the records of a run; None when any lacks them (records written before
    they were stored per sample, in ``where``: a warning says so, and that ``rerun=true`` computes them)."""
    missing = sum(any(not isinstance(r.get(k), (int, float)) for k in STORED_FIELDS) for r in records)
    if missing or not records:
        if missing:
            log.warning("%s: %d of %d records hold no stored KV bytes (written by an older version): "
                        "kv_bytes_per_token is left out; rerun=true computes it", where, missing, len(records))
        return None
    return tuple(sum(r[k] for r in records) for k in STORED_FIELDS)


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

    def check_backend(self, backend, method) -> None:
        """Raise a clear error if the task cannot run ``method`` through ``backend`` (an oscar.backend.Backend).
        Checked before the weights load."""

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
    def grid_cell(cls, subset: str) -> bool:
        """Whether a row of ``subset`` holds one cell of the task's grid (the grid options choose which cells run, so
        a cell's value does not depend on them); a summary row covers the cells its run chose. Default: no grid."""
        return False

    @classmethod
    def subset_problem(cls, subset: str) -> str:
        """What keeps a row of ``subset`` out of the tables ("" when nothing does), e.g. a NIAH cell that is not
        ``<length>@<depth>``. Default: nothing."""
        return ""

    @classmethod
    def sample_words(cls, row: dict) -> str:
        """What the row's value is taken over, in words, from its ``n`` and subset (``8188 tokens``, ``20 cells``):
        a table column never mixes values over two of them. Default: ``n=<n>``."""
        return f"n={row['n']}"

    @classmethod
    def shown(cls, row: dict) -> bool:
        """Whether a table or figure of ``make tables`` reads the row (the committed results keep only those).
        Default: every row."""
        return True

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """This task's own tables and figures under ``out`` (tables/, figures/) from the tidy rows (of every
        task, summaries merged); returns the files written. Default: none (the methods table shows the
        headline)."""
        return []
