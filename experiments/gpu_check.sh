#!/usr/bin/env bash
# The GPU path in one short run, for a machine with an NVIDIA GPU whose own Python already has
# JAX with CUDA, transformers and torch (nothing is installed: colibri runs from this tree).
#
#   bash experiments/gpu_check.sh            # writes $OUT (default /tmp/gpu-check)
#
# In order, each step bounded in time so that a slow one cannot starve the others:
#   1. the devices JAX sees, and which of colibri's imports are missing;
#   2. the oracle against transformers (tests/test_oracle.py, three families and their held
#      variants) at JAX's default matmul precision: the model asks for float32 products itself
#      (colibri.model.layers.EXACT), so a GPU's TF32 default must not show;
#   3. the tiers on the GPU (pinned host RAM, staging into device slots: tests/test_tiers.py);
#   4. decode steps on the GPU (experiments/bench_scale.py --devices 1).
# A summary goes to $OUT/gpu_check.log, each pytest's whole report to $OUT/<step>.txt, the
# benchmark's tables to $OUT/scale.md and .json. Packages the machine lacks (compressed-tensors,
# for the int4 and int8 oracle) may come first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
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
  step "oracle"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 $PY -m pytest -q -rfEs -p no:cacheprovider \
    -n 4 tests/test_oracle.py -k "$FAMILIES" \
    >"$OUT/oracle.txt" 2>&1
  tail -n 25 "$OUT/oracle.txt"
  step "tiers on the GPU"
  timeout 100 $PY -m pytest -q -rfEs -p no:cacheprovider tests/test_tiers.py -k qwen3_moe \
    >"$OUT/tiers.txt" 2>&1
  tail -n 15 "$OUT/tiers.txt"
  step "decode steps"
  timeout 100 $PY experiments/bench_scale.py --devices 1 --steps 24 2>&1 | tail -4
  cp experiments/results/scale.md experiments/results/scale.json "$OUT"/ 2>/dev/null
  git checkout -q -- experiments/results/scale.md experiments/results/scale.json 2>/dev/null
  step "done"
} 2>&1 | tee "$OUT/gpu_check.log"
