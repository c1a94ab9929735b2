#!/usr/bin/env bash
# Two ways to use several GPUs of one machine.
set -euo pipefail
MODEL=${MODEL:?set MODEL=/path/to/rwkv7-model.pth}

case "${1:-one-process}" in
  one-process)
    # One process, one worker thread per GPU; a single port and a single state cache.
    exec python backend-python/main.py --model-path "$MODEL" \
        --strategy "albatross workers=$(nvidia-smi -L | wc -l) batch=256" --port 8000
    ;;
  per-gpu)
    # One process per GPU on consecutive ports, each with its own state database; put
    # nginx-multi-replica.conf in front of them.
    n=$(nvidia-smi -L | wc -l)
    for ((i = 0; i < n; i++)); do
      CUDA_VISIBLE_DEVICES=$i python backend-python/main.py --model-path "$MODEL" \
          --strategy "albatross workers=1 batch=256" --port $((8000 + i)) \
          --state-cache-path "$HOME/.local/share/rwkv-albatross/states-gpu$i.sqlite3" &
    done
    wait
    ;;
  *)
    echo "usage: $0 [one-process|per-gpu]" >&2
    exit 2
    ;;
esac
