#!/usr/bin/env bash
# One device call for int8 weights (W8A16) and the memory plan, within ~8 minutes: build the int8
# library for the GPU (JIT into the kernel cache: the committed binaries of the other libraries are
# used as they are), run the int8 and model GPU tests, the memory-plan tests under a consumer
# card's memory cap (a process of their own), then the model-level speed of int8 against fp16 on
# 7.2B (the floors), the matmul paths on the 7.2B shapes (with torchao and gemlite when their wheels
# are carried in .whl/), and the accuracy on 0.4B and 1.5B. Everything lands in $OUT (7 files).
#   OUT=... bash backend-python/bench/int8_gpu_session.sh        (from the repository root)
# Knobs: TESTS=0, MEMORY=0, MODEL=0, KERNELS=0, ACCURACY=0; KERNEL_ROWS (bench_int8.py --rows);
# TEST_FILES; ACCURACY_SHAPES (default 0.4b,1.5b).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
. backend-python/bench/carried_wheels.sh  # the wheels of .whl/, if carried
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 RWKV_V7_ON=1 PYTHONPATH="$PWD/backend-python${PYTHONPATH:+:$PYTHONPATH}"
export ALBATROSS_KERNEL_CACHE=/tmp/albatross-build-cache
log="$OUT/int8_session.log"
cd backend-python

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
  echo "== kernels (int8 built here once; the others from manifest.json)"
  time timeout 300 $PY -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s %(message)s')
from albatross import cuda_ops, int8_dispatch
for name, result in cuda_ops.enable_cuda_kernels().items(): print(result.describe())
print('int8 paths', int8_dispatch.enabled())
"
} 2>&1 | tee "$log"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests" | tee -a "$log"
  TEST_FILES=${TEST_FILES:-tests/test_int8_cuda.py tests/test_kernel_loader.py tests/test_model_cuda.py tests/test_engine_cuda.py}
  timeout 180 $PY -m pytest $TEST_FILES -q -n 4 -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/int8_tests.log" | tail -25 | tee -a "$log"
fi

if [ "${MEMORY:-1}" = 1 ]; then
  echo "== memory plan under per-process caps (12 GiB, 8 GiB)" | tee -a "$log"
  timeout 240 $PY -m pytest tests/test_memory_plan_cuda.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/memory_plan_tests.log" | grep -E "passed|failed|GiB|GB|Error|error" | tail -20 | tee -a "$log"
fi

if [ "${MODEL:-1}" = 1 ]; then
  echo "== model level, 7.2B: int8 against fp16 (floors: graph b1 1.6x, b960 0.9x, prefill 64x512 0.8x)" | tee -a "$log"
  timeout 200 $PY bench/bench_int8.py model --shape 7.2b --steps 20 --json "$OUT/int8_model.json" 2>&1 | tail -14 | tee -a "$log"
fi

if [ "${KERNELS:-1}" = 1 ]; then
  # ~90 s on an H200, at most ~140 s (each implementation capped at 20 s); one JSON line per measurement,
  # appended as it is taken, so a killed run keeps its rows.
  echo "== matmul paths on the 7.2B shapes (us per call in CUDA graphs, median of 5)" | tee -a "$log"
  timeout 240 $PY bench/bench_int8.py kernels --reps 5 ${KERNEL_ROWS:+--rows "$KERNEL_ROWS"} --json "$OUT/int8_kernels.jsonl" 2>&1 \
    | tee "$OUT/int8_kernels.log" | grep -v '^{' | tail -24 | tee -a "$log"
fi

if [ "${ACCURACY:-1}" = 1 ]; then
  echo "== accuracy against all-fp32" | tee -a "$log"
  timeout 150 $PY bench/bench_int8.py accuracy --device cuda --shapes "${ACCURACY_SHAPES:-0.4b,1.5b}" --streams 32 --steps 128 \
    --json "$OUT/int8_accuracy.json" 2>&1 | tail -24 | tee -a "$log"
fi
date -u | tee -a "$log"
