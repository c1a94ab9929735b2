#!/usr/bin/env bash
# One device call that measures a change to the CUDA kernel sources against the tree's own: first
# the tree as it is (its committed binaries), then with the .cu/.cuh files of $VARIANT copied over
# albatross/cuda/ (on the device's copy only; the loader JIT-builds what changed, for this GPU).
# Each side runs the cuda tests of the few-row products and times them: bench_gemv.py (fp16
# split-K GEMV against cuBLAS), bench_int8.py kernels (the int8 GEMV rows, 1-2 rows) and the 7.2B
# batch-1 decode with a CUDA graph, fp16 and int8 (bench_model.py, bench_int8.py model --cases
# decode1 --weights int8: the prefill and batch-960 cases these kernels do not run are left out).
#   VARIANT=gpu_scratch/variant bash backend-python/bench/kernel_ab_gpu_session.sh   (repository root; .whl/ carried)
# $VARIANT is relative to the repository root and must travel (an untracked, not ignored folder).
# Knobs: BASE=0, TESTS=0 or TESTS=variant, TEST_FILES, VARIANT_ENVS (settings that time the variant again, untested),
# GEMV=0 (no few-row product timings), SAMPLER=1 (bench_sampler.py at batch 1, 64 and 960),
# MODEL=0 (no model rows), FP16_MODEL=0 (the int8 model only), INT8_MODEL=0 (the fp16 model only), BATCHES (fp16-state graph batches, 1), GRAPH_BATCHES (fp32-state graph batches, 1; empty: none), SHAPE (7.2b), MODEL_ARGS (more bench_model.py flags, e.g. --gemv on,off
# --fused-lora on,off), INT8_ARGS (more bench_int8.py model flags, e.g. --fused-lora on,off), BENCH (one more benchmark
# command run on each side, e.g. "bench/bench_norm_mix_rows.py --shapes 64x512"), AGAIN=1 (the base side once more after
# the variant, its sources put back, so the card's drift shows). Output: $OUT/log.txt, and per side base-*/variant-* JSON.
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
root=$(cd .. && pwd)
variant="$root/${VARIANT:?VARIANT names a folder of replacement kernel sources}"
[ -d "$variant" ] || { echo "no folder $variant" >&2; exit 2; }
export ALBATROSS_KERNEL_CACHE=${ALBATROSS_KERNEL_CACHE:-/tmp/albatross-build-cache}
log="$OUT/log.txt"

side() {  # $1: base or variant
  echo "== $1: kernels" | tee -a "$log"
  timeout 300 python3 -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s %(message)s')
from albatross import cuda_ops
print({name: result.how for name, result in cuda_ops.enable_cuda_kernels().items()})
" 2>&1 | tee -a "$log"
  if [ "${TESTS:-1}" = 1 ] || [ "${TESTS:-1}" = "$1" ]; then  # TESTS=variant: only the changed side
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda ${TEST_FILES:-tests/test_gemv_cuda.py tests/test_int8_cuda.py \
        tests/test_cuda_kernels.py tests/test_lora_cuda.py tests/test_pdl_cuda.py} 2>&1 | tail -4 | tee -a "$log"
  fi
  if [ -n "${BENCH:-}" ]; then
    timeout 240 python3 $BENCH 2>&1 | grep -v "^{" | tail -60 | tee -a "$log"
  fi
  if [ "${GEMV:-1}" = 1 ]; then
    timeout 240 python3 bench/bench_gemv.py --rows 1,2 --json "$OUT/$1-gemv.json" 2>&1 | tee -a "$log" | tail -14
    timeout 240 python3 bench/bench_int8.py kernels --rows 1,2 --only GEMV --json "$OUT/$1-int8.jsonl" 2>&1 | tee -a "$log" | tail -14
  fi
  if [ "${SAMPLER:-0}" = 1 ]; then
    timeout 240 python3 bench/bench_sampler.py --batches 1,64,960 --json "$OUT/$1-sampler.json" 2>&1 | tee -a "$log" | tail -14
  fi
  if [ "${MODEL:-1}" = 1 ] && [ "${FP16_MODEL:-1}" = 1 ]; then
    timeout 300 python3 bench/bench_model.py --shape "${SHAPE:-7.2b}" --batches "${BATCHES:-1}" --graph-batches "${GRAPH_BATCHES-1}" --fp16-graph-batches "${BATCHES:-1}" \
        --steps 10 --skip-accuracy --wkv-chunked= ${MODEL_ARGS:-} --json "$OUT/$1-model.json" 2>&1 | tee -a "$log" | tail -8
  fi
  if [ "${MODEL:-1}" = 1 ] && [ "${INT8_MODEL:-1}" = 1 ]; then
    timeout 300 python3 bench/bench_int8.py model --shape "${SHAPE:-7.2b}" --cases decode1 --weights int8 ${INT8_ARGS:-} --json "$OUT/$1-int8-model.json" 2>&1 | tee -a "$log" | tail -8
  fi
}

{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } 2>&1 | tee -a "$log"
[ "${BASE:-1}" = 1 ] && side base  # BASE=0: the variant only (a VARIANT_ENVS setting as its control)
committed=$(mktemp -d)
cp albatross/cuda/*.cu* "$committed"/
cp "$variant"/*.cu* albatross/cuda/ 2>/dev/null
echo "== variant files: $(cd "$variant" && ls)" | tee -a "$log"
side variant
for setting in ${VARIANT_ENVS:-}; do  # e.g. "ALBATROSS_PDL=0": the variant's kernels again, timed under that setting
  (export "$setting"; TESTS=0 side "variant-${setting//=/-}")
done
if [ "${AGAIN:-0}" = 1 ]; then
  cp "$committed"/*.cu* albatross/cuda/
  TESTS=0 side base-again
fi
