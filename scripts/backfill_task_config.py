"""Fill the ``task_config`` column of tidy rows written before it existed, from their run folders.

    python scripts/backfill_task_config.py [--rows results/rows.csv] [--runs runs]

A row gets a task_config only when its run folder ``<runs>/<task>/<model>/<method>-<run_id>``
holds a config.yaml that hashes to the row's run_id (oscar.runner.run_id_for, with the digest of the
task's data files as it is now or, for runs made before ids covered the data, without), so the options are
those of the run that wrote the row; other rows keep "" and are counted. Rows that already have a
task_config are left as they are. The file is rewritten under the append lock.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

if __package__ in (None, ""):  # `python scripts/backfill_task_config.py`
    sys.path.insert(0, str(REPO_ROOT))

import yaml

from oscar.results import task_config_label, update_rows
from oscar.runner import data_digest, run_id_for, task_defaults

log = logging.getLogger("backfill_task_config")


def task_config_of_run(runs: Path, row: dict) -> str | None:
    """The task_config of the run that wrote ``row``, or None when no run folder matches its run_id."""
    from evals import build_task

    path = Path(runs) / row["task"] / row["model"] / f"{row['method']}-{row['run_id']}" / "config.yaml"
    if not path.exists():
        return None
    config = yaml.safe_load(path.read_text())
    options = dict(config["task"])
    task = build_task(options.pop("name"), **options)
    if row["run_id"] not in (run_id_for(config), run_id_for(config, data_digest(task.data_files()))):
        return None
    return task_config_label(config["task"], task_defaults(task))


def backfill(rows_file: Path, runs: Path) -> dict[str, int]:
    """Fill empty task_config cells of ``rows_file``; returns row counts: ``matched`` (a run folder
    matched; ``non_default`` of them got a non-empty task_config) and ``unmatched`` (left "")."""
    derived: dict[tuple, str | None] = {}
    counts = {"matched": 0, "non_default": 0, "unmatched": 0}

    def update(row: dict) -> dict:
        if row["task_config"]:
            return row
        key = (row["task"], row["model"], row["method"], row["run_id"])
        if key not in derived:
            derived[key] = task_config_of_run(runs, row)
        if derived[key] is None:
            counts["unmatched"] += 1
            return row
        counts["matched"] += 1
        counts["non_default"] += bool(derived[key])
        return {**row, "task_config": derived[key]}

    update_rows(rows_file, update)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="results/rows.csv")
    parser.add_argument("--runs", default="runs", help="the runs_dir the rows' runs wrote into")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    counts = backfill(Path(args.rows), Path(args.runs))
    log.info("%s: %d rows matched their run folder (%d with non-default task options); %d rows without a "
             "matching run folder keep task_config empty", args.rows, counts["matched"], counts["non_default"],
             counts["unmatched"])


if __name__ == "__main__":
    main()
