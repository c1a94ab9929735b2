#!/usr/bin/env bash
# One device call for issue #3: our WKV op and sampler against flash-linear-attention's Triton
# RWKV-7 kernels and FlashInfer's sampling kernels (bench/bench_external.py); about 3-4 minutes.
# Run from the repository root with .whl-ext carried (it is git-ignored, never committed):
#   .whl-ext/fla_core-*.whl           flash-linear-attention's ops (needs torch, triton, einops)
#   .whl-ext/flashinfer-include/      FlashInfer's sampling headers (built into our binding)
#   .whl-ext/curand-include/          cuRAND headers, used only when the toolkit lacks them
#     bash backend-python/bench/external_gpu_session.sh
# Results land under $OUT: external.json (rewritten after every row), external.log, build and
# warm-up logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl-ext/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ext/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-8}
export ALBATROSS_KERNEL_CACHE=${ALBATROSS_KERNEL_CACHE:-/tmp/albatross-build-cache}
export ALBATROSS_BENCH_BUILD=${ALBATROSS_BENCH_BUILD:-/tmp/albatross-bench-build}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
cd backend-python
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)" 2>&1 | tail -1
} | tee "$OUT/gpu.txt"

# Everything that compiles runs at once, in the background: our kernels (only when manifest.json's
# binaries are stale), the FlashInfer binding (needed by the sampling part, after the wkv part),
# and one process per fla kernel whose Triton autotuning fills Triton's disk cache. The timed run
# starts when the autotuning is done, so nothing else competes for the GPU while it measures.
bench=bench/bench_external.py
timeout 300 python3 $bench --prebuild ours >"$OUT/prebuild_ours.log" 2>&1 &
builds=($!)
timeout 300 python3 $bench --prebuild flashinfer >"$OUT/prebuild_flashinfer.log" 2>&1 &
builds+=($!)
warmers=()
for kernel in ${FLA_KERNELS:-chunk recurrent mul_recurrent}; do
  timeout "${WARM_TIMEOUT:-200}" python3 $bench --warm-fla "$kernel" >"$OUT/warm_$kernel.log" 2>&1 &
  warmers+=($!)
done
wait "${warmers[@]}"
tail -n 4 "$OUT"/warm_*.log

timeout "${BENCH_TIMEOUT:-240}" python3 $bench --json "$OUT/external.json" ${BENCH_ARGS:-} 2>&1 |
  tee "$OUT/external.log" | grep -v -E "^\{'impl'"
wait "${builds[@]}"
tail -n 3 "$OUT/prebuild_ours.log" "$OUT/prebuild_flashinfer.log"
