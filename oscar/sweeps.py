"""A multirun checked before its first job, and where it writes: the Hydra callback of conf/config.yaml
(``hydra.callbacks.sweep_check``).

Before any job starts, :class:`SweepCheck` lists the sweep's jobs as Hydra's basic sweeper will launch them (its own
``split_arguments`` over ``hydra.sweeper.params`` and the command line's overrides, in its order), composes each job's
configuration as the launcher does (``load_sweep_config``, the ``hydra`` node removed as ``run_job`` removes it) and
runs the preflight of a single run on it (:func:`oscar.runner.preflight`: every check that needs no weights). When
one job is refused the sweep starts none: it logs one line per refused job (its number as Hydra counts jobs, the
swept values, the reason) and exits with code 2, so a sweep never stops part-way over a configuration it could have
refused at the start. It logs the sweep's folder (``hydra.sweep.dir``: its ``rows.csv`` is what
``scripts/sweep_summary.py`` reads) at the start and at the end; run.py lets a job that fails while it runs log its
error and the sweep go on, and at the end the jobs whose run is not finished (no ``metrics.json``) are named, with
exit code 1.

Only the basic sweeper's jobs can be listed before they run: under another sweeper (``hydra/sweeper=...``) each job
is checked as it starts, as a single run is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from oscar.runner import BAD_INPUT, TaskFactory, preflight

log = logging.getLogger(__name__)

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


@dataclass
class Job:
    """One job of a sweep: its number (Hydra's ``hydra.job.num``), the values that differ between the sweep's jobs
    (``key=value`` text) and its run folder (None: refused)."""

    number: int
    swept: str
    run_dir: Path | None = None


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """Each job's overrides, in the order Hydra's basic sweeper launches them (``hydra.sweeper.params`` first, then
    the command line's overrides, expanded by ``BasicSweeper.split_arguments``)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    return [job for batch in BasicSweeper.split_arguments(parser.parse_overrides(arguments), None) for job in batch]


def job_config(config: DictConfig, overrides: list[str]) -> DictConfig:
    """The configuration the task function of the job with ``overrides`` receives."""
    from hydra.core.global_hydra import GlobalHydra

    job = GlobalHydra.instance().config_loader().load_sweep_config(master_config=config, sweep_overrides=overrides)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return job


def swept_values(jobs: list[list[str]]) -> list[str]:
    """Per job, its overrides of the keys whose value differs between the jobs (what tells the jobs apart)."""
    values: dict[str, set[str]] = {}
    for job in jobs:
        for override in job:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    varying = {key for key, seen in values.items() if len(seen) > 1}
    return [" ".join(o for o in job if o.partition("=")[0] in varying) or "(the only job)" for job in jobs]


def check_jobs(config: DictConfig, tasks: TaskFactory) -> tuple[list[Job], list[tuple[Job, str]]]:
    """Preflight every job of the sweep ``config``: (every job, the refused ones with their reason)."""
    overrides = sweep_jobs(config)
    jobs, refused = [], []
    for number, (job_overrides, swept) in enumerate(zip(overrides, swept_values(overrides))):
        job = Job(number, swept)
        jobs.append(job)
        try:
            job.run_dir = preflight(job_config(config, list(job_overrides)), tasks).run_dir
        except BAD_INPUT as e:
            refused.append((job, _one_line(e)))
        except Exception as e:  # noqa: BLE001 - Hydra turns a callback's exception into a warning: report it here
            refused.append((job, f"{type(e).__name__}: {_one_line(e)} (a single run of this job with "
                                 "HYDRA_FULL_ERROR=1 shows its traceback)"))
    return jobs, refused


def _one_line(error: Exception) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


class SweepCheck(Callback):
    """Hydra callback: preflight every job of a multirun before the first starts; log the sweep's folder at the start
    and at the end, and fail the sweep (exit code 1) when a job did not finish. ``tasks``: the task factory the
    preflight builds tasks with (run.py's ``evals.build_task``, given by conf/config.yaml)."""

    def __init__(self, tasks: TaskFactory) -> None:
        self.tasks = tasks
        self.jobs: list[Job] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = config.hydra.sweep.dir
        if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
            log.warning("sweep folder: %s; its jobs are checked as each starts (only the basic sweeper's jobs can be "
                        "listed before they run)", folder)
            return
        self.jobs, refused = check_jobs(config, self.tasks)
        if refused:
            lines = "\n".join(f"  #{job.number} {job.swept}: {reason}" for job, reason in refused)
            log.error("bad input, nothing was loaded: %d of the %d jobs of this sweep are refused, so none was "
                      "started:\n%s", len(refused), len(self.jobs), lines)
            raise SystemExit(2)
        finished = sum(_finished(job) for job in self.jobs)
        log.info("sweep folder: %s (%d jobs checked, %d already finished; the sweep's rows: %s/rows.csv, its "
                 "summary: python scripts/sweep_summary.py %s)", folder, len(self.jobs), finished, folder, folder)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        folder = config.hydra.sweep.dir
        unfinished = [job for job in self.jobs if not _finished(job)]
        if unfinished:
            lines = "\n".join(f"  #{job.number} {job.swept}: no {job.run_dir}/metrics.json" for job in unfinished)
            log.error("sweep folder: %s; %d of its %d jobs did not finish (their errors are logged above and in "
                      "%s/<job number>/run.log; the same command reruns them, and skips the finished ones):\n%s",
                      folder, len(unfinished), len(self.jobs), folder, lines)
            raise SystemExit(1)
        log.info("sweep folder: %s (%s; summary: python scripts/sweep_summary.py %s)", folder,
                 f"{len(self.jobs)} jobs finished" if self.jobs else "done", folder)


def _finished(job: Job) -> bool:
    return job.run_dir is not None and (job.run_dir / "metrics.json").exists()

