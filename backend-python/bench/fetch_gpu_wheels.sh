#!/usr/bin/env bash
# Download the wheels of gpu_wheels.txt for the GPU image (CPython 3.12, x86_64 manylinux) into
# .whl/ at the repository root (git-ignored), without their dependencies: the list is the closure.
set -euo pipefail
cd "$(dirname "$0")/../.."
platforms=(--platform manylinux2014_x86_64 --platform any)
for n in 5 17 24 26 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl -r <(grep -v '^#' backend-python/bench/gpu_wheels.txt)
if [ "${COMPARE:-0}" = 1 ]; then  # the int8 comparison libraries of gpu_compare_wheels.txt
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d .whl "$(grep '^torchao==' backend-python/bench/gpu_compare_wheels.txt)"
  python3 -m pip wheel -q --no-deps -w .whl "$(grep '^gemlite==' backend-python/bench/gpu_compare_wheels.txt)"  # an sdist only
fi
if [ "${PEERS:-0}" = 1 ]; then  # the side-by-side peers' own needs (gpu_peer_wheels.txt), beside their checkouts
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d .peers/wheels -r <(grep -v '^#' backend-python/bench/gpu_peer_wheels.txt)
fi
ls .whl | wc -l
