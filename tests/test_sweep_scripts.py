"""The documented CPU sweeps (scripts/frontier_sweeps.sh, scripts/ruler_sweep.sh): each one's ``run`` helper, taken
from the script and run with a Python that fails, logs the run's real exit status in the progress log."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from oscar.paths import REPO_ROOT


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script, progress", [("frontier_sweeps.sh", "sweeps_progress.log"),
                                              ("ruler_sweep.sh", "ruler_progress.log")])
def test_a_sweeps_progress_log_holds_each_runs_exit_status(tmp_path, script, progress):
    text = (REPO_ROOT / "scripts" / script).read_text()
    helper = re.search(r"^run\(\) \{.*?; \}$", text, re.S | re.M)
    assert helper, f"{script}: its run() helper"
    for python, status in (("false", 1), ("true", 0)):
        subprocess.run(["bash", "-c", f"PY={python}\n{helper.group(0)}\nrun first --flag"], cwd=tmp_path, check=True)
        last = (tmp_path / progress).read_text().splitlines()[-1]
        assert last.endswith(f"end first rc={status}"), last
