#!/usr/bin/env bash
# One device call: the whole test suite on the GPU, then the engine benchmark (in process) and the
# HTTP benchmark (a real server, streaming clients). Results land under $OUT.
#   run from the repo root with the wheels of fastapi & co. carried in .whl/ (docs/performance.md)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
cd backend-python
export PYTHONUNBUFFERED=1 RWKV_V7_ON=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$OUT/gpu.txt"

if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests -q -n 8 -p no:cacheprovider --maxfail=20 2>&1 | tee "$OUT/pytest.txt" | tail -25
fi

if [ "${ENGINE:-1}" = 1 ]; then
  timeout 240 python3 bench/engine_benchmark.py --shape "${SHAPE:-7.2b}" --requests 960 --batch 960 --json "$OUT/engine960.json" 2>&1 | tee "$OUT/engine960.txt" | tail -25
  [ "${BATCH1:-1}" = 1 ] && timeout 90 python3 bench/engine_benchmark.py --shape "${SHAPE:-7.2b}" --requests 1 --batch 1 --prompt-min 64 --prompt-max 64 --json "$OUT/engine1.json" 2>&1 | tail -12
fi

if [ "${HTTP:-1}" = 1 ]; then
  python3 main.py --model-path "random:${SHAPE:-7.2b}" --strategy "albatross workers=1 batch=960" --port 8123 --max-tokens 4096 >"$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq 1 120); do
    if python3 -c "import httpx,sys; sys.exit(0 if httpx.get('http://127.0.0.1:8123/status').json().get('status') == 3 else 1)" 2>/dev/null; then break; fi
    sleep 1
  done
  timeout 300 python3 bench/albatross_api_benchmark.py --url http://127.0.0.1:8123 --concurrency "${LEVELS:-1,64,960}" \
      --max-tokens 256 --prompt-words 200 --client-procs 8 --json "$OUT/api.json" 2>&1 | tee "$OUT/api.txt" | tail -15
  if [ "${NOCACHE:-1}" = 1 ]; then  # the same load without the per-request prefix-cache saves
    timeout 300 python3 bench/albatross_api_benchmark.py --url http://127.0.0.1:8123 --concurrency "${LEVELS:-1,64,960}" \
        --max-tokens 256 --prompt-words 200 --client-procs 8 --route openai-native --prefix-cache off \
        --json "$OUT/api_nocache.json" 2>&1 | tee "$OUT/api_nocache.txt" | tail -6
  fi
  kill "$server"; wait "$server" 2>/dev/null
  tail -5 "$OUT/server.log"
fi
