"""Where things live: the repository root and the data (the one module that knows).

Data is named by its path inside a data folder, e.g. ``text/wikitext-2-raw-v1.test.rows.jsonl`` or
``mm/docvqa`` (the layout of ``../shared/data`` and of the cache ``make data`` fills). A name is
looked up in these roots, the first that holds it wins:

1. ``$OSCAR_DATA`` (``data_root`` in conf/config.yaml sets it for a run): a copy of your own;
2. ``../shared/data`` beside the repository (where this project's CI and workstations keep it);
3. the user cache ``$XDG_CACHE_HOME/oscar-kv/data`` (``~/.cache/oscar-kv/data`` by default; see
   :func:`user_cache`), where ``make data`` (scripts/fetch_data.py) downloads every file from its
   public source.

Task options that name data (``task.path``, ``task.data_dir``, ...) go through :func:`resolve_data`:
an absolute path is taken as is, a relative one is looked up in the roots above and then against the
repository root (so ``results/x.txt`` or ``../shared/data/...`` still work).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_ENV = "OSCAR_DATA"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
FETCH_HINT = "`make data` (python scripts/fetch_data.py) downloads it into the cache"


class DataNotFoundError(FileNotFoundError):
    """A data file or folder is in none of the places data is looked for."""


def user_cache() -> Path:
    """The project's user cache: ``$OSCAR_KV_CACHE``, else ``$XDG_CACHE_HOME/oscar-kv`` (``~/.cache``
    when XDG_CACHE_HOME is unset, empty or relative, as the XDG base directory spec says). Converted
    model weights live in ``<name>/`` under it, downloaded data in ``data/``."""
    if os.environ.get("OSCAR_KV_CACHE"):
        return Path(os.environ["OSCAR_KV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache") / "oscar-kv"


def data_cache() -> Path:
    """Where ``make data`` writes: ``user_cache() / "data"``, the last of the data roots."""
    return user_cache() / "data"


def data_roots() -> list[Path]:
    """The folders searched for data, in order: $OSCAR_DATA (if set), ../shared/data, the cache."""
    roots = [Path(os.environ[DATA_ENV]).expanduser().absolute()] if os.environ.get(DATA_ENV) else []
    return [*roots, SHARED_DATA.resolve(), data_cache()]


def find_data(name: str | Path) -> Path | None:
    """The first ``root / name`` that exists (file or folder), or None."""
    for root in data_roots():
        if (root / name).exists():
            return root / name
    return None


def data_file(name: str | Path) -> Path:
    """``name`` resolved in the data roots, or a DataNotFoundError naming it, every place looked, and
    how to get it."""
    found = find_data(name)
    if found is None:
        raise DataNotFoundError(missing_message(name))
    return found


def resolve_data(path: str | Path) -> Path:
    """A task option that names data: absolute (or ``~``) as is; relative: the data roots, then the
    repository root. Raises DataNotFoundError (a FileNotFoundError) when it is in none of them."""
    p = Path(path).expanduser()
    if p.is_absolute():
        if p.exists():
            return p
        raise DataNotFoundError(f"{p} not found")
    found = find_data(p)
    if found is not None:
        return found
    if (REPO_ROOT / p).exists():
        return (REPO_ROOT / p).resolve()
    raise DataNotFoundError(missing_message(p, also=[REPO_ROOT / p]))


def locate_data(path: str | Path) -> Path:
    """:func:`resolve_data` that never raises (for run ids of runs whose data is missing): the path found,
    or, for a missing one, where it was looked for first."""
    try:
        return resolve_data(path)
    except DataNotFoundError:
        p = Path(path).expanduser()
        return p if p.is_absolute() else data_roots()[0] / p


def missing_message(name: str | Path, also: list[Path] = ()) -> str:
    places = [str(root / name) for root in data_roots()] + [str(p) for p in also]
    return (f"data {str(name)!r} not found; looked in: {', '.join(places)}. {FETCH_HINT}, or set "
            f"{DATA_ENV}=/folder/with/a/copy (same layout: {name})")


def calibration_command(method: str, calibration: str | None, model: str) -> str:
    """The command that writes the calibration file ``calibration`` of ``method`` for ``model`` (None: the script's
    default file for that model, which the method's config reads)."""
    out = f" --out {calibration}" if calibration is not None else ""
    return f"`python scripts/calibrate_{method}.py --model {model}{out}`"


def calibration_location(calibration: str) -> Path:
    """The path of a method's ``calibration`` option: absolute as is, relative from the repository root (it may not
    exist: :func:`calibration_file` checks)."""
    path = Path(calibration)
    return path if path.is_absolute() else REPO_ROOT / path


def calibration_file(method: str, calibration: str, model: str, hint: str = "") -> Path:
    """The calibration file a method reads (a relative path: from the repository root); a missing one (or a folder)
    is an error naming the command that makes it, ``python scripts/calibrate_<method>.py --model <model>``
    (+ ``hint``)."""
    path = calibration_location(calibration)
    if not path.exists():
        raise FileNotFoundError(f"{method}: calibration file {path} not found; make it with "
                                f"{calibration_command(method, calibration, model)}{hint}")
    if path.is_dir():
        raise IsADirectoryError(f"{method}: calibration {path} is a folder, not a file; point method.calibration at "
                                f"the file {calibration_command(method, calibration, model)} writes{hint}")
    return path
