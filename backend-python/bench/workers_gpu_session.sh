#!/usr/bin/env bash
# One device call for the worker modes (issues 15 and 17), at most ~6 minutes; everything lands
# under $OUT (log.txt with every table, one JSON per benchmark run):
#   1. the GPU engine tests and the worker-process tests (worker threads and worker processes);
#   2. the engine benchmark (7.2B random weights, 960 requests, the wave-1 workload) with workers=1
#      as a worker thread and as a worker process, with the step profile (GPU idle between steps);
#   3. bench/host_overhead.py on this host's cores: simulated H200s, N = 1, 2, 4 (threads) and
#      N = 1, 2, 4, 8 (processes), 960 requests per worker of 128 tokens (the floor: 8 processes
#      >= 7x one);
#   4. with more GPUs visible: the engine benchmark for N = 2, 4, 8 (as far as the GPUs go),
#      960 requests per GPU, worker processes (and threads with THREADS_MULTI=1), step profile.
#   bash backend-python/bench/workers_gpu_session.sh        (from the repository root)
# Knobs (environment): TESTS=0, ENGINE=0, HOST=0, MULTI=0 skip a part; SHAPE (7.2b); HOST_THREADS
# ("1,2,4"), HOST_PROCESSES ("1,2,4,8"), THREADS_MULTI=1; BUDGET_S (345): the whole call's seconds,
# each part's timeout is cut to what is left (a part with under 20 s left is skipped, and logged).
# Carry the wheels of fastapi & co. in .whl/ when the image lacks them (as for engine_gpu_session.sh).
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
log() { echo "== $*" | tee -a "$OUT/log.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/log.txt"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
log "$(date -u +%FT%TZ): $GPUS GPU(s), $(nproc) CPUs, $(python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])")"
SHAPE=${SHAPE:-7.2b}
START=$SECONDS
BUDGET_S=${BUDGET_S:-345}
within() {  # $1: the part's own timeout; prints the timeout that fits what is left, or nothing
  local left=$((BUDGET_S - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then return 1; fi
  echo $(($1 < left ? $1 : left))
}
skipped() { log "skipped (the session's ${BUDGET_S} s are spent): $*"; }

if [ "${TESTS:-1}" = 1 ]; then
  log "GPU engine tests and worker-process tests"
  timeout "$(within 150 || echo 1)" python3 -m pytest tests/test_engine_cuda.py tests/test_worker_processes.py -q -p no:cacheprovider 2>&1 \
    | tee -a "$OUT/log.txt" | tail -15
fi

engine() {  # $1: name, $2: workers, $3: worker mode
  local requests=$((960 * $2)) limit
  limit=$(within 110) || { skipped "engine benchmark $1"; return; }
  log "engine benchmark: $SHAPE, $requests requests, workers=$2, worker_mode=$3 (timeout $limit s)"
  timeout "$limit" python3 bench/engine_benchmark.py --shape "$SHAPE" --requests "$requests" --batch 960 --workers "$2" \
    --worker-mode "$3" --step-profile --json "$OUT/$1.json" 2>&1 | grep -v "^INFO" | tee -a "$OUT/log.txt" | tail -40
}

if [ "${ENGINE:-1}" = 1 ]; then
  engine engine_w1_thread 1 thread
  engine engine_w1_process 1 process
fi

if [ "${HOST:-1}" = 1 ]; then
  if limit=$(within 50); then
    log "host overhead, simulated H200s, worker threads"
    timeout "$limit" python3 bench/host_overhead.py --workers "${HOST_THREADS:-1,2,4}" --worker-mode thread --max-tokens 128 \
      --json "$OUT/host_threads.json" 2>&1 | tee -a "$OUT/log.txt" | tail -8
  else skipped "host overhead, threads"; fi
  if limit=$(within 80); then
    log "host overhead, simulated H200s, worker processes"
    timeout "$limit" python3 bench/host_overhead.py --workers "${HOST_PROCESSES:-1,2,4,8}" --worker-mode process --max-tokens 128 \
      --json "$OUT/host_processes.json" 2>&1 | tee -a "$OUT/log.txt" | tail -10
  else skipped "host overhead, processes"; fi
fi

if [ "${MULTI:-1}" = 1 ] && [ "$GPUS" -ge 2 ]; then
  for n in 2 4 8; do
    [ "$n" -le "$GPUS" ] || break
    engine "engine_w${n}_process" "$n" process
    [ "${THREADS_MULTI:-0}" = 1 ] && engine "engine_w${n}_thread" "$n" thread
  done
fi
log "done $(date -u +%FT%TZ), $((SECONDS - START)) s"
