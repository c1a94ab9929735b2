"""Which worker takes a task (plain Python, no device calls).

Without affinity, the live worker with the fewest tasks (waiting + running; the lowest index on a
tie). With per-worker prefix caches (worker processes keep their own), a task that uses the prefix
cache and is longer than one prefix block carries an affinity key, the hash of its first block: the
workers are ranked for that key by rendezvous hashing, and the first whose load stays within
`AFFINITY_SLACK` times the even share takes it. So the turns of one conversation, and prompts that
share a long system prompt, meet the cache that holds their prefix, while a popular prefix spills
over to the next workers of its ranking instead of piling onto one (consistent hashing with
bounded loads). When a worker is down its keys move to their next-ranked worker, and only those.

Session states need no affinity: they live in the server's store, and a turn's state moves to
whichever worker runs it (docs/engine.md, "Worker processes").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, TypeVar

from albatross_engine.state_store import PREFIX_BOUNDARY_TOKENS

AFFINITY_SLACK = 1.25


class Placeable(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def load(self) -> int: ...


W = TypeVar("W", bound="Placeable")


def affinity_key(prompt_tokens: Sequence[int], use_prefix_cache: bool) -> int | None:
    """The key of a prompt that can hit a prefix state beyond its first block, else None."""
    if not use_prefix_cache or len(prompt_tokens) <= PREFIX_BOUNDARY_TOKENS:
        return None
    return hash(tuple(prompt_tokens[:PREFIX_BOUNDARY_TOKENS]))  # ints hash the same in every process and run


def placement_order(workers: Sequence[W], key: int | None) -> list[W]:
    """The live workers in the order to try them (the first that accepts takes the task)."""
    by_load = sorted(workers, key=lambda w: (w.load, w.index))
    if key is None or len(workers) < 2:
        return by_load
    bound = math.ceil(AFFINITY_SLACK * (sum(w.load for w in workers) + 1) / len(workers))
    ranked = sorted(workers, key=lambda w: hash((key, w.index)), reverse=True)
    within = [w for w in ranked if w.load < bound]
    return within + [w for w in by_load if w not in within]
