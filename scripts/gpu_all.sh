#!/usr/bin/env bash
# Build, check and time the CuPy kernels on a GPU machine in one go; logs and CSVs go to $OUT
# (default results/efficiency). Stages: tests | kernels | e2e | engine [bench_generate args] | smoke (tests + quick
# kernel bench) | methods (KIVI, QuaRot, TurboQuant+ on backend=cupy: cache and engine tests) |
# methods_bench [bench_generate args] (every kernel method end to end; writes generate_methods.csv and
# eval_throughput.csv under $OUT: give it its own OUT to keep the engine stage's eval rows) | all.
#   scripts/gpu_all.sh all            # everything (about 10 minutes on an H200)
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/efficiency}
PY=${PYTHON:-python3}
STAGE=${1:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts import the package (not pip-installed there)
status=0

run_tests() {
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv;
    $PY -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)";
    $PY -m pytest -m gpu tests/test_kernels.py -q -p no:cacheprovider -rf --durations=5; } 2>&1 | tee "$OUT/test_kernels.log" || status=1
}
run_engine() {
  $PY -m pytest -m gpu tests/test_engine_gpu.py tests/test_kernels.py -k "engine or graph or cupy_cache or generate_runs" \
    -q -p no:cacheprovider -rf 2>&1 | tee "$OUT/test_engine.log" || status=1
  $PY scripts/bench_generate.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_generate.log" || status=1
}
run_methods() {
  $PY -m pytest -m gpu tests/test_cupy_methods_gpu.py tests/test_engine_gpu.py -q -p no:cacheprovider -rf \
    --durations=5 2>&1 | tee "$OUT/test_cupy_methods.log" || status=1
}
run_methods_bench() {
  $PY scripts/bench_generate.py --out "$OUT" --methods oscar kivi quarot turboquant "$@" 2>&1 \
    | tee "$OUT/bench_generate_methods.log" || status=1
}
run_kernels() { $PY scripts/bench_kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_kernels.log" || status=1; }
run_e2e() { $PY scripts/bench_e2e.py --out "$OUT" --profile "$@" 2>&1 | tee "$OUT/bench_e2e.log" || status=1; }

case "$STAGE" in
  tests) run_tests ;;
  kernels) run_kernels ;;
  e2e) run_e2e ;;
  engine) shift; run_engine "$@" ;;
  smoke) run_tests; run_kernels --quick ;;
  methods) run_methods ;;
  methods_bench) shift; run_methods_bench "$@" ;;
  all) run_tests; run_kernels; run_e2e; run_engine ;;
  *) echo "unknown stage $STAGE (tests | kernels | e2e | engine | smoke | methods | methods_bench | all)"; exit 2 ;;
esac
exit $status
