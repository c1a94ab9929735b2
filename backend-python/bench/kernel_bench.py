"""What the kernel benchmarks share: the check for a CUDA GPU with the kernel library loaded, the
CUDA-event timing of repeated eager calls, and the best of several rounds of ways that take turns."""

from __future__ import annotations

from collections.abc import Callable

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


def timed_ms(call: Callable[[], object], iters: int) -> float:
    """Mean milliseconds of `call` over `iters` back-to-back calls, between two CUDA events (no
    warm-up: the caller has made one and synchronised)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


ACTIVATION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def fastest_of_rounds(ways: dict[str, Callable[[], object]], iters: int, rounds: int) -> dict[str, float]:
    """Microseconds a call of each way: one untimed call of each first (Triton builds each shape
    once), then `rounds` turns in which every way runs `iters` calls; each keeps its fastest turn,
    so a clock drift during the run favours none."""
    for call in ways.values():
        call()
    torch.cuda.synchronize()
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, call in ways.items():
            best[name] = min(best.get(name, float("inf")), 1e3 * timed_ms(call, iters))
    return best


def fastest(times: dict[str, float]) -> tuple[str, float]:
    """The name and time of the fastest entry."""
    name = min(times, key=times.__getitem__)
    return name, times[name]


def event_ms(call: Callable[[], object], iters: int) -> float:
    """`timed_ms` after one untimed warm-up call (kernel loading, Triton compiles) has finished."""
    call()
    torch.cuda.synchronize()
    return timed_ms(call, iters)
