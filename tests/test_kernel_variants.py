"""Kernel variants (kernels.variant): one file per method, registered by name, so a kernel method touches no shared
file. A copy of kernels/variants/kivi.py registered under a new name, beside a method registered under that name,
is found by the backend, checked, and runs through the CuPy cache on the CPU emulator like the torch path (the
checks of tests/test_cupy_cache_emulated.py); a taken name is refused, an unknown one is refused by name."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from test_cupy_cache_emulated import check_cache_against_torch_path, emulator_libraries  # noqa: F401
from test_method_kernels_emulated import emulated_ops  # noqa: F401 (fixture)

from kernels.backend import KERNELS, check_method, missing
from kernels.variant import VARIANTS, KernelVariant, register_variant
from oscar import build_method
from oscar.method import METHODS
from oscar.paths import REPO_ROOT

#: what a contributor adds beside the copied variant: the method, registered under the same name
RENAMED_METHOD = '''

from dataclasses import dataclass

from methods.kivi import KIVI
from oscar.method import register_method


@register_method("kivi_renamed")
@dataclass
class RenamedKIVI(KIVI):
    """KIVI under another name."""
'''


@pytest.fixture
def scratch_registries(monkeypatch):
    """The method and variant registries as they are, restored after the test (its registrations dropped)."""
    for registry in (VARIANTS, METHODS):
        registry.names()  # discovered first: the copies hold every registered name
        monkeypatch.setattr(registry, "_classes", dict(registry._classes))
        monkeypatch.setattr(registry, "_origins", dict(registry._origins))


def drop_in(monkeypatch, tmp_path, name: str, source: str) -> None:
    """Import ``source`` as the module ``name`` from a file of its own (removed from sys.modules after the test)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)


def test_a_renamed_kivi_variant_runs_on_the_emulator(emulated_ops, scratch_registries, monkeypatch, tmp_path):
    source = (REPO_ROOT / "kernels" / "variants" / "kivi.py").read_text()
    assert source.count('@register_variant("kivi")') == 1
    source = source.replace('@register_variant("kivi")', '@register_variant("kivi_renamed")')
    assert "kivi_renamed" not in KERNELS
    drop_in(monkeypatch, tmp_path, "kivi_renamed_variant", source + RENAMED_METHOD)
    variant = KERNELS["kivi_renamed"]
    assert variant.kernel == "kivi" and "kivi_renamed" in list(KERNELS)
    check_method(build_method("kivi_renamed"))
    assert missing(build_method("kivi_renamed", k_bits=3)) == [
        "k_bits=3, v_bits=2 (the kernels pack 2 or 4 bits)"]
    check_cache_against_torch_path("kivi_renamed", dict(group_size=32, residual_length=32), "cpu")


def test_variant_names_are_refused_when_taken_and_named_when_unknown(scratch_registries, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="kernel variant name 'kivi' is already registered by KIVIVariant"):
        register_variant("kivi")(type("Other", (KernelVariant,), {}))
    assert missing(build_method("fp16")) == []  # the static BF16 mirror, no variant needed
    drop_in(monkeypatch, tmp_path, "no_variant_method", RENAMED_METHOD.replace("kivi_renamed", "no_variant"))
    with pytest.raises(ValueError, match=r"backend=cupy does not implement method=no_variant \(kernels exist for "
                                         r"kivi, oscar, ott, quarot, rotatekv, spectral, turboquant\)"):
        check_method(build_method("no_variant"))
    with pytest.raises(ValueError, match="unknown kernel variant 'nothing'; available: kivi, oscar, ott"):
        VARIANTS.get("nothing")
