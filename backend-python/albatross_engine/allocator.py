"""The one setting the engine makes to PyTorch's CUDA caching allocator: expandable segments.

Without them, the allocator keeps fixed-size segments, and a workload that alternates between a
large prefill's activations and small decode steps leaves freed blocks it cannot reuse or give
back: on the H200, a 0.4B engine with 8,192-token prefill steps reserved 2.21-2.28 GB at peak for
1.90 GB allocated, past the memory plan's 2.07 GB (docs/performance.md). Expandable segments map
and unmap pages inside one growing range instead, so reserved memory follows what is allocated;
torch supports them with CUDA graphs' private pools. A user's own allocator configuration
(`PYTORCH_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF`) is left exactly as it is.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_done = False
_lock = threading.Lock()


def use_expandable_segments() -> bool:
    """Turn expandable segments on for this process's CUDA allocator (once); False where the
    user configured the allocator, or this torch cannot."""
    global _done
    with _lock:
        if _done:
            return True
        if any(os.environ.get(name) for name in ALLOCATOR_ENV):
            logger.info("CUDA allocator: leaving the configuration in the environment as it is")
            return False
        # Newer torch spells the setter on the accelerator module (the cuda one is deprecated there).
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        try:
            setter("expandable_segments:True")
        except (AttributeError, RuntimeError) as error:  # a private API: a torch without it keeps its default
            logger.warning("CUDA allocator: expandable segments unavailable (%s)", error)
            return False
        _done = True
        return True
