"""Run folders and tidy result rows.

A run folder holds config.yaml, predictions.jsonl (written sample by sample), metrics.json (written
last: its presence marks the run finished) and env.json. Tidy rows (one per metric) are appended to the
run's ``results_file`` (default ``runs/rows.csv``; the committed results are ``results/rows.csv``); ``make
tables`` reads nothing else.

Nothing half-written: an append that fails (a full disk) is cut back to the file's old end, and a file
with an older header is rewritten through oscar.atomic (a new file renamed over the old one, under the
lock), so a failure leaves the old file whole. Damage does not spread: an append first ends a last line
left without its newline (under the lock), so a new row is never glued onto an old one; the reader skips
a malformed row (wrong number of fields, a value that is not a finite number, a stray carriage return)
with a warning naming the file and line, and reads a row whose method column disagrees with its config
as its config's method (with a warning); the prediction log skips lines that are not records, and
records that lack a field their task needs or hold it mistyped (their samples computed again), likewise.
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import json
import logging
import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from oscar.atomic import atomic_open
from oscar.provenance import process_code_version

log = logging.getLogger(__name__)

#: provenance (the last three): ``code_version`` (oscar.provenance.code_version: commit + "+dirty"; "" in rows written
#: before it was recorded), ``config_digest`` (12 hex digits of the run's identity), ``date`` (UTC ISO-8601, seconds,
#: when the run finished)
ROW_FIELDS = ["model", "method", "bits", "group_size", "residual_length", "task", "subset", "metric", "value",
              "n", "run_id", "config", "task_config", "code_version", "config_digest", "date"]
#: longest option value written out in a task_config; longer ones (or ones with whitespace) become a digest
MAX_VALUE_CHARS = 40


#: a field of :class:`PredictionLog` records that holds a number (an int or a float, never a bool)
NUMBER = (int, float)


class PredictionLog:
    """Append-only per-sample predictions, so a killed run resumes at the sample in flight.

    ``log.done`` maps a sample key to its stored record; ``log.write(key, record)`` appends one
    line and flushes it to disk at once, stamped with the code that computed it (``code_version``:
    oscar.provenance.process_code_version; a resumed run's rows name every version its samples came from,
    :func:`record_code_versions`). ``fields`` (name -> type or tuple of types, e.g. ``NUMBER``) are what a
    stored record must hold to be reused: a record that lacks one or holds another type (an edit, a log of an older
    version) is left out with a warning naming the file and line, and its sample is computed again.
    """

    def __init__(self, path: Path, fields: dict[str, type | tuple[type, ...]] | None = None):
        self.path = Path(path)
        self.done: dict[str, dict] = {}
        if self.path.exists():
            text = self.path.read_text()
            if text and not text.endswith("\n"):  # end a line cut by a kill, so the next record starts afresh
                with self.path.open("a") as f:
                    f.write("\n")
            lines = text.splitlines()
            unusable: dict[str, tuple[int, str]] = {}  # key -> (line, problem) of records left out
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
                problem = _field_problem(record, fields or {})
                if problem:
                    unusable[record["key"]] = (number, problem)
                    continue
                self.done[record["key"]] = record
            for key, (number, problem) in unusable.items():
                if key not in self.done:  # not logged whole again later
                    log.warning("%s:%d: the record of %r %s; ignored (its sample is computed again)", self.path,
                                number, key, problem)

    def write(self, key: str, record: dict) -> dict:
        record = {"key": key, **record, "code_version": process_code_version() or "unrecorded"}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        self.done[key] = record
        return record


def record_code_versions(path: Path) -> dict[str, int]:
    """Code version -> how many samples of the prediction log at ``path`` it computed (the last record of each key;
    "unrecorded" for records written before records were stamped), in the order the versions first appear; {} when
    there is no log. Records are read as :class:`PredictionLog` reads them (a JSON object with a string ``key``; others
    are left out, as it leaves them out), but for their task's fields. A record may name a list of versions (lm-eval's,
    whose answers come from a request cache that several versions may have filled): each counts it; a
    ``code_version`` that is neither a string nor a list of strings counts as "unrecorded"."""
    path, latest = Path(path), {}
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # PredictionLog warns about these where it reads them
            continue
        if isinstance(record, dict) and isinstance(record.get("key"), str):
            named = record.get("code_version")
            named = [named] if isinstance(named, str) else named
            valid = isinstance(named, list) and named and all(isinstance(v, str) and v.strip() for v in named)
            latest[record["key"]] = [v.strip() for v in named] if valid else ["unrecorded"]
    counts: dict[str, int] = {}
    for named in latest.values():
        for version in dict.fromkeys(named):
            counts[version] = counts.get(version, 0) + 1
    return counts


_KIND_WORDS = {float: "a number", int: "an integer", str: "a string", list: "a list", dict: "an object",
               bool: "true or false", type(None): "null"}


def _field_problem(record: dict, fields: dict[str, type | tuple[type, ...]]) -> str:
    """What ``record`` lacks of ``fields``, or holds of another type ("" when nothing); a bool is not a number."""
    for name, kinds in fields.items():
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if name not in record:
            return f"lacks {name!r}"
        value = record[name]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            wanted = " or ".join(_KIND_WORDS.get(k, k.__name__) for k in kinds if k is not int or float not in kinds)
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            return f"has {name}={shown}, not {wanted}"
    return ""


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
    """Append tidy rows to a CSV under an exclusive lock (parallel sweep jobs share the file), whole or not at all: a
    write that fails (a full disk) is cut off again, so no row is left half-written. A last line left without its
    newline is ended first, so a new row is never glued onto an old one. A file written with an older header (a
    subset of ROW_FIELDS, e.g. without ``task_config``) is rewritten with the current header, its missing columns
    empty, atomically (a new file renamed over the old one), so no row lands misaligned and none is lost."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    with _locked(path, "a+") as f:
        f.seek(0)
        header = next(csv.reader(f), None)
        if header is not None and header != ROW_FIELDS:
            _rewrite(path, f, _read_locked(f, header) + rows)
            return
        _append(f, _csv_text(rows, header=header is None))


def update_rows(path: Path, update: Callable[[dict], dict]) -> int:
    """Rewrite every row of the CSV as ``update(row)`` (values as text, missing columns "") under the
    append lock, with the current header, atomically; returns the number of rows."""
    path = Path(path)
    with _locked(path, "r+") as f:
        header = next(csv.reader(f), None)
        rows = [update(row) for row in _read_locked(f, header or ROW_FIELDS)]
        _rewrite(path, f, rows)
    return len(rows)


@contextmanager
def _locked(path: Path, mode: str) -> Iterator[IO]:
    """``path`` open in ``mode`` (text) under an exclusive lock on the file the path names once the lock is held: a
    rewrite renames a new file over the old one while holding the old one's lock, so a writer that waited on the
    old file opens the path again rather than append to a file no longer there. Closing the file releases the
    lock."""
    while True:
        f = path.open(mode, newline="", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
            held, named = os.fstat(f.fileno()), _stat_or_none(path)
            if named is not None and (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                break
        except BaseException:
            f.close()
            raise
        f.close()
    try:
        yield f
    finally:
        f.close()


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _csv_text(rows: list[dict], header: bool) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=ROW_FIELDS, extrasaction="ignore")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _append(f, text: str) -> None:
    """Append ``text`` to the open, locked file ``f`` after ending a last line left without its newline (the csv
    writer's own terminator), flushed to disk; on a failed write the file is cut back to its old end."""
    fd = f.fileno()
    end = os.fstat(fd).st_size
    if end and os.pread(fd, 1, end - 1) != b"\n":  # a line cut by a kill, or an edit without a final newline
        text = "\r\n" + text
    data = memoryview(text.encode("utf-8"))
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, end)
        raise


def _read_locked(f, header: list[str]) -> list[dict]:
    """Every row of the open, locked file ``f`` (header included), each with every ROW_FIELDS key."""
    problem = header_problem(header)
    if problem:
        raise ValueError(f"{f.name}: {problem}; refusing to rewrite the file and lose them")
    f.seek(0)
    return [_complete(row) for row in csv.DictReader(f)]


def _rewrite(path: Path, f, rows: list[dict]) -> None:
    """Replace ``path`` (open and locked as ``f``) by a file of ``rows`` under the current header, whole or not at
    all, with the old file's permissions."""
    mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
    with atomic_open(path, newline="") as out:
        os.fchmod(out.fileno(), mode)
        out.write(_csv_text(rows, header=True))


def header_problem(header: list[str]) -> str:
    """What keeps rows from being written under a results file's ``header`` (its first line, as fields) ("" when
    nothing: ROW_FIELDS or an older subset of them)."""
    unknown = [name for name in header if name not in ROW_FIELDS]
    if not header or len(unknown) == len(header):
        return (f"its first line {header} is not a header of tidy-row fields {ROW_FIELDS} (a file without its "
                "header, or not a results file)")
    if unknown:
        return f"columns {unknown} are not tidy-row fields {ROW_FIELDS}"
    return ""


def results_file_problem(path: Path) -> str:
    """What keeps tidy rows from being appended to the existing results file ``path`` ("" when nothing, or when there
    is no file yet): a file that is not UTF-8 text, or whose first line is not a tidy-row header."""
    try:
        with Path(path).open(newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
    except FileNotFoundError:
        return ""
    except UnicodeDecodeError:
        return "not UTF-8 text (not a results file)"
    except csv.Error as e:
        return f"its first line cannot be read as CSV ({e})"
    return "" if header is None else header_problem(header)


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
