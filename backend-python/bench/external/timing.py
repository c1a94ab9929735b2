"""GPU timing for bench_external: CUDA events around repeated eager calls.

The time per call includes the host side of each call (Python wrappers, launches), as an eager
caller pays it; a call that is launch-bound shows that honestly instead of hiding it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from kernel_bench import timed_ms  # bench/, on the path of every script that imports this


def cuda_ms(fn: Callable[[], object], target_ms: float = 200.0, max_reps: int = 50, warmup: int = 2) -> float:
    """Mean milliseconds per call of `fn`: `warmup` untimed calls, one timed call to size the run,
    then as many calls as fit in about `target_ms` (3 to `max_reps`)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    once = timed_ms(fn, 1)
    reps = max(3, min(max_reps, int(target_ms / max(once, 1e-3))))
    return timed_ms(fn, reps)


class Deadline:
    """A wall-clock budget shared by the parts, so a slow first compile cannot push the whole
    device call past its limit: later items are skipped with a line saying so."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def passed(self) -> bool:
        return self.left() <= 0
