"""Giving freed heap memory back to the operating system.

What looked like a leak under disconnect storms (RSS +135 to +250 MiB per 600 aborted streams, not
back after a model switch) is two things, measured with tracemalloc snapshots between storms:
Python objects grew by ~2 MB over three storms, while RSS grew by hundreds of MiB. One part is the
prefix cache filling its budget (every prefilled prompt, also of an aborted stream, leaves its
state: 34-68 KB a prompt on the tiny test models, bounded by --state-l1-bytes and
--state-l2-bytes, which on a CPU device are both host memory). The rest is glibc keeping freed
memory in its arenas: `malloc_trim(0)` after a storm returned 130-230 MiB at once, and with it RSS
stayed flat from storm to storm (docs/deployment.md, "Memory").

So the server trims the heap when the last running request finishes (`IdleTrim`, at most once per
`IDLE_TRIM_INTERVAL_S`, in a thread) and after a backend shut down (runner.model_manager). On a
libc without `malloc_trim` (musl, macOS) both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("runner.heap")

IDLE_TRIM_INTERVAL_S = 1.0  # a trim walks the heap (milliseconds per GiB); never more often than this


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_TRIM = _malloc_trim()


def trim() -> bool:
    """Return the free memory at the top of every glibc arena to the OS; False where unsupported."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


@dataclass(slots=True)
class IdleTrim:
    """Called when no request is in flight any more; trims in a worker thread."""

    trims: int = 0
    last_trim_at: float = float("-inf")
    _running: bool = False

    def __call__(self) -> None:
        if _TRIM is None or self._running or time.monotonic() - self.last_trim_at < IDLE_TRIM_INTERVAL_S:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # released outside the event loop (a finalizer at exit): nothing to schedule on
        self._running = True
        loop.run_in_executor(None, self._trim)

    def _trim(self) -> None:
        try:
            trim()
            self.trims += 1
        except Exception:  # a failed trim costs memory, never a request
            log.exception("malloc_trim failed")
        finally:
            self.last_trim_at = time.monotonic()
            self._running = False
