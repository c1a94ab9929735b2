#!/usr/bin/env bash
# One device call: the whole test suite on the GPU, then the engine benchmark (in process) and the
# HTTP benchmark (a real server, streaming clients). Results land under $OUT (at most 8 files come
# back: every table goes to log.txt; JSON for the engine and each HTTP load; server.log; pyspy.txt).
#   run from the repo root with the wheels of fastapi & co. (and py-spy for PYSPY=1) carried in .whl/
# Knobs (environment): TESTS, MODEL (bench_model.py with BENCH_ARGS), ENGINE, BATCH1, HTTP, NOCACHE,
# LEVELS, SHAPE, TEST_TIMEOUT, TEST_PATHS, ENGINE_STATE_DTYPES, ENGINE_ARGS (extra engine_benchmark.py flags),
# ITL_TARGETS (e.g. "0 150": one engine run per adaptive prefill budget target, 0 = the static budget), PYSPY=1 (sample the
# server's threads during the first HTTP load), SWITCH_INTERVALS (e.g. "0.0005": restart the server
# with that sys.setswitchinterval and repeat the chat-route load; PYSPY_DELAY, PYSPY_DURATION, PYSPY_FLAGS e.g. "--native"), DEVICE_STEP=profiled (serve through
# bench/bench_server.py with CUDA events around every step, and print each HTTP level's step profile:
# GPU time per kind of step, the mixed steps' fit, the GPU's idle time between steps), SYNC_DEBUG=1 (the same server
# logs each distinct call that makes the host wait for the GPU, with its stack, to server.log), MIXED=1
# (bench/mixed_step_cost.py: a mixed step's time on a grid of prompt tokens x decode rows, the engine's
# one-forward step against graph decode + a prefill forward; MIXED_CHUNKS, default "128,256"),
# RATES (e.g. "4,16": bench/request_rate_benchmark.py against the HTTP server, RATES_DURATION s each, RATES_DRAIN s to finish),
# STRATEGY_EXTRA (appended to the server's strategy, e.g. "itl_target_ms=200"), STRATEGY_EXTRAS (several
# such, separated by ";": one server and one chat-route load each, JSON api_s<n>.json, after the first).
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/log.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$OUT/log.txt"

if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest ${TEST_PATHS:-tests} -q -n 8 -p no:cacheprovider --maxfail=20 2>&1 | tee -a "$OUT/log.txt" | tail -25
fi

if [ "${MODEL:-0}" = 1 ]; then
  timeout "${MODEL_TIMEOUT:-200}" python3 bench/bench_model.py ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/log.txt" | tail -60
fi

if [ "${MIXED:-0}" = 1 ]; then
  timeout "${MIXED_TIMEOUT:-400}" python3 bench/mixed_step_cost.py --shape "${SHAPE:-7.2b}" --chunks "${MIXED_CHUNKS:-128,256}" --reps 3 \
      --json "$OUT/mixed_step_cost.json" 2>&1 | tee -a "$OUT/log.txt" | tail -60
  # One prompt's step at 128 .. 4,096 tokens (the chunked WKV kernel from 512 for one slot), alone and
  # next to 480 decoding streams: what feeding a lone 4,096-token prompt costs in chunks of each size.
  timeout "${MIXED_TIMEOUT:-400}" python3 bench/mixed_step_cost.py --shape "${SHAPE:-7.2b}" --one-prompt \
      --prompt-tokens 128,256,512,1024,2048,4096 --decode-rows 0,480 --reps 3 --json "$OUT/mixed_step_long.json" 2>&1 | tee -a "$OUT/log.txt" | tail -32
fi

if [ "${ENGINE:-1}" = 1 ]; then
  for state in ${ENGINE_STATE_DTYPES:-default}; do  # e.g. "default fp32": the engine's default state, then fp32
    for target in ${ITL_TARGETS:-default}; do  # e.g. "0 150": static budget, then the adaptive one at 150 ms
      flags=$([ "$state" = default ] || echo "--state-dtype $state")
      flags="$flags $([ "$target" = default ] || echo "--itl-target-ms $target")"
      name=$state$([ "$target" = default ] || echo "_itl$target")
      echo "== engine, 960 requests, state: $state, itl_target_ms: $target" | tee -a "$OUT/log.txt"
      timeout 240 python3 bench/engine_benchmark.py --shape "${SHAPE:-7.2b}" --requests 960 --batch 960 $flags ${ENGINE_ARGS:-} \
          --json "$OUT/engine960_$name.json" 2>&1 | tee -a "$OUT/log.txt" | tail -60
    done
  done
  [ "${BATCH1:-1}" = 1 ] && timeout 90 python3 bench/engine_benchmark.py --shape "${SHAPE:-7.2b}" --requests 1 --batch 1 --prompt-min 64 --prompt-max 64 2>&1 | tee -a "$OUT/log.txt" | tail -12
fi

start_server() {  # $1: sys.setswitchinterval value, or "" for Python's default; $2: strategy extra (default STRATEGY_EXTRA)
  local script=main.py device_step=()
  if [ -n "${DEVICE_STEP:-}" ]; then script=bench/bench_server.py device_step=(--device-step "$DEVICE_STEP"); fi
  if [ "${SYNC_DEBUG:-0}" = 1 ]; then script=bench/bench_server.py device_step+=(--sync-debug); fi
  python3 -c "import sys, runpy; sys.setswitchinterval(float('$1')) if '$1' else None; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" \
    "$script" "${device_step[@]}" --model-path "random:${SHAPE:-7.2b}" --strategy "albatross workers=1 batch=960 ${2:-${STRATEGY_EXTRA:-}}" --port 8123 --max-tokens 4096 >>"$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq 1 150); do
    if python3 -c "import httpx,sys; sys.exit(0 if httpx.get('http://127.0.0.1:8123/status').json().get('status') == 3 else 1)" 2>/dev/null; then return; fi
    sleep 1
  done
  echo "server did not come up"; tail -20 "$OUT/server.log"
}

api() {  # $1: json name; the rest: extra benchmark flags
  local name=$1; shift
  timeout 300 python3 bench/albatross_api_benchmark.py --url http://127.0.0.1:8123 --concurrency "${LEVELS:-1,64,960}" \
      --max-tokens 256 --prompt-words 200 --client-procs 8 --json "$OUT/$name.json" ${DEVICE_STEP:+--device-report} "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -50
}

if [ "${HTTP:-1}" = 1 ]; then
  start_server ""
  if [ "${PYSPY:-0}" = 1 ]; then
    (sleep "${PYSPY_DELAY:-8}"; /tmp/site/bin/py-spy record --pid "$server" --nonblocking --threads --idle --rate 50 --duration "${PYSPY_DURATION:-30}" ${PYSPY_FLAGS:-} \
        --format raw --output "$OUT/pyspy.txt" >>"$OUT/log.txt" 2>&1) &
  fi
  api api
  if [ "${NOCACHE:-1}" = 1 ]; then  # the same load without the per-request prefix-cache saves
    api api_nocache --route openai-native --prefix-cache off
  fi
  if [ -n "${RATES:-}" ]; then  # Poisson arrivals of the request-rate mix (long prompts included)
    timeout "${RATES_TIMEOUT:-400}" python3 bench/request_rate_benchmark.py --url http://127.0.0.1:8123 --rates "$RATES" \
        --duration "${RATES_DURATION:-30}" --drain "${RATES_DRAIN:-60}" --json "$OUT/request_rate.json" 2>&1 | tee -a "$OUT/log.txt" | tail -12
  fi
  kill "$server"; wait "$server" 2>/dev/null
  n=0
  IFS=';' read -ra extras <<<"${STRATEGY_EXTRAS:-}"
  for extra in "${extras[@]}"; do
    n=$((n + 1))
    echo "== server with strategy extra: $extra" | tee -a "$OUT/log.txt"
    start_server "" "$extra"
    api "api_s$n"
    kill "$server"; wait "$server" 2>/dev/null
  done
  for interval in ${SWITCH_INTERVALS:-}; do
    echo "== server with sys.setswitchinterval($interval)"
    start_server "$interval"
    api "api_switch_$interval"
    kill "$server"; wait "$server" 2>/dev/null
  done
  tail -5 "$OUT/server.log"
fi
