"""The Pareto figure (scripts/pareto.py) from small fixture rows and efficiency CSVs: stored bits per value from
the packed bytes of each configuration, latencies of the configurations the benchmarks ran (end to end from
user_path.csv where it has the model, else decode attention from kernel.csv), the frontier, one file per model and
headline task, written deterministically by ``make tables``."""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

import pytest

from oscar import build_method
from oscar.results import append_rows, read_rows
from scripts.make_tables import build_all
from scripts.pareto import figure_points, frontier, latencies, latency_of, measured_points, stored_bits


def _config(name: str, **changes) -> str:
    return json.dumps({"name": name, **build_method(name, **changes).hyperparameters()}, sort_keys=True)


def _row(model, name, task, subset, metric, value, run_id, **changes):
    config = json.loads(_config(name, **changes))
    return dict(model=model, method=name, bits=config["k_bits"], group_size=config["group_size"],
                residual_length=config["residual_length"], task=task, subset=subset, metric=metric, value=value, n=5,
                run_id=run_id, config=json.dumps(config, sort_keys=True))


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _user_path_row(context, part, method, backend, batch, ms, date="2026-12-05T10:00:00+00:00") -> dict:
    """A user_path.csv decode row as ``python -m benchmarks user_path`` writes it."""
    return dict(question="user_path", gpu="NVIDIA H200", date=date, code_version="abc1234", arguments="",
                model="llama-3.1-8b", part=part, method=method, backend=backend, batch=batch, context=context,
                chunk=8192, ms_per_token=ms, tokens_per_s=batch / ms * 1e3)


#: (method, hyperparameters, LongBench-E average, perplexity)
CONFIGS = [("fp16", dict(k_bits=16, v_bits=16, residual_length=0), 41.7, 8.0), ("kivi", {}, 39.8, 9.0),
           ("oscar", {}, 41.5, 8.4), ("quarot", {}, 37.9, 12.0), ("turboquant", {}, 40.0, 9.5),
           ("ott", {}, 40.7, 8.8), ("kivi", dict(k_bits=4, v_bits=4), 41.6, 8.1)]


@pytest.fixture
def results(tmp_path) -> tuple[list[dict], Path]:
    """Rows of two models (Llama: LongBench-E, with a user_path.csv of two runs; SmolLM2: perplexity, with a kernel.csv
    only) and the efficiency CSVs under tmp_path/efficiency."""
    rows = []
    for i, (name, changes, score, ppl) in enumerate(CONFIGS):
        rows.append(_row("llama-3.1-8b-instruct", name, "longbench_e", "average", "score", score, f"lb{i}", **changes))
        rows.append(_row("llama-3.1-8b-instruct", name, "longbench_e", "trec_e", "score", score - 3, f"lb{i}",
                         **changes))
        rows.append(_row("smollm2-135m", name, "perplexity", "wikitext-2", "perplexity", ppl, f"p{i}", **changes))
    path = tmp_path / "rows.csv"
    append_rows(path, rows)
    efficiency = tmp_path / "efficiency"
    efficiency.mkdir()
    user_path = [_user_path_row(131072, "decode", "kivi", "cupy", 1, 1.0, date="2026-12-01T10:00:00+00:00")]  # older
    for context, scale in ((32768, 0.5), (131072, 1.0)):
        for method, backend, ms in (("fp16", "torch", 10.0), ("oscar", "cupy", 7.0), ("kivi", "cupy", 7.5),
                                    ("quarot", "cupy", 7.9), ("turboquant", "cupy", 8.2), ("oscar", "torch", 11.0)):
            user_path.append(_user_path_row(context, "decode", method, backend, 1, scale * ms))
        user_path.append(_user_path_row(context, "max_batch", "kivi", "cupy", 40, 99.0))
    _write_csv(efficiency / "user_path.csv", user_path)
    kernel = [dict(question="kernel", gpu="NVIDIA H200", date="2026-12-05T10:00:00+00:00", code_version="abc1234",
                   arguments="", part="decode", method=m, bits=b, batch=batch, context=t, ms=ms * t / 131072,
                   floor_ms=0.2 * b * t / 131072, pct_floor=0.2 * b / ms, bf16_ms=0.9 * t / 131072, speedup=0.9 / ms,
                   bits_per_value=b + 1.0)
              for m, b, ms in (("oscar", 2, 0.30), ("kivi", 2, 0.28), ("kivi", 4, 0.45), ("quarot", 2, 0.33),
                               ("turboquant", 2, 0.36)) for batch in (1, 8) for t in (32768, 131072)]
    _write_csv(efficiency / "kernel.csv", kernel)
    return read_rows(path), tmp_path


def test_stored_bits_leave_out_the_methods_notes_on_their_probe_model(caplog):
    """make tables probes every Pareto point's configuration: RotateKV's note that tiny-llama's 2 KV heads rotate in
    groups of 2, not 4, is said where the run prepares its model, not once per point (30 times in make demo)."""
    from oscar.models import model_attention
    from scripts.pareto import _probe_model

    with caplog.at_level(logging.WARNING):
        assert stored_bits(_config("rotatekv", reorder=False, head_group=4), "tiny-llama") == 3.0
    assert not [r for r in caplog.records if r.name.startswith("methods")]
    assert logging.getLogger("methods").level == logging.NOTSET  # as it was
    with caplog.at_level(logging.WARNING):
        build_method("rotatekv", reorder=False, head_group=4).prepare_model(_probe_model(model_attention("tiny-llama")))
    assert any("rotating groups of 2 heads instead of 4" in r.getMessage() for r in caplog.records)


def test_stored_bits_come_from_the_packed_bytes():
    """What the methods' quantizers store per value at a model's attention shape (Llama-3.1-8B: 8 KV heads x 128):
    codes plus 16-bit scale and zero per G values (KIVI, QuaRot), plus OScaR's fp32 norm per token over all heads,
    TurboQuant+'s fp16 norm per 32 values, OTT's pooled tokens; fp16 stores 16 bits."""
    llama = "llama-3.1-8b-instruct"  # its spec declares the shape: nothing is downloaded
    per_token_norm = 32 / (8 * 128)
    assert stored_bits(_config("kivi"), llama) == 2 + 32 / 32
    assert stored_bits(_config("kivi", k_bits=4, v_bits=4, group_size=64, residual_length=128), llama) == 4 + 32 / 64
    assert stored_bits(_config("quarot"), llama) == 3.0
    assert stored_bits(_config("oscar"), llama) == pytest.approx(3 + per_token_norm / 2)
    assert stored_bits(_config("oscar"), "tiny-llama") == pytest.approx(3 + 32 / (2 * 64) / 2)  # 2 KV heads x 64
    assert stored_bits(_config("turboquant"), llama) == 2.5
    assert stored_bits(_config("fp16", k_bits=16, v_bits=16, residual_length=0), llama) == 16
    assert 3.0 < stored_bits(_config("ott"), llama) < 3.5  # the pool's exact tokens: real bytes, not a formula


def test_stored_bits_use_the_calibration_of_the_rows_model():
    """Calibrated methods are prepared on a model of the rows' own attention shape with that model's files (the
    committed ones): RotateKV's channel order moves no byte; OSCAR (spectral) stores fp32 scale and zero per group of
    min(128, head_dim) values plus its 64 exact sink tokens; another model's rotations are refused."""
    rotatekv = dict(name="rotatekv", reorder=True, calibration="results/calibration/rotatekv_smollm2-135m.pt")
    assert stored_bits(json.dumps(rotatekv), "smollm2-135m") == 3.0
    for model, per_group in (("smollm2-135m", 64 / 64), ("gemma3-270m", 64 / 128)):  # head_dim 64 and 256
        spectral = json.dumps(dict(name="spectral", calibration=f"results/calibration/{model}/spectral.pt"))
        sinks = 64 * 16 / 4096  # 64 of the block's 4096 tokens kept in bf16
        assert 2 + per_group + sinks < stored_bits(spectral, model) < 2 + per_group + sinks + 0.01
    with pytest.raises(ValueError, match="holds rotations"):
        stored_bits(json.dumps(dict(name="spectral", calibration="results/calibration/gemma3-270m/spectral.pt")),
                    "smollm2-135m")


def test_every_committed_method_is_in_its_pareto_figure():
    """On the committed rows, each (model, task) figure has a point of every method with rows of that model and
    task (the figure's setting is the one with the most methods), spectral included where the whole matrix ran
    (not LongBench-E's rows: fp16, KIVI and OScaR)."""
    from oscar.paths import REPO_ROOT

    rows = read_rows(REPO_ROOT / "results" / "rows.csv")
    figures = measured_points(rows, REPO_ROOT / "results" / "efficiency")
    assert {model for model, _ in figures} == {"smollm2-135m", "gemma3-270m"}
    for (model, task), (_, _, _, points) in figures.items():
        ran = {r["method"] for r in rows if r["model"] == model and r["task"] == task}
        assert {p["method"] for p in points} == ran, (model, task)
    assert all(any(p["method"] == "spectral" for p in points) for (_, task), (*_, points) in figures.items()
               if task != "longbench_e")


def test_the_figure_takes_the_setting_with_the_most_methods(results):
    """A setting with more configurations of fewer methods (a sweep) loses to the one that has every method."""
    rows, _ = results
    sweep = [_row("smollm2-135m", "kivi", "perplexity", "wikitext-2", "perplexity", 9.0 + g / 100, f"sweep{g}{r}",
                  group_size=g, residual_length=r) for g in (16, 32, 64, 128) for r in (128, 256)]
    assert len(sweep) > len(CONFIGS)
    for r in sweep:
        r["task_config"] = "window=512"
    _, _, setting, points = figure_points(rows + sweep)["smollm2-135m", "perplexity"]
    assert setting == "" and {p["method"] for p in points} == {c[0] for c in CONFIGS}


def test_latencies_of_the_configurations_the_benchmarks_ran(results):
    rows, tmp = results
    table, label = latencies("llama-3.1-8b-instruct", tmp / "efficiency")
    assert "user_path.csv" in label and "128K" in label and "batch 1" in label
    # the newest run, batch 1, the longest context, each method on its kernels (fp16 on its static cache)
    assert table == dict(fp16=10.0, oscar=7.0, kivi=7.5, quarot=7.9, turboquant=8.2)
    assert latency_of(json.loads(_config("kivi")), table) == 7.5
    assert latency_of(json.loads(_config("kivi", k_bits=4, v_bits=4)), table) is None  # not what the path ran
    assert latency_of(json.loads(_config("ott")), table) is None
    table, label = latencies("smollm2-135m", tmp / "efficiency")  # no user_path.csv rows: the kernel question
    assert "kernel.csv" in label and "per layer" in label
    assert latency_of(json.loads(_config("kivi", k_bits=4, v_bits=4, residual_length=64)), table) == 0.45
    assert latency_of(json.loads(_config("fp16", k_bits=16, v_bits=16, residual_length=0)), table) == 0.9
    assert latency_of(json.loads(_config("kivi", group_size=64, residual_length=128)), table) is None
    assert latency_of(json.loads(_config("ott")), table) is None


def test_frontier():
    points = [(3.0, 40.0), (2.5, 39.0), (16.0, 42.0), (3.0, 38.0), (3.2, 40.0), (2.5, 39.0)]
    assert frontier(points, higher_is_better=True) == [1, 5, 0, 2]  # ties both kept; dominated ones dropped
    assert frontier([(1.0, 9.0), (2.0, 8.0), (3.0, 8.5)], higher_is_better=False) == [0, 1]


def test_make_tables_writes_one_figure_per_model_and_headline_task(results):
    rows, tmp = results
    points = figure_points(rows)
    assert sorted(points) == [("llama-3.1-8b-instruct", "longbench_e"), ("smollm2-135m", "perplexity")]
    metric, higher, setting, llama = points["llama-3.1-8b-instruct", "longbench_e"]
    assert metric == "longbench_e score (5 subsets)" and higher and setting == "" and len(llama) == len(CONFIGS)
    assert points["smollm2-135m", "perplexity"][1] is False  # the direction the task declares
    assert {p["accuracy"] for p in llama} == {c[2] for c in CONFIGS}  # the headline subset, not trec_e
    first = build_all(rows, tmp)
    figures = sorted(p.name for p in first if p.name.startswith("pareto_") and p.suffix == ".png")
    assert figures == ["pareto_llama-3.1-8b-instruct_longbench_e.png", "pareto_smollm2-135m_perplexity.png"]
    tables = sorted(p.relative_to(tmp).as_posix() for p in first if p.name.startswith("pareto_") and p.suffix != ".png")
    assert tables == [f"tables/pareto_{name}.{ext}" for name in ("llama-3.1-8b-instruct_longbench_e",
                                                                  "smollm2-135m_perplexity") for ext in ("md", "tex")]
    shutil.copytree(tmp / "efficiency", tmp / "again" / "efficiency")
    again = build_all(rows, tmp / "again")
    for name in figures + [t.split("/")[1] for t in tables]:
        folder = "figures" if name.endswith(".png") else "tables"
        assert (tmp / folder / name).read_bytes() == (tmp / "again" / folder / name).read_bytes()


# ----------------------------------------------------------------------------- the figure reads at a glance


def dense_points() -> list[dict]:
    """A figure's worth of points as the committed perplexity rows give them: 8 methods, 1.1-16 bits, perplexities
    over six decades, a frontier of 25 configurations, 18 of them crowded between 3 and 5.5 bits near the 16-bit
    value, latencies for 8."""
    import random

    rng = random.Random(0)
    methods = ["kivi", "oscar", "quarot", "rotatekv", "ott", "turboquant", "spectral"]
    points = [dict(method="fp16", label="fp16", accuracy=25.0, bits=16.0, latency=0.137)]
    for i in range(140):
        method, bits = methods[i % 7], rng.choice([1.125, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 5.0])
        accuracy = 25.0 * 10 ** (rng.uniform(0.05, 6.0) * (5.0 - min(bits, 4.9)) / 4.0)
        points.append(dict(method=method, label=f"{method} K={i % 4 + 1} V={i % 3 + 1} G={32 << i % 3} #{i}",
                           accuracy=accuracy, bits=bits, latency=None))
    for i in range(18):  # the crowded end of the frontier
        bits = 3.0 + 2.5 * i / 17
        points.append(dict(method=methods[i % 7], label=f"{methods[i % 7]} K={3 + i % 2} V={3 + i % 2} G={64 + i}",
                           accuracy=26.2 - 0.06 * i, bits=bits, latency=None))
    for i, p in enumerate(points[1:8]):
        p["latency"] = 0.05 + 0.004 * i
    return points


def test_the_pareto_figure_names_what_it_shows_and_nothing_collides(tmp_path):
    """Titles on the figure and both panels, a legend entry per method, frontier numbers that overlap no other
    number, tick label or the axes' edge, and their names under the legend, on no axes and on no other text."""
    from matplotlib.text import Text

    from scripts.pareto import numbered_frontier, pareto_figure, plot

    points = dense_points()
    title = "smollm2-135m / perplexity: perplexity against stored bits and decode latency"
    fig = pareto_figure(title, "perplexity", False, points, "stored bits per value", "decode ms per token")
    renderer = fig.canvas.get_renderer()
    left, right = fig.axes
    assert fig._suptitle.get_text() == title
    assert left.get_title().startswith(f"every configuration ({len(points)}): perplexity against stored bits")
    assert right.get_title().startswith("the 8 configurations with a latency benchmark")
    assert left.get_yscale() == "log" and left.get_xscale() == "log"   # six decades of perplexity; bits on log2
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "fp16 (1)", *(f"{m} ({sum(p['method'] == m for p in points)})" for m in
                      ("kivi", "oscar", "quarot", "rotatekv", "ott", "turboquant", "spectral")),
        "Pareto frontier (numbered: below)"]
    frontier_points = numbered_frontier(points, higher=False)
    assert len(frontier_points) >= 20
    ticks = [t.get_window_extent(renderer) for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()
             if t.get_text()]
    for ax in fig.axes:
        numbers = [(t.get_text(), Text.get_window_extent(t, renderer)) for t in ax.texts]
        assert numbers and all(text.isdigit() for text, _ in numbers)
        for i, (text, box) in enumerate(numbers):
            assert ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1), text
            assert not any(box.overlaps(other) for _, other in numbers[i + 1:]), text
            assert not any(box.overlaps(tick) for tick in ticks), text
    assert sorted({int(t.get_text()) for ax in fig.axes for t in ax.texts}) == list(range(1, len(frontier_points) + 1))
    keys = [t for t in fig.texts if t is not fig._suptitle]
    assert [t.get_text() for t in keys] == [f"{i + 1}  {p['label']}" for i, p in enumerate(frontier_points)]
    boxes = [t.get_window_extent(renderer) for t in keys]
    taken = [legend.get_window_extent(renderer), *(ax.get_tightbbox(renderer) for ax in fig.axes)]
    for i, box in enumerate(boxes):
        assert not any(box.overlaps(other) for other in boxes[i + 1:] + taken), keys[i].get_text()
    path = plot(title, "perplexity", False, points, "stored bits per value", "decode ms per token",
                tmp_path / "pareto.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_point_table_holds_what_the_figure_leaves_out():
    from scripts.pareto import numbered_frontier, point_table, short_label

    points = dense_points()
    header, body = point_table("perplexity", False, points)
    assert header == ["#", "configuration", "perplexity (lower is better)", "bits / value", "latency",
                      "Pareto frontier"]
    assert len(body) == len(points) and body[0][1] == "fp16" and body[0][5] == "bits, latency"
    numbered = {row[0]: row[1] for row in body if row[0] is not None}
    assert numbered == {i + 1: p["label"] for i, p in enumerate(numbered_frontier(points, False))}
    assert sum(row[4] is not None for row in body) == 8
    assert short_label(json.loads(_config("oscar"))) == "oscar"
    assert short_label(json.loads(_config("kivi", k_bits=4, v_bits=4, group_size=64))) == "kivi K=4 V=4 G=64"
    assert short_label(json.loads(_config("oscar", rotate=False))) == "oscar rotate=off"
    assert short_label({**json.loads(_config("rotatekv")), "calibration": "results/calibration/x.pt"}) == "rotatekv"
