#!/usr/bin/env bash
# One device call for session 20's prefill fusion (issue 16, prefill 64 x 512): the binaries load,
# the GPU tests of norm_mix_rows and of the kernels it shares code with, one layer's norms both ways
# (bench_norm_mix_rows.py), the 7.2B prefill with the
# op off and on in turn (twice each, so a drift of the card's clock shows), then the batch-960 and
# batch-1 graph decode on the same binaries. Most important first; each step has its timeout.
# (Session 20 ran it with wkv_prefill_fused too, which it then dropped: in git history at 2e1a60e.)
#   bash backend-python/bench/prefill_fusion_session.sh   (repository root, .whl/ carried)
# Knobs: TESTS=0, WHOLE=1 (the whole GPU suite at the end). Output: $OUT/log.txt.
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
log="$OUT/log.txt"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } 2>&1 | tee -a "$log"
timeout 120 python3 -c "
from albatross import cuda_ops
print({name: result.how for name, result in cuda_ops.enable_cuda_kernels().items()})" 2>&1 | tail -2 | tee -a "$log"
if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests: norm_mix_rows and the kernels it shares code with" | tee -a "$log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda \
      tests/test_norm_mix_rows_cuda.py tests/test_cuda_kernels.py tests/test_wkv_decode_step_cuda.py \
      tests/test_norm_mix_decode_cuda.py tests/test_norm_mix_cuda.py tests/test_wkv_decode_cuda.py tests/test_model_cuda.py \
      tests/test_wkv_chunked_cuda.py tests/test_gemv_cuda.py 2>&1 | tail -12 | tee -a "$log"
fi
echo "== one layer's norms, the two ops against norm_mix_rows" | tee -a "$log"
timeout 120 python3 bench/bench_norm_mix_rows.py --json "$OUT/norm.json" 2>&1 | grep -v "^{" | tee -a "$log" | tail -12
echo "== 7.2B prefill, norm_mix_rows off and on in turn" | tee -a "$log"
timeout 300 python3 bench/bench_model.py --batches 64 --graph-batches= --fp16-graph-batches= --steps 3 --skip-accuracy \
    --norm-rows-op off,on,off,on --json "$OUT/prefill.json" 2>&1 | grep -v "^{" | tee -a "$log" | tail -14
echo "== 7.2B graph decode, batch 960 and 1" | tee -a "$log"
timeout 200 python3 bench/bench_model.py --batches 960 --graph-batches= --fp16-graph-batches 1,960 --steps 10 \
    --skip-accuracy --json "$OUT/decode.json" 2>&1 | grep -v "^{" | tee -a "$log" | tail -8
if [ "${WHOLE:-0}" = 1 ]; then
  echo "== the whole GPU suite" | tee -a "$log"
  timeout 500 python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda tests 2>&1 | tail -15 | tee -a "$log"
fi
