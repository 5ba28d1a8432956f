"""Typed, range-checked options for the dataclasses a config builds (methods, tasks, model specs, runs).

Hydra hands over whatever the command line said: ``method.rotate=off`` arrives as the string 'off'
(truthy), ``task.lengths=[-50]`` as a list with a negative length. :func:`check_options` checks
every field of a dataclass against its annotation, once, in the base class's ``__post_init__``:

- ``bool`` takes only a boolean (YAML / Hydra ``true`` / ``false``); anything else is refused by name;
- ``int`` an integer (not a bool, not 2.0); ``float`` any number (an int becomes a float); numpy scalars
  count as the Python numbers they hold (``numpy.int64(2)`` is the int 2);
- ``str``, ``Literal[...]`` (one of the listed values), ``X | None``, ``list[X]``, ``dict``;
- bounds declared with :func:`bounded` (``ge``/``gt``/``le``/``lt``; on a list: every element).
Annotations this module does not know are left alone.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from typing import Any, Literal

import numpy as np

_BOUNDS = "bounds"


def bounded(default: Any = dataclasses.MISSING, *, factory=dataclasses.MISSING, ge=None, gt=None, le=None,
            lt=None):
    """A dataclass field with bounds: ``pool_size: int = bounded(64, ge=0)``; on a list, per element."""
    bounds = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    return dataclasses.field(default=default, default_factory=factory, metadata={_BOUNDS: bounds})


def check_options(obj, owner: str) -> None:
    """Check (and normalize: int -> float for float fields) every field of the dataclass ``obj``.

    Raises ValueError naming ``owner``, the field, what it must be and what it got.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name not in hints:
            continue
        value = getattr(obj, f.name)
        ok, normalized = _conforms(value, hints[f.name])
        if not ok:
            raise ValueError(f"{owner}: {f.name} must be {describe(hints[f.name])}, got {value!r}")
        if normalized is not value:
            object.__setattr__(obj, f.name, normalized)
        bounds = f.metadata.get(_BOUNDS)
        if bounds and normalized is not None:
            for item in normalized if isinstance(normalized, (list, tuple)) else [normalized]:
                if not _within(item, bounds):
                    where = " (every element)" if isinstance(normalized, (list, tuple)) else ""
                    raise ValueError(f"{owner}: {f.name} must be {_bounds_text(bounds)}{where}, got {value!r}")


def _conforms(value, hint) -> tuple[bool, Any]:
    """(whether value fits hint, the value normalized)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args), value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, normalized = _conforms(value, arg)
            if ok:
                return True, normalized
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        if isinstance(value, np.bool_):
            return True, bool(value)
        return isinstance(value, bool), value
    if hint is int:  # numpy's integer scalars too (numbers.Integral), as a Python int
        ok = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
        return ok, int(value) if ok and type(value) is not int else value
    if hint is float:  # numpy's real scalars too, as a Python float
        ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        return ok, float(value) if ok and type(value) is not float else value
    if hint is str:
        return isinstance(value, str), value
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        if not args:
            return True, value
        items = [_conforms(v, args[0]) for v in value]
        if not all(ok for ok, _ in items):
            return False, value
        return True, type(value)(v for _, v in items) if any(v is not o for (_, v), o in zip(items, value)) else value
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    return True, value  # an annotation this module does not check


def describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"a list of {_plural(describe(args[0]))}" if args else "a list"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
             list: "a list"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _plural(text: str) -> str:
    return {"an integer": "integers", "a number": "numbers", "a string": "strings", "a mapping": "mappings",
            "true or false": "booleans"}.get(text, text)


def _within(x, bounds: dict) -> bool:
    checks = {"ge": lambda b: x >= b, "gt": lambda b: x > b, "le": lambda b: x <= b, "lt": lambda b: x < b}
    return all(checks[k](b) for k, b in bounds.items())


def _bounds_text(bounds: dict) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return " and ".join(f"{words[k]} {b}" for k, b in bounds.items())
