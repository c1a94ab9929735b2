#!/usr/bin/env bash
# One device call for the two prefill fusions of issue 16 (session 31): the channel mix's key
# product with relu^2 in its epilogue (albatross/relu_square_triton.py) and the LoRA up products
# with wkv_prep as their epilogue (albatross/lora_prep_triton.py). Their GPU tests, each kernel
# against the unfused path at each tile shape (bench_ffn_key.py, bench_lora_prep.py), then the 7.2B
# prefill with each on and off in turn, at the tile shapes that were fastest at 32,768 rows.
#   bash backend-python/bench/prefill_fusions_gpu_session.sh        (repository root, .whl/ carried)
# Knobs: TESTS=0, ROWS (both benchmarks' --rows), MODEL=0 (no prefill rows), RELU and PREP
# (bench_model's --fused-relu-square and --fused-lora-prep, default on,off each: four combinations,
# run twice). Output: $OUT/log.txt, $OUT/ffn_key.json, $OUT/lora_prep.json, $OUT/model.json.
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
log="$OUT/log.txt"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; } 2>&1 | tee -a "$log"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== tests" | tee -a "$log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_relu_square_triton_cuda.py tests/test_relu_square_triton.py \
      tests/test_relu_square_sm90_compile.py tests/test_lora_prep_triton_cuda.py tests/test_lora_prep_triton.py \
      tests/test_lora_prep_sm90_compile.py tests/test_fused_kernels.py tests/test_model_cuda.py 2>&1 | tail -15 | tee -a "$log"
fi

rows=${ROWS:-960,4096,16384,32768}
echo "== bench_ffn_key.py" | tee -a "$log"
timeout 240 python3 bench/bench_ffn_key.py --rows "$rows" --json "$OUT/ffn_key.json" 2>&1 | grep -v "^{" | tee -a "$log"
echo "== bench_lora_prep.py" | tee -a "$log"
timeout 180 python3 bench/bench_lora_prep.py --rows "$rows" --json "$OUT/lora_prep.json" 2>&1 | grep -v "^{" | tee -a "$log"

best() {  # $1: the benchmark's JSON, $2: the module whose CANDIDATES it timed
  python3 -c "
import json, sys
sys.path.insert(0, '.')
from albatross.$2 import CANDIDATES
rows = json.load(open('$1'))['results']
big = max(rows, key=lambda r: r['rows'])
label = min(big['fused_us'], key=big['fused_us'].get)
print([t.label() for t in CANDIDATES].index(label))" 2>>"$log" || echo 0
}

if [ "${MODEL:-1}" = 1 ]; then
  relu_tiles=$(best "$OUT/ffn_key.json" relu_square_triton)
  prep_tiles=$(best "$OUT/lora_prep.json" lora_prep_triton)
  echo "== 7.2B prefill: relu^2 fused at CANDIDATES[$relu_tiles], LoRA + prep fused at CANDIDATES[$prep_tiles]" | tee -a "$log"
  for round in 1 2; do
    timeout 200 python3 bench/bench_model.py --batches 64 --graph-batches= --fp16-graph-batches= --steps 3 --skip-accuracy \
        --wkv-chunked on --fused-relu-square "${RELU:-on,off}" --relu-square-tiles "$relu_tiles" \
        --fused-lora-prep "${PREP:-on,off}" --lora-prep-tiles "$prep_tiles" --json "$OUT/model-$round.json" 2>&1 \
        | grep -v "^{" | tee -a "$log" | tail -12
  done
fi
