"""The product speaks only of itself: no tracked file (code, configs, docs, results, logs) and no file name mentions
the sessions or the issues the project was built in; that history is in the commit messages. (This file holds the
pattern and is left out.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from oscar.paths import REPO_ROOT

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(?:st|nd|rd|th)|"
            "this|last|next|previous")
#: "session 17", "sessions 9, 11", "session17", "issue 22", "issues 13", "issue #27", "the eighth session"
HISTORY = re.compile(rf"(?<![a-z])(?:sessions?|issues?)[ _]?#?\d+|\b(?:{ORDINALS}) sessions?\b", re.IGNORECASE)


def mentions(text: str) -> list[str]:
    """The history mentions in ``text``, as found."""
    return [m.group(0) for m in HISTORY.finditer(text)]


def test_the_pattern_finds_the_forms_history_takes():
    assert mentions("the eighteenth session's run; session 17, sessions 9, 11; test_gpu_session9.log") == [
        "eighteenth session", "session 17", "sessions 9", "session9"]
    assert mentions("issue 22's targets, issues 13 and 23, (KIVI issue #27); ran until this session") == [
        "issue 22", "issues 13", "issue #27", "this session"]
    assert mentions('pytest fixtures of scope="session", a W&B session, loads issued together, '
                    "start_new_session=True, issue the copies") == []


def test_no_tracked_file_names_a_session_or_an_issue():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    this = Path(__file__).resolve().relative_to(REPO_ROOT).as_posix()
    found = []
    for name in filter(None, listed.stdout.decode().split("\0")):
        found += [f"{name}: the file's name" for _ in mentions(name)]
        path = REPO_ROOT / name
        if name == this or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:  # a binary file (figures)
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            found += [f"{name}:{number}: {m!r}" for m in mentions(line)]
    assert not found, f"{len(found)} mention(s) of how the project was built:\n" + "\n".join(found[:60])
