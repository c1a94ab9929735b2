#!/usr/bin/env bash
# The issue-16 kernels on one H200 (more than one 10-minute call in all: run TESTS/WKV and GEMV/MODEL
# in separate calls with the knobs below): make the GEMV library for this
# GPU, run the GPU tests of the chunked WKV prefill (Triton) and the GEMV, time WKV sequential vs
# chunked (1x4096, 64x512, 16x2048 and edge sizes, with the switch point they imply), the GEMV vs
# cuBLAS at 1-4 rows, and the model's prefill / batch-1 decode with each kernel on and off.
# Everything lands in $OUT (at most 9 files: log, tests, three JSONs, two benchmark logs, and with
# BUILD=1 the manifest and gemv.so).
#   OUT=/tmp/out bash backend-python/bench/speed_gpu_session.sh      (from the repository root)
# Every library, gemv included, loads from the committed binaries of manifest.json; BUILD=1 first
# rebuilds gemv for sm90 with build_kernels.py in this copy of the tree (after a source edit).
# Knobs: BUILD=1, TESTS=0, TEST_FILES, WKV=0, GEMV=0, MODEL=0, TEST_TIMEOUT, WKV_ARGS (bench_wkv_chunked.py),
# MODEL_ARGS (bench_model.py).
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
  $PY -c "import torch, triton, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', sys.version.split()[0])"
  if [ "${BUILD:-0}" = 1 ]; then
    echo "== build gemv (sm90) with build_kernels.py"
    time $PY build_kernels.py --arch sm90 --kernels gemv
    cp manifest.json "$OUT/manifest.json"
    cp backend-python/albatross/kernels/*/*/gemv.so "$OUT/"
  fi
  echo "== loader (the committed binaries)"
  time $PY -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s %(message)s')
from albatross import cuda_ops, linear, wkv_dispatch
results = cuda_ops.enable_cuda_kernels()
print({name: r.how for name, r in results.items()}, 'gemv enabled:', linear.gemv_enabled(), 'chunked WKV:', wkv_dispatch.chunked_kernel_available())
"
} 2>&1 | tee "$log"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== tests" | tee -a "$log"
  TEST_FILES=${TEST_FILES:-tests/test_wkv_chunked_cuda.py tests/test_gemv_cuda.py tests/test_cuda_kernels.py tests/test_model_cuda.py tests/test_kernel_loader.py}
  (cd backend-python && timeout "${TEST_TIMEOUT:-300}" $PY -m pytest $TEST_FILES \
      -q -n 4 -p no:cacheprovider --durations=8 2>&1) | tee "$OUT/tests.log" | tail -30 | tee -a "$log"
fi

if [ "${WKV:-1}" = 1 ]; then
  echo "== WKV: sequential vs chunked" | tee -a "$log"
  (cd backend-python && timeout 300 $PY bench/bench_wkv_chunked.py ${WKV_ARGS:-} --json "$OUT/wkv_chunked.json" 2>&1) \
      | tee "$OUT/bench_wkv_chunked.log" | grep -v "^{" | tail -80 | tee -a "$log"
fi

if [ "${GEMV:-1}" = 1 ]; then
  echo "== GEMV vs cuBLAS" | tee -a "$log"
  (cd backend-python && timeout 90 $PY bench/bench_gemv.py --json "$OUT/gemv.json" 2>&1) | grep -v "^{" | tail -40 | tee -a "$log"
fi

if [ "${MODEL:-1}" = 1 ]; then
  echo "== model: prefill with/without the chunked WKV, batch-1 graph decode with/without the GEMV" | tee -a "$log"
  (cd backend-python && timeout 300 $PY bench/bench_model.py --batches 1,960 --graph-batches 1 --steps 10 --skip-accuracy \
      --wkv-chunked on,off --gemv on,off ${MODEL_ARGS:-} --json "$OUT/bench_model.json" 2>&1) \
      | tee "$OUT/bench_model.log" | grep -v "^{" | tail -20 | tee -a "$log"
fi
