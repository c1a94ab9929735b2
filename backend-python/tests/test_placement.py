"""Placement (plain Python): the least-loaded worker without affinity; with an affinity key, the
same worker for the same key while its load stays within the bound, the next-ranked one beyond it,
and only a dead worker's keys move when it is gone."""

from __future__ import annotations

import random
from dataclasses import dataclass

from albatross_engine.placement import affinity_key, placement_order
from albatross_engine.state_store import PREFIX_BOUNDARY_TOKENS


@dataclass
class FakeWorker:
    index: int
    load: int = 0


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 65530) for _ in range(length)]


def test_without_a_key_the_least_loaded_worker_comes_first_and_ties_go_to_the_lowest_index() -> None:
    workers = [FakeWorker(0, 3), FakeWorker(1, 1), FakeWorker(2, 1), FakeWorker(3, 2)]
    assert [w.index for w in placement_order(workers, None)] == [1, 2, 3, 0]


def test_only_prompts_longer_than_one_block_that_use_the_prefix_cache_have_a_key() -> None:
    rng = random.Random(1)
    long = prompt(rng, PREFIX_BOUNDARY_TOKENS + 1)
    assert affinity_key(long, use_prefix_cache=True) is not None
    assert affinity_key(long, use_prefix_cache=False) is None
    assert affinity_key(long[:PREFIX_BOUNDARY_TOKENS], use_prefix_cache=True) is None, "nothing past the first block to reuse"
    extended = long + prompt(rng, 300)
    assert affinity_key(extended, True) == affinity_key(long, True), "a conversation's next turn keeps its key"


def test_a_key_goes_to_the_same_worker_while_it_is_within_its_share() -> None:
    workers = [FakeWorker(i) for i in range(4)]
    key = affinity_key(prompt(random.Random(2), 400), True)
    chosen = placement_order(workers, key)[0]
    for load in range(3):
        for worker in workers:
            worker.load = load
        assert placement_order(workers, key)[0] is chosen, f"the key moved at an even load of {load}"


def test_a_key_whose_worker_is_over_the_bound_spills_to_its_next_ranked_worker() -> None:
    workers = [FakeWorker(i) for i in range(4)]
    key = affinity_key(prompt(random.Random(3), 400), True)
    ranking = placement_order(workers, key)
    first, second = ranking[0], ranking[1]
    first.load = 10  # the others idle: its share is ceil(1.25 * 11 / 4) = 4
    order = placement_order(workers, key)
    assert order[0] is second, "an overloaded worker passes the key on to the next in the key's ranking"
    assert order[-1] is first, "it is still tried, last"


def test_keys_spread_over_the_workers_and_a_dead_workers_keys_are_the_only_ones_that_move() -> None:
    rng = random.Random(4)
    keys = [affinity_key(prompt(rng, 300), True) for _ in range(400)]
    workers = [FakeWorker(i) for i in range(4)]
    homes = {key: placement_order(workers, key)[0].index for key in keys}
    counts = [list(homes.values()).count(i) for i in range(4)]
    assert min(counts) > 60, f"keys spread over the workers: {counts}"
    survivors = [w for w in workers if w.index != 2]
    moved = [key for key in keys if homes[key] != 2 and placement_order(survivors, key)[0].index != homes[key]]
    assert moved == [], "keys of live workers stayed where they were"
