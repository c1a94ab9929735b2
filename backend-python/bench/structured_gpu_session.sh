#!/usr/bin/env bash
# One device call for constrained decoding (issue 13): the sampler kernel with masks and biases
# (a JIT build for this GPU when the committed binary predates the source), the cuda-marked
# constraint and sampler tests, the structured benchmark (7.2B random weights, batch 960, 0% / 10% /
# 100% of the requests under a JSON schema), the same 100% run with the Python tokenizer encoding
# forced text (ALBATROSS_GRAMMAR_ENCODER=python, the A/B of albatross/grammar_vocabulary.py), mask
# filling on this machine's CPUs (bench/mask_scaling.py, also beside a busy Python thread) and the
# host-overhead simulation. Everything lands in $OUT (log.txt, tests.log, structured.json,
# structured_python.json). The defaults (tests, benchmark, A/B; the benchmark took 45 s in session 5) fit one call;
# the CPU-side measurements are a second one: TESTS=0 BENCH=0 AB=0 MASKS=1 HOST=1.
#   bash backend-python/bench/structured_gpu_session.sh      (from the repository root; .whl/ carried)
# Knobs: TESTS=0, BENCH=0, AB=0, MASKS=1, HOST=1, SLICES=1 (one more 100% run with
# ALBATROSS_GRAMMAR_SLICES=fine), SHAPE (7.2b), BATCH (960), TEST_TIMEOUT (240), BENCH_TIMEOUT (240).
set -uo pipefail
. "$(dirname "$0")/session_start.sh"  # root, $OUT, carried wheels, then backend-python/
export ALBATROSS_KERNEL_CACHE=${ALBATROSS_KERNEL_CACHE:-/tmp/albatross-build-cache}
log="$OUT/log.txt"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, sys, os; print('torch', torch.__version__, 'python', sys.version.split()[0], 'cpus', os.cpu_count())"
  python3 -c "import numba, llguidance; print('numba', numba.__version__, 'llguidance', llguidance.__version__)"
  echo "== kernels (the committed binaries; JIT-built for this GPU only where one is stale or missing)"
  timeout 300 python3 -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s %(message)s')
from albatross import cuda_ops, ops
results = cuda_ops.enable_cuda_kernels()
print({name: result.how for name, result in results.items()}, 'CUDA ops:', ops.registered_cuda_ops())
assert 'sample' in ops.registered_cuda_ops(), 'no sampler kernel'
"
} 2>&1 | tee -a "$log"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== cuda tests: masks and biases, the sampler kernel, the engine on the GPU" | tee -a "$log"
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m cuda --durations=5 \
      tests/test_sampler_constraints.py tests/test_structured_engine.py tests/test_cuda_kernels.py tests/test_engine_cuda.py \
      tests/test_grammar_vocabulary.py tests/test_constraints.py \
      2>&1 | tee "$OUT/tests.log" | tail -25 | tee -a "$log"
fi

if [ "${BENCH:-1}" = 1 ]; then
  echo "== structured benchmark" | tee -a "$log"
  timeout "${BENCH_TIMEOUT:-240}" python3 bench/structured_benchmark.py --shape "${SHAPE:-7.2b}" --batch "${BATCH:-960}" \
      --json "$OUT/structured.json" 2>&1 | tee -a "$log" | tail -12
fi

if [ "${AB:-1}" = 1 ]; then
  echo "== structured benchmark, 100% constrained, the Python tokenizer encoding forced text" | tee -a "$log"
  ALBATROSS_GRAMMAR_ENCODER=python timeout "${BENCH_TIMEOUT:-240}" python3 bench/structured_benchmark.py --shape "${SHAPE:-7.2b}" \
      --batch "${BATCH:-960}" --fractions 0,1 --schemas 1 --json "$OUT/structured_python.json" 2>&1 | tee -a "$log" | tail -6
fi

if [ "${SLICES:-0}" = 1 ]; then
  echo "== structured benchmark, 100% constrained, llguidance's finer string slices" | tee -a "$log"
  ALBATROSS_GRAMMAR_SLICES=fine timeout "${BENCH_TIMEOUT:-240}" python3 bench/structured_benchmark.py --shape "${SHAPE:-7.2b}" \
      --batch "${BATCH:-960}" --fractions 0,1 --schemas 1 --json "$OUT/structured_fine.json" 2>&1 | tee -a "$log" | tail -6
fi

if [ "${MASKS:-0}" = 1 ]; then
  echo "== mask filling on this machine's CPUs, 960 matchers" | tee -a "$log"
  timeout 240 python3 bench/mask_scaling.py --matchers 960 --steps 30 --threads 1,4,12 --vocabulary native 2>&1 | tee -a "$log"
  timeout 200 python3 bench/mask_scaling.py --matchers 960 --steps 10 --threads 12 --busy 2>&1 | tee -a "$log"
fi

if [ "${HOST:-0}" = 1 ]; then
  for fraction in 0.1 1.0; do
    echo "== host overhead, simulated H200 steps, $fraction constrained, this machine's CPUs" | tee -a "$log"
    timeout 150 python3 bench/host_overhead.py --constrained "$fraction" 2>&1 | tee -a "$log" | tail -3
  done
fi
