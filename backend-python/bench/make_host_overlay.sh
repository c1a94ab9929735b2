#!/usr/bin/env bash
# Writes a side for host_ab_gpu_session.sh: the given backend-python/ files as they are at a
# commit, laid out under DIR as under backend-python/ (the device's copy has no git history).
#   bash backend-python/bench/make_host_overlay.sh gpu_scratch/overlays/base 6d1b1a9^ albatross_engine/worker.py runner/jobs.py
# DIR must be ignored (gpu_scratch/ is) and carried. Only the named files change on that side, so
# name every file the change touched that the rest of today's tree still imports compatibly.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 DIR COMMIT FILE..." >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
dir=$1 commit=$2
shift 2
for file in "$@"; do
  mkdir -p "$dir/$(dirname "$file")"
  git show "$commit:backend-python/$file" >"$dir/$file"
  echo "$dir/$file: backend-python/$file at $(git rev-parse --short "$commit")"
done
