"""The switch that turns the CUDA kernels on: `enable_cuda_kernels()` loads every kernel library
once per process (kernel_loader's order: prebuilt binary, JIT build, none). A loaded library
registers its CUDA kernels for the ops declared in `albatross.ops`, so from then on those ops run
the kernels on CUDA tensors; without a GPU nothing is loaded and the torch twins run.
"""

from __future__ import annotations

from pathlib import Path

from albatross import kernel_loader

_enabled: dict[str, kernel_loader.LoadResult] | None = None


def enable_cuda_kernels(
    manifest_path: Path = kernel_loader.DEFAULT_MANIFEST, allow_jit: bool = True
) -> dict[str, kernel_loader.LoadResult]:
    """Load the kernel libraries once per process; returns how each was loaded (logged once each)."""
    global _enabled
    if _enabled is None:
        _enabled = kernel_loader.load_kernels(manifest_path=manifest_path, allow_jit=allow_jit)
    return _enabled
