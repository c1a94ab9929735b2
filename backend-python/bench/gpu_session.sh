#!/usr/bin/env bash
# The one script run on the GPU machine (device tool): show that the loader takes the binaries of
# manifest.json without compiling, run the CUDA tests, time the model. Everything worth keeping
# lands in $OUT (at most 8 files).
#   bash backend-python/bench/gpu_session.sh            (from the repository root)
# Knobs: BUILD=1 (first rebuild the kernels here: ARCHS=sm90,... or build_kernels.py's default of
# every arch; KERNELS=wkv7,... only these), TEST_FILES, WKV_BENCH=0, MODEL_BENCH=0,
# BENCH_ARGS / BENCH_TIMEOUT (bench_model.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/backend-python${PYTHONPATH:+:$PYTHONPATH}"
export ALBATROSS_KERNEL_CACHE=/tmp/albatross-build-cache
log="$OUT/session.log"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
  if [ "${BUILD:-0}" = 1 ]; then
    echo "== build"
    time $PY build_kernels.py ${ARCHS:+--arch "$ARCHS"} ${KERNELS:+--kernels "$KERNELS"}
    cp manifest.json "$OUT/manifest.json"
    for name in $(echo "${KERNELS:-wkv7,sampler,fused}" | tr , ' '); do  # only what was built: 8 files come back
      cp backend-python/albatross/kernels/*/*/"$name".so "$OUT/"
    done
  else
    echo "== no build: the committed binaries of manifest.json"
  fi
  echo "== loader (a fresh, empty JIT cache: anything but 'prebuilt' would be a failure)"
  ALBATROSS_KERNEL_CACHE=/tmp/albatross-empty-cache $PY -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s %(message)s')
from albatross import cuda_ops
results = cuda_ops.enable_cuda_kernels()
assert all(r.how == 'prebuilt' for r in results.values()), results
import os; print('JIT cache created:', os.path.exists('/tmp/albatross-empty-cache'))
"
} 2>&1 | tee "$log"

echo "== tests" | tee -a "$log"
TEST_FILES=${TEST_FILES:-tests/test_kernel_loader.py tests/test_cuda_kernels.py tests/test_fused_kernels.py tests/test_model_cuda.py tests/test_state_cache.py tests/test_engine_cuda.py}
(cd backend-python && timeout 240 $PY -m pytest $TEST_FILES \
  -q -n 4 -p no:cacheprovider --durations=5 2>&1) | tee "$OUT/tests.log" | tail -25 | tee -a "$log"

echo "== bench" | tee -a "$log"
if [ "${WKV_BENCH:-1}" = 1 ]; then
  (cd backend-python && timeout 120 $PY bench/bench_wkv.py --json "$OUT/bench_wkv.json" 2>&1) | tee -a "$OUT/bench.log" | tail -22
fi
if [ "${MODEL_BENCH:-1}" = 1 ]; then
  (cd backend-python && timeout "${BENCH_TIMEOUT:-270}" $PY bench/bench_model.py ${BENCH_ARGS:-} --json "$OUT/bench_model.json" 2>&1) | tee -a "$OUT/bench.log" | tail -30
fi
