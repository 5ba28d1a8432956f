"""oscar.atomic: a write is whole or absent, a failed write leaves the old file and no temporary file."""

from __future__ import annotations

import json

import pytest

from oscar import atomic


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "metrics.json"
    atomic.write_json(path, {"score": 57.14})
    atomic.write_json(path, {"score": 60.0})
    assert json.loads(path.read_text()) == {"score": 60.0}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic.atomic_open(path) as f:
            f.write("a,b\n")
            raise RuntimeError("disk full")
    assert path.read_text() == "a,b\n1,2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rows.csv"]


def test_full_disk_leaves_no_empty_file(tmp_path, monkeypatch):
    """A write that fails at fsync (the disk filled) is not a 0-byte file counted as done."""
    path = tmp_path / "metrics.json"

    def full(_fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        atomic.write_json(path, {"score": 1.0})
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_bytes_figure_and_torch(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    atomic.write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    atomic.save_figure(fig, tmp_path / "f.png", dpi=50)
    plt.close(fig)
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    atomic.torch_save({"order": torch.arange(4)}, tmp_path / "c.pt")
    assert torch.equal(torch.load(tmp_path / "c.pt")["order"], torch.arange(4))
    with pytest.raises(ValueError, match="mode"):
        with atomic.atomic_open(tmp_path / "x", "a"):
            pass


def test_a_new_file_follows_the_umask_and_a_rewritten_one_keeps_its_mode(tmp_path):
    """mkstemp makes 0600 files: a table or rows file written atomically must not turn private."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        atomic.write_text(tmp_path / "new.md", "x")
        assert stat.S_IMODE((tmp_path / "new.md").stat().st_mode) == 0o644
        (tmp_path / "kept.csv").write_text("a\n")
        os.chmod(tmp_path / "kept.csv", 0o640)
        atomic.write_text(tmp_path / "kept.csv", "b\n")
        assert stat.S_IMODE((tmp_path / "kept.csv").stat().st_mode) == 0o640
    finally:
        os.umask(old)
