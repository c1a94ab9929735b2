#!/usr/bin/env bash
# One device call for the prefill floors (issue 16: 1 x 4,096 and 64 x 512): where a prefill call's
# time goes with the committed kernels, then a variant of the WKV kernel sources ($VARIANT, copied
# over albatross/cuda/ on the device's copy only, JIT-built) tested and timed under each value of
# its switch ($SWITCH, e.g. ALBATROSS_WKV_SPLIT, one value the control), one layer
# (bench_wkv.py) and the 7.2B model (bench_model.py), all in the same process tree and call.
#   VARIANT=backend-python/bench/variants/NAME bash backend-python/bench/prefill_gpu_session.sh
# (session 16 ran it with the wkv_seq_split variant, in git history at commit b0ba2e4)
# (repository root, .whl/ carried.) Knobs: PROFILE=0 (no kernel tables), TESTS=0, TEST_VALUES (the
# switch values the GPU tests run under; default all of VALUES), VALUES (default "1 2 4"),
# WKV_CASES (bench_wkv.py prefill shapes), WKV_ROWS (its --rows-per-thread, default 1), BASE_WKV=1 (that
# table on the committed binaries first), MODEL_VALUES (default VALUES; empty: no model rows),
# CHUNKED_ARGS (bench_wkv_chunked.py flags: its sweep runs after the tables), IDENTITY=1 (outputs and states under every value compared bit for bit), SHAPE (7.2b). Output: $OUT/log.txt and JSON per value.
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
root=$(cd .. && pwd)
export ALBATROSS_KERNEL_CACHE=${ALBATROSS_KERNEL_CACHE:-/tmp/albatross-build-cache}
log="$OUT/log.txt"
switch=${SWITCH:-ALBATROSS_WKV_SPLIT}
values=${VALUES:-1 2 4}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } 2>&1 | tee -a "$log"

model() {  # bench_model's prefill rows (1 x 4,096 and 64 x 512, fp32 state), eager decode at 64 on the side
  timeout 300 python3 bench/bench_model.py --shape "${SHAPE:-7.2b}" --batches 64 --graph-batches= --fp16-graph-batches= \
      --steps 2 --skip-accuracy --wkv-chunked on "$@" 2>&1
}

if [ "${PROFILE:-1}" = 1 ]; then
  echo "== committed kernels: prefill kernel tables, and batch-960 graph decode (fp16 state) timed and profiled" | tee -a "$log"
  timeout 400 python3 bench/bench_model.py --shape "${SHAPE:-7.2b}" --batches 960 --graph-batches= --fp16-graph-batches 960 \
      --steps 10 --skip-accuracy --profile-prefill 64x512,1x4096 --profile-graph-batches 960 --json "$OUT/base-model.json" 2>&1 | tee -a "$log" | tail -150
fi

if [ -n "${CHUNKED_ARGS:-}" ]; then  # the chunked Triton kernel's sweeps (bench_wkv_chunked.py), before any variant is copied
  echo "== chunked WKV: bench_wkv_chunked.py $CHUNKED_ARGS" | tee -a "$log"
  timeout 300 python3 bench/bench_wkv_chunked.py $CHUNKED_ARGS --json "$OUT/chunked.json" 2>&1 | grep -v "^{" | tee -a "$log" | tail -60
fi

wkv_layer() {  # bench_wkv.py's prefill table for WKV_CASES and WKV_ROWS; $1 names the JSON
  timeout 300 python3 bench/bench_wkv.py --batches= --prefill "${WKV_CASES:-1x4096,16x2048,64x512,128x128}" \
      --rows-per-thread "${WKV_ROWS:-1}" --state-dtypes fp32,fp16 --json "$OUT/wkv-$1.json" 2>&1 | tee -a "$log" | tail -30
}

if [ "${BASE_WKV:-0}" = 1 ]; then  # the same one-layer table on the committed binaries, before any variant is copied
  echo "== one layer, committed binaries" | tee -a "$log"
  wkv_layer base
fi

if [ -n "${VARIANT:-}" ]; then
  variant="$root/$VARIANT"
  [ -d "$variant" ] || { echo "no folder $variant" >&2; exit 2; }
  cp "$variant"/*.cu* albatross/cuda/
  echo "== variant files: $(cd "$variant" && ls)" | tee -a "$log"
  timeout 300 python3 -c "
from albatross import cuda_ops
print({name: result.how for name, result in cuda_ops.enable_cuda_kernels().items()})" 2>&1 | tee -a "$log"
  if [ "${TESTS:-1}" = 1 ]; then
    for value in ${TEST_VALUES:-$values}; do
      echo "== tests, $switch=$value" | tee -a "$log"
      env "$switch=$value" timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_cuda_kernels.py \
          tests/test_wkv_chunked_cuda.py tests/test_model_cuda.py 2>&1 | tail -6 | tee -a "$log"
    done
  fi
  if [ "${IDENTITY:-0}" = 1 ]; then  # a variant meant to be bit-identical: the same call's outputs under every value
    for value in $values; do
      env "$switch=$value" timeout 120 python3 -c "
import sys, torch; sys.path.insert(0, 'bench')
from albatross import cuda_ops, ops
from bench_wkv import _inputs
cuda_ops.enable_cuda_kernels()
out = {}
for lengths in ([512] * 8, [128] * 5 + [1] * 9 + [300, 2], [4096]):
    for state_dtype in (torch.float32, torch.float16):
        gen = torch.Generator(device='cuda').manual_seed(sum(lengths))
        state = (torch.randn(len(lengths), 64, 64, 64, generator=gen, device='cuda') * 0.1).to(state_dtype)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device='cuda')
        slots = torch.randperm(len(lengths), generator=gen, device='cuda').to(torch.int32)
        inputs = _inputs(sum(lengths), 64, torch.float16, gen)
        for rows, direct in ((1, False), (2, False), (2, True)):  # each launch shape of the sequential kernel, on a copy of the states
            s = state.clone()
            y = ops.wkv7(s, slots, cu, *inputs, rows_per_thread=rows, direct_rows=direct)
            out[f'{len(lengths)}x{max(lengths)} {state_dtype} r{rows}' + (' direct' if direct else '')] = (y.cpu(), s.cpu())
torch.save(out, '/tmp/identity-$value.pt')" 2>&1 | tail -3 | tee -a "$log"
    done
    python3 -c "
import sys, torch
runs = [torch.load(f'/tmp/identity-{v}.pt') for v in sys.argv[1:]]
for key in runs[0]:
    same = all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0][key], run[key]))
    print(f'bit-identical across $switch={sys.argv[1:]}: {key}: {same}')" $values 2>&1 | tee -a "$log"
  fi
  for value in $values; do
    echo "== one layer, $switch=$value" | tee -a "$log"
    (export "$switch=$value"; wkv_layer "$value")
  done
  for value in ${MODEL_VALUES-$values}; do
    echo "== model, $switch=$value" | tee -a "$log"
    (export "$switch=$value"; model --json "$OUT/model-$value.json") | tee -a "$log" | grep -E "prefill|error|Error" | tail -6
  done
fi
