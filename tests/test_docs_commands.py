"""Every command of the README and docs/*.md, as written, against the code: a doc and its code cannot drift apart.

The code blocks of each file are read (indented blocks and ``bash`` fences; continuation lines joined, a quoted
argument over several lines kept whole, ``NAME=value`` lines expanded into the lines after them in the block, a
``<placeholder>`` for the reader to fill given a value), and
each command line is checked by its kind, on a CPU, offline (``HF_HUB_OFFLINE=1``, an empty hub cache for what runs
in a subprocess):

- ``python run.py ...``: every job (one, or each job of a ``-m`` sweep as Hydra's basic sweeper lists them) is
  composed by Hydra and preflighted (``oscar.runner.preflight``: every check before the weights load). Each must
  pass, or be refused for what this machine lacks (the hub, a GPU, a generated input: :data:`ELSEWHERE`); a command
  whose comment starts with "refused" must have a refused job. ``--cfg job`` runs as written.
- ``python scripts/X.py ...``: ``--help`` (the script's own parser), which must know every ``--option`` written.
- ``python -m ...`` and ``python -c ...``: run as written (the lm-eval CLI is refused in one line without its data).
- ``make X``: the target exists (``make -n``).
- the rest (installing packages, a vLLM server, a request to it) needs what a CPU test machine does not have:
  each is matched by :data:`NOT_HERE`, which says why; a command of no known kind fails the test.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from oscar.paths import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
#: how a command line starts
STARTS = ("python ", "python3 ", "make ", "vllm ", "pip ", "curl ", ".venv", "PYTHONPATH=")
#: commands this CPU test machine cannot run, by what they start with, and why
NOT_HERE = {
    "python3 -m venv": "creates a virtual environment and installs packages (docs/serving.md's vLLM setup)",
    "pip install": "installs packages",
    ".venv-vllm/bin/pip": "installs packages into the vLLM environment",
    "PYTHONPATH=$PWD .venv-vllm/bin/python": "runs in the vLLM environment docs/serving.md builds",
    "vllm serve": "needs vLLM and a CUDA GPU",
    "curl localhost:8000": "needs the vLLM server of the line before",
}
#: refusals that say what this machine lacks, not what the docs got wrong: (exception name, message pattern)
ELSEWHERE = [
    ("ModelUnavailableError", r"not in the local cache and HF_HUB_OFFLINE is set|cannot reach the Hugging Face hub"),
    ("DataUnavailableError", r"HF_HUB_OFFLINE is set|hub .*(cannot be used|cannot reach)|cannot reach the Hugging Face"),
    ("ValueError", r"no CUDA GPU is visible|needs a CUDA GPU|CUDA"),
    ("RuntimeError", r"CUDA|GPU"),
    # docs/benchmarks.md makes this folder with scripts/longbench_fixture.py on the line before its smoke sweep
    ("DataNotFoundError", r"data 'runs/longbench_fixture' not found"),
    # a data file `make data` fetches, and this machine could not (the suite runs on without it)
    ("DataNotFoundError", r"`make data`"),
]


@dataclass
class Command:
    """A documented command: where it is, its words (shell-split, comments out, variables expanded), its comment."""

    where: str
    words: list[str]
    comment: str

    @property
    def text(self) -> str:
        return shlex.join(self.words)


def _comment(line: str) -> str:
    """The text after a `` #`` outside quotes ('' when none)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[i + 1:].strip()
    return ""


def commands_of(path: Path) -> list[Command]:
    """The command lines of one Markdown file (see the module docstring)."""
    lines = path.read_text().splitlines()
    found, variables, fence, i = [], {}, None, 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:].strip() or "text"
            variables = {}
            i += 1
            continue
        in_block = fence in ("bash", "sh", "console", "shell") or (fence is None and line.startswith("    "))
        stripped = line.strip()
        if not stripped:
            variables = {} if fence is None and i + 1 < len(lines) and not lines[i + 1].startswith("    ") else variables
        if not in_block or not stripped:
            i += 1
            continue
        assignment = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(\S+)", stripped)
        if assignment:
            variables[assignment[1]] = assignment[2]
            i += 1
            continue
        if not stripped.startswith(STARTS):
            i += 1
            continue
        start, text, comment = i + 1, "", ""
        while True:  # continuation lines; a quoted argument over several lines
            piece = lines[i].strip()
            comment = " ".join(filter(None, [comment, _comment(piece)]))
            text += ("\n" if text else "") + piece
            i += 1
            try:
                words = shlex.split(text.replace("\\\n", " "), comments=True)
            except ValueError:  # an open quote: the argument goes on
                continue
            if text.rstrip().endswith("\\") and i < len(lines):
                text = text.rstrip()[:-1].rstrip()
                continue
            break
        for name, value in variables.items():
            words = [w.replace(f"${{{name}}}", value).replace(f"${name}", value) for w in words]
        words = [re.sub(r"<[a-z_]+>", "placeholder", w) for w in words]  # `<partition>`: the reader's own value
        found.append(Command(f"{path.relative_to(REPO_ROOT)}:{start}", words, comment))
    return found


@functools.cache
def documented() -> list[Command]:
    return [command for doc in DOCS for command in commands_of(doc)]


def kind(command: Command) -> str:
    words = command.words
    for start in NOT_HERE:
        if command.text.startswith(start) or " ".join(words).startswith(start):
            return "not here"
    if words[0] in ("python", "python3") and len(words) > 1:
        if words[1] == "run.py":
            return "run.py --cfg" if "--cfg" in words else "run.py"
        if words[1].startswith("scripts/"):
            return "script"
        if words[1] in ("-m", "-c"):
            return "python " + words[1]
    if words[0] == "make":
        return "make"
    return "unknown"


def test_the_docs_have_commands_of_known_kinds():
    """Every command is one of the kinds this file checks (a new kind needs a check here)."""
    commands = documented()
    assert len(commands) >= 40, [c.where for c in commands]
    unknown = [f"{c.where}: {c.text}" for c in commands if kind(c) == "unknown"]
    assert not unknown, unknown
    texts = {c.text for c in commands}
    assert "python run.py --cfg job" in texts and "make demo" in texts
    assert any(c.words[:2] == ["python", "-c"] and "\n" in c.words[2] for c in commands)  # a quoted snippet, whole
    results = [c for c in commands if c.where.startswith("docs/results.md") and c.words[:2] == ["python", "run.py"]]
    # $M expanded; the experiments sweep their own methods
    assert results and all("method=fp16,kivi,oscar,quarot,rotatekv,turboquant,ott,spectral" in c.words
                           for c in results if not {"+experiment=ablation", "+experiment=sweep_gxr",
                                                    "+experiment=ruler"} & set(c.words))


# ----------------------------------------------------------------------------- python run.py ...


@pytest.fixture(scope="module")
def offline():
    """The hub unreachable for this module's preflights (HF_HUB_OFFLINE=1, as the models' and data checks read it),
    restored afterwards."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from evals.lm_eval_model import hub_unreachable

    hub_unreachable.cache_clear()
    try:
        import datasets
        from huggingface_hub import constants

        flags = (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE)
    except ImportError:
        flags = None
    yield
    if flags is not None:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = flags
    hub_unreachable.cache_clear()
    if previous is None:
        del os.environ["HF_HUB_OFFLINE"]
    else:
        os.environ["HF_HUB_OFFLINE"] = previous


def run_py_jobs(words: list[str], runs_dir: Path) -> list[list[str]]:
    """The overrides of each job of a documented ``python run.py`` line (one job, or a sweep's as the basic sweeper
    lists them: ``oscar.sweeps.sweep_jobs``), with the run's outputs moved under ``runs_dir`` (the checks look at
    where a run would write); Hydra's own options (``hydra/launcher=...``, ``hydra.*``) are composed once here and
    left out of the jobs (they choose how jobs are launched, not what they compute)."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    from oscar.sweeps import sweep_jobs

    overrides = [w for w in words[2:] if w not in ("-m", "--multirun")]
    overrides += [f"runs_dir={runs_dir}", f"results_file={runs_dir / 'rows.csv'}"]
    if "-m" not in words and "--multirun" not in words:
        return [overrides]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    single = [o.input_line for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]
    config = compose("config", overrides=single, return_hydra_config=True)
    with open_dict(config):
        config.hydra.overrides.task = overrides
    return [[o for o in job if not o.startswith(("hydra.", "hydra/"))] for job in sweep_jobs(config)]


@functools.cache
def _composed(groups: tuple[str, ...]):
    from hydra import compose

    return compose("config", overrides=list(groups))


def job_config(job: list[str]):
    """The configuration of one job, as Hydra composes it: the config groups it chooses (``method=kivi``,
    ``+experiment=niah``; composed once per choice, the slow part), then its other overrides applied the way Hydra
    applies them after composing (``ConfigLoaderImpl._apply_overrides_to_config``)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(job)
    chooses = [loader.repository.group_exists(o.key_or_group) for o in parsed]
    config = copy.deepcopy(_composed(tuple(o.input_line for o, group in zip(parsed, chooses) if group)))
    ConfigLoaderImpl._apply_overrides_to_config([o for o, group in zip(parsed, chooses) if not group], config)
    return config


@functools.cache
def _preflight(job: tuple[str, ...]) -> tuple[str, str] | None:
    """The refusal (exception name, message) of one job's configuration, None when it passes (each job once: the
    docs repeat sweeps with other launchers)."""
    from evals import build_task
    from oscar.runner import BAD_INPUT, preflight

    try:
        preflight(job_config(list(job)), build_task)
    except BAD_INPUT as e:
        return type(e).__name__, str(e)
    return None


def check_run_py(command: Command, runs_dir: Path) -> list[tuple[str, str]]:
    """Each job's refusal (exception name, message), [] for a command whose jobs all pass."""
    return [refusal for job in run_py_jobs(command.words, runs_dir) if (refusal := _preflight(tuple(job)))]


def is_ruler(command: Command) -> bool:
    """A RULER line: its preflight makes the samples through NVIDIA's generators (half a minute a job on 2 cores)."""
    return any("ruler" in word for word in command.words)


@pytest.mark.parametrize("ruler", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["others", "ruler"])
def test_every_documented_run_py_line_composes_and_preflights(tmp_path, offline, ruler):
    from hydra import initialize_config_dir

    checked = 0
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO_ROOT / "conf")):
        for command in documented():
            if kind(command) != "run.py" or is_ruler(command) != ruler:
                continue
            refusals = check_run_py(command, tmp_path / "runs")
            checked += 1
            if command.comment.startswith("refused"):
                assert refusals, f"{command.where}: documented as refused, but every job passes: {command.text}"
                continue
            wrong = [(name, message) for name, message in refusals
                     if not any(name == kind_ and re.search(pattern, message) for kind_, pattern in ELSEWHERE)]
            assert not wrong, f"{command.where}: {command.text}\n  refused: {wrong[0][0]}: {wrong[0][1]}"
    assert checked >= (3 if ruler else 25)


def test_the_readme_sweep_runs_fully_on_the_default_model(tmp_path, offline):
    """The README's sweep example: 8 jobs on SmolLM2, every one passes; its neighbour shows the G=128 refusal."""
    from hydra import initialize_config_dir

    readme = [c for c in documented() if c.where.startswith("README.md") and c.words[:3] == ["python", "run.py", "-m"]
              and "task=niah" in c.words]
    runs, refused = readme
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO_ROOT / "conf")):
        assert len(run_py_jobs(runs.words, tmp_path)) == 8 and check_run_py(runs, tmp_path) == []
        refusals = check_run_py(refused, tmp_path)
    assert [message for _, message in refusals] == ["oscar: group_size=128 must divide head_dim=64 (per-token "
                                                    "value groups)", "kivi: group_size=128 must divide head_dim=64 "
                                                    "(per-token value groups)"]
    assert "2 jobs with G=128" in refused.comment


# ----------------------------------------------------------------------------- scripts, python -m / -c, make


def test_every_documented_script_knows_its_options(capsys, monkeypatch):
    import importlib

    scripts = [c for c in documented() if kind(c) == "script"]
    assert scripts
    for command in scripts:
        module = importlib.import_module(command.words[1].removesuffix(".py").replace("/", "."))
        monkeypatch.setattr(sys, "argv", [command.words[1], "--help"])
        with pytest.raises(SystemExit) as done:
            module.main()
        assert done.value.code == 0, command.where
        usage = capsys.readouterr().out
        for option in (w.split("=")[0] for w in command.words[2:] if w.startswith("--")):
            assert option in usage, f"{command.where}: {command.words[1]} has no {option}"


def _run(words: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run([sys.executable if words[0] in ("python", "python3") else words[0], *words[1:]],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**clean, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
                               "OMP_NUM_THREADS": "1", **env})


def test_every_documented_python_module_and_snippet_runs_as_written(tmp_path):
    """``python -m``/``-c`` lines as written: the lm-eval CLI refuses gsm8k in one line (no data here, exit 2), the
    vLLM check says in one line that vLLM is missing (exit 2) where it is, or reports it; the snippets run."""
    import importlib.util

    has_vllm = importlib.util.find_spec("vllm") is not None
    commands = [c for c in documented() if kind(c) in ("python -m", "python -c")]
    assert {c.words[2] for c in commands if c.words[1] == "-m"} == {"evals.lm_eval_model", "oscar_vllm.core"}
    started = []
    for command in commands:
        if command.words[2] == "oscar_vllm.core" and "--apply" in command.words and has_vllm:
            continue  # it patches the installed vLLM
        args = [sys.executable if command.words[0] in ("python", "python3") else command.words[0], *command.words[1:]]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env = {**clean, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        started.append((command, subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE, text=True, env=env)))
    for command, process in started:
        out, err = process.communicate(timeout=300)
        where = f"{command.where}: {command.text}\n{(out + err)[-2000:]}"
        if command.words[2] == "evals.lm_eval_model":
            assert process.returncode == 2 and err.strip().splitlines() == [err.strip()], where
            assert err.startswith("bad input, nothing was loaded: lm_eval: the data of gsm8k is not in the local "
                                  "cache"), where
        elif command.words[2] == "oscar_vllm.core" and not has_vllm:
            assert process.returncode == 2 and err == ("vLLM is not installed here: pip install -e '.[vllm]' (vLLM "
                                                       "0.33.0; its install steps: docs/serving.md)\n"), where
        else:
            assert process.returncode in (0, 1) and "Traceback" not in err, where


def test_run_py_cfg_job_prints_the_composed_config(tmp_path):
    (command,) = [c for c in documented() if kind(c) == "run.py --cfg"]
    done = _run(command.words, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "method:\n  name: oscar" in done.stdout and "task:\n  name: niah" in done.stdout


def test_every_documented_make_target_exists():
    targets = {c.words[1] for c in documented() if kind(c) == "make"}
    assert {"demo", "test", "tables"} <= targets
    for target in targets:
        done = subprocess.run(["make", "-n", target], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"make {target}: {done.stderr}"
