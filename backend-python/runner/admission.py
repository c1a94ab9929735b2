"""Back-pressure: a bounded number of generations in flight; beyond it, 429 with Retry-After.

A backend runs `generation_slots()` generations at once and queues the rest. `Admission` counts
the generations (choices, native rows) of every request from the moment a route accepts it until
its driver closes, and refuses a request that would take the count past the slots plus
`--max-queued-requests` (default `QUEUE_SLOTS_MULTIPLE` times the slots): an unbounded queue let
1,500 requests against 16 slots wait up to minutes for a first byte, all of them slow. A request
arriving while nothing runs is always admitted, so one larger than the limit (up to
--max-batch-items) still runs, alone.

The count lives on the event loop: routes admit and drivers release on it, so it needs no lock.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

from runner.errors import ApiError

QUEUE_SLOTS_MULTIPLE = 4  # default queue: four generations waiting per slot
RETRY_AFTER_S = 1  # a hint; OpenAI clients wait this long, then back off on their own


class QueueFull(ApiError):
    def __init__(self, in_flight: int, rows: int, slots: int, queued: int) -> None:
        super().__init__(
            429,
            f"the server is at capacity: {in_flight} generations are running or queued ({slots} slots "
            f"+ {queued} queued, --max-queued-requests); this request needs {rows} more. Retry later.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class Ticket:
    """A request's place in the count; `release()` gives it back (once, however often called)."""

    __slots__ = ("_admission", "rows", "__weakref__")

    def __init__(self, admission: Admission | None, rows: int) -> None:
        self._admission = admission
        self.rows = rows

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.released(self.rows)

    def release_with(self, owner: object) -> None:
        """Also release when `owner` is garbage collected (a stream whose body never ran)."""
        weakref.finalize(owner, self.release)


@dataclass(slots=True)
class Admission:
    max_queued: int | None = None  # None: QUEUE_SLOTS_MULTIPLE x the backend's slots
    on_idle: Callable[[], None] | None = None  # called when the last generation in flight ends
    in_flight: int = 0
    rejected: int = 0

    def released(self, rows: int) -> None:
        self.in_flight -= rows
        if self.in_flight == 0 and rows and self.on_idle is not None:
            self.on_idle()

    def queue_size(self, slots: int) -> int:
        return QUEUE_SLOTS_MULTIPLE * slots if self.max_queued is None else self.max_queued

    def limit(self, slots: int) -> int:
        return slots + self.queue_size(slots)

    def admit(self, rows: int, slots: int) -> Ticket:
        """A ticket for `rows` generations, or QueueFull (a 429 with Retry-After)."""
        if self.in_flight and self.in_flight + rows > self.limit(slots):
            self.rejected += 1
            raise QueueFull(self.in_flight, rows, slots, self.queue_size(slots))
        self.in_flight += rows
        return Ticket(self, rows)
