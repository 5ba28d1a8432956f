"""Reading a benchmark's local data files with errors that name the file and the line, and checking
that a hub dataset can be had, all before any model is loaded (``Task.check``).

A task's ``check`` opens its files and parses the rows the run will read: a malformed line, a row
without a required column or an empty file fails there, as ``<file>:<line>: <what is wrong>``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path


class DataError(ValueError):
    """A local data file that cannot be used: malformed, wrong columns, or empty."""


class DataUnavailableError(FileNotFoundError):
    """A benchmark's data is neither in its local folder nor reachable on the hub."""


def read_jsonl(path: Path, required: Iterable[str | tuple[str, ...]] = (), limit: int | None = None, task: str = "") -> list[dict]:
    """The records of a .jsonl file (UTF-8, lines ending at a newline, blank lines skipped), each checked for
    ``required`` keys; at most ``limit`` records. Raises DataError with file:line for a line that is not UTF-8
    text, not a JSON object or lacks a key, and for a file without records."""
    path = Path(path)
    prefix = f"{task}: " if task else ""
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{prefix}{path}:{number}: not UTF-8 text ({e.reason} at byte {e.start} of the "
                                "line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{prefix}{path}:{number}: not valid JSON ({e.msg}, column {e.colno})") from None
            _check_record(record, required, f"{prefix}{path}:{number}")
            rows.append(record)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise DataError(f"{prefix}{path}: no records (an empty file would give a run that scores nothing)")
    return rows


def read_json(path: Path, task: str = ""):
    """A whole .json document; a syntax error names the file, line and column."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{task + ': ' if task else ''}{path}: not UTF-8 text ({e.reason} at byte "
                        f"{e.start:,})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{task + ': ' if task else ''}{path}:{e.lineno}: not valid JSON ({e.msg}, column "
                        f"{e.colno})") from None


def check_records(records: list, required: Iterable[str | tuple[str, ...]], where: str, what: str = "record") -> None:
    """Every record a JSON object with the ``required`` keys (``where``: file name; records numbered from 1)."""
    if not isinstance(records, list) or not records:
        raise DataError(f"{where}: expected a non-empty list of {what}s, got "
                        f"{'an empty list' if isinstance(records, list) else type(records).__name__}")
    for i, record in enumerate(records, 1):
        _check_record(record, required, f"{where}: {what} {i}")


def _check_record(record, required: Iterable[str | tuple[str, ...]], where: str) -> None:
    """``required``: key names, or tuples of alternative names (any one will do)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    alternatives = [(k,) if isinstance(k, str) else tuple(k) for k in required]
    missing = [" or ".join(map(repr, names)) for names in alternatives if not any(n in record for n in names)]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)} (has {', '.join(map(repr, record)) or 'nothing'})")


def check_hub_dataset(repo_id: str, task: str, fix: str) -> None:
    """Before any model load: a hub dataset is in the local cache, or the hub answers (10 s timeout);
    else DataUnavailableError with ``fix`` (how to pass a local copy)."""
    from huggingface_hub import dataset_info, snapshot_download

    try:
        snapshot_download(repo_id, repo_type="dataset", local_files_only=True)
        return
    except Exception:  # noqa: BLE001 - not cached: ask the hub below
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise DataUnavailableError(f"{task}: the hub dataset {repo_id} is not in the local cache and HF_HUB_OFFLINE "
                                   f"is set; {fix}")
    try:
        dataset_info(repo_id, timeout=10)
    except Exception as e:  # noqa: BLE001 - any failure means the data cannot be had here
        raise DataUnavailableError(f"{task}: cannot reach the Hugging Face hub for the dataset {repo_id} "
                                   f"({type(e).__name__}); {fix}") from None
