"""Which code computed a number: the commit of the checkout (:func:`git_state`), as rows, metrics.json, prediction
records and benchmark rows name it (:func:`code_version`). It is recorded beside the numbers, never in a run's identity
(oscar.identity)."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from oscar.paths import REPO_ROOT

#: what a run writes, a person reads or the test suite checks, not what computes a number: changes there leave the
#: tree's code clean (a run that appends to results/rows.csv does not make the next run's code "+dirty"; calibration
#: files under results/ are in the run's identity by their digests)
NOT_CODE = ("results", "docs", "tests", "*.md")


def git_state(root: Path = REPO_ROOT) -> tuple[str, bool] | None:
    """(commit, dirty) of the checkout at ``root``, or None where git or a checkout of ``root`` itself is not there
    (an installed package outside the repository, possibly inside another one); dirty: uncommitted changes outside
    :data:`NOT_CODE`."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    commit = git("rev-parse", "HEAD")
    if not top or not commit or Path(top).resolve() != Path(root).resolve():
        return None
    return commit, bool(git("status", "--porcelain", "--", ".", *(f":(exclude){path}" for path in NOT_CODE)))


def code_version(root: Path = REPO_ROOT) -> str:
    """The code that computes a run: ``$OSCAR_CODE_VERSION`` where set (a copy of the tree sent to another machine,
    whose .git, if it has one, need not be the commit it was copied from), else its commit's first 10 hex digits,
    ``+dirty`` when the tree's code has uncommitted changes (:func:`git_state`); "" where git or the checkout is not
    there."""
    if os.environ.get("OSCAR_CODE_VERSION"):
        return os.environ["OSCAR_CODE_VERSION"]
    state = git_state(root)
    if state is None:
        return ""
    commit, dirty = state
    return commit[:10] + ("+dirty" if dirty else "")


@functools.cache
def process_provenance() -> tuple[tuple[str, bool] | None, str]:
    """(:func:`git_state`, :func:`code_version`) of the repository as this process first read them: the code a process
    runs is the code it imported, so a commit made while it runs (the next change, results committed beside a sweep)
    does not rename its numbers. The runner reads it before any weights load; every record, row and env.json of the
    process names it."""
    return git_state(), code_version()


def process_code_version() -> str:
    """This process's :func:`code_version` (:func:`process_provenance`)."""
    return process_provenance()[1]
