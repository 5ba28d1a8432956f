# OScaR-KV. Every target bootstraps .venv first (idempotent; see scripts/bootstrap.sh).
PY := .venv/bin/python
METHODS ?= fp16,kivi,oscar
DEMO_SWEEP := multirun/demo
# test workers (pytest-xdist), one torch thread each: the suite is many single-threaded builds and small runs
TEST_WORKERS ?= 2

.PHONY: help setup data demo test test-slow tables results reproduce clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup:  ## create .venv and install the package (CPU torch unless a GPU driver is present)
	@bash scripts/bootstrap.sh

data: setup  ## download the data files from their public sources into ~/.cache/oscar-kv/data (skips files ../shared/data or OSCAR_DATA has)
	$(PY) scripts/fetch_data.py

demo: setup  ## the embedded default: SmolLM2-135M, needle-in-a-haystack, fp16 vs KIVI vs OScaR (CPU, no network); its own summary and heatmaps only
	@rm -f $(DEMO_SWEEP)/rows.csv
	$(PY) run.py -m method=$(METHODS) hydra.sweep.dir=$(DEMO_SWEEP)
	@$(PY) scripts/sweep_summary.py $(DEMO_SWEEP)

test: setup  ## the CPU test suite (fast; slow and GPU tests are skipped); fetches missing data first where the network allows
	@$(PY) scripts/fetch_data.py --optional || echo "make data failed; the tests that need its files are skipped"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

test-slow: setup  ## the slow CPU tests (real model runs)
	$(PY) -m pytest -q -m slow

tables: setup  ## your runs (runs/rows.csv) beside the committed results: tables and figures under runs/; print the merged methods table
	$(PY) scripts/make_tables.py

reproduce: setup  ## re-run a stated sample of the committed rows (SmolLM2: a NIAH cell and a perplexity run per method) with this code; exit 1 where one no longer comes out
	$(PY) scripts/reproduce.py

results: setup  ## the committed results: results/rows.csv cut to the rows the tables read, then results/tables, figures and efficiency tables
	$(PY) scripts/make_tables.py --rows results/rows.csv --out results --compact

clean:  ## remove run folders (your rows and tables under runs/ too) and Hydra outputs (results/ is kept)
	rm -rf runs outputs multirun
