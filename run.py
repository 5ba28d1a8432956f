"""Hydra entry point: `python run.py method=oscar model=qwen3-8b task=longbench_e`.

Composes conf/ (model, method, task, backend, logger), runs one cell through oscar.runner (or many
with -m), and logs the comparison table of every method run so far on the same model and task.
"""

import logging

import hydra
from omegaconf import DictConfig

log = logging.getLogger("run")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from oscar.models import ModelSpec
    from oscar.results import read_rows
    from oscar.runner import execute
    from scripts.make_tables import methods_table

    execute(cfg)
    rows = [r for r in read_rows(cfg.results_file)
            if r["model"] == ModelSpec.from_any(dict(cfg.model)).name and r["task"] == cfg.task.name]
    log.info("results so far for %s / %s:\n%s", cfg.model.name, cfg.task.name, methods_table(rows))


if __name__ == "__main__":
    main()
