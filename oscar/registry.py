"""A registry: the classes of one kind (KV methods, backends, tasks) by name, with one behaviour for every kind.

- ``register(name)``, a class decorator in the module that defines the class, refuses a name another class
  holds (the same class registered again, its module imported a second time, e.g. run as ``python -m``, is no
  duplicate: it replaces itself);
- discovery is lazy: the first lookup imports the modules that register (``modules``: each named module, and
  every module of a named package), so the layers above are found by name and never imported from below;
- an unknown name raises ValueError listing the registered names, and ``build`` refuses options the class (a
  dataclass) has no field for, naming those it has, before anything is constructed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> classes of one ``kind`` ("KV method", "backend", "task"), found in ``modules``; ``options`` is
    what the error of :meth:`build` calls the dataclass fields ("hyperparameter", "option")."""

    def __init__(self, kind: str, modules: Sequence[str], options: str = "option"):
        self.kind = kind
        self.modules = tuple(modules)
        self.options = options
        self._classes: dict[str, type[T]] = {}
        self._origins: dict[str, tuple[str, str | None]] = {}  # name -> where its class statement is
        self._discovered = False

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: the class becomes ``name`` (its ``name`` attribute is set)."""

        def wrap(cls: type[T]) -> type[T]:
            held, origin = self._classes.get(name), _origin(cls)
            if held is not None and held is not cls and (origin != self._origins[name] or origin[1] is None):
                raise ValueError(f"{self.kind} name {name!r} is already registered by {held.__qualname__} "
                                 f"({held.__module__}); {cls.__qualname__} ({cls.__module__}) needs another name")
            cls.name = name
            self._classes[name], self._origins[name] = cls, origin
            return cls

        return wrap

    def discover(self, also: Sequence[str] = ()) -> None:
        """Import the registering modules (once: on the first lookup), then the modules ``also`` names (a class
        defined elsewhere, e.g. a backend's ``module`` in its conf/backend YAML)."""
        if not self._discovered:
            for module in self.modules:
                _import_with_submodules(module)
            self._discovered = True
        for module in also:
            importlib.import_module(module)

    def names(self, also: Sequence[str] = ()) -> list[str]:
        self.discover(also)
        return sorted(self._classes)

    def find(self, name: str) -> type[T] | None:
        """The class registered as ``name``, or None."""
        self.discover()
        return self._classes.get(name)

    def get(self, name: str, also: Sequence[str] = ()) -> type[T]:
        """The class registered as ``name``; ValueError listing the registered names otherwise."""
        known = self.names(also)
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {', '.join(known)}")
        return self._classes[name]

    def build(self, name: str, options: dict, also: Sequence[str] = ()) -> T:
        """``cls(**options)`` for the class registered as ``name``, unknown options refused first."""
        cls = self.get(name, also)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"{self.kind} {name!r} has no {self.options}(s) {unknown}; it has {sorted(fields)}")
        return cls(**options)


def _import_with_submodules(name: str) -> None:
    module = importlib.import_module(name)
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        importlib.import_module(f"{name}.{info.name}")


def _origin(cls: type) -> tuple[str, str | None]:
    """(qualified name, file) of a class statement: the same for the statement run twice (a module imported
    again, or run as ``python -m`` after an import of it); no file for a class typed into an interpreter."""
    try:
        return cls.__qualname__, os.path.realpath(inspect.getfile(cls))
    except (TypeError, OSError):
        return cls.__qualname__, None
