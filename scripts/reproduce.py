"""Do the committed numbers still come out of the code? Re-run a stated, cheap sample of results/rows.csv with the
current code and compare, row by row.

    python scripts/reproduce.py [--methods fp16,kivi] [--tasks niah] [--rows results/rows.csv] [--device cpu]
    make reproduce                                          # the whole sample below

The sample, on SmolLM2-135M, each method at its default configuration (conf/method/<name>.yaml; a committed row
written before a hyperparameter existed counts as its default, as in the tables):
- ``niah``, every method: the cell 1024@50 (a 1,024-token prompt, the needle at half depth, 32 new tokens) of any
  committed NIAH grid of the default needle and prompt: its ``score`` and ``exact``;
- ``perplexity``, the demo's methods fp16, KIVI and OScaR: the default perplexity run (4 windows of 2,048 tokens of
  WikiText-2 test, quantized prefill): its ``perplexity`` and ``kv_bytes_per_token``.
``--methods`` replaces both lists, ``--tasks`` picks the tasks. Of several committed rows of one (method, task, cell,
metric) the newest is compared (latest ``date``, then the last in the file). Each cell runs once through the runner
(``device=cpu`` unless ``--device``, backend torch, seed 0, ``dtype`` null: float32 on a CPU) into a temporary
runs_dir and results_file: the rows file is only read. A row agrees when
``math.isclose(stored, recomputed, rel_tol=1e-4, abs_tol=1e-6)``: summation order (threads, another CPU) moves a
perplexity by about 1e-5 of itself, a change of the computation by more (OScaR's 41.104 against a row's 41.126 is
5e-4), and a NIAH cell's score moves by whole words. Printed per row: the stored and recomputed values, the code
version that wrote the stored row ("unrecorded" for rows older than the column) and the current one, and whether
they agree. Exit code 1 when a row disagrees or the sample has no committed row, else 0.

Time, measured as CPU time on this project's 2-core machine while other jobs shared it (wall time was 3-5 times
longer): the cheapest case (``--methods fp16 --tasks niah``, one cell: the test suite runs it) 13 s including
imports; KIVI's and OScaR's perplexity runs 83 s together (one thread); ``make reproduce`` about 4-5 minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from oscar.paths import REPO_ROOT

if __package__ in (None, ""):  # `python scripts/reproduce.py`
    sys.path.insert(0, str(REPO_ROOT))

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from evals import build_task
from evals.base import task_class
from evals.tables import config_key
from oscar.method import available_methods
from oscar.provenance import process_code_version
from oscar.results import parse_task_config, read_rows
from oscar.runner import KV_BYTES_METRIC, execute, preflight

log = logging.getLogger("reproduce")

MODEL = "smollm2-135m"
#: task -> (overrides of its run, the subset compared, the metrics compared, its methods: None = every method)
SAMPLE = {
    "niah": (["task.lengths=[1024]", "task.depths=[50]"], "1024@50", ("score", "exact"), None),
    "perplexity": ([], "wikitext-2-raw-v1", ("perplexity", KV_BYTES_METRIC), ("fp16", "kivi", "oscar")),
}
REL_TOL, ABS_TOL = 1e-4, 1e-6


@dataclass
class Comparison:
    method: str
    task: str
    subset: str
    metric: str
    stored: float | None  # None: no committed row of the sample
    recomputed: float | None
    stored_code: str
    current_code: str

    @property
    def agrees(self) -> bool:
        return (self.stored is not None and self.recomputed is not None
                and math.isclose(self.stored, self.recomputed, rel_tol=REL_TOL, abs_tol=ABS_TOL))


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def committed(rows: list[dict], method_config: dict, task: str, subset: str, metric: str) -> dict | None:
    """The newest row of ``rows`` (latest date, then file order) of SmolLM2-135M, ``method_config`` (defaults
    completed on both sides), ``task`` at its default options (a NIAH grid's lengths and depths aside: they only
    choose cells), ``subset`` and ``metric``; None when there is none."""
    key = config_key({"config": json.dumps(method_config)})
    grid = set(getattr(task_class(task), "grid_options", ()))
    matches = [(row.get("date") or "", i, row) for i, row in enumerate(rows)
               if row["model"] == MODEL and row["task"] == task and row["subset"] == subset and row["metric"] == metric
               and not set(parse_task_config(row["task_config"])) - grid and config_key(row) == key]
    return max(matches, key=lambda m: m[:2])[2] if matches else None


def reproduce(rows_file: Path, tasks: list[str], methods: list[str] | None, runs_dir: Path,
              device: str) -> list[Comparison]:
    """Recompute the sample's cells of ``tasks`` (of ``methods``, None: the sample's; into ``runs_dir``) and compare
    them with the committed rows of ``rows_file``. A finished run in ``runs_dir`` that other code computed is computed
    again (rerun=true): the recomputed numbers are always this code's."""
    rows, current, out = read_rows(rows_file), process_code_version(), []
    for task in tasks:
        overrides, subset, metrics, sampled = SAMPLE[task]
        for method in methods or sampled or available_methods():
            base = [f"model={MODEL}", f"method={method}", f"task={task}", *overrides, f"device={device}",
                    "backend=torch", "seed=0", "dtype=null", "logger=files", f"runs_dir={runs_dir}",
                    f"results_file={runs_dir / 'rows.csv'}"]
            cfg = _compose(base)
            stored = {m: committed(rows, OmegaConf.to_container(cfg.method, resolve=True), task, subset, m)
                      for m in metrics}
            recomputed = {}
            if any(stored.values()):
                p = preflight(cfg, build_task)
                if p.finished and p.done.get("code_version") != current:
                    cfg = _compose([*base, "rerun=true"])
                    p = preflight(cfg, build_task)
                execute(cfg, p)
                recomputed = {(r["subset"], r["metric"]): r["value"]
                              for r in json.loads((p.run_dir / "rows.json").read_text())}
            for metric, row in stored.items():
                out.append(Comparison(method, task, subset, metric, None if row is None else row["value"],
                                      recomputed.get((subset, metric)),
                                      "" if row is None else row.get("code_version") or "unrecorded", current))
    return out


def table(comparisons: list[Comparison]) -> str:
    header = ["method", "task", "cell", "metric", "stored", "recomputed", "stored code", "current code", "agree"]
    lines = [header]
    for c in comparisons:
        value = lambda v: "none" if v is None else f"{v:.6g}"  # noqa: E731
        lines.append([c.method, c.task, c.subset, c.metric, value(c.stored), value(c.recomputed),
                      c.stored_code or "-", c.current_code or "unknown", "yes" if c.agrees else "no"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=str(REPO_ROOT / "results" / "rows.csv"), help="the committed rows (read only)")
    parser.add_argument("--methods", default=None, help="comma-separated method names (default: the sample's)")
    parser.add_argument("--tasks", default=",".join(SAMPLE), help=f"comma-separated, of {', '.join(SAMPLE)}")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, ...: where the cells are recomputed")
    parser.add_argument("--runs-dir", default=None, help="keep the recomputed runs here (default: a temporary "
                        "folder, removed after); a second call reuses the finished ones this code computed")
    args = parser.parse_args(argv)
    methods, tasks = args.methods.split(",") if args.methods else None, args.tasks.split(",")
    unknown = sorted(set(methods or ()) - set(available_methods())) + sorted(set(tasks) - set(SAMPLE))
    if unknown:
        parser.error(f"unknown method(s) or task(s) {unknown}; methods: {', '.join(available_methods())}; tasks: "
                     f"{', '.join(SAMPLE)}")
    if not Path(args.rows).is_file():
        parser.error(f"--rows {args.rows}: no such file")
    with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
        comparisons = reproduce(Path(args.rows), tasks, methods, Path(args.runs_dir or tmp), args.device)
    print(f"{MODEL}: committed rows of {args.rows} recomputed with the current code on {args.device} "
          f"(agree: within {REL_TOL:g} relative)")
    print(table(comparisons))
    bad = [c for c in comparisons if not c.agrees]
    print(f"{len(comparisons) - len(bad)} of {len(comparisons)} rows agree"
          + (f"; {sum(c.stored is None for c in bad)} have no committed row" if any(c.stored is None for c in bad)
             else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
