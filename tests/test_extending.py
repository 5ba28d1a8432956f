"""docs/extending.md, followed once: its method steps 1 and 2 on a copy of the repository (the two code blocks of the
document written to methods/toy_signs.py and conf/method/toy_signs.yaml, nothing else edited), then step 4: the
conformance suite holds every test for the new method; the interface contract passes for it and fails for a broken
variant (queries left out of the attention space), with its name in the ids of the failing tests; ``-m slow``:
every test of the suite passes for it, and the broken variant fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from oscar.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "extending.md"
COPIED = ["oscar", "methods", "kernels", "evals", "scripts", "conf", "tests", "pyproject.toml", "README.md"]

BROKEN = '''"""toy_signs with its queries left unrotated: keys and queries in different spaces (must fail the suite)."""

from dataclasses import dataclass

from methods.toy_signs import ToySigns
from oscar.method import register_method


@register_method("toy_broken")
@dataclass
class ToyBroken(ToySigns):
    def transform_query(self, q, layer_idx):
        return q
'''


def method_steps() -> tuple[str, str]:
    """The code blocks of the method section: (the method file, its YAML)."""
    section = DOC.read_text().split("## A method")[1].split("\n## ")[0]
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    yaml = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(python) == len(yaml) == 1, "docs/extending.md: one method file and one YAML in the method steps"
    dedent = lambda block: "\n".join(line[3:] for line in block.splitlines()) + "\n"  # noqa: E731 (list indent)
    return dedent(python[0]), dedent(yaml[0])


@pytest.mark.parametrize("whole", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["contract", "suite"])
def test_the_documented_steps_add_a_method_that_the_suite_tests(repo_copy, whole):
    repo = repo_copy(COPIED, "*.pt")
    method, config = method_steps()
    (repo / "methods" / "toy_signs.py").write_text(method)  # step 1
    (repo / "conf" / "method" / "toy_signs.yaml").write_text(config)  # step 2
    (repo / "methods" / "toy_broken.py").write_text(BROKEN)
    (repo / "conf" / "method" / "toy_broken.yaml").write_text(config.replace("name: toy_signs", "name: toy_broken"))

    env = {**os.environ, "PYTHONPATH": str(repo)}  # the copy before the installed (editable) checkout
    pytest_args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py"]
    expected = set(re.findall(r'@pytest.mark.parametrize\("name", METHODS\)\n(?:@.*\n)*def (\w+)',
                              (repo / "tests" / "test_conformance.py").read_text()))
    listed = subprocess.run([*pytest_args, "--collect-only", "-k", "toy_signs"], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=900).stdout
    collected = set(re.findall(r"^tests/test_conformance.py::(\w+)\[[^\]]*toy_signs[^\]]*\]", listed, re.M))
    assert collected == expected, "every method test of the suite runs for the new method"
    out = subprocess.run([*pytest_args, "-rA", "-k", "toy" if whole else "test_interface_contract and toy"],  # step 4
                         cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    results = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) tests/test_conformance.py::(\w+)\[([^\]]*)\]",
                         out.stdout, re.M)
    assert results, out.stdout[-3000:] + out.stderr[-3000:]
    toy = {(test, ids): status for status, test, ids in results if "toy_signs" in ids}
    broken = {(test, ids): status for status, test, ids in results if "toy_broken" in ids}
    assert {test for test, _ in toy} == (expected if whole else {"test_interface_contract"})
    assert set(toy.values()) == {"PASSED"}, {k: v for k, v in toy.items() if v != "PASSED"}
    assert len(broken) == len(toy) and "FAILED" in broken.values()
    assert broken[("test_interface_contract", "toy_broken")] == "FAILED"
