#!/bin/bash
# Issue 25 sweeps (the frontier below 2 bits), one after another; each resumable: a finished run is skipped.
# Usage: nohup bash scripts/frontier_sweeps.sh &   (progress: sweeps_progress.log; one log per sweep: sweep_*.log)
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
J="hydra/launcher=joblib hydra.launcher.n_jobs=2 logger=files"
OTHERS=method=quarot,rotatekv,ott,turboquant          # the quantizing methods other than KIVI, OScaR, OSCAR
run() { local log=$1; shift; echo "== $(date +%T) start $log: $*" >> sweeps_progress.log
        nice -n 10 $PY run.py "$@" > "sweep_$log.log" 2>&1
        echo "== $(date +%T) end $log rc=$?" >> sweeps_progress.log; }
# A finished run is skipped by its run folder (runs/, not committed): on a fresh clone the sweeps whose rows are
# already in results/rows.csv would run again, so only what is left is listed (docs/results.md says what ran:
# sessions 9 and 11 ran G=32 for every method on both models, kv_error at G=32, NIAH at (1,1) and (1,2), OScaR's
# choices, SmolLM2 at G=64 and Gemma 3's KIVI and OScaR at G=64 and 128). Gemma 3's other methods at the larger
# groups first (2 of its 60 runs are in), then kv_error at them.
run ppl_gemma3_g64_g128 -m $J +experiment=frontier model=gemma3-270m $OTHERS,spectral method.group_size=64,128
run kv_smollm2_g64 -m $J +experiment=frontier task=kv_error model=smollm2-135m method=kivi,oscar,quarot,rotatekv,ott,turboquant method.group_size=64
run kv_gemma3_g64_g128 -m $J +experiment=frontier task=kv_error model=gemma3-270m method.group_size=64,128
