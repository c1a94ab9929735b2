"""Builds and loads our torch binding of FlashInfer's sampling kernels
(flashinfer_sampling.{h,cpp} and flashinfer_sampling_kernels.cu beside this file) with
torch.utils.cpp_extension.load. The FlashInfer headers are not in the repository: they travel in
`.whl-ext/flashinfer-include` (see bench/external_gpu_session.sh). cuRAND's headers come from the
CUDA toolkit, else from `.whl-ext/curand-include`, else from torch's nvidia-curand wheel.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import torch

EXTERNAL_DIR = Path(__file__).resolve().parent
REPO_ROOT = EXTERNAL_DIR.parents[2]
DEFAULT_EXT_ROOT = REPO_ROOT / ".whl-ext"
LIBRARY = "albatross_bench_flashinfer"
SOURCES = ("flashinfer_sampling.cpp", "flashinfer_sampling_kernels.cu")
# torch builds CUDA with half/bf16 operators switched off; FlashInfer's vec_dtypes.cuh needs them.
NVCC_FLAGS = (
    "-O3",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-diag-suppress=177",  # FlashInfer's kernels keep an unused local
)


class FlashinferMissing(RuntimeError):
    """The headers or a build tool are not there: the sampling comparison is skipped."""


def _curand_include(ext_root: Path) -> Path | None:
    """Where curand_kernel.h is; None when the toolkit's own include directory has it."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "include" / "curand_kernel.h").exists():
        return None
    # the carried copy first: it holds cuRAND's headers only, whereas the nvidia wheels' include
    # directory also holds runtime headers that could shadow the toolkit's own
    candidates = [ext_root / "curand-include"]
    try:
        import nvidia  # the namespace package of torch's CUDA runtime wheels

        candidates += [Path(root) / sub / "include" for root in nvidia.__path__ for sub in ("cu13", "curand")]
    except ImportError:
        pass
    for candidate in candidates:
        if (candidate / "curand_kernel.h").exists():
            return candidate
    raise FlashinferMissing(f"curand_kernel.h is neither in CUDA_HOME ({CUDA_HOME}) nor in {', '.join(map(str, candidates))}")


def include_dirs(ext_root: Path = DEFAULT_EXT_ROOT) -> list[Path]:
    headers = ext_root / "flashinfer-include"
    if not (headers / "flashinfer" / "sampling.cuh").exists():
        raise FlashinferMissing(f"no FlashInfer headers at {headers} (carry .whl-ext, see bench/external_gpu_session.sh)")
    curand = _curand_include(ext_root)
    return [headers] if curand is None else [headers, curand]


def load(ext_root: Path = DEFAULT_EXT_ROOT, verbose: bool = False) -> ModuleType:
    """Build (first use; about a minute) or reuse the binding and return its op namespace,
    `torch.ops.albatross_bench_flashinfer`. Two processes may call this at once: torch's build
    lock makes the second wait for the first."""
    from torch.utils import cpp_extension

    if not hasattr(getattr(torch.ops, LIBRARY), "top_p_from_probs"):  # not loaded in this process yet
        if cpp_extension.CUDA_HOME is None or not cpp_extension.is_ninja_available():
            raise FlashinferMissing(f"building the binding needs nvcc (CUDA_HOME={cpp_extension.CUDA_HOME}) and ninja")
        build_dir = Path(os.environ.get("ALBATROSS_BENCH_BUILD", "/tmp/albatross-bench-build")) / LIBRARY
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=LIBRARY,
            sources=[str(EXTERNAL_DIR / source) for source in SOURCES],
            extra_include_paths=[str(path) for path in include_dirs(ext_root)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=list(NVCC_FLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    return getattr(torch.ops, LIBRARY)
