"""The questions that run on a CPU, each through the command on a tiny model or shape: long_context (decode over
filled caches at two contexts, the real chunked prefill, the largest batches), eval_throughput (seconds per sample
through generate, its table against fp16 of each column), multimodal (a real image prompt through tiny-qwen3-vl) and
input_checks; each row led by its provenance. (user_path, prefill_census and multi_gpu have their own files; the
kernel question needs a GPU: tests/test_benchmarks.py checks it says so.)"""

from __future__ import annotations

import logging

import pytest

from benchmarks import eval_throughput, input_checks, long_context, report
from benchmarks.__main__ import main
from test_method_kernels_emulated import emulated_ops, emulator_libraries  # noqa: F401 (fixtures)


def _rows(path) -> list[dict]:
    rows = report.read_rows(path)
    assert rows and all(r["question"] == path.stem and r["gpu"].startswith("cpu") and r["code_version"] for r in rows)
    return rows


def test_long_context_on_a_cpu(tmp_path):
    main(["long_context", "--out", str(tmp_path), "--models", "tiny-llama", "--contexts", "256", "512", "--methods",
          "oscar", "--backend", "torch", "--batch-context", "256", "--prefill", "512", "--chunk", "128", "--steps", "2",
          "--memory", "0.002"])
    rows = _rows(tmp_path / "long_context.csv")
    decode = {(r["method"], r["context"]): r for r in rows if r["part"] == "decode"}
    assert set(decode) == {("fp16", 256), ("oscar", 256), ("fp16", 512), ("oscar", 512)}
    for r in decode.values():
        assert r["fits"] is True and r["ms_per_token"] > 0 and r["attention_ms"] > 0
    assert decode["fp16", 512]["kv_gib"] > decode["fp16", 256]["kv_gib"] > 0  # real stored bytes grow with context
    prefill = next(r for r in rows if r["part"] == "prefill")
    assert prefill["seconds"] > 0 and prefill["chunk"] == 128 and prefill["bound_gib"] > prefill["weights_gib"]
    largest = {r["method"]: r for r in rows if r["part"] == "max_batch"}
    assert set(largest) == {"fp16", "oscar"} and largest["fp16"]["batch"] >= 1
    assert "| tiny-llama | decode | oscar (torch) | 1 x 512 |" in long_context.table(rows)


def test_long_context_figure_draws_the_newest_runs_gpu_alone(tmp_path, monkeypatch, caplog):
    """The figure's cells: the newest run's GPU only, per (method, context) its newest row; its title names that GPU
    and a warning names the GPU left out."""
    import oscar.atomic

    def row(gpu, date, method, tokens, ms):
        return dict(question="long_context", gpu=gpu, date=date, code_version="abc", arguments="", part="decode",
                    model="llama-3.1-8b", method=method, backend="cupy", context=tokens, fits=True, ms_per_token=ms,
                    kv_gib=tokens / 2**20)

    rows = [row("H100", "2026-12-09", "oscar", 131072, 9.0), row("H100", "2026-12-09", "kivi", 262144, 9.0),
            row("H200", "2026-12-01", "oscar", 131072, 2.0), row("H200", "2026-12-03", "oscar", 131072, 1.0),
            row("H200", "2026-12-03", "oscar", 262144, 3.0), row("H200", "2026-12-10", "oscar", 262144, 2.5)]
    titles = []
    monkeypatch.setattr(oscar.atomic, "save_figure",
                        lambda fig, path, dpi: titles.extend(ax.get_title() for ax in fig.axes))
    with caplog.at_level(logging.WARNING, logger="benchmarks.long_context"):
        assert long_context.figure(rows, tmp_path / "l.png")
    gpu, cells = long_context.figure_cells(rows)
    assert gpu == "H200" and {(r["method"], r["context"]): r["ms_per_token"] for r in cells} == {
        ("oscar", 131072): 1.0, ("oscar", 262144): 2.5}
    assert titles and all("(H200)" in title for title in titles)
    assert "left out the decode rows of H100" in caplog.text


def test_eval_throughput_on_a_cpu(tmp_path, data_file, caplog):
    """A tenth of the LongBench-E column (tiny prompts) through the scheduler for fp16 and KIVI on the torch backend,
    the official loop on the stratified samples of one subset, agreement with batch 1 on two samples: each row's
    column minutes are its replay's wall time scaled by the fraction's inverse, and exact agreement on a CPU; the
    profile gives each method's host functions. --tokenizer (SmolLM2's, offline) adds one row first: the same samples
    as real text, cut at the 64 tokens and tokenized, its seconds scaled to the column, shown below the table."""
    data_file("longbench/task.md")
    with caplog.at_level(logging.INFO, logger="benchmarks.eval_throughput"):
        main(["eval_throughput", "--out", str(tmp_path), "--model", "tiny-llama", "--methods", "kivi", "--backend",
              "torch", "--fraction", "0.002", "--tokens-per-word", "0.005", "--max-prompt-tokens", "64",
              "--prefill-chunk", "32", "--official", "trec", "--agreement", "2", "--profile", "--tokenizer"])
    profiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile of ")]
    assert [p.split("'")[0] for p in profiles] == ["profile of fp16/torch", "profile of kivi/torch"]
    assert all("function calls" in p and "(none recorded)" in p for p in profiles)  # no GPU: no sync to record
    tokenized, *rows = _rows(tmp_path / "eval_throughput.csv")
    assert [r["method"] for r in [tokenized, *rows]] == ["tokenize", "fp16", "kivi"]
    assert tokenized["tokenizer"] == "smollm2-135m" and tokenized["samples"] == 7 and tokenized["host_cores"] >= 1
    assert 0 < tokenized["truncate_s"] and 0 < tokenized["requests_s"] and 0 < tokenized["cpu_s"]
    assert tokenized["tokenize_min"] == pytest.approx(
        (tokenized["truncate_s"] + tokenized["requests_s"]) / 60 * 3668 / 7)
    # each sample's prompt as read is cut to at most 64 tokens; the replay's 0.005 tokens a word give it fewer
    assert rows[0]["prompt_tokens"] == tokenized["replay_prompt_tokens"] <= tokenized["prompt_tokens"] <= 64 * 7
    assert tokenized["prompt_tokens"] >= 7 * 50 and tokenized["cut_samples"] >= 1
    assert eval_throughput.columns([tokenized, *rows])[("tiny-llama", rows[0]["gpu"])] == rows
    assert "| smollm2-135m |" in eval_throughput.table([tokenized, *rows])
    alone = eval_throughput.table([tokenized])
    assert "| smollm2-135m |" in alone and "| fp16" not in alone
    for r in rows:
        assert r["samples"] == 7 and r["column_min"] == pytest.approx(r["wall_s"] / 60 * 3668 / 7)
        assert 0 < r["busy"] <= 1 and r["prefill_share"] > 0 and r["decode_share"] > 0
        assert r["rows_per_step"] >= 1 and 0 <= r["drain_share"] < r["decode_share"]
        assert 0 < r["step_host_ms"] == r["step_ms"]  # a CPU's step is the host's time
        assert r["cache_peak_gib"] <= r["budget_gib"] and r["agreement"] == 1 and r["max_logit_diff"] < 1e-4
        assert r["official_min"] > 0 and r["vs_official"] == pytest.approx(r["official_min"] / r["column_min"])
        assert "3 samples:" in r["official_fit"]
    assert rows[1]["vs_fp16"] == pytest.approx(rows[0]["column_min"] / rows[1]["column_min"])
    assert "| kivi (torch) |" in eval_throughput.table(rows)
    assert ("| rows a step | drain % | step ms | host ms a step | agreement with batch 1 | max logit diff |"
            in eval_throughput.table(rows))


def test_eval_throughput_prompts_have_their_words_and_are_cut_past_the_limit():
    """The tokenization row's prompts: each sample's words of essay text (context, and its question where the
    template reads an input; the essays wrap around), as many in the filled template as the sample's words plus the
    template's own; tokenize_column cuts those past the limit as LongBenchE.truncated cuts them one by one, chat
    template by subset, and counts the tokens as read."""
    from evals.longbench import LongBenchE
    from evals.longbench_prompts import PROMPTS
    from evals.scheduler_replay import QUESTION_WORDS, ReplaySample, haystack_words, prompt_fields, tokenize_column
    from oscar import build_method
    from oscar.lm import KVModel, prompt_length
    from oscar.models import load_tokenizer
    from oscar.paths import DataNotFoundError

    try:
        words = haystack_words()
    except DataNotFoundError as e:
        pytest.skip(str(e))
    short = words[:50]  # a sample longer than its words wraps around
    samples = [ReplaySample(subset, "0-4k", n, n, 32) for subset, n in (
        ("qasper", 0), ("qasper", 7), ("gov_report", 120), ("lcc", 90), ("repobench-p", 60), ("trec", 400),
        ("hotpotqa", 30), ("samsum", 25))]
    fields = prompt_fields(samples, short, seed=1)
    for s, f in zip(samples, fields):
        question = min(QUESTION_WORDS, s.words // 2) if "{input}" in PROMPTS[s.subset] else 0
        assert (len(f["context"].split()), len(f["input"].split())) == (s.words - question, question)
        assert set(f["context"].split()) | set(f["input"].split()) <= set(short)
        template = PROMPTS[s.subset]
        assert len(template.format(**f).split()) == s.words + len(template.format(context="", input="").split())
    assert prompt_fields(samples, short, seed=1) == fields != prompt_fields(samples, short, seed=2)
    lm = KVModel(eval_throughput.skeleton("tiny-llama"), load_tokenizer("smollm2-135m"), build_method("fp16"),
                 max_length=200)
    task = LongBenchE(scheduler=True)
    cut = [task.truncated(lm, f"{s.subset}_e", PROMPTS[s.subset].format(**f)) for s, f in zip(samples, fields)]
    read = [prompt_length(lm.tokenizer, text, task.uses_chat(f"{s.subset}_e", lm.tokenizer))
            for s, (text, _) in zip(samples, cut)]
    times = tokenize_column(lm, samples, fields, task)
    assert times.samples == len(samples) and times.truncate_s > 0 and times.requests_s > 0
    assert times.prompt_tokens == sum(read) and max(read) <= 200
    # qasper's 7 words: 172 tokens, past the 200 only with the chat template's 30; its empty prompt is not cut
    assert times.cut == sum(was_cut for _, was_cut in cut) and [was_cut for _, was_cut in cut] == [
        False, True, True, False, False, True, False, False]


def test_eval_throughput_without_the_baseline(tmp_path, data_file):
    """--no-baseline (a column split over calls, fp16's in another): the methods' rows alone, no vs_fp16."""
    data_file("longbench/task.md")
    main(["eval_throughput", "--out", str(tmp_path), "--model", "tiny-llama", "--methods", "kivi", "--backend",
          "torch", "--fraction", "0.001", "--tokens-per-word", "0.005", "--max-prompt-tokens", "64", "--official",
          "--no-baseline"])
    rows = _rows(tmp_path / "eval_throughput.csv")
    assert [r["method"] for r in rows] == ["kivi"] and rows[0]["vs_fp16"] in (None, "") and rows[0]["column_min"] > 0
    assert "| kivi (torch) |" in eval_throughput.table(rows) and "| fp16" not in eval_throughput.table(rows)


def test_eval_throughput_figure_takes_each_methods_largest_fraction(tmp_path):
    """The figure's columns: per model and GPU, each method's row of the largest fraction (of those, the newest),
    whichever call ran it; the newest group first; the PNG written, nothing drawn without rows."""
    def row(method, fraction, date, gpu="H100", minutes=30.0):
        return dict(model="llama-3.1-8b", gpu=gpu, method=method, backend="cupy", fraction=fraction, date=date,
                    code_version="abc", column_min=minutes, prefill_share=0.6, decode_share=0.3, official_min=600.0)

    rows = [row("fp16", 0.12, "2026-12-06", minutes=29.0), row("ott", 0.12, "2026-12-06", minutes=39.0),
            row("ott", 0.01, "2026-12-07", minutes=58.0), row("ott", 0.12, "2026-12-07", minutes=35.0),
            row("kivi", 0.002, "2026-12-05", minutes=60.0), row("fp16", 0.05, "2026-12-08", gpu="H200")]
    groups = eval_throughput.columns(rows)
    assert list(groups) == [("llama-3.1-8b", "H200"), ("llama-3.1-8b", "H100")]
    h100 = {r["method"]: (r["fraction"], r["column_min"]) for r in groups[("llama-3.1-8b", "H100")]}
    assert h100 == {"fp16": (0.12, 29.0), "ott": (0.12, 35.0), "kivi": (0.002, 60.0)}
    assert eval_throughput.figure(rows, tmp_path / "e.png") and (tmp_path / "e.png").stat().st_size > 10_000
    assert eval_throughput.figure([], tmp_path / "none.png") is False and not (tmp_path / "none.png").exists()


def test_eval_throughput_figure_compares_only_the_newest_rows_column(tmp_path, caplog):
    """Per model and GPU, only rows whose column-defining settings (--max-prompt-tokens, --tokens-per-word, --seed)
    equal the newest row's are drawn, whatever their fraction; a warning names each row left out and why."""
    def row(method, date, arguments, minutes):
        return dict(model="llama-3.1-8b", gpu="H100", method=method, backend="cupy", fraction=0.12, date=date,
                    code_version=f"c{date[-1]}", arguments=arguments, column_min=minutes, prefill_share=0.6,
                    decode_share=0.3)

    rows = [row("kivi", "2026-12-01", "--fraction 0.002 --max-prompt-tokens 8192 --budget 150", 5.0),
            row("quarot", "2026-12-02", "--fraction 0.1 --seed 3", 20.0),
            row("fp16", "2026-12-03", "--methods oscar --fraction 0.12 --official --budget 540", 29.0),
            row("oscar", "2026-12-03", "--methods oscar --fraction 0.12 --official --budget 540", 31.0),
            row("ott", "2026-12-04", "--methods ott --no-baseline --fraction 0.01 --tokens-per-word 1.3", 40.0)]
    with caplog.at_level(logging.WARNING, logger="benchmarks.eval_throughput"):
        groups = eval_throughput.columns(rows)
    assert [r["method"] for r in groups[("llama-3.1-8b", "H100")]] == ["fp16", "oscar", "ott"]
    assert "left out kivi (cupy) of code c1" in caplog.text and "--max-prompt-tokens 8192 (not 31500)" in caplog.text
    assert "left out quarot (cupy) of code c2" in caplog.text and "--seed 3 (not 0)" in caplog.text
    assert eval_throughput.figure(rows, tmp_path / "e.png")


def test_multimodal_on_a_cpu(tmp_path, data_file):
    from evals.modality import DEFAULT_IMAGE

    data_file(DEFAULT_IMAGE)  # the page: skipped without it, with a pointer to `make data`
    main(["multimodal", "--out", str(tmp_path), "--arch", "tiny-qwen3-vl", "--methods", "fp16", "kivi",
          "--new-tokens", "2", "--repeats", "1"])
    rows = _rows(tmp_path / "multimodal.csv")
    fp16, kivi = rows
    assert fp16["prompt_tokens"] > 100  # the page's image tokens are in the prompt and in the cache
    assert kivi["cached_tokens"] == fp16["cached_tokens"] and kivi["kv_bytes"] < fp16["kv_bytes"]
    assert kivi["kv_saving_vs_fp16"] == pytest.approx(fp16["kv_bytes"] / kivi["kv_bytes"])


def test_input_checks_on_a_cpu(tmp_path):
    main(["input_checks", "--out", str(tmp_path), "--repeats", "5"])
    rows = _rows(tmp_path / "input_checks.csv")
    assert [r["case"] for r in rows] == [case[0] for case in input_checks.CASES]
    for r in rows:
        assert r["quantize_us"] > 0 and r["structure_check_us"] > 0
        assert r["overhead"] == pytest.approx((r["finite_check_us"] + r["structure_check_us"]) / r["quantize_us"])


def test_step_census_on_the_kernel_emulator(tmp_path, emulated_ops, caplog):
    """A continuous batch of 3 rows serving 4 samples of 300-420 prompt tokens on backend=cupy (the kernels on the CPU
    emulator): per method a row for the decode steps' bookkeeping and one for the prefills. fp16's static cache
    launches nothing; KIVI's and OSCAR's flushes launch their kernels in both parts; OSCAR's steps, past its sink
    prefix, launch no stage or write of kept tokens (the log's kernels)."""
    with caplog.at_level(logging.INFO, logger="benchmarks.step_census"):
        main(["step_census", "--out", str(tmp_path), "--model", "tiny-llama", "--methods", "fp16", "kivi", "spectral",
              "--rows", "3", "--samples", "4", "--min-prompt", "300", "--max-prompt", "420", "--new-tokens", "40",
              "--prefill-chunk", "128"])
    rows = {(r["method"], r["part"]): r for r in _rows(tmp_path / "step_census.csv")}
    assert sorted(rows) == sorted((m, p) for m in ("fp16", "kivi", "spectral") for p in ("step", "prefill"))
    for (method, part), r in rows.items():  # 4 prefills; at least the 40 steps of a sample's new tokens
        assert r["count"] == 4 if part == "prefill" else r["count"] >= 40
        assert r["ops"] > 0 and r["ops_per_layer"] == pytest.approx(r["ops"] / 2)
    assert rows["fp16", "step"]["launches"] == rows["fp16", "prefill"]["launches"] == 0
    for method in ("kivi", "spectral"):
        assert rows[method, "step"]["launches"] > 0 and rows[method, "prefill"]["launches"] > 0
        assert rows[method, "prefill"]["ops"] > rows["fp16", "prefill"]["ops"]
    steps = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("spectral   step"))
    assert "quantize_spectral" in steps and "stage_kept" not in steps and "write_kept" not in steps, steps
