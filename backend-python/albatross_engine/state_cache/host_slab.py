"""L2's memory when L1 is on a GPU: one page-locked arena, cut into equal slots of one state each.

Demoting a state from the GPU to host memory must never make the engine's thread wait or allocate.
Page-locking memory is slow (milliseconds per state at 7.2B) and torch's pinned allocator rounds
every block up to a power of two, so allocating per demotion both stalled the worker while L2 filled
and could pin up to twice the `--state-l2-bytes` budget. The arena is allocated and page-locked once,
on a background thread; until it is ready, or when every slot is taken, a demotion finds no slot and
the cache drops the entry instead of waiting (a prefix state is recomputable, a session state is on
disk). The first state sets the slot size; a larger one later gets no slot.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from albatross_engine.state_cache.records import SerializableState, StateT, tensor_fields

logger = logging.getLogger(__name__)

_ALIGN = 256  # bytes: every tensor view starts on a boundary any dtype accepts


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class HostSlab:
    def __init__(self, capacity_bytes: int, pin: bool = True) -> None:
        self.capacity_bytes = capacity_bytes
        self._pin = pin
        self._lock = threading.Lock()
        self._arena: torch.Tensor | None = None
        self._slot_bytes = 0
        self._free: list[int] = []
        self._thread = threading.Thread(target=self._allocate, name="state-cache-slab", daemon=True)
        self._thread.start()

    def _allocate(self) -> None:
        try:
            arena = torch.empty(self.capacity_bytes, dtype=torch.uint8)
            if self._pin:
                # cudaHostRegister locks exactly these bytes (torch's pinned allocator would round up).
                status = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
                if int(status) != 0:
                    raise RuntimeError(f"cudaHostRegister returned {status}")
        except Exception:  # no arena: demotions find no slot and the cache drops instead
            logger.exception("state cache: could not page-lock %d bytes for L2; GPU states will not be kept in host memory", self.capacity_bytes)
            return
        with self._lock:
            self._arena = arena

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self._arena is not None

    def fits(self, state: SerializableState) -> bool:
        """Whether `state` can ever get a slot (the arena is ready and the state not too large)."""
        with self._lock:
            return self._arena is not None and (self._slot_bytes == 0 or self._slot_size(state) <= self._slot_bytes)

    def take(self, state: SerializableState) -> int | None:
        """A free slot for `state`, or None (not allocated yet, all taken, or the state too large)."""
        needed = self._slot_size(state)
        with self._lock:
            if self._arena is None:
                return None
            if self._slot_bytes == 0:
                self._slot_bytes = needed
                self._free = list(range(self.capacity_bytes // needed - 1, -1, -1))
            if needed > self._slot_bytes or not self._free:
                return None
            return self._free.pop()

    def give_back(self, slot: int) -> None:
        """The slot's entry left L2. Copies out of it run on the current stream and copies into it
        on the copy stream after all the current stream's work issued so far (records.copy_into),
        so the next state copied into it lands after them; the host side must no longer read it."""
        with self._lock:
            self._free.append(slot)

    def view(self, slot: int, like: StateT) -> StateT:
        """`like`'s tensors laid out in `slot` of the arena (shapes and dtypes of `like`)."""
        assert self._arena is not None
        offset = slot * self._slot_bytes
        views = {}
        for name, tensor in tensor_fields(like).items():
            nbytes = tensor.numel() * tensor.element_size()
            views[name] = self._arena[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            offset += _aligned(nbytes)
        return dataclasses.replace(like, **views)

    def close(self) -> None:
        self._thread.join()
        with self._lock:
            arena, self._arena, self._free = self._arena, None, []
            if arena is not None and self._pin:
                torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())

    @staticmethod
    def _slot_size(state: SerializableState) -> int:
        return sum(_aligned(t.numel() * t.element_size()) for t in tensor_fields(state).values())
