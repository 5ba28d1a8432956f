"""Integrity of cached folders: a manifest of every file's size and SHA-256, recorded when the folder is made (the
converted-model cache, oscar.models) and checked on every reuse, so a truncated or overwritten file is found before
anything loads it.

A check compares every recorded file's size; it hashes a file again only when the file's stat stamp (size, mtime,
ctime, inode) differs from the one stored at its last successful check, so a folder nobody wrote to costs a few
``stat`` calls, and one copied or written to is hashed once (its new stamps are stored, where the folder is
writable). A folder made before manifests existed has none: :func:`safetensors_problem` checks its weights'
structure instead (header length, JSON header, data size), and the caller records a manifest of what it found.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

MANIFEST = "oscar-manifest.json"
#: a safetensors header longer than this is garbage, not metadata (safetensors' own limit)
MAX_HEADER_BYTES = 100_000_000


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
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{MANIFEST}-")
    with os.fdopen(fd, "w") as f:
        json.dump({"files": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, folder / MANIFEST)


def problem(folder: Path) -> str:
    """What is wrong with ``folder`` against its manifest ("" when nothing is): no manifest, a recorded file missing,
    of another size, or with another SHA-256 than recorded."""
    folder = Path(folder)
    try:
        entries = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} cannot be read ({type(e).__name__})"
    restamped = False
    for name, entry in sorted(entries.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size:,} bytes, {entry['size']:,} when it was written"
        if _stamp(path) != entry.get("stamp"):
            if sha256(path) != entry["sha256"]:
                return f"{name} does not have the SHA-256 recorded when it was written"
            entry["stamp"], restamped = _stamp(path), True
    if restamped:
        try:
            _write(folder, entries)
        except OSError:  # a read-only cache: checked (hashed) again next time
            pass
    return ""


def safetensors_problem(path: Path) -> str:
    """What is structurally wrong with a safetensors file ("" when nothing is): a header length past the file or
    absurd, a header that is not JSON, or data that ends elsewhere than the file."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name} has {size} bytes, fewer than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            return f"{path.name}: header length {length:,} past the file's {size:,} bytes"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return f"{path.name}: the header is not safetensors metadata"
    if 8 + length + end != size:
        return f"{path.name} has {size:,} bytes, its header describes {8 + length + end:,}"
    return ""
