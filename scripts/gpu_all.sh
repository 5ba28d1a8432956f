#!/usr/bin/env bash
# The GPU machine's runs in one go: the GPU test suite, then the measurement questions (python -m benchmarks).
# Results go to $OUT (default results/efficiency: one CSV per question, test_gpu.log), each run's log to $LOGS
# (default runs/gpu_logs). `make tables` then redraws results/efficiency/README.md and the figures.
#   scripts/gpu_all.sh tests                    # pytest -m gpu over tests/ -> $OUT/test_gpu.log
#   scripts/gpu_all.sh user_path [options]      # any question, its options passed on (python -m benchmarks --help)
#   scripts/gpu_all.sh all                      # tests, kernel, user_path, long_context, eval_throughput
# Where the tree has no git checkout, set OSCAR_CODE_VERSION to the commit it was copied from (the rows record it).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/efficiency}
LOGS=${LOGS:-runs/gpu_logs}
PY=${PYTHON:-python3}
STAGE=${1:-all}
shift || true
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package need not be installed there
status=0

run_tests() {
  local command="$PY -m pytest -m gpu tests/ -q -p no:cacheprovider -rf $*"
  { echo "# $command"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)"
    $PY -c "from benchmarks.harness import code_version; print('code', code_version())"  # as the result rows name it
    $command; } 2>&1 | tee "$OUT/test_gpu.log" || status=1
}
run_question() {
  local question=$1
  shift
  $PY -m benchmarks "$question" --out "$OUT" "$@" 2>&1 | tee "$LOGS/$question.log" || status=1
}

case "$STAGE" in
  tests) run_tests "$@" ;;
  all) run_tests; for q in kernel user_path long_context eval_throughput; do run_question "$q"; done ;;
  *) run_question "$STAGE" "$@" ;;
esac
exit $status
