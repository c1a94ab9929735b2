#!/usr/bin/env bash
# One device call that measures host-side changes (worker, scheduler, routes, state cache) on the
# wave-1 burst: fresh servers through bench/bench_server.py --device-step profiled, one after
# another, each from its own copy of backend-python/ with a side's Python files copied over it,
# and the burst's table and step profile (GPU gaps, host time inside and between issues, the
# allocator's waits) printed for each. Sides alternate in $ORDER, so a drifting card shows.
#   SIDES="base=gpu_scratch/overlays/base" ORDER="tree base tree base" bash backend-python/bench/host_ab_gpu_session.sh
# (repository root; .whl/ and the overlay folders carried). A side is NAME=DIR[+DIR...]: the
# files under each DIR (relative to the repository root or absolute, laid out as under backend-python/) are
# copied over that side's copy in order; "tree" is the tree as it is. bench/make_host_overlay.sh
# writes a DIR from a commit (the device has no git).
# Knobs: ORDER (default "tree base tree base"), SHAPE (7.2b), STRATEGY ("albatross workers=1
# batch=960"), CONCURRENCY (960), WORDS (200), MAX_TOKENS (256), BUDGET_S (540: a side is not
# started with less than RUN_S (100) left), DEVICE_STEP (profiled; "simulated" with SERVER_ARGS="--simulated-step
# 36.7,5.2,26.9,40" checks the script on a CPU), SERVER_ARGS. Output: $OUT/log.txt, and $OUT/runs.tgz (each run's
# JSON and server log; the device returns at most 8 files).
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
root=$(cd .. && pwd)
log="$OUT/log.txt" keep=/tmp/host_ab_runs
t0=$(date +%s)
rm -rf "$keep" && mkdir -p "$keep"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"

declare -A overlays=([tree]="")
for side in ${SIDES:-}; do
  overlays[${side%%=*}]=${side#*=}
done
for name in "${!overlays[@]}"; do
  copy=/tmp/host_ab_$name
  rm -rf "$copy" && cp -r "$root/backend-python" "$copy"
  IFS='+' read -ra dirs <<<"${overlays[$name]}"
  for dir in "${dirs[@]}"; do
    [[ $dir = /* ]] || dir="$root/$dir"
    [ -d "$dir" ] || { echo "side $name: no folder $dir" | tee -a "$log"; exit 2; }
    cp -r "$dir/." "$copy/"
    echo "side $name: $(find "$dir" -type f | wc -l) files from $dir" | tee -a "$log"
  done
done

run=0
for name in ${ORDER:-tree base tree base}; do
  [ -n "${overlays[$name]+set}" ] || { echo "ORDER names $name, which SIDES does not define" | tee -a "$log"; exit 2; }
  if [ $(( ${BUDGET_S:-540} - ($(date +%s) - t0) )) -lt "${RUN_S:-100}" ]; then
    echo "== stopping before run $((run + 1)) ($name): the budget is spent" | tee -a "$log"
    break
  fi
  run=$((run + 1))
  cd "/tmp/host_ab_$name"
  started=$(date +%s)
  python3 bench/bench_server.py --device-step "${DEVICE_STEP:-profiled}" ${SERVER_ARGS:-} --model-path "random:${SHAPE:-7.2b}" \
      --strategy "${STRATEGY:-albatross workers=1 batch=960}" --port 8123 --max-tokens 4096 >"$keep/server_${run}_$name.log" 2>&1 &
  server=$!
  for _ in $(seq 1 150); do
    python3 -c "import httpx,sys; sys.exit(0 if httpx.get('http://127.0.0.1:8123/status').json().get('status') == 3 else 1)" 2>/dev/null && break
    sleep 1
  done
  echo "== run $run: side $name, server up in $(( $(date +%s) - started )) s" | tee -a "$log"
  timeout 200 python3 bench/albatross_api_benchmark.py --url http://127.0.0.1:8123 --concurrency "${CONCURRENCY:-960}" \
      --max-tokens "${MAX_TOKENS:-256}" --prompt-words "${WORDS:-200}" --client-procs 8 --device-report \
      --json "$keep/run_${run}_$name.json" 2>&1 | tee -a "$log" | tail -30
  kill "$server"; wait "$server" 2>/dev/null
  echo "== run $run done in $(( $(date +%s) - started )) s" | tee -a "$log"
done
tar czf "$OUT/runs.tgz" -C "$keep" .
