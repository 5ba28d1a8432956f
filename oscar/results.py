"""Run folders and tidy result rows.

A run folder holds config.yaml, predictions.jsonl (written sample by sample), metrics.json (written
last: its presence marks the run finished) and env.json. Tidy rows (one per metric) are appended to the
run's ``results_file`` (default ``runs/rows.csv``; the committed results are ``results/rows.csv``); ``make
tables`` reads nothing else.

Damage does not spread: an append first ends a last line left without its newline (under the lock),
so a new row is never glued onto an old one; the reader skips a malformed row (wrong number of
fields, a value that is not a finite number, a stray carriage return) with a warning naming the file
and line, and reads a row whose method column disagrees with its config as its config's method (with a
warning); the prediction log skips lines that are not records, likewise.
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

ROW_FIELDS = ["model", "method", "bits", "group_size", "residual_length", "task", "subset", "metric", "value",
              "n", "run_id", "config", "task_config"]
#: longest option value written out in a task_config; longer ones (or ones with whitespace) become a digest
MAX_VALUE_CHARS = 40


class PredictionLog:
    """Append-only per-sample predictions, so a killed run resumes at the sample in flight.

    ``log.done`` maps a sample key to its stored record; ``log.write(key, record)`` appends one
    line and flushes it to disk at once.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.done: dict[str, dict] = {}
        if self.path.exists():
            text = self.path.read_text()
            if text and not text.endswith("\n"):  # end a line cut by a kill, so the next record starts afresh
                with self.path.open("a") as f:
                    f.write("\n")
            lines = text.splitlines()
            for number, line in enumerate(lines, 1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: recompute that sample
                    if number < len(lines) and line.strip():
                        log.warning("%s:%d: not a JSON record, ignored (its sample is computed again)", self.path, number)
                    continue
                if not isinstance(record, dict) or not isinstance(record.get("key"), str):
                    log.warning("%s:%d: not a prediction record (a JSON object with a 'key'), ignored", self.path, number)
                    continue
                self.done[record["key"]] = record

    def write(self, key: str, record: dict) -> dict:
        record = {"key": key, **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        self.done[key] = record
        return record


def task_config_label(options: dict, defaults: dict) -> str:
    """The task options that differ from the task's defaults, as ``name=value`` pairs sorted by name
    and joined by single spaces (``max_windows=16``; "" when every option is a default). ``name`` is
    skipped; an option without a default always counts. Values: lists comma-joined, None as ``null``,
    booleans as ``true``/``false``; one longer than MAX_VALUE_CHARS or holding whitespace becomes
    ``#`` + 8 hex digits of the SHA-1 of its JSON (stable, and still tells settings apart)."""
    missing = object()
    changed = {k: v for k, v in options.items() if k != "name" and defaults.get(k, missing) != v}
    return " ".join(f"{k}={_option_text(changed[k])}" for k in sorted(changed))


def parse_task_config(text: str) -> dict[str, str]:
    """``task_config_label``'s string back to {option: value text}."""
    return dict(pair.partition("=")[::2] for pair in text.split())


def _option_text(value) -> str:
    if value is None or isinstance(value, bool):
        text = json.dumps(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
        text = ",".join(map(str, value))
    elif isinstance(value, (str, int, float)):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    if len(text) > MAX_VALUE_CHARS or any(ch.isspace() for ch in text):
        blob = json.dumps(value, sort_keys=True, default=str).encode()
        return "#" + hashlib.sha1(blob).hexdigest()[:8]
    return text


def append_rows(path: Path, rows: Iterable[dict]) -> None:
    """Append tidy rows to a CSV under an exclusive lock (parallel sweep jobs share the file). A file
    written with an older header (a subset of ROW_FIELDS, e.g. without ``task_config``) is first
    rewritten with the current header, its missing columns empty, so no row lands misaligned."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", newline="") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        header = next(csv.reader(f), None)
        if header is not None and header != ROW_FIELDS:
            _rewrite(f, _read_locked(f, header))
        _end_last_line(f)
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        if header is None:
            writer.writeheader()
        for row in rows:
            writer.writerow(row)
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def _end_last_line(f) -> None:
    """Write a newline if the open file ``f`` does not end with one (a line cut by a kill, or an edit
    without a final newline), so the next row starts on a line of its own."""
    end = f.seek(0, 2)
    if end == 0:
        return
    with open(f.name, "rb") as raw:
        raw.seek(end - 1)
        last = raw.read(1)
    if last != b"\n":
        f.write("\r\n")  # the csv writer's own line terminator


def update_rows(path: Path, update: Callable[[dict], dict]) -> int:
    """Rewrite every row of the CSV as ``update(row)`` (values as text, missing columns "") under the
    append lock, with the current header; returns the number of rows."""
    with Path(path).open("r+", newline="") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        header = next(csv.reader(f), None)
        rows = [update(row) for row in _read_locked(f, header or ROW_FIELDS)]
        _rewrite(f, rows)
        fcntl.flock(f, fcntl.LOCK_UN)
    return len(rows)


def _read_locked(f, header: list[str]) -> list[dict]:
    """Every row of the open, locked file ``f`` (header included), each with every ROW_FIELDS key."""
    unknown = [name for name in header if name not in ROW_FIELDS]
    if unknown:
        raise ValueError(f"{f.name}: columns {unknown} are not tidy-row fields {ROW_FIELDS}; "
                         "refusing to rewrite the file and lose them")
    f.seek(0)
    return [_complete(row) for row in csv.DictReader(f)]


def _rewrite(f, rows: list[dict]) -> None:
    f.seek(0)
    f.truncate()
    writer = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    f.flush()


def _complete(row: dict) -> dict:
    """A CSV row with every ROW_FIELDS key; columns an older file lacks (or a short line) read as ""."""
    return {**row, **{k: "" for k in ROW_FIELDS if row.get(k) is None}}


def read_rows(path: Path) -> list[dict]:
    """Tidy rows, the last row of each (run_id, subset, metric) winning; columns missing from an older
    file read as "". Malformed rows are skipped with a warning naming the file and line (:func:`iter_rows`)."""
    latest: dict[tuple, dict] = {}
    for _, row in iter_rows(path):
        latest[(row["run_id"], row["subset"], row["metric"])] = row
    return list(latest.values())


def iter_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, row) for every well-formed row of the CSV ``path`` in file order (nothing for a missing file),
    ``value`` as a float and every ROW_FIELDS key present (columns an older file lacks read as ""). A malformed row
    (more or fewer fields than the header: two rows merged on one line, or a line cut short by a kill or a full
    disk; a value that is not a finite number; a carriage return inside a line) is skipped with a warning that names
    the file and its line (lines end at a newline: a bare carriage return does not end one). A row whose ``method``
    column disagrees with the name in its ``config`` is read as its config's method, with a warning."""
    path = Path(path)
    if not path.exists():
        return
    with path.open(newline="") as f:
        text = f.read()
    reader = csv.DictReader(_physical_lines(text))
    try:
        header = reader.fieldnames or []
    except csv.Error as e:
        log.warning("%s:1: the header cannot be read (%s); no row read", path, e)
        return
    line = reader.line_num + 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # a bare carriage return, a NUL byte, ...
            reason = "a carriage return inside the line" if "new-line character" in str(e) else str(e)
            log.warning("%s:%d: malformed row skipped (%s)", path, line, reason)
            line = reader.line_num + 1
            continue
        problem = _row_problem(row, header)
        if problem:
            log.warning("%s:%d: malformed row skipped (%s)", path, line, problem)
        else:
            row = _complete(row)
            row["value"] = float(row["value"])
            _config_method(row, f"{path}:{line}")
            yield line, row
        line = reader.line_num + 1


def _physical_lines(text: str):
    """``text`` split after each newline only (a bare carriage return stays inside its line, where the csv reader
    reports it), so that the reader's line numbers are the file's lines."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _config_method(row: dict, where: str) -> None:
    """Make ``row["method"]`` the method its config names (the config is what tables key lines on), warning where the
    method column says otherwise."""
    try:
        name = json.loads(row.get("config") or "{}").get("name")
    except (json.JSONDecodeError, AttributeError):
        return
    if isinstance(name, str) and name and name != row["method"]:
        log.warning("%s: method column %r disagrees with the row's config (method %r); read as %r", where,
                    row["method"], name, name)
        row["method"] = name


def _row_problem(row: dict, header: list[str]) -> str:
    """What is wrong with a CSV row read against ``header`` ("" when nothing is)."""
    if None in row:
        return f"{len(header) + len(row[None])} fields, the header has {len(header)}: two rows merged on one line?"
    if any(row.get(k) is None for k in header):  # a line cut short (a kill or a full disk mid-write)
        return f"{sum(v is not None for v in row.values())} fields, the header has {len(header)}: a line cut short?"
    try:
        value = float(row["value"])
    except (TypeError, ValueError, KeyError):
        return f"value {row.get('value')!r} is not a number"
    if not math.isfinite(value):
        return f"value {row['value']!r} is not finite"
    return ""
