#!/usr/bin/env bash
# One device call for the batch-1 decode paths on the committed binaries (no variant):
# - the loader takes every library prebuilt with an empty JIT cache;
# - the WKV-step, batch-1 Triton and PDL tests run twice (a race shows as a run that differs);
# - STEP: the CUDA decode ops (norm_mix_decode, wkv_decode_step) against the kernels they replace
#   (7.2B graph decode at batch 1 and 960 with fp16 weights, at batch 1 with int8);
# - PATHS: the 7.2B batch-1 graph rows with each Triton path on and off (fp16: bench_model.py;
#   int8: bench_int8.py model, again with ALBATROSS_PDL=0);
# - PROFILE: the kernels of a captured batch-1 step (int8 and fp16 weights);
# - DRIFT: one row's logits at batch 1 against a batch of 11 (batch_drift.py);
# - NCU: Nsight Compute on the 4096 x 4096 products; SUITE: the whole GPU suite.
#   bash backend-python/bench/batch1_gpu_session.sh        (repository root; .whl/ carried)
# Knobs: STEP=0, PATHS=0, PROFILE=0, DRIFT=0, NCU=0, SUITE=0 skip a step (all of them take about
# 13 minutes: split them over two calls); MODEL_ARGS / INT8_ARGS (default: --fused-lora on,off). Output: $OUT/log.txt,
# step.json, model.json, int8.json, int8-nopdl.json, ncu.txt, suite.log.
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
log="$OUT/log.txt"
paths="--fused-lora on,off"  # the Triton norm + mix and WKV step give way to the CUDA decode ops (on by default)
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } 2>&1 | tee "$log"
ALBATROSS_KERNEL_CACHE=/tmp/albatross-empty-cache python3 -c "
import logging, os; logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s %(message)s')
from albatross import cuda_ops
print({name: result.how for name, result in cuda_ops.enable_cuda_kernels().items()})
print('JIT cache created:', os.path.exists('/tmp/albatross-empty-cache'))" 2>&1 | tee -a "$log"
for run in 1 2; do
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_wkv_decode_step_cuda.py tests/test_norm_mix_decode_cuda.py tests/test_wkv_decode_cuda.py \
      tests/test_norm_mix_cuda.py tests/test_lora_cuda.py tests/test_pdl_cuda.py -rf --tb=short 2>&1 | tail -6 | tee -a "$log"
done
if [ "${STEP:-1}" = 1 ]; then  # the CUDA decode ops against the kernels they replace, batch 1 and 960, then int8 at batch 1
  timeout 300 python3 bench/bench_model.py --shape 7.2b --batches 1,960 --graph-batches= --fp16-graph-batches 1,960 --steps 10 \
      --skip-accuracy --wkv-chunked= --decode-ops on,off --json "$OUT/step.json" 2>&1 | tail -5 | tee -a "$log"
  timeout 200 python3 bench/bench_model.py --shape 7.2b --weights int8 --batches 1 --graph-batches= --fp16-graph-batches 1 \
      --steps 10 --skip-accuracy --wkv-chunked= --decode-ops on,off 2>&1 | tail -3 | tee -a "$log"
fi
if [ "${PATHS:-1}" = 1 ]; then  # the batch-1 Triton paths on and off
  timeout 240 python3 bench/bench_model.py --shape 7.2b --batches 1 --graph-batches 1 --fp16-graph-batches 1 --steps 10 \
      --skip-accuracy --wkv-chunked= ${MODEL_ARGS:-$paths} --json "$OUT/model.json" 2>&1 | tail -8 | tee -a "$log"
  timeout 200 python3 bench/bench_int8.py model --shape 7.2b --cases decode1 --weights int8 ${INT8_ARGS:-$paths} \
      --json "$OUT/int8.json" 2>&1 | tail -7 | tee -a "$log"
  ALBATROSS_PDL=0 timeout 150 python3 bench/bench_int8.py model --shape 7.2b --cases decode1 --weights int8 \
      --json "$OUT/int8-nopdl.json" 2>&1 | tail -3 | tee -a "$log"
fi
if [ "${PROFILE:-1}" = 1 ]; then  # where a captured batch-1 step's time goes, the defaults' paths, int8 then fp16
  for weights in int8 fp16; do
    timeout 150 python3 bench/bench_model.py --shape 7.2b --weights $weights --batches 1 --graph-batches= --fp16-graph-batches= \
        --steps 2 --skip-accuracy --wkv-chunked= --profile-graph-batches 1 2>&1 | sed -n '/== profile/,/^$/p' | head -44 | tee -a "$log"
  done
fi
if [ "${DRIFT:-1}" = 1 ]; then
  timeout 90 python3 bench/batch_drift.py --shape 4x256 --seed 3 --steps 16 2>&1 | tee -a "$log"
fi
if [ "${NCU:-1}" = 1 ]; then
  timeout 120 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
      --section Occupancy -k regex:"gemv|gemm" --print-summary per-kernel python3 bench/ncu_small_products.py \
      --shape 4096x4096 > "$OUT/ncu.txt" 2>&1
  tail -3 "$OUT/ncu.txt" | tee -a "$log"
fi
if [ "${SUITE:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda -n 8 -rf --tb=short > "$OUT/suite.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/suite.log" | tee -a "$log"
fi
