"""The multimodal tasks' tables (OCRBench / DocVQA / MMAU-Pro ``report``) from tidy rows, paper numbers beside ours."""

from __future__ import annotations

import json

from evals.mmau_pro import mmau_pro_table
from evals.ocrbench import ocrbench_table
from scripts.make_tables import task_tables


def row(model, method, task, subset, metric, value, n, bits=2, group_size=32, residual_length=128):
    config = json.dumps({"name": method, "k_bits": bits, "group_size": group_size, "residual_length": residual_length})
    return dict(model=model, method=method, bits=str(bits), group_size=str(group_size),
                residual_length=str(residual_length), task=task, subset=subset, metric=metric, value=float(value),
                n=str(n), run_id=f"{model}-{method}-{n}", config=config)


def test_ocrbench_table_puts_the_paper_beside_full_runs_only():
    rows = [row("qwen3-vl-8b", "oscar", "ocrbench", "all", "score", 850, 1000),
            row("qwen3-vl-8b", "oscar", "ocrbench", "Text Recognition", "score", 280, 300),
            row("qwen3-vl-8b", "fp16", "ocrbench", "all", "score", 860, 1000, bits=16, residual_length=0),
            row("tiny-qwen3-vl", "oscar", "ocrbench", "all", "score", 0, 2)]
    header, body = ocrbench_table(rows)
    table = {(r[0], r[1].split(" ")[0]): dict(zip(header, r)) for r in body}
    assert table[("qwen3-vl-8b", "oscar")]["paper"] == 856 and table[("qwen3-vl-8b", "oscar")]["Δ"] == "-6"
    assert table[("qwen3-vl-8b", "oscar")]["recognition"] == 280.0
    assert table[("qwen3-vl-8b", "fp16")]["paper"] == 858  # the 16-bit baseline in its own setting
    assert table[("tiny-qwen3-vl", "oscar")]["paper"] is None  # 2 questions: no comparison


def test_mmau_pro_table_reads_the_judge_from_the_subset():
    rows = [row("qwen3-omni-30b-a3b", "oscar", "mmau_pro", "open/judge=Qwen/Qwen2.5-7B-Instruct", "open", 67.0, 600),
            row("qwen3-omni-30b-a3b", "oscar", "mmau_pro", "open/judge=Qwen/Qwen2.5-7B-Instruct", "good_rate", 30.0, 600),
            row("qwen3-omni-30b-a3b", "oscar", "mmau_pro", "instruction following", "aif", 88.0, 80)]
    header, body = mmau_pro_table(rows)
    line = dict(zip(header, body[0]))
    assert (line["open"], line["good rate"], line["AIF"]) == (67.0, 30.0, 88.0)
    assert (line["paper open"], line["paper good"], line["paper AIF"]) == (67.4, 29.8, 88.5)
    assert line["Δ open"] == "-0.4" and line["judge"] == "Qwen/Qwen2.5-7B-Instruct"


def test_build_writes_markdown_and_latex(tmp_path):
    rows = [row("tiny-qwen3-vl", "oscar", "docvqa", "validation", "anls", 12.5, 12),
            row("tiny-qwen3-vl", "oscar", "ocrbench", "all", "score", 1, 2)]
    written = task_tables(rows, tmp_path)
    assert sorted(p.name for p in written) == ["docvqa.md", "docvqa.tex", "ocrbench.md", "ocrbench.tex"]
    assert "12.50" in (tmp_path / "tables" / "docvqa.md").read_text()
