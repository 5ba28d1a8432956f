"""RULER (Hsieh et al., 2024): 13 synthetic long-context tasks at each of ``lengths`` tokens, made for the model's own
tokenizer by NVIDIA's package (evals/ruler_package.py says what is used from it and how).

Per length L and task (``tasks``: any of the 13, default all):
  1. ``num_samples`` samples from the package's generator for this tokenizer at max_seq_length L and seed ``seed``
     (RULER's 42): a prompt in the ``base`` template (raw text ending in the task's answer prefix) and its
     references; the generator sizes the haystack so that the prompt and the task's tokens to generate fit in L
     tokens as it counts them (no special tokens), FWE its prompt alone;
  2. greedy decoding of the task's tokens to generate (NIAH 128, VT 30, CWE 120, FWE 50, QA 32) after the raw
     prompt, no stop string, in left-padded batches of ``batch_size`` samples of one task, or (``scheduler=true``)
     every sample of every task and length at once through evals.scheduler (ordered by length, continuous batching
     up to ``batch_tokens``; on a CPU the tokens each sample gets alone);
  3. the package's score of each sample (x100): the share of the references found in the prediction (NIAH, VT, CWE,
     FWE), or whether any is (QA), case-insensitive.
Reported: the package's score of each task at each length (subset ``<task>@<L>``, two decimals, as its summary);
``average@<L>``, the mean over the tasks at L; ``average``, the mean of those over the lengths (in the tables, over
the tasks every method of the model ran: :meth:`Ruler.merge_rows`). Predictions are logged per sample, so a killed
run resumes at the sample in flight.

Samples are made in the preflight (``check_tokenizer``, before the weights load) and kept for the run in this
process (the jobs of a sweep in one process share them); the same options and tokenizer give the same samples, so a
resumed run makes them again identically. Refused before the weights load: an unknown task, a length past the
model's max_length or positions, a length shorter than a task's template and answer or than its generator's
smallest haystack, and a sample whose prompt and answer run past the model's positions (FWE fills the length with
its prompt, so its answer can run past L).
"""

from __future__ import annotations

import logging
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from evals import ruler_package as package
from evals.base import Headline, Task, TaskResult, register_task
from evals.scheduler import Job, ScheduledGeneration, scheduled_generate
from evals.tables import config_key, labelled, ordered, task_setting, value_table, write_table
from oscar.lm import KVModel, prompt_length
from oscar.options import bounded
from oscar.results import NUMBER, PredictionLog

log = logging.getLogger(__name__)

#: what a logged sample holds (a record without them is computed again)
SAMPLE_FIELDS = dict(task=str, length=int, index=int, pred=str, outputs=list, score=NUMBER)
#: (tokenizer digest, package version, task, length, samples, seed) -> samples, for this process
_SAMPLES: dict[tuple, list[dict]] = {}


def cell(task: str, length: int) -> str:
    """A row's subset: ``niah_single_1@4096``."""
    return f"{task}@{length}"


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@register_task("ruler")
@dataclass
class Ruler(ScheduledGeneration, Task):
    """Options: ``tasks`` (RULER's names), ``lengths`` (tokens), ``num_samples`` per task and length, ``seed`` of
    the generators, ``batch_size``; ``scheduler`` and ``batch_tokens`` (evals.scheduler)."""

    headline = (Headline("score", "average"),)
    grid_options = ("tasks", "lengths")
    option_words = {"num_samples": lambda v: f"{v} samples per task", "seed": lambda v: f"seed {v}",
                    "batch_size": lambda v: f"batches of {v}"}

    tasks: list[str] = field(default_factory=lambda: list(package.TASKS))
    lengths: list[int] = bounded(factory=lambda: [4096], gt=0)
    num_samples: int = bounded(10, ge=1)
    seed: int = bounded(42, ge=0, le=2**32 - 1)  # the generators seed Python's and numpy's generators with it
    batch_size: int = bounded(1, ge=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [t for t in self.tasks if t not in package.TASKS]
        if unknown:
            raise ValueError(f"ruler: unknown task(s) {unknown}; RULER's 13 are {list(package.TASKS)}")
        for option in ("tasks", "lengths"):
            values = getattr(self, option)
            twice = sorted({v for v in values if values.count(v) > 1}, key=values.index)
            if not values or twice:
                raise ValueError(f"ruler: task.{option} must name each {option[:-1]} once (got {values})")
        self.check_scheduler(self.batch_size)
        self._limits: dict[str, int | None] = {}  # the model's max_length and positions, from the checks below

    # -- checks (before the weights load) -------------------------------------------------------
    def check(self) -> None:
        """The package, the generators' modules, the punkt model of the essay tasks and every file they read."""
        package.require_package()
        for name in self.tasks:
            missing = package.missing_modules(name)
            if missing:
                raise ImportError(f"ruler: {name}'s generator imports {', '.join(missing)}, not installed; "
                                  f"{package.INSTALL}")
            if package.uses_essays(name) and package.punkt_root() is None:
                raise FileNotFoundError(f"ruler: {name} splits its essays into sentences with NLTK's punkt_tab, "
                                        f"found neither in llama-index-core nor in NLTK's data folders; "
                                        f"{package.INSTALL}")
        absent = [str(p) for p in self.data_files() if not p.is_file()]
        if absent:
            raise FileNotFoundError(f"ruler: the package's files {absent} are missing; reinstall it: {package.INSTALL}")

    def check_context(self, max_length: int) -> None:
        self._limits["max_length"] = max_length
        long = [length for length in self.lengths if length > max_length]
        if long:
            raise ValueError(f"ruler: task.lengths {long} exceed the model's max_length {max_length}")

    def check_positions(self, max_positions: int | None) -> None:
        self._limits["positions"] = max_positions
        long = [length for length in self.lengths if max_positions is not None and length > max_positions]
        if long:
            raise ValueError(f"ruler: task.lengths {long} run past the model's {max_positions} positions")

    def check_tokenizer(self, tokenizer) -> None:
        """Each length against each task's template and answer, then the samples made (the generators refuse a
        length below their smallest haystack) and each prompt against the model's max_length and positions."""
        for name in self.tasks:
            needed = package.template_tokens(name, tokenizer)
            short = [length for length in self.lengths if length < needed]
            if short:
                raise ValueError(f"ruler: task.lengths {short} are shorter than {name}'s template and answer "
                                 f"({needed} tokens of this model)")
        max_length, positions = self._limits.get("max_length"), self._limits.get("positions")
        for (name, length), records in self.samples(tokenizer).items():
            answer = package.task_config(name)["tokens_to_generate"]
            for record in records:
                tokens = prompt_length(tokenizer, record["input"])
                if max_length is not None and tokens > max_length:
                    raise ValueError(f"ruler: {name}'s sample {record['index']} at length {length} has a {tokens}-"
                                     f"token prompt, more than the model's max_length {max_length}")
                if positions is not None and tokens + answer > positions:
                    raise ValueError(f"ruler: {name}'s sample {record['index']} at length {length} has a {tokens}-"
                                     f"token prompt and generates {answer} tokens, past the model's {positions} "
                                     f"positions{' (FWE fills the length with its prompt)' if name == 'fwe' else ''}"
                                     f"; lower task.lengths or leave {name} out of task.tasks")

    def data_files(self) -> list[Path]:
        if package.package_dir() is None:
            return []
        return list(dict.fromkeys(path for name in self.tasks for path in package.data_files(name)))

    # -- samples and the run ------------------------------------------------------------------
    def samples(self, tokenizer) -> dict[tuple[str, int], list[dict]]:
        """(task, length) -> the package's samples for ``tokenizer`` (made once per process)."""
        version = package.version()
        out = {}
        with tempfile.TemporaryDirectory(prefix="ruler_tokenizer_") as folder:
            digest = package.tokenizer_folder(tokenizer, Path(folder))
            for length in self.lengths:
                for name in self.tasks:
                    key = (digest, version, name, length, self.num_samples, self.seed)
                    if key not in _SAMPLES:
                        log.info("ruler: making %d samples of %s at %d tokens", self.num_samples, name, length)
                        try:
                            _SAMPLES[key] = package.generate(name, Path(folder), length, self.num_samples, self.seed)
                        except package.TooShort as e:
                            needs = (f"needs {e.needed} tokens of this model (prompt and answer)" if e.needed
                                     else "does not fit")
                            raise ValueError(f"ruler: task.lengths [{length}] is too short for {name}: its "
                                             f"generator's smallest haystack {needs}") from None
                    out[(name, length)] = _SAMPLES[key]
        return out

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        self.check()
        self.check_context(lm.max_length)
        self.check_positions(lm.positions)
        self.check_tokenizer(lm.tokenizer)
        samples = self.samples(lm.tokenizer)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        predictions = PredictionLog(Path(run_dir) / "predictions.jsonl", SAMPLE_FIELDS)
        key = lambda name, length, record: f"{cell(name, length)}#{record['index']}"  # noqa: E731
        todo = {c: [r for r in records if key(*c, r) not in predictions.done] for c, records in samples.items()}

        def record(name: str, length: int, batch: list[dict], outputs: list[str]) -> None:
            scores = package.sample_scores(name, outputs, [r["outputs"] for r in batch])
            for sample, output, score in zip(batch, outputs, scores):
                predictions.write(key(name, length, sample), {
                    "task": name, "length": length, "index": sample["index"], "pred": output,
                    "outputs": sample["outputs"], "prompt_tokens": prompt_length(lm.tokenizer, sample["input"]),
                    "score": score})

        if self.scheduler:
            jobs, of_job = [], {}
            for (name, length), records in todo.items():
                answer = package.task_config(name)["tokens_to_generate"]
                for sample in records:
                    jobs.append(Job(key(name, length, sample), sample["input"], answer))
                    of_job[jobs[-1].key] = (name, length, sample)
            for job, output, _ in tqdm(scheduled_generate(lm, jobs, self.batch_tokens), total=len(jobs),
                                       desc=f"ruler {lm.name}"):
                name, length, sample = of_job[job.key]
                record(name, length, [sample], [output])
        else:
            for (name, length), records in tqdm(todo.items(), desc=f"ruler {lm.name}"):
                answer = package.task_config(name)["tokens_to_generate"]
                for start in range(0, len(records), self.batch_size):
                    batch = records[start:start + self.batch_size]
                    record(name, length, batch, lm.generate([r["input"] for r in batch], answer))
        return self.summarize({c: [predictions.done[key(*c, r)] for r in records] for c, records in samples.items()})

    def summarize(self, done: dict[tuple[str, int], list[dict]]) -> TaskResult:
        """Rows: the package's score per (task, length), the average per length, the average over lengths."""
        rows, metrics = [], {}

        def add(subset: str, value: float, n: int) -> float:
            rows.append({"subset": subset, "metric": "score", "value": value, "n": n})
            metrics[subset] = value
            return value

        averages = []
        for length in self.lengths:
            scores = [add(cell(name, length),
                          package.task_score(name, [r["pred"] for r in records], [r["outputs"] for r in records]),
                          len(records))
                      for (name, at), records in done.items() if at == length]
            averages.append(add(f"average@{length}", mean(scores), len(scores)))
        add("average", mean(averages), len(done))
        return TaskResult(metrics=metrics, rows=rows)

    # -- tables -------------------------------------------------------------------------------
    @classmethod
    def merge_rows(cls, rows: list[dict]) -> list[dict]:
        """``rows`` with RULER's averages recomputed over the task cells of every run of the same model, method
        configuration and task setting (tasks or lengths split over runs count as one grid): ``average@<L>`` over
        the line's own tasks at L; ``average``, the headline the methods table and the Pareto figures compare lines
        by, over the cells every line of the model and task setting has (where lines ran different tasks, the
        shared ones: its ``n`` says how many), the mean of its per-length means."""
        cells: dict[tuple, dict[str, dict]] = defaultdict(dict)
        for r in rows:
            if r["task"] == "ruler" and "@" in r["subset"] and not r["subset"].startswith("average"):
                cells[_line(r)][r["subset"]] = r
        group = {line: (line[0], *line[2:]) for line in cells}  # (model, task setting, metric): lines that compare
        shared: dict[tuple, set[str]] = {}  # group -> the cells every line of it has
        for line, grid in cells.items():
            shared[group[line]] = shared[group[line]] & set(grid) if group[line] in shared else set(grid)
        merged = [r for r in rows if not (r["task"] == "ruler" and r["subset"].startswith("average")
                                          and _line(r) in cells)]
        for line, grid in cells.items():
            example = next(iter(grid.values()))
            for length, values in sorted(_by_length(grid, set(grid)).items(), key=lambda kv: int(kv[0])):
                merged.append({**example, "subset": f"average@{length}", "value": mean(values), "n": len(values)})
            common = shared[group[line]] or set(grid)
            merged.append({**example, "subset": "average", "n": len(common),
                           "value": mean(mean(v) for v in _by_length(grid, common).values())})
        return merged

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """tables/ruler_<length>: per (model, method) the score of each task at that length and their mean."""
        written = []
        for length, (header, body) in ruler_tables(rows).items():
            written += write_table(out, f"ruler_{length}", header, body,
                                   f"RULER at {length} tokens: the package's score per task (0-100) and their mean")
        return written


def _line(row: dict) -> tuple:
    return row["model"], config_key(row), task_setting(row), row["metric"]


def _by_length(grid: dict[str, dict], subsets: set[str]) -> dict[str, list[float]]:
    """The values of ``grid``'s cells among ``subsets`` (``<task>@<L>``), by length L."""
    by_length: dict[str, list[float]] = defaultdict(list)
    for subset, r in grid.items():
        if subset in subsets:
            by_length[subset.split("@")[1]].append(float(r["value"]))
    return by_length


def ruler_tables(rows: list[dict]) -> dict[int, tuple[list[str], list[list]]]:
    """length -> (header, body): a line per (model, method), a column per task of RULER (in its order) that some
    line has at that length, then ``avg`` (the mean over that line's tasks); where the lines of a model ran different
    tasks, also ``avg of the N shared``: the mean over the tasks every line of its model has, the one average its
    lines can be compared by (as the headline ``average`` of :meth:`Ruler.merge_rows`; "avg of the shared" where the
    models share different numbers of tasks)."""
    rows = labelled([r for r in rows if r["task"] == "ruler" and r["metric"] == "score" and "@" in r["subset"]])
    values = value_table(rows)
    tables = {}
    for length in sorted({int(r["subset"].split("@")[1]) for r in rows}):
        present = {r["subset"].split("@")[0] for r in rows if r["subset"].endswith(f"@{length}")}
        names = [name for name in package.TASKS if name in present]
        lines = [key for key in ordered(values) if any(("ruler", cell(n, length), "score") in values[key]
                                                       for n in names)]
        scores = {key: {n: values[key].get(("ruler", cell(n, length), "score")) for n in names} for key in lines}
        body = [[*key, *scores[key].values(), values[key].get(("ruler", f"average@{length}", "score"))]
                for key in lines]
        header = ["model", "method", *names, "avg"]
        shared = {model: [n for n in names if all(scores[key][n] is not None for key in lines if key[0] == model)]
                  for model in dict.fromkeys(key[0] for key in lines)}
        if any(len(tasks) < len(names) for tasks in shared.values()):
            counts = {len(tasks) for tasks in shared.values()}
            header.append(f"avg of the {counts.pop()} shared" if len(counts) == 1 else "avg of the shared")
            for line, key in zip(body, lines):
                line.append(mean(scores[key][n] for n in shared[key[0]]) if shared[key[0]] else None)
        tables[length] = (header, body)
    return tables
