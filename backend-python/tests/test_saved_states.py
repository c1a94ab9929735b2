"""albatross_engine/saved_states.py: starting states from the store, and which states are saved."""

from __future__ import annotations

import pytest

from albatross_engine.metrics import WorkerMetrics
from albatross_engine.saved_states import SavedStates
from albatross_engine.scheduler import Row, RowKind
from albatross_engine.state_store import PROMPT_HEAD_TOKENS, DictStateStore, PrefixHasher, PromptEndIndex, prefix_key
from albatross_engine.tasks import EngineTask, SyncChannel
from engine_helpers import RecordingDeviceStep
from runner.interface import BackendError, SamplingParams


def make_task(prompt_len: int, slot: int = 0, **fields: object) -> EngineTask:
    task = EngineTask(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), seed=1, channel=SyncChannel(), **fields)  # type: ignore[arg-type]
    task.slot = slot
    return task


def make(store: DictStateStore | None = None) -> tuple[SavedStates, RecordingDeviceStep, WorkerMetrics]:
    device, metrics = RecordingDeviceStep(), WorkerMetrics()
    return SavedStates(device, metrics, PromptEndIndex(), store), device, metrics  # type: ignore[arg-type]


def test_a_forked_hasher_gives_a_fresh_hashers_keys_and_goes_on_alone() -> None:
    tokens, salt = list(range(1, 3 * PROMPT_HEAD_TOKENS)), b"initial-state:abc\n"
    hasher = PrefixHasher(tokens, salt)
    hasher.key_at(PROMPT_HEAD_TOKENS + 3)
    fork = hasher.fork()
    assert fork.head == hasher.head == PrefixHasher(tokens, salt).head is not None
    assert fork.key_at(2 * PROMPT_HEAD_TOKENS) == PrefixHasher(tokens, salt).key_at(2 * PROMPT_HEAD_TOKENS)
    assert hasher.length == PROMPT_HEAD_TOKENS + 3  # the fork's hashing did not move the original
    assert hasher.key_at(PROMPT_HEAD_TOKENS + 5) == PrefixHasher(tokens, salt).key_at(PROMPT_HEAD_TOKENS + 5)


def test_a_session_state_is_written_into_the_tasks_slot() -> None:
    store = DictStateStore()
    store.put("chat", "saved conversation")  # type: ignore[arg-type]
    saved, device, _ = make(store)
    saved.prepare(make_task(3, slot=2, load_key="chat"))
    assert device.states == {2: "saved conversation"}


@pytest.mark.parametrize("store", [DictStateStore(), None], ids=["missing key", "no store"])
def test_a_missing_session_state_is_404(store: DictStateStore | None) -> None:
    saved, device, _ = make(store)
    with pytest.raises(BackendError) as raised:
        saved.prepare(make_task(3, load_key="gone"))
    assert raised.value.status_code == 404 and device.states == {}


def test_the_longest_cached_prefix_below_the_prompt_wins_and_is_skipped() -> None:
    store = DictStateStore()
    task = make_task(600, use_prefix_cache=True)
    store.put(prefix_key(task.prompt_tokens[:256]), "after 256")  # type: ignore[arg-type]
    store.put(prefix_key(task.prompt_tokens[:512]), "after 512")  # type: ignore[arg-type]
    saved, device, metrics = make(store)
    saved.prepare(task)
    assert device.states == {0: "after 512"}
    assert (task.prompt_pos, task.cached_prompt_tokens) == (512, 512)
    snapshot = metrics.snapshot()
    assert (snapshot.prefix_cache_hits, snapshot.cached_prompt_tokens_total) == (1, 512)


def test_a_saved_prompt_end_is_looked_up_and_a_whole_prompt_hit_is_not_used() -> None:
    store = DictStateStore()
    task = make_task(300, use_prefix_cache=True)
    store.put(prefix_key(task.prompt_tokens[:290]), "after 290")  # type: ignore[arg-type]
    store.put(prefix_key(task.prompt_tokens), "after all 300")  # type: ignore[arg-type]
    saved, device, _ = make(store)
    head = prefix_key(task.prompt_tokens[:PROMPT_HEAD_TOKENS])
    saved.prompt_ends.add(head, 290)
    saved.prompt_ends.add(head, 300)
    saved.prepare(task)
    assert device.states == {0: "after 290"} and task.prompt_pos == 290


class CountingStore(DictStateStore):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def contains(self, key: str) -> bool:
        self.asked.append(key)
        return super().contains(key)


def test_only_the_ends_of_prompts_that_start_alike_are_looked_up() -> None:
    """A burst of unrelated prompts: each admission asks the store about its own boundaries and
    the ends of prompts sharing its head (plus the few shorter than a head), not every end saved."""
    store = CountingStore()
    saved, device, _ = make(store)
    for n, length in enumerate(range(200, 400, 2)):  # 100 unrelated prompts' ends, saved
        other = EngineTask([1000 + n, *range(2, length + 1)], SamplingParams(max_tokens=4), seed=1, channel=SyncChannel(), use_prefix_cache=True)  # type: ignore[arg-type]
        saved.prepare(other)
        saved.save_prefix_state(other, length, "an unrelated end")  # type: ignore[arg-type]
    for length in (5, 9):  # short prompts' ends: any prompt may extend them
        short = make_task(length, use_prefix_cache=True)
        saved.prepare(short)
        saved.save_prefix_state(short, length, f"after {length}")  # type: ignore[arg-type]
    earlier = make_task(300, use_prefix_cache=True)  # a conversation's previous turn
    saved.prepare(earlier)
    saved.save_prefix_state(earlier, 300, "after 300")  # type: ignore[arg-type]
    store.asked.clear()
    task = make_task(700, use_prefix_cache=True)
    saved.prepare(task)
    assert device.states[0] == "after 300" and task.prompt_pos == 300
    assert store.asked == [prefix_key(task.prompt_tokens[:n]) for n in (512, 300)], "a boundary, then this head's end (a hit)"
    store.asked.clear()
    other_head = EngineTask([*range(1, 10), *range(5000, 5100)], SamplingParams(max_tokens=4), seed=1, channel=SyncChannel(), slot=1, use_prefix_cache=True)  # type: ignore[arg-type]
    saved.prepare(other_head)
    assert device.states[1] == "after 9" and store.asked == [prefix_key(other_head.prompt_tokens[:9])], "a short end, whatever the head"


def test_an_end_is_indexed_under_its_head_and_a_short_end_under_none() -> None:
    ends = PromptEndIndex(capacity=3)
    ends.add("head-a", 40)
    ends.add(None, 7)
    ends.add("head-b", 50)
    assert sorted(ends.below("head-a", 1000)) == [7, 40] and sorted(ends.below("head-b", 45)) == [7]
    assert ends.below(None, 5) == [], "a short end serves longer prompts only"
    ends.add("head-b", 60)  # over capacity: the oldest entry (head-a's 40) goes
    assert sorted(ends.below("head-a", 1000)) == [7] and sorted(ends.below("head-b", 1000)) == [7, 50, 60]
    with pytest.raises(ValueError):
        ends.add(None, PROMPT_HEAD_TOKENS)
    with pytest.raises(ValueError):
        ends.add("head-a", PROMPT_HEAD_TOKENS - 1)


def test_no_cached_prefix_is_a_counted_miss_from_a_zero_state() -> None:
    saved, device, metrics = make(DictStateStore())
    task = make_task(600, use_prefix_cache=True)
    saved.prepare(task)
    assert device.states == {} and task.prompt_pos == 0 and metrics.snapshot().prefix_cache_misses == 1


def test_a_prefix_checkpoint_is_saved_once_under_its_key_and_a_prompt_end_is_remembered() -> None:
    store = DictStateStore()
    saved, device, metrics = make(store)
    task = make_task(300, slot=1, use_prefix_cache=True)
    task.prefix_hasher = PrefixHasher(task.prompt_tokens)
    device.states[1] = "after 256"
    saved.save_prefix(Row(task, 1, RowKind.PREFILL, start=0, stop=256))
    device.states[1] = "after 300"
    saved.save_prefix(Row(task, 1, RowKind.PREFILL, start=256, stop=300))
    assert store.get(prefix_key(task.prompt_tokens[:256])) == "after 256"
    assert store.get(prefix_key(task.prompt_tokens)) == "after 300"
    assert saved.prompt_ends.below(prefix_key(task.prompt_tokens[:PROMPT_HEAD_TOKENS]), 1000) == [300], "only a prompt's end is a length worth remembering"
    assert metrics.snapshot().state_saves == 2


class FailingStore(DictStateStore):
    def put(self, key: str, state: object) -> None:  # type: ignore[override]
        raise OSError("disk full")


def test_a_failing_prefix_save_costs_the_cache_entry_not_the_request() -> None:
    saved, _, metrics = make(FailingStore())
    task = make_task(256, use_prefix_cache=True)
    task.prefix_hasher = PrefixHasher(task.prompt_tokens)
    saved.save_prefix(Row(task, 0, RowKind.PREFILL, start=0, stop=256))  # does not raise
    assert metrics.snapshot().state_saves == 0


def test_a_final_state_is_saved_under_the_save_key_and_failures_raise() -> None:
    store = DictStateStore()
    saved, device, metrics = make(store)
    device.states[3] = "final"
    saved.save_final(make_task(2, slot=3, save_key="chat"))
    assert store.get("chat") == "final" and metrics.snapshot().state_saves == 1
    with pytest.raises(BackendError, match="no state cache"):
        make(None)[0].save_final(make_task(2, save_key="chat"))
    with pytest.raises(OSError, match="disk full"):
        make(FailingStore())[0].save_final(make_task(2, save_key="chat"))
