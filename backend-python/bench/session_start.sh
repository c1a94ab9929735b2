# Sourced by the GPU session scripts that share it (engine, side_by_side, structured, workers):
# into the repository root whatever the caller's directory, $OUT (default /tmp/out) made, the
# wheels of .whl/ installed if carried (carried_wheels.sh), then into backend-python/ with Python
# unbuffered and the rwkv package's RWKV-7 switch on. Its own path, not $0, finds the root: sourced
# from `bash -c` in a device call, $0 is "bash" (session 12 lost a call to that).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. backend-python/bench/carried_wheels.sh
cd backend-python
export PYTHONUNBUFFERED=1 RWKV_V7_ON=1
