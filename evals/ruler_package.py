"""NVIDIA's RULER as PyPI's ``nvidia-long-context-eval`` 26.3 ships it: its task table, sample generators and scorer.

What is taken from the package, and how:

- the task table: ``long_context_eval/synthetic.yaml`` (the 13 tasks: generator and arguments), merged with the
  generators' templates, answer prefixes and tokens to generate (``data/synthetic/constants.py``) and the ``base``
  model template (``data/template.py``), as ``data/prepare.py`` merges them (:func:`task_config`);
- the generators (``data/synthetic/<generator>.py``): scripts that parse their arguments and load the tokenizer
  when imported, so each runs as ``__main__`` in a forked child process with the arguments ``prepare.py`` gives it
  (:func:`generator_arguments`; the model's tokenizer saved to a folder, ``--tokenizer_type hf``) and writes
  ``<task>/validation.jsonl``. Not ``prepare.py`` itself: it fixes the seed at 42, runs ``python`` from PATH through
  a shell and prints a failed generator's error instead of failing; tests/test_ruler.py checks that the samples
  are ``prepare.py``'s for seed 42. A fork, not a new interpreter, so that the child need not import transformers
  and NLTK again (about 1 s a task instead of 15 on a 2-core machine);
- the scorer: the per-sample metrics of ``eval/synthetic/constants.py`` (``string_match_all`` for NIAH, VT, CWE
  and FWE; ``string_match_part`` for QA), on the prediction cleaned as ``eval/evaluate.py`` cleans it
  (:func:`postprocess`, the one piece rewritten: ``evaluate.py`` is a script that parses arguments and downloads
  NLTK's punkt when imported); tests/test_ruler.py checks the scores against ``evaluate.py``'s summary.

Dependencies: the package is installed ``--no-deps`` (scripts/bootstrap.sh). Of those it declares, the generators
import only wonderwords (word lists), nltk (the essays' sentence splitting), scipy (FWE's zeta distribution),
tenacity (imported by its tokenizer module), numpy, pyyaml, tqdm and transformers; nemo-evaluator and openai serve
its model-API client and tiktoken its OpenAI tokenizers (whose encodings are fetched at run time): none of that
runs here.

Offline: the five NIAH tasks with the essay haystack split the Paul Graham essays into sentences with NLTK's
``punkt_tab`` model, which NLTK downloads from GitHub at run time. It is read from the copy that PyPI's
``llama-index-core`` wheel ships (installed ``--no-deps`` and never imported), or from NLTK's own data folders where
they have it (:func:`punkt_root`). Every other file the generators read is inside the two packages.

A length too short for a task's smallest prompt makes some generators retry a sample forever; :func:`generate`
stops a generator whose haystack search found nothing that fits, from the lines it prints, and raises
:class:`TooShort` with what its first step needed (the ``Current length`` it printed); a generator silent for
:data:`STALL_SECONDS` is stopped too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import re
import runpy
import string
import sys
import tempfile
from collections import defaultdict
from functools import cache
from pathlib import Path

DISTRIBUTION = "nvidia-long-context-eval"
VERSION = "26.3"
INSTALL = (f'pip install --no-deps "{DISTRIBUTION}=={VERSION}" "llama-index-core==0.14.25" and pip install -e '
           '".[ruler]" (make setup does both)')
#: the 13 tasks of RULER, in its order (the package's entrypoint.AVAILABLE_TASKS)
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
#: the modules each generator imports beyond the package, numpy, pyyaml, tqdm and transformers
GENERATOR_MODULES = {"niah": ("wonderwords", "nltk", "tenacity"), "variable_tracking": ("tenacity",),
                     "common_words_extraction": ("wonderwords", "tenacity"),
                     "freq_words_extraction": ("scipy", "tenacity"), "qa": ("tenacity",)}
#: the lines a generator prints at the end of its haystack search (the size found) and at each of its steps
SEARCH_END = re.compile(r"^(?:Num haystack|Num noises|num_words|Number of documents|num_example_words):\s*(-?\d+)")
SEARCH_STEP = re.compile(r"Current length (\d+)")
FWE_SEARCH_END = "num_example_words:"
#: a generator silent this long is retrying a sample forever (its slowest step, a 128K-token search step or NIAH's
#: word list, takes well under a minute)
STALL_SECONDS = 600
PUNKT = "tokenizers/punkt_tab/english"


class TooShort(ValueError):
    """A length below the smallest prompt a generator can make: ``needed`` tokens (prompt and answer; None: it
    measured none)."""

    def __init__(self, needed: int | None):
        super().__init__(f"the generator's smallest haystack needs {needed or 'more'} tokens")
        self.needed = needed


def package_dir() -> Path | None:
    """The installed ``long_context_eval`` folder, or None."""
    spec = importlib.util.find_spec("long_context_eval")
    return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None


def require_package() -> Path:
    """The package folder; an ImportError with the install command when it is not installed."""
    folder = package_dir()
    if folder is None or not (folder / "synthetic.yaml").is_file():
        raise ImportError(f"ruler: the package {DISTRIBUTION} is not installed; {INSTALL}")
    return folder


def version() -> str:
    return importlib.metadata.version(DISTRIBUTION)


@cache
def _table() -> dict:
    import yaml

    return yaml.safe_load((require_package() / "synthetic.yaml").read_text())


def task_config(name: str) -> dict:
    """``name``'s entry of synthetic.yaml with its generator's defaults, as prepare.py merges them: ``task`` (the
    generator), ``args``, ``tokens_to_generate`` and ``template`` (the ``base`` model template around the task's,
    then its answer prefix)."""
    from long_context_eval.data.synthetic.constants import TASKS as GENERATORS
    from long_context_eval.data.template import Templates

    config = dict(_table()[name])
    config.update(GENERATORS[config["task"]])
    config["template"] = (Templates["base"].format(task_template=config["template"])
                          + config.get("answer_prefix", ""))
    return config


def generator_arguments(name: str, tokenizer_dir: Path, length: int, num_samples: int, seed: int,
                        save_dir: Path) -> list[str]:
    """The command-line arguments prepare.py passes to ``name``'s generator (chunk 0 of 1, ``seed`` for its 42)."""
    config = task_config(name)
    args = ["--save_dir", str(save_dir), "--save_name", name, "--subset", "validation",
            "--tokenizer_path", str(tokenizer_dir), "--tokenizer_type", "hf", "--max_seq_length", str(length),
            "--tokens_to_generate", str(config["tokens_to_generate"]), "--num_samples", str(num_samples),
            "--random_seed", str(seed)]
    for key, value in config["args"].items():
        args += [f"--{key}", str(value)]
    if config["task"] == "qa":
        args += ["--pre_samples", "0"]
    return args + ["--template", config["template"]]


def generator_script(name: str) -> Path:
    return require_package() / "data" / "synthetic" / f"{_table()[name]['task']}.py"


def uses_essays(name: str) -> bool:
    """Whether ``name`` is a NIAH task over the essays (sentence-split with punkt)."""
    entry = _table()[name]
    return entry["task"] == "niah" and entry["args"].get("type_haystack") == "essay"


def punkt_root() -> Path | None:
    """An NLTK data folder holding English ``punkt_tab``: llama-index-core's copy, else NLTK's own folders."""
    try:
        bundled = Path(importlib.metadata.distribution("llama-index-core").locate_file(
            "llama_index/core/_static/nltk_cache"))
    except importlib.metadata.PackageNotFoundError:
        bundled = None
    if bundled is not None and (bundled / PUNKT).is_dir():
        return bundled
    if importlib.util.find_spec("nltk") is None:
        return None
    import nltk

    return next((Path(p) for p in nltk.data.path if (Path(p) / PUNKT).is_dir()), None)


def missing_modules(name: str) -> list[str]:
    """The modules ``name``'s generator imports that are not installed."""
    return [m for m in GENERATOR_MODULES[_table()[name]["task"]] if importlib.util.find_spec(m) is None]


def data_files(name: str) -> list[Path]:
    """Every file that decides ``name``'s samples and scores: the package's table, templates, generator and
    scorer, the data it reads (essays, SQuAD, HotpotQA; the punkt model), wonderwords' word lists."""
    root = require_package()
    synthetic = root / "data" / "synthetic"
    files = [root / "synthetic.yaml", synthetic / "constants.py", root / "data" / "template.py",
             root / "data" / "tokenizer.py", generator_script(name), root / "eval" / "synthetic" / "constants.py"]
    entry = _table()[name]
    if uses_essays(name):
        files.append(synthetic / "json" / "PaulGrahamEssays.json")
        punkt = punkt_root()
        files += sorted((punkt / PUNKT).glob("*")) if punkt else []
    if entry["task"] == "qa":
        files.append(synthetic / "json" / f"{entry['args']['dataset']}.json")
    if entry["task"] in ("niah", "common_words_extraction") and importlib.util.find_spec("wonderwords"):
        assets = Path(list(importlib.util.find_spec("wonderwords").submodule_search_locations)[0]) / "assets"
        files += [assets / f"{kind}list.txt" for kind in ("noun", "adjective", "verb")]
    return files


def template_tokens(name: str, tokenizer) -> int:
    """Tokens of ``name``'s prompt without any haystack or needle (the template and answer prefix, its fields
    empty) plus the tokens it generates: no length below this can hold one of its samples."""
    config = task_config(name)
    fields = defaultdict(str, type_needle_v=config["args"].get("type_needle_v", ""))
    bare = string.Formatter().vformat(config["template"], (), fields)
    return len(tokenizer.tokenize(bare)) + config["tokens_to_generate"]


#: tokenizer_config.json keys that no generator reads, which loading or KVModel (left padding) set
UNREAD_TOKENIZER_KEYS = ("padding_side", "pad_token", "is_local", "local_files_only")


def tokenizer_folder(tokenizer, folder: Path) -> str:
    """Save ``tokenizer`` into ``folder`` (what the generators load) and return a digest of what decides its tokens:
    the files saved, less :data:`UNREAD_TOKENIZER_KEYS`."""
    tokenizer.save_pretrained(folder)
    digest = hashlib.sha1()
    for path in sorted(Path(folder).iterdir()):
        data = path.read_bytes()
        if path.name == "tokenizer_config.json":
            config = {k: v for k, v in json.loads(data).items() if k not in UNREAD_TOKENIZER_KEYS}
            data = json.dumps(config, sort_keys=True).encode()
        digest.update(path.name.encode() + b"\0" + data)
    return digest.hexdigest()[:16]


def generate(name: str, tokenizer_dir: Path, length: int, num_samples: int, seed: int) -> list[dict]:
    """``num_samples`` samples of task ``name`` at ``length`` tokens by the package's generator (records with
    ``index``, ``input``, ``outputs``, ``length``), run in a forked child. :class:`TooShort` when no haystack fits;
    a RuntimeError with the generator's last lines when it fails, or when it prints nothing for
    :data:`STALL_SECONDS` (a retry loop the search rule missed): never a run that waits forever."""
    script = generator_script(name)
    punkt = punkt_root() if uses_essays(name) else None
    tail: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ruler_") as save_dir:
        argv = [str(script), *generator_arguments(name, tokenizer_dir, length, num_samples, seed, Path(save_dir))]
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_run_generator, args=(argv, punkt, send), daemon=True)
        child.start()
        send.close()
        try:
            while True:
                if not receive.poll(STALL_SECONDS):
                    child.kill()
                    raise RuntimeError(f"ruler: the package's {script.name} printed nothing for {STALL_SECONDS} s "
                                       f"making {name} at length {length} (a generator retrying forever); its "
                                       f"output ended: {' | '.join(tail)}")
                kind, detail = receive.recv()
                if kind != "line":
                    break
                tail = (tail + [detail])[-5:]
        except EOFError:  # the child died without a word (killed, out of memory)
            kind, detail = "error", f"its process ended without a result (exit code {child.exitcode})"
        child.join()
        if kind == "short":
            raise TooShort(detail)
        if kind == "error":
            raise RuntimeError(f"ruler: the package's {script.name} failed making {name} at length {length}: "
                               f"{detail}; its output ended: {' | '.join(tail)}")
        with open(Path(save_dir) / name / "validation.jsonl", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


class _SearchWatch:
    """The generator's stdout and stderr in the child: sends each line to the parent, and stops the generator
    (raises TooShort) where its haystack search ended without a haystack that fits, from which it would retry a
    sample forever: at a size of 0, or without measuring a step (VT's search, when its in-context example alone
    fills the length; FWE's search measures no steps and cannot end so)."""

    def __init__(self, send):
        self.send = send
        self.first_step: int | None = None
        self._line = ""

    def write(self, text: str) -> int:
        self._line += text
        *lines, self._line = re.split(r"[\n\r]", self._line)
        for line in filter(str.strip, lines):
            self.send.send(("line", line))
            step, end = SEARCH_STEP.search(line), SEARCH_END.match(line)
            if step and self.first_step is None:
                self.first_step = int(step.group(1))
            if end:
                if int(end.group(1)) <= 0 or (self.first_step is None and not line.startswith(FWE_SEARCH_END)):
                    raise TooShort(self.first_step)
                self.first_step = None  # VT searches twice: its in-context example, then the samples
        return len(text)

    def flush(self) -> None:
        pass


def _run_generator(argv: list[str], punkt: Path | None, send) -> None:
    """In the forked child: run the generator script as ``__main__`` with ``argv``, as ``python <script> ...``
    would (its folder first on sys.path); send its lines, then ("ok" | "short" | "error", detail)."""
    sys.stdout = sys.stderr = _SearchWatch(send)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the parent's tokenizer threads do not survive the fork
    try:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).parent))
        if punkt is not None:
            import nltk

            nltk.data.path.insert(0, str(punkt))
        runpy.run_path(argv[0], run_name="__main__")
        send.send(("ok", None))
    except TooShort as e:
        send.send(("short", e.needed))
    except BaseException as e:  # noqa: BLE001 - the generator's own error (SystemExit of argparse included)
        send.send(("error", f"{type(e).__name__}: {e}"))


def postprocess(prediction: str | None) -> str:
    """A prediction as ``eval/evaluate.py``'s ``postprocess_pred`` cleans it: stripped, control characters made
    newlines, stripped again."""
    if prediction is None:
        return ""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def _metrics(name: str) -> dict:
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    return METRICS[_table()[name]["task"]]


def sample_scores(name: str, predictions: list[str], references: list[list[str]]) -> list[float]:
    """The package's per-sample scores (0-100) of ``name``'s predictions."""
    return [float(s) for s in _metrics(name)["metric_fn_per_sample"]([postprocess(p) for p in predictions],
                                                                     references)]


def task_score(name: str, predictions: list[str], references: list[list[str]]) -> float:
    """The package's score (0-100, two decimals) of ``name`` over its samples, as evaluate.py's summary gives it."""
    return float(_metrics(name)["metric_fn"]([postprocess(p) for p in predictions], references))
