#!/usr/bin/env bash
# The GPU path in one short run, for a machine with an NVIDIA GPU whose own Python already has
# JAX with CUDA, transformers and torch (nothing is installed: colibri runs from this tree).
#
#   bash experiments/gpu_check.sh            # writes $OUT (default /tmp/gpu-check)
#
# In order, each step bounded in time so that a slow one cannot starve the others:
#   1. the devices JAX sees, and which of colibri's imports are missing;
#   2. the oracle against transformers (tests/test_oracle.py, three families) at JAX's default
#      matmul precision, then at "highest" (float32 products on a GPU may otherwise run as TF32);
#   3. the tiers on the GPU (pinned host RAM, staging into device slots: tests/test_tiers.py);
#   4. decode steps on the GPU (experiments/bench_scale.py --devices 1).
# Everything goes to $OUT/gpu_check.log; the benchmark's tables to $OUT/scale.md and .json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FAMILIES="qwen3_moe or olmoe or deepseek_v3"

step() { echo; echo "== $* ($(date -u +%T))"; }

{
  step "devices"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
  step "imports"
  $PY - <<'EOF'
import importlib
need = ["numpy", "jax", "safetensors", "tokenizers", "jinja2", "tqdm", "psutil", "pandas",
        "transformers", "torch", "hypothesis", "pytest", "matplotlib"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("missing:", " ".join(missing) or "none")
EOF
  step "oracle, default precision"
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_oracle.py -k "$FAMILIES" 2>&1 | tail -25
  step "oracle, JAX_DEFAULT_MATMUL_PRECISION=highest"
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 \
    $PY -m pytest -q -p no:cacheprovider tests/test_oracle.py -k "$FAMILIES" 2>&1 | tail -25
  step "tiers on the GPU"
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_tiers.py -k qwen3_moe 2>&1 | tail -15
  step "decode steps"
  timeout 120 $PY experiments/bench_scale.py --devices 1 --steps 24 2>&1 | tail -20
  cp experiments/results/scale.md experiments/results/scale.json "$OUT"/ 2>/dev/null
  git checkout -q -- experiments/results/scale.md experiments/results/scale.json 2>/dev/null
  step "done"
} 2>&1 | tee "$OUT/gpu_check.log"
