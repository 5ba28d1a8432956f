"""oscar.registry, the one registry behind methods, backends and tasks: a taken name refused (the same class
registered again is no duplicate), lazy discovery of the registering modules, the registered names in the error
for an unknown name, unknown options refused before construction."""

from __future__ import annotations

import importlib
import runpy
import sys
import textwrap
from dataclasses import dataclass

import pytest

from evals.base import Task, available_tasks, build_task, register_task, task_class
from oscar import KVMethod, available_methods, build_method, method_class, register_method
from oscar import registry as registry_module
from oscar.backend import Backend, available_backends, build_backend, register_backend

# (register, a name the repository registers, the base class, build by name, the registered names)
KINDS = {
    "method": (register_method, "kivi", KVMethod, build_method, available_methods),
    "backend": (register_backend, "torch", Backend, build_backend, available_backends),
    "task": (register_task, "perplexity", Task, build_task, available_tasks),
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_registry_refuses_a_taken_name(kind):
    register, taken, base, build, names = KINDS[kind]
    held = build(taken).__class__

    with pytest.raises(ValueError, match=f"name '{taken}' is already registered by {held.__qualname__}"):
        @register(taken)
        @dataclass
        class Impostor(base):
            pass

    assert type(build(taken)) is held and held.name == taken
    assert register(taken)(held) is held  # the class that holds the name, registered again: no duplicate


@pytest.mark.parametrize("kind", KINDS)
def test_every_registry_lists_its_names_for_an_unknown_one(kind):
    _, _, _, build, names = KINDS[kind]
    known = names()
    assert len(known) >= 2 and known == sorted(known)
    with pytest.raises(ValueError, match=f"unknown [a-zA-Z ]*'nope'; available: {', '.join(known)}$"):
        build("nope")


@pytest.mark.parametrize("kind, what", [("method", "hyperparameter"), ("backend", "option"), ("task", "option")])
def test_every_registry_refuses_unknown_options_naming_the_fields(kind, what):
    _, taken, _, build, _ = KINDS[kind]
    with pytest.raises(ValueError, match=rf"'{taken}' has no {what}\(s\) \['bogus'\]; it has \["):
        build(taken, bogus=1)


def test_lookups_that_may_miss():
    assert method_class("kivi").name == "kivi"
    assert task_class("niah").name == "niah" and task_class("a_removed_task") is None  # rows of an old run
    with pytest.raises(ValueError, match="unknown KV method 'nope'"):
        method_class("nope")


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """A registry ``THINGS`` (module ``home_<id>``) over a package ``pkg_<id>`` of two registering modules, and a
    module ``extra_<id>`` registering a third class outside it: (home module name, package name, extra name)."""
    tag = tmp_path.name.replace("-", "_")
    home, package, extra = f"home_{tag}", f"pkg_{tag}", f"extra_{tag}"
    registry = f"from oscar.registry import Registry\nTHINGS = Registry('thing', ['{package}'])\n"
    (tmp_path / f"{home}.py").write_text(registry)
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    source = textwrap.dedent("""
        from dataclasses import dataclass

        from {home} import THINGS


        @THINGS.register("{name}")
        @dataclass
        class {cls}:
            size: int = 1
        """)
    for module, name, cls in ((f"{package}/alpha", "alpha", "Alpha"), (f"{package}/beta", "beta", "Beta"),
                              (extra, "gamma", "Gamma")):
        (tmp_path / f"{module}.py").write_text(source.format(home=home, name=name, cls=cls))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield home, package, extra
    for name in [m for m in sys.modules if m.split(".")[0] in (home, package, extra)]:
        del sys.modules[name]


def test_discovery_imports_the_registering_modules_on_the_first_lookup_only(toy_package, monkeypatch):
    home, package, extra = toy_package
    things = importlib.import_module(home).THINGS
    assert f"{package}.alpha" not in sys.modules  # nothing imported before a lookup
    walks = []
    walk = registry_module._import_with_submodules
    monkeypatch.setattr(registry_module, "_import_with_submodules", lambda name: walks.append(name) or walk(name))
    assert things.names() == ["alpha", "beta"]
    assert things.get("beta").name == "beta" and things.build("alpha", {"size": 3}).size == 3
    assert walks == [package]  # the package walked once, for every lookup
    with pytest.raises(ValueError, match="unknown thing 'gamma'; available: alpha, beta$"):
        things.get("gamma")
    assert things.get("gamma", also=[extra]).name == "gamma"  # a class defined elsewhere, its module named
    with pytest.raises(ValueError, match=r"thing 'alpha' has no option\(s\) \['weight'\]; it has \['size'\]"):
        things.build("alpha", {"weight": 2})


def test_a_module_imported_twice_registers_the_same_classes_again(toy_package):
    """A module run with ``python -m`` after an import of it (or reloaded) runs its class statements again: not a
    duplicate. A different class under a taken name is."""
    home, package, _ = toy_package
    things = importlib.import_module(home).THINGS
    first = things.get("alpha")
    alpha = importlib.import_module(f"{package}.alpha")
    runpy.run_path(alpha.__file__, run_name="__main__")  # what `python -m pkg.alpha` does
    assert things.get("alpha") is not first and things.get("alpha").__qualname__ == "Alpha"
    importlib.reload(alpha)
    assert things.get("alpha") is alpha.Alpha

    with pytest.raises(ValueError, match=r"thing name 'alpha' is already registered by Alpha \(pkg_.*\.alpha\); "
                                         r".*<locals>\.Alpha \(.*test_registry\) needs another name"):
        @things.register("alpha")
        class Alpha:
            pass
