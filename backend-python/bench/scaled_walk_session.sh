#!/usr/bin/env bash
# One device call for session 21's scaled WKV walk (issue 16, prefill 64 x 512): the binaries load
# prebuilt, the GPU tests of the WKV kernel (the scaled walk's own, the op's, the model's), one
# layer of the sequential kernel with the plain and the scaled walk at both two-row layouts
# (bench_wkv.py), the 7.2B prefill with the plain and the scaled walk in turn (twice each, so a
# drift of the card's clock shows), a profiled 64 x 512 prefill (how much of its wall time the
# device is busy), then where a direct launch's cycles go, plain against scaled
# (Nsight Compute's scheduler and warp-state sections, when ncu is there). Most important first;
# each step has its timeout.
#   bash backend-python/bench/scaled_walk_session.sh   (repository root, .whl/ carried)
# Knobs: TESTS=0, NCU=0, WHOLE=1 (the whole GPU suite at the end), TEST_FILES. Output: $OUT/log.txt.
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
log="$OUT/log.txt"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; } 2>&1 | tee -a "$log"
timeout 120 python3 -c "
from albatross import cuda_ops
print({name: result.how for name, result in cuda_ops.enable_cuda_kernels().items()})" 2>&1 | tail -2 | tee -a "$log"
if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests: the WKV kernel's walks, the fused norms, the model" | tee -a "$log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda ${TEST_FILES:-tests/test_wkv_scaled_cuda.py \
      tests/test_cuda_kernels.py tests/test_norm_mix_rows_cuda.py tests/test_norm_mix_decode_cuda.py tests/test_model_cuda.py \
      tests/test_wkv_chunked_cuda.py tests/test_kernel_loader.py} 2>&1 | tail -15 | tee -a "$log"
fi
echo "== one layer, 64 heads: the two-row walks, plain and scaled" | tee -a "$log"
timeout 150 python3 bench/bench_wkv.py --batches= --prefill 64x512,128x128,32x512,8x512 --rows-per-thread 2,2s,2d,2ds \
    --state-dtypes fp16,fp32 --json "$OUT/wkv.json" 2>&1 | grep -v "^{" | tee -a "$log" | tail -36
echo "== 7.2B prefill, plain and scaled walk in turn; then 64 x 512 profiled (the default walk): device span, busy, idle" | tee -a "$log"
timeout 360 python3 bench/bench_model.py --batches 64 --graph-batches= --fp16-graph-batches= --steps 3 --skip-accuracy \
    --wkv-rows plain,scaled,plain,scaled --profile-prefill 64x512 --json "$OUT/prefill.json" 2>&1 | grep -v "^{" \
    | tee "$OUT/prefill.log" | tail -16 | tee -a "$log"
grep -A26 "== profile" "$OUT/prefill.log" | cut -c1-160 >> "$log"
if [ "${NCU:-1}" = 1 ] && command -v ncu >/dev/null 2>&1; then
  echo "== ncu: one direct launch each, plain then scaled (64 x 512, fp16 state)" | tee -a "$log"
  for walk in plain:2d scaled:2ds; do
    timeout 180 ncu --kernel-name regex:wkv7_rows_kernel --launch-skip 1 --launch-count 1 --section SchedulerStats \
        --section WarpStateStats --section LaunchStats --section Occupancy --section SpeedOfLight \
        python3 bench/bench_wkv.py --batches= --prefill 64x512 --rows-per-thread "${walk#*:}" --state-dtypes fp16 --iters 10 2>&1 \
        | grep -v "^{" | tee "$OUT/ncu_${walk%%:*}.txt" | tail -3
  done
fi
if [ "${WHOLE:-0}" = 1 ]; then
  echo "== the whole GPU suite" | tee -a "$log"
  timeout 500 python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda tests 2>&1 | tail -15 | tee -a "$log"
fi
