#!/bin/bash
# The GPU checks of issues 26 and 28 in one call of a lent GPU machine (its python3 has torch,
# Triton, transformers and peft; nothing is installed): the Triton kernel and CUDA engine tests,
# then benchmarks/gpu_quant.py. Logs and the JSON figures go to $OUT.
#   bash benchmarks/device_check.sh [pytest -k expression] [gpu_quant.py arguments...]
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
select=${1:-}
shift || true
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if [ "$select" != "none" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -s -p no:cacheprovider --timeout 240 tests/kernels/test_kernels.py \
    ${select:+-k "$select"} >"$OUT/tests.txt" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|error|fp8 weights on CUDA" "$OUT/tests.txt" | tail -8
fi
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/gpu_quant.py --json "$OUT/gpu_quant.json" "$@" 2>&1 | tee "$OUT/bench.txt"
