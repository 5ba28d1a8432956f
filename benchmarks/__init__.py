"""The measurements: one module per question, one harness, one command.

    python -m benchmarks --help                 # the questions, one line each
    python -m benchmarks QUESTION [options]     # e.g. python -m benchmarks user_path --kernels oscar kivi

A question is a module of this package that defines

- a docstring whose first line is the question (``--help`` lists it) and whose body says what each row measures;
- ``add_arguments(parser)``: its options (``--out`` and ``--budget`` are everyone's; ``parser.set_defaults(budget=...)``
  sets its own default budget);
- ``run(args, bench)``: measures, adding each row with ``bench.add(row)`` (``bench``: a benchmarks.harness.Run, which
  writes ``<out>/<question>.csv`` after every row, below the rows earlier runs left there, each row led by the
  question, the GPU, the date, the code version and the command's arguments);

and may define ``FIELDS`` (its measured columns, in CSV order), ``table(rows) -> str`` (its README table, Markdown)
and ``figure(rows, path)`` (its figure): ``make tables`` draws both from the CSVs (benchmarks.report). The helpers
(``harness``, ``filled``, ``profiling``, ``report``) define no ``run``. docs/extending.md says how to add a question.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from pathlib import Path
from types import ModuleType

__all__ = ["is_question", "load_question", "questions"]


def is_question(module: ModuleType) -> bool:
    """Whether ``module`` is a question: it defines ``add_arguments`` and ``run``."""
    return callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None))


def questions() -> dict[str, ModuleType]:
    """The questions of this package by name, sorted."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            if is_question(module):
                found[info.name] = module
    return dict(sorted(found.items()))


def load_question(name: str) -> ModuleType:
    """The question ``name`` of this package, or the module file ``name`` (a path ending in .py: a question being
    written elsewhere runs the same way); ValueError naming the known questions otherwise."""
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"no question module at {path}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        known = questions()
        if name not in known:
            raise ValueError(f"unknown question {name!r}; the questions: {', '.join(known)}")
        module = known[name]
    if not is_question(module):
        raise ValueError(f"{name} defines no add_arguments(parser) and run(args, bench): not a question")
    return module
