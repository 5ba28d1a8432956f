"""Files that are whole or absent: every file that marks progress or holds results is written through here.

A write goes to a temporary file in the target's own folder (same file system), is flushed and fsync'd, then
renamed over the target (``os.replace``: atomic on POSIX). A reader therefore sees the old file or the new one, never
a cut one; a write that fails (full disk, Ctrl-C) leaves the old file as it was and no temporary file behind.

    with atomic_open(path) as f:          # text; atomic_open(path, "wb") for bytes
        f.write(...)
    write_text(path, text); write_json(path, value); save_figure(fig, path); torch_save(obj, path)
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", *, encoding: str | None = "utf-8",
                newline: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing (``mode`` "w" or "wb"); on a clean exit it replaces
    ``path`` whole, on an exception it is removed and ``path`` is untouched."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, _mode(path))  # mkstemp's 0600 would make every rewritten file private
        text = {} if "b" in mode else dict(encoding=encoding, newline=newline)
        with os.fdopen(fd, mode, **text) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _mode(path: Path) -> int:
    """The permissions the written file gets: the file's own where it exists, else what the umask leaves of 0666."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text(path: str | Path, text: str) -> None:
    """``path.write_text(text)``, whole or not at all."""
    with atomic_open(path) as f:
        f.write(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    """``path.write_bytes(data)``, whole or not at all."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_json(path: str | Path, value, **dump_options) -> None:
    """``value`` as JSON (``json.dumps`` options passed through), whole or not at all."""
    write_text(path, json.dumps(value, **dump_options))


def save_figure(fig, path: str | Path, **savefig_options) -> None:
    """A matplotlib figure saved whole or not at all (the format from ``path``'s suffix)."""
    path = Path(path)
    savefig_options.setdefault("format", path.suffix.lstrip(".") or None)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, **savefig_options)


def torch_save(obj, path: str | Path) -> None:
    """``torch.save(obj, path)``, whole or not at all."""
    import torch

    with atomic_open(path, "wb") as f:
        torch.save(obj, f)
