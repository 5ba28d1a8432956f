#!/bin/bash
# RULER for every method on the two small models (docs/benchmarks.md "RULER"): 4K and 8K on both; on SmolLM2, whose
# 8,192 positions just hold 8K, without FWE there (FWE fills the length with its prompt: 8,177 tokens of SmolLM2, and
# its 50 answer tokens would run past the positions; the preflight refuses it).
# Resumable: a finished run is skipped by its run folder under runs/ (not committed), a killed one resumes at the
# sample in flight (its predictions.jsonl); the samples are made again identically (same tokenizer, seed, package).
# Time, with SAMPLES=5 (the default) on 2 free cores, two jobs at a time: about 6 CPU-hours per sample per task
# (SmolLM2 4K ~0.8, Gemma 3 4K ~0.9, SmolLM2 8K ~2.0, Gemma 3 8K ~2.1), so about 15 hours; measured per sample with
# one thread: 20-36 s at 4K (VT's 30 answer tokens to NIAH's 128), 65-90 s at SmolLM2's 8K; Gemma 3's 8K took 66 and
# 70 minutes a method (fp16 and OScaR, all 13 tasks, two at a time).
# Usage: nohup bash scripts/ruler_sweep.sh &   (progress: ruler_progress.log; one log per sweep: ruler_*.log)
#        SAMPLES=20 bash scripts/ruler_sweep.sh  (more samples per task: new runs, about four times as long)
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
SAMPLES=${SAMPLES:-5}
J="hydra/launcher=joblib hydra.launcher.n_jobs=2 logger=files"
NIAH="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue"
NO_FWE="[$NIAH,niah_multiquery,vt,cwe,qa_1,qa_2]"
run() { local log=$1; shift; echo "== $(date +%T) start $log: $*" >> ruler_progress.log
        nice -n 10 $PY run.py "$@" > "ruler_$log.log" 2>&1
        local rc=$?  # before the echo: its $(date) would reset $?
        echo "== $(date +%T) end $log rc=$rc" >> ruler_progress.log; }
run smollm2_4k -m $J +experiment=ruler model=smollm2-135m task.num_samples=$SAMPLES
run gemma3_4k -m $J +experiment=ruler model=gemma3-270m task.num_samples=$SAMPLES
run smollm2_8k -m $J +experiment=ruler model=smollm2-135m task.num_samples=$SAMPLES "task.lengths=[8192]" \
    "task.tasks=$NO_FWE"
run gemma3_8k -m $J +experiment=ruler model=gemma3-270m task.num_samples=$SAMPLES "task.lengths=[8192]"
$PY scripts/make_tables.py --quiet
