"""Hydra entry point: `python run.py method=oscar model=qwen3-8b task=longbench_e`.

Composes conf/ (model, method, task, backend, logger) and runs one cell through oscar.runner, with the tasks of
evals/ (or many with -m). Bad input stops with one error line before any model is loaded (exit code 2), Ctrl-C
with one line saying that the same command resumes the run (exit code 130; HYDRA_FULL_ERROR=1 shows the
traceback of either). A multirun checks every job before the first starts (oscar.sweeps, a Hydra callback); a job
that fails while it runs logs its error in one line and the sweep goes on with the others (the callback names the
unfinished jobs at the end, exit code 1). A multirun appends its runs' rows to <sweep dir>/rows.csv as well (what
scripts/sweep_summary.py reads). With ``show_tables=true``, after a run it logs this run's numbers, in a
multirun the sweep's runs so far, then, under its own heading, the merged view of every row of the model
and task in results_file.
"""

import json
import logging
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

log = logging.getLogger("run")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except KeyboardInterrupt:  # Ctrl-C: finished samples are on disk, the run resumes at the one in flight
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        again = ("without rerun=true to resume it (with it, the run starts over)" if cfg.get("rerun")
                 else "again to resume it")
        log.error("interrupted: the run is not finished; run the same command %s (finished samples are kept, nothing "
                  "is computed twice)", again)
        raise SystemExit(130) from None
    except Exception as e:
        if _sweep_dir() is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        # a sweep goes on with its other jobs; oscar.sweeps names this one at the end (its run has no metrics.json)
        log.error("this job failed, the sweep goes on with the others (HYDRA_FULL_ERROR=1 shows the traceback): "
                  "%s: %s", type(e).__name__, e)


def run(cfg: DictConfig) -> None:
    from evals import build_task
    from evals.tables import read_results
    from oscar.results import append_rows
    from oscar.runner import BAD_INPUT, execute, preflight
    from scripts.make_tables import methods_table

    try:
        plan = preflight(cfg, build_task)  # the runner is handed the task registry (oscar imports nothing above it)
    except BAD_INPUT as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("bad input, nothing was loaded: %s", e)
        if _sweep_dir() is not None:  # checked before the sweep started: something changed since; the others go on
            return
        raise SystemExit(2) from None
    execute(cfg, plan)
    done = plan.run_dir / "rows.json"
    rows = json.loads(done.read_text()) if done.exists() else []
    sweep = _sweep_dir()
    if sweep is not None:
        append_rows(sweep / "rows.csv", rows)
    if not cfg.show_tables:
        return
    log.info("this run (%s):\n%s", plan.run_dir, methods_table(rows))
    if sweep is not None:
        log.info("this sweep so far (%s):\n%s", sweep, methods_table(read_results(sweep / "rows.csv")))
    model, task = plan.spec.name, plan.task.name
    merged = [r for r in read_results(Path(cfg.results_file)) if r["model"] == model and r["task"] == task]
    log.info("merged view: every row of %s / %s in %s (earlier runs included; runs of one method configuration and "
             "task setting share a line, its newest rows; NIAH averages the cells of all of them; malformed rows "
             "skipped):\n%s", model, task, cfg.results_file, methods_table(merged))


def _sweep_dir() -> Path | None:
    """The multirun's output folder (shared by its jobs), None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.sweep.dir) if hydra_cfg.mode == RunMode.MULTIRUN else None


if __name__ == "__main__":
    main()
