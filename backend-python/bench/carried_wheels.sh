# Sourced (from the repository root) by the GPU session scripts: the wheels a call carries in .whl/
# (gpu_wheels.txt, and gpu_compare_wheels.txt's when fetched) go into /tmp/site, which goes on
# PYTHONPATH; without .whl/ nothing happens (an image that has them all).
# .peers/wheels/ (the peers' own needs, .peers/README-session.txt) go in with them when .peers is carried.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl $(ls .peers/wheels/*.whl 2>/dev/null) && export PYTHONPATH=/tmp/site
fi
