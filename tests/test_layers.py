"""The architecture of design.md section 2, checked on the code: every module of oscar/ methods/ kernels/
evals/ scripts/ oscar_vllm/ (and run.py) imports on its own in a fresh interpreter; no import cycle, counting the
imports inside functions; a module imports only modules of its own layer or of the layers below. Registries find
the layers above them by name (``importlib``: methods, backends, loaders, tasks), which is not an import here."""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import subprocess
import sys

from oscar.paths import REPO_ROOT

PACKAGES = ("oscar", "methods", "kernels", "evals", "scripts", "oscar_vllm")
#: modules that import an optional package at module level: imported on their own only where it is installed
OPTIONAL = {"oscar_vllm.backend": "vllm"}

#: design.md section 2, bottom to top; a module matches the first pattern that fits
LAYERS = [
    ("primitives and the method interface", ["oscar", "oscar.quant", "oscar.method", "oscar.options", "oscar.paths",
                                             "oscar.registry", "oscar.weights", "oscar.exact", "oscar.rope",
                                             "oscar.results", "oscar.flush", "oscar.manifest"]),
    ("methods", ["methods", "methods.*"]),
    ("kernels", ["kernels", "kernels.ops", "kernels.runtime", "kernels.quantizers", "kernels.decode_layouts",
                 "kernels.storage", "kernels.plans", "kernels.attention", "kernels.method_layouts",
                 "kernels.reference"]),
    ("cache, attention hook, backends, model loading", ["oscar.cache", "oscar.row_groups", "oscar.static_cache",
                                                        "oscar.attention", "oscar.backend", "oscar.engine", "oscar.lm",
                                                        "oscar.models", "oscar.multimodal", "oscar.placement",
                                                        "kernels.backend"]),
    ("serving: the vLLM plugin", ["oscar_vllm", "oscar_vllm.*"]),
    ("evals", ["evals", "evals.*"]),
    ("run.py and scripts", ["run", "oscar.runner", "scripts", "scripts.*"]),
]


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
