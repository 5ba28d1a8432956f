"""Integrity of cached folders: a manifest of every file's size and SHA-256, recorded when the folder is made (the
converted-model cache, oscar.models) and checked on every reuse, so a truncated or overwritten file is found before
anything loads it.

A check compares every recorded file's size; it hashes a file again only when the file's stat stamp (size, mtime,
ctime, inode) differs from the one stored at its last successful check, so a folder nobody wrote to costs a few
``stat`` calls, and one copied or written to is hashed once (its new stamps are stored, where the folder is
writable). The manifest is written last (atomically), so a folder without one, or with one that cannot be read, is
not a finished folder: its caller makes it again (structure checks cannot tell sound weights from damaged ones of
the same shape, and recording a manifest of what is found would certify the damage).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from oscar.atomic import write_json

MANIFEST = "oscar-manifest.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def record(folder: Path) -> None:
    """Write the manifest of every file in ``folder`` (relative path -> size, SHA-256, stat stamp)."""
    folder = Path(folder)
    entries = {p.relative_to(folder).as_posix(): dict(size=p.stat().st_size, sha256=sha256(p), stamp=_stamp(p))
               for p in _files(folder)}
    _write(folder, entries)


def _write(folder: Path, entries: dict) -> None:
    write_json(folder / MANIFEST, {"files": entries}, indent=1, sort_keys=True)


def problem(folder: Path) -> str:
    """What is wrong with ``folder`` against its manifest ("" when nothing is): no manifest, one that cannot be read
    (its path named), a recorded file missing, of another size, or with another SHA-256 than recorded."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        entries = json.loads(path.read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path} cannot be read ({type(e).__name__})"
    if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in entries.values()):
        return f"{path} is not a manifest (files, each with its size and sha256)"
    restamped = False
    for name, entry in sorted(entries.items()):
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size:,} bytes, {entry['size']:,} when it was written"
        if _stamp(file) != entry.get("stamp"):
            if sha256(file) != entry["sha256"]:
                return f"{name} does not have the SHA-256 recorded when it was written"
            entry["stamp"], restamped = _stamp(file), True
    if restamped:
        try:
            _write(folder, entries)
        except OSError:  # a read-only cache: checked (hashed) again next time
            pass
    return ""
