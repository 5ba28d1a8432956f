#!/bin/bash
# Every sweep of the frontier below 2 bits (docs/results.md "Below 2 bits"), one after another, each resumable:
# a finished run is skipped by its run folder under runs/ (not committed), so on a fresh clone the whole set runs
# again (about 30 hours of a 2-core machine).
# Usage: nohup bash scripts/frontier_sweeps.sh &   (progress: sweeps_progress.log; one log per sweep: sweep_*.log)
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
J="hydra/launcher=joblib hydra.launcher.n_jobs=2 logger=files"
run() { local log=$1; shift; echo "== $(date +%T) start $log: $*" >> sweeps_progress.log
        nice -n 10 $PY run.py "$@" > "sweep_$log.log" 2>&1
        local rc=$?  # before the echo: its $(date) would reset $?
        echo "== $(date +%T) end $log rc=$rc" >> sweeps_progress.log; }
for model in smollm2-135m gemma3-270m; do
  run "fp16_$model" +experiment=frontier method=fp16 model=$model logger=files
  run "fp16_kv_$model" +experiment=frontier method=fp16 task=kv_error model=$model logger=files
done
# perplexity and kv_error: SmolLM2's head_dim of 64 takes G = 32, 64; Gemma 3's 256 every G
run ppl_smollm2 -m $J +experiment=frontier model=smollm2-135m method.group_size=32,64
run ppl_gemma3 -m $J +experiment=frontier model=gemma3-270m
run kv_smollm2 -m $J +experiment=frontier task=kv_error model=smollm2-135m method.group_size=32,64
run kv_gemma3 -m $J +experiment=frontier task=kv_error model=gemma3-270m
# NIAH 1K-4K below 2 bits ((2,2) and fp16: the method matrix's +experiment=niah cells)
run niah_smollm2 -m $J +experiment=frontier_niah model=smollm2-135m +kv_bits=k1v1,k1v2
run niah_gemma3 -m $J +experiment=frontier_niah model=gemma3-270m +kv_bits=k1v1,k1v2
# OScaR's open choices at 2 and 1 bits (norm_head is the paper's setting on Gemma 3's one KV head)
GEMMA_CHOICES=+oscar_choice=paper,norm_floor,signed_hadamard,orthogonal,plain_values
run choices_smollm2 -m $J +experiment=oscar_choices model=smollm2-135m
run choices_gemma3 -m $J +experiment=oscar_choices model=gemma3-270m $GEMMA_CHOICES
run choices_niah_smollm2 -m $J +experiment=oscar_choices_niah model=smollm2-135m
run choices_niah_gemma3 -m $J +experiment=oscar_choices_niah model=gemma3-270m $GEMMA_CHOICES
