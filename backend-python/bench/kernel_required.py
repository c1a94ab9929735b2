"""What a kernel benchmark checks first: a CUDA GPU, and its kernel library loaded."""

from __future__ import annotations

import torch

from albatross import cuda_ops


def require_kernel(script: str, library: str, what: str) -> str:
    """Exit with one message unless a CUDA GPU is here and `library`'s kernels loaded (prebuilt
    or JIT-built); returns how it loaded, for the log."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    loaded = cuda_ops.enable_cuda_kernels()[library]
    if loaded.how not in ("prebuilt", "jit"):
        raise SystemExit(f"the {what} kernel did not load: {loaded.describe()}")
    return loaded.describe()
