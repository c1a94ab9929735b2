#!/usr/bin/env bash
# One device call for the norm_mix_pairs variant (bench/variants/norm_mix_pairs: norm_mix_rows
# normed two rows at a time, one pair of block sums for both, eight rows a block): the committed
# op, then the variant JIT-built from the variant's fused.cu, then the committed op again, each
# timed alone (bench_norm_mix_rows.py) and in the 7.2B prefill (bench_model.py); the variant's
# side runs the op's GPU tests first (bit-identity with add_layer_norm + shift_mix, the model
# through it). The committed side is timed twice, before and after, so the card's drift shows.
#   bash backend-python/bench/norm_mix_pairs_session.sh   (repository root, .whl/ carried)
# Knobs: TESTS=0, MODEL=0, AGAIN=0 (no second committed side). Output: $OUT/log.txt.
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
export ALBATROSS_KERNEL_CACHE=${ALBATROSS_KERNEL_CACHE:-/tmp/albatross-build-cache}
log="$OUT/log.txt"
committed=$(mktemp)
cp albatross/cuda/fused.cu "$committed"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; } 2>&1 | tee -a "$log"

side() {  # $1: the side's name
  echo "== $1: kernels" | tee -a "$log"
  timeout 300 python3 -c "
from albatross import cuda_ops
print({name: result.how for name, result in cuda_ops.enable_cuda_kernels().items()})" 2>&1 | tail -1 | tee -a "$log"
  if [ "${TESTS:-1}" = 1 ] && [ "$1" = variant ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda tests/test_norm_mix_rows_cuda.py \
        2>&1 | tail -3 | tee -a "$log"
  fi
  timeout 120 python3 bench/bench_norm_mix_rows.py --shapes 64x512,128x128,32x512,1x4096 --iters 30 \
      --json "$OUT/$1-op.json" 2>&1 | grep -v "^{" | tail -10 | tee -a "$log"
  if [ "${MODEL:-1}" = 1 ]; then
    timeout 240 python3 bench/bench_model.py --batches 64 --graph-batches= --fp16-graph-batches= --steps 3 --skip-accuracy \
        --json "$OUT/$1-model.json" 2>&1 | grep -v "^{" | grep "prefill" | tee -a "$log"
  fi
}

side committed
cp bench/variants/norm_mix_pairs/fused.cu albatross/cuda/fused.cu
side variant
cp "$committed" albatross/cuda/fused.cu
[ "${AGAIN:-1}" = 1 ] && side committed-again
