#!/usr/bin/env bash
# One device call for the channel mix's key product with relu^2 in its epilogue
# (albatross/relu_square_triton.py; issue 16, prefill): its GPU tests, the kernel against cuBLAS
# plus the relu_square pass at each tile shape (bench_ffn_key.py), then the 7.2B prefill with it on
# and off in turn, at the tile shape that was fastest at 32,768 rows.
#   bash backend-python/bench/ffn_key_gpu_session.sh        (repository root, .whl/ carried)
# Knobs: TESTS=0, ROWS (bench_ffn_key.py --rows), MODEL=0 (no prefill rows), SETTINGS (bench_model's
# --fused-relu-square, default on,off,on,off). Output: $OUT/log.txt, $OUT/ffn_key.json, $OUT/model.json.
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
log="$OUT/log.txt"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; } 2>&1 | tee -a "$log"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== tests" | tee -a "$log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_relu_square_triton_cuda.py tests/test_relu_square_triton.py \
      tests/test_relu_square_sm90_compile.py tests/test_fused_kernels.py -k "relu" 2>&1 | tail -15 | tee -a "$log"
fi

echo "== bench_ffn_key.py" | tee -a "$log"
timeout 300 python3 bench/bench_ffn_key.py --rows "${ROWS:-960,2048,4096,16384,32768}" --json "$OUT/ffn_key.json" 2>&1 \
    | grep -v "^{" | tee -a "$log"

if [ "${MODEL:-1}" = 1 ]; then
  best=$(python3 -c "
import json, sys
sys.path.insert(0, '.')
from albatross.relu_square_triton import CANDIDATES
rows = json.load(open('$OUT/ffn_key.json'))['results']
big = max(rows, key=lambda r: r['rows'])
label = min(big['fused_us'], key=big['fused_us'].get)
print([t.label() for t in CANDIDATES].index(label))" 2>>"$log" || echo 0)
  echo "== 7.2B prefill, fused relu^2 at CANDIDATES[$best]" | tee -a "$log"
  timeout 360 python3 bench/bench_model.py --batches 64 --graph-batches= --fp16-graph-batches= --steps 3 --skip-accuracy \
      --wkv-chunked on --fused-relu-square "${SETTINGS:-on,off,on,off}" --relu-square-tiles "$best" --json "$OUT/model.json" 2>&1 \
      | grep -v "^{" | tee -a "$log" | tail -20
fi
