#!/bin/bash
# Issue 25 sweeps (the frontier below 2 bits), one after another; each resumable: a finished run is skipped.
# Usage: nohup bash scripts/frontier_sweeps.sh &   (progress: sweeps_progress.log; one log per sweep: sweep_*.log)
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
J="hydra/launcher=joblib hydra.launcher.n_jobs=2 logger=files"
OTHERS=method=quarot,rotatekv,ott,turboquant          # the quantizing methods other than KIVI, OScaR, OSCAR
VARIANTS=norm_head,norm_floor,signed_hadamard,orthogonal,plain_values   # OScaR's choices other than the paper's
run() { local log=$1; shift; echo "== $(date +%T) start $log: $*" >> sweeps_progress.log
        nice -n 10 $PY run.py "$@" > "sweep_$log.log" 2>&1
        echo "== $(date +%T) end $log rc=$?" >> sweeps_progress.log; }
# A finished run is skipped by its run folder (runs/, not committed): on a fresh clone the sweeps whose rows are
# already in results/rows.csv would run again, so they are not listed here: SmolLM2 fp16 and every method at G=32,
# Gemma 3 fp16, KIVI and OScaR at G=32 and QuaRot's (1,1), (1,2), (2,1), (2,2) (sessions 9; docs/results.md).
# Gemma 3's other methods at G=32 first (TurboQuant+ leads SmolLM2's frontier below 2 bits), then kv_error, NIAH
# and OScaR's choices, then the larger groups
run ppl_gemma3_g32_turboquant -m $J +experiment=frontier model=gemma3-270m method=turboquant method.group_size=32
run ppl_gemma3_g32_others -m $J +experiment=frontier model=gemma3-270m method=spectral,ott,rotatekv method.group_size=32
run ppl_gemma3_g32_quarot -m $J +experiment=frontier model=gemma3-270m method=quarot method.group_size=32 +kv_bits=k3v3,k4v4
run kv_smollm2_fp16 +experiment=frontier task=kv_error method=fp16 model=smollm2-135m logger=files
run kv_gemma3_fp16 +experiment=frontier task=kv_error method=fp16 model=gemma3-270m logger=files
run kv_g32 -m $J +experiment=frontier task=kv_error model=smollm2-135m,gemma3-270m method.group_size=32
run ppl_smollm2_spectral128 -m $J +experiment=frontier model=smollm2-135m method=spectral method.group_size=128
run niah_smollm2 -m $J +experiment=frontier_niah model=smollm2-135m +kv_bits=k1v1,k1v2
run choices_smollm2 -m $J +experiment=oscar_choices model=smollm2-135m
run ppl_gemma3_spectral128 -m $J +experiment=frontier model=gemma3-270m method=spectral method.group_size=128
run kv_spectral128 -m $J +experiment=frontier task=kv_error model=smollm2-135m,gemma3-270m method=spectral method.group_size=128
run niah_gemma3 -m $J +experiment=frontier_niah model=gemma3-270m +kv_bits=k1v1,k1v2
run choices_gemma3 -m $J +experiment=oscar_choices model=gemma3-270m +oscar_choice=paper,${VARIANTS#norm_head,}
run choices_niah2_smollm2 -m $J +experiment=oscar_choices_niah model=smollm2-135m +oscar_choice=$VARIANTS +kv_bits=k2v2
run choices_niah2_gemma3 -m $J +experiment=oscar_choices_niah model=gemma3-270m +oscar_choice=${VARIANTS#norm_head,} +kv_bits=k2v2
run choices_niah1_smollm2 -m $J +experiment=oscar_choices_niah model=smollm2-135m +oscar_choice=$VARIANTS +kv_bits=k1v1
run choices_niah1_gemma3 -m $J +experiment=oscar_choices_niah model=gemma3-270m +oscar_choice=${VARIANTS#norm_head,} +kv_bits=k1v1
run ppl_smollm2_g64_kivi_oscar -m $J +experiment=frontier model=smollm2-135m method=kivi,oscar method.group_size=64
run ppl_gemma3_g64_g128_kivi_oscar -m $J +experiment=frontier model=gemma3-270m method=kivi,oscar method.group_size=64,128
run ppl_smollm2_g64 -m $J +experiment=frontier model=smollm2-135m $OTHERS method.group_size=64
run ppl_gemma3_g64_g128 -m $J +experiment=frontier model=gemma3-270m $OTHERS,spectral method.group_size=64,128
run kv_smollm2_g64 -m $J +experiment=frontier task=kv_error model=smollm2-135m method=kivi,oscar,quarot,rotatekv,ott,turboquant method.group_size=64
run kv_gemma3_g64_g128 -m $J +experiment=frontier task=kv_error model=gemma3-270m method.group_size=64,128
