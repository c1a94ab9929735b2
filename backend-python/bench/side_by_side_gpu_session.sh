#!/usr/bin/env bash
# One device call for the HTTP comparisons: write the 7.2B random weights with the impossible ids
# once, then bench/side_by_side.py serves them from each server in turn and runs the same loads.
#   SERVERS=albatross,classic RATES_FOR=classic=1,2 OUT=/tmp/out bash backend-python/bench/side_by_side_gpu_session.sh
#       (the request-rate table: Albatross against the classic backend)
#   SERVERS=albatross,runner,lightning OUT=/tmp/out bash backend-python/bench/side_by_side_gpu_session.sh
#       (the peers: .peers/RWKV-Runner (its backend-python/ is enough) and .peers/rwkv_lightning,
#       and .peers/wheels/ from `PEERS=1 bash backend-python/bench/fetch_gpu_wheels.sh`; carry
#       [".whl", ".peers"]: with the ~30 MB tree they must stay under the device's 64 MiB, so leave
#       out what the CUDA paths do not use: RWKV-Runner's get-pip.py, rwkv_pip/webgpu and
#       rwkv_pip/cpp, and the py-spy wheel (~24 MB carried in session 25). All three servers fit
#       one 600 s call with short windows: RATES=16 DURATION=8 DRAIN=20 BURST_DRAIN=45 ran in 423 s
#       in session 26 (a peer slower than a window is measured by what it delivered in it).
#       `lightning-batch` is rwkv_lightning through its batch route (the burst as requests of 480
#       prompts); RATES=, runs the burst alone)
# From the repository root, with the wheels of fastapi & co. carried in .whl/ (the GPU image has
# no fastapi). Knobs: SHAPE (7.2b), RATES (4,16,64), BURST (960), DURATION (15), DRAIN (45), BURST_DRAIN (60),
# WEIGHTS (an existing file instead of writing one), ARGS (more side_by_side.py flags).
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/log.txt"
SHAPE=${SHAPE:-7.2b}
# Block 0's value weights too: RWKV-Runner's Albatross does not load a checkpoint without them
# (session 25 lost its run to that); every server ignores their values.
WEIGHTS=${WEIGHTS:-/tmp/weights/rwkv7-$SHAPE-side-by-side.pth}
if [ ! -f "$WEIGHTS" ]; then
  time python3 -m albatross.random_checkpoint --shape "$SHAPE" --dtype fp16 --device cuda \
      --impossible-ids 0,65530-65535 --layer0-value-weights --output "$WEIGHTS" 2>&1 | tee -a "$OUT/log.txt"
fi
rates_for=""
for item in ${RATES_FOR:-}; do rates_for="$rates_for --rates-for $item"; done
timeout "${TIMEOUT:-560}" python3 bench/side_by_side.py --weights "$WEIGHTS" --servers "${SERVERS:-albatross,runner,lightning}" \
    --rates "${RATES:-4,16,64}" --burst "${BURST:-960}" --duration "${DURATION:-15}" --drain "${DRAIN:-45}" \
    --burst-drain "${BURST_DRAIN:-60}" $rates_for \
    --out "$OUT" ${ARGS:-} 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | tail -80
python3 bench/plot_request_rate.py "$OUT/side_by_side.json" --output "$OUT" 2>&1 | tee -a "$OUT/log.txt" \
    || echo "no plots here (matplotlib?): run bench/plot_request_rate.py on the JSON elsewhere" | tee -a "$OUT/log.txt"
