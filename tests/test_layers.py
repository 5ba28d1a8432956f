"""The architecture of design.md section 2, checked on the code: every module of oscar/ methods/ kernels/
evals/ scripts/ benchmarks/ oscar_vllm/ (and run.py) imports on its own in a fresh interpreter; no import cycle,
counting the imports inside functions; a module imports only modules of its own layer or of the layers below, and no
module of oscar/ (the core) imports the methods, the kernels, evals/ (the tasks), the vLLM plugin, scripts/,
benchmarks/ or run.py, by any import statement in the file or by ``importlib`` with the name written out: the layers
above depend on the core, never the reverse. Registries find the layers above them by a name they are given
(``importlib``: methods, backends, loaders, tasks), which is not an import here; the runner (oscar.runner) is handed
the task registry by run.py, the torch backend's static cache the kernels' fused step rotation by the backend that
offers it (oscar.backend.offered_step_rotation)."""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import subprocess
import sys

from oscar.paths import REPO_ROOT

PACKAGES = ("oscar", "methods", "kernels", "evals", "scripts", "benchmarks", "oscar_vllm")
#: modules that import an optional package at module level: imported on their own only where it is installed
OPTIONAL = {"oscar_vllm.backend": "vllm"}

#: design.md section 2, bottom to top; a module matches the first pattern that fits
LAYERS = [
    ("primitives and the method interface", ["oscar.quant", "oscar.method", "oscar.options", "oscar.paths",
                                             "oscar.registry", "oscar.weights", "oscar.exact", "oscar.rope",
                                             "oscar.results", "oscar.flush", "oscar.manifest", "oscar.transfer",
                                             "oscar.atomic", "oscar.provenance"]),
    ("methods", ["methods", "methods.*"]),
    ("kernels", ["kernels", "kernels.ops", "kernels.runtime", "kernels.quantizers", "kernels.decode_layouts",
                 "kernels.storage", "kernels.plans", "kernels.attention", "kernels.method_layouts",
                 "kernels.kept_tokens", "kernels.ott_pool", "kernels.rotatekv_keys", "kernels.layers",
                 "kernels.fused_layers", "kernels.reference", "kernels.variant", "kernels.variants",
                 "kernels.variants.*"]),
    # the package itself exports the drop-in (oscar.apply) beside the method interface
    ("cache, attention hook, backends, model loading", ["oscar", "oscar.cache", "oscar.row_groups", "oscar.row_slots",
                                                        "oscar.static_cache", "oscar.attention", "oscar.backend",
                                                        "oscar.engine", "oscar.continuous", "oscar.lm",
                                                        "oscar.preparation", "oscar.dropin", "oscar.models",
                                                        "oscar.multimodal", "oscar.placement",
                                                        "kernels.backend", "kernels.cupy_layer", "kernels.cupy_flush",
                                                        "kernels.cupy_storage"]),
    ("serving: the vLLM plugin", ["oscar_vllm", "oscar_vllm.*"]),
    ("the runner: one run of the task it is handed, what the run is, a sweep of them", ["oscar.runner", "oscar.identity",
                                                                                         "oscar.sweeps"]),
    ("evals", ["evals", "evals.*"]),
    ("run.py, scripts and benchmarks", ["run", "scripts", "scripts.*", "benchmarks", "benchmarks.*"]),
]
#: what no module of oscar/ imports: every package that is not the core (each one depends on the core)
NOT_FROM_OSCAR = ("methods", "kernels", "evals", "oscar_vllm", "scripts", "benchmarks", "run")


def project_modules() -> dict[str, object]:
    """Module name -> its file, for every .py file of the packages and run.py."""
    modules = {"run": REPO_ROOT / "run.py"}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def layer_of(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return index
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py::LAYERS (design.md section 2): place it")


def imports_of(path, modules: dict) -> set[str]:
    """The project modules a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def imported_names(path, root=REPO_ROOT) -> set[str]:
    """Every module name a file (under ``root``) imports: ``import`` and ``from ... import`` statements anywhere
    (module level, functions, branches; a relative import as the module it names) and ``importlib.import_module`` /
    ``__import__`` calls with the name written out."""
    names = set()
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(
                node.args[0].value, str) and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                                                        "__import__"):
            names.add(node.args[0].value)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_every_module_is_in_a_layer_and_imports_downward_only():
    upward = []
    for module, imported in sorted(import_graph().items()):
        for other in sorted(imported):
            if layer_of(other) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {other} "
                              f"({LAYERS[layer_of(other)][0]})")
    assert not upward, "\n".join(upward)


def test_oscar_imports_nothing_above_it():
    """oscar/ is the base: no module of it imports methods/ (found by the registry), kernels/ (the backend that offers
    a kernel hands it in), evals/ (the runner is handed the task registry), the vLLM plugin, scripts/, benchmarks/ or
    run.py, at module level or inside a function."""
    climbing = []
    for module, path in sorted(project_modules().items()):
        if module.split(".")[0] == "oscar":
            above = sorted(name for name in imported_names(path) if name.split(".")[0] in NOT_FROM_OSCAR)
            climbing += [f"{module} ({path.relative_to(REPO_ROOT)}) imports {name}" for name in above]
    assert not climbing, "\n".join(climbing)


def test_the_import_scan_finds_imports_inside_functions(tmp_path):
    """The scan of the rule above finds an import wherever a file writes it (and only what it imports)."""
    probe = tmp_path / "oscar" / "sub" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("import os\n\n\ndef f():\n    from evals import build_task\n\n\n"
                     "class C:\n    def g(self):\n        if True:\n            import evals.niah as niah\n\n\n"
                     "def h():\n    import importlib\n    return importlib.import_module('scripts.make_tables')\n\n\n"
                     "def i():\n    from ..lm import KVModel\n    from . import sibling\n")
    assert imported_names(probe, root=tmp_path) == {
        "os", "evals", "evals.build_task", "evals.niah", "importlib", "scripts.make_tables",
        "oscar.lm", "oscar.lm.KVModel", "oscar.sub", "oscar.sub.sibling"}


def test_no_import_cycle():
    graph = import_graph()
    cycles, index, low, stack, on_stack, counter = [], {}, {}, [], set(), [0]

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"modules that import each other: {cycles}"


def test_every_module_imports_on_its_own():
    """Each module imported first in a fresh set of project modules (third-party packages stay loaded, so one
    interpreter serves them all): an import that works only after another module was imported fails here."""
    names = sorted(name for name in project_modules()
                   if name not in OPTIONAL or importlib.util.find_spec(OPTIONAL[name]) is not None)
    script = f"""
import importlib, json, sys, traceback
sys.path.insert(0, {str(REPO_ROOT)!r})
failed = {{}}
for name in {names!r}:
    for loaded in [m for m in sys.modules if m.split(".")[0] in {PACKAGES + ("run",)!r}]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{name}:\n{trace}" for name, trace in failed.items())


def test_the_kernels_step_rotation_reaches_the_core_through_its_backend(monkeypatch):
    """The torch backend's static cache gets the fused step rotation that a registered backend offers (the cupy
    backend's kernel where CuPy and a GPU are present; none on a CPU-only machine), without oscar/ importing it."""
    from kernels.backend import CupyBackend
    from kernels.runtime import cupy_available
    from oscar import build_method
    from oscar.backend import build_backend, offered_step_rotation
    from tests.conftest import build_tiny

    if not cupy_available():
        assert offered_step_rotation() is None
    model = build_tiny("tiny-llama")

    def rotation(query, keys, lengths):
        return query

    monkeypatch.setattr(CupyBackend, "step_rotation", lambda self: rotation)
    cache = build_backend("torch").static_cache(model, build_method("oscar"), [0], 256)
    assert [layer.step_rotation for layer in cache.layers] == [rotation] * len(cache.layers)
