"""Which tasks hold state slots, and what each step feeds the model. Plain Python, no torch.

Policy (one screen):
- Admission is first come, first served into the lowest free slot.
- Every step, each running task that has a sampled token not yet fed gets one row: DECODE (feed
  it and sample the next) while it may still sample, else FEED (feed only, so that a saved final
  state has consumed every generated token). Decoding never waits for prefill.
- Prompts are then fed in chunks within the step's `PrefillBudget`, by default the fewest prompt
  tokens left first (`prefill_order="shortest"`, below; "arrival": oldest admission first)
  (albatross_engine/prefill_budget.py): statically `prefill_budget` tokens per step in all; with
  an inter-token target, as many prompt tokens as keep the decode rows' step under it (learned
  from the measured step times the worker reports through `observe_step`). Each task takes at most
  `prefill_chunk` tokens or an equal share of what is left, when larger: many prompts in chunks of
  `prefill_chunk`, a few in long chunks; and its whole rest when that is at most twice as much
  and crosses no prefix-cache boundary (`_whole_rest`). A task using the prefix cache saves its state at every
  multiple of `prefix_boundary`: the boundaries inside a chunk are captured by the forward itself
  (`Row.checkpoints`, at most MAX_CHECKPOINTS_PER_STEP a step; past that the chunk ends at a
  boundary), and a chunk's end is saved from the slot.
- A row samples when it is a decode row or the chunk that ends its prompt (unless max_tokens is 0).
- Tasks admitted together with the same prompt from a zero state (the `n` samples of a request)
  prefill it once: the first one's chunks stop before the last prompt token, the worker copies
  its state into the others, and each then feeds the last token itself.

Shortest first cuts the mean time to first token, as shortest-remaining-time-first does for any
queue: a burst's short prompts no longer wait behind the long ones admitted before them. A task's
order key is its prompt tokens left plus `prefill_chunk` tokens for every step between the first
step and its admission, so tasks admitted together go strictly shortest first, and a long prompt
is passed over by a later one only while their lengths differ by more than a chunk a step of the
later one's delay: it cannot starve however many short prompts keep arriving.

`plan()` records what it issues on the tasks (prompt_pos, sampled, fed, last_sample_row): the
worker issues every plan it gets, so these counters describe the steps sent to the device.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass

from albatross_engine.config import DEFAULT_PREFILL_BUDGET, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_ORDER, PREFILL_ORDERS
from albatross_engine.prefill_budget import PrefillBudget
from albatross_engine.state_store import PREFIX_BOUNDARY_TOKENS
from albatross_engine.tasks import EngineTask


# The most prefix states one step captures inside its chunks (each a slot state: 17 MB at 7.2B,
# held until the step's saves; the memory plan counts them). A prompt crossing more boundaries
# goes on in the next step, its chunk ending at a boundary.
MAX_CHECKPOINTS_PER_STEP = 16


class RowKind(enum.IntEnum):
    PREFILL = 0  # a chunk of the prompt
    DECODE = 1  # the newest sampled token, then sample again
    FEED = 2  # the newest sampled token, no sampling


@dataclass(slots=True)
class Row:
    task: EngineTask
    slot: int
    kind: RowKind
    start: int = 0  # PREFILL: prompt slice [start, stop)
    stop: int = 0
    input_row: int = -1  # DECODE/FEED: the row of the previous step's sampled ids to feed
    sample_row: int = -1  # index into this step's sampled ids; -1: not sampled
    prefix_checkpoint: bool = False  # save the slot state after this row under the prompt's prefix key
    # Prefix lengths strictly inside [start, stop) whose states the forward captures for the
    # prefix cache (RWKV7.forward_saving), so a long chunk need not stop at every boundary.
    checkpoints: tuple[int, ...] = ()
    starts_followers: bool = False  # after this row, the task's followers start from a copy of its state

    @property
    def samples(self) -> bool:
        return self.sample_row >= 0


@dataclass(slots=True)
class StepPlan:
    rows: list[Row]
    sample_count: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.rows)

    def without(self, task_ids: set[int]) -> StepPlan:
        """This plan less the rows of these tasks, for a step issued again without the rows whose
        inputs it refused before anything ran: the kept sample rows are renumbered (input rows
        point into the previous step's ids and stay)."""
        rest = StepPlan(rows=[row for row in self.rows if row.task.task_id not in task_ids])
        for row in rest.rows:
            if row.samples:
                row.sample_row = row.task.last_sample_row = rest.sample_count
                rest.sample_count += 1
            if row.kind is RowKind.PREFILL:
                rest.prefill_tokens += row.stop - row.start
            else:
                rest.decode_tokens += 1
        return rest


def _can_lead(task: EngineTask) -> bool:
    """Still feeding its prompt from a zero state, short of the last token."""
    return not task.finished and task.load_key is None and task.prompt_pos < task.prompt_len - 1


class Scheduler:
    def __init__(
        self,
        batch_size: int,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefill_budget: int = DEFAULT_PREFILL_BUDGET,
        prefix_boundary: int = PREFIX_BOUNDARY_TOKENS,
        itl_target_s: float | None = None,
        prefill_order: str = DEFAULT_PREFILL_ORDER,
    ) -> None:
        if min(batch_size, prefill_chunk, prefill_budget, prefix_boundary) < 1:
            raise ValueError("batch_size, prefill_chunk, prefill_budget and prefix_boundary must be >= 1")
        if prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, got {prefill_order!r}")
        self.batch_size = batch_size
        self.budget = PrefillBudget(prefill_chunk, prefill_budget, itl_target_s)
        self.prefix_boundary = prefix_boundary
        self.waiting: deque[EngineTask] = deque()
        self.running: dict[int, EngineTask] = {}  # task_id -> task, in admission order
        self._free_slots: list[int] = list(range(batch_size))  # a heap: the lowest slot first
        self.shortest_first = prefill_order == "shortest"
        self._steps = 0  # plans made: the clock of the prefill order's aging

    @property
    def free_slot_count(self) -> int:
        return len(self._free_slots)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, task: EngineTask) -> None:
        self.waiting.append(task)

    def admit(self) -> list[EngineTask]:
        """Move waiting tasks into free slots; the caller prepares each slot's starting state."""
        admitted: list[EngineTask] = []
        while self.waiting and self._free_slots:
            task = self.waiting.popleft()
            task.slot = heapq.heappop(self._free_slots)
            task.admitted_step = self._steps
            self.running[task.task_id] = task
            admitted.append(task)
        return admitted

    def share_prefills(self, admitted: list[EngineTask]) -> None:
        """Newly admitted tasks that start a prompt from a zero state follow a task feeding the same
        prompt that has not yet reached its last token (one already running, or the first of them).
        Call after the admitted tasks' starting states are set."""
        candidates = [
            task for task in admitted
            if not task.finished and task.load_key is None and task.prompt_pos == 0 and task.prompt_len >= 2
        ]
        if not candidates:
            return
        # Runs every admission round: only prompts of a newcomer's length are worth hashing.
        lengths = {task.prompt_len for task in candidates}
        newcomers = {task.task_id for task in admitted}
        # Only tasks that start from the same state share: the same prompt from a state file's
        # state is another computation than from zeros.
        leaders: dict[tuple[str | None, tuple[int, ...]], EngineTask] = {}
        for task in self.running.values():
            if task.prompt_len in lengths and task.task_id not in newcomers and task.leader is None and _can_lead(task):
                leaders.setdefault((task.initial_state_id, tuple(task.prompt_tokens)), task)
        for task in candidates:
            leader = leaders.setdefault((task.initial_state_id, tuple(task.prompt_tokens)), task)
            if leader is not task:
                task.leader = leader
                leader.followers.append(task)

    @staticmethod
    def start_followers(leader: EngineTask) -> list[EngineTask]:
        """The leader has fed all but its last prompt token: its followers continue from there."""
        followers = [task for task in leader.followers if not task.finished]
        for task in followers:
            task.leader = None
            task.prompt_pos = leader.prompt_pos
        leader.followers.clear()
        return followers

    def remove_waiting(self, task: EngineTask) -> bool:
        try:
            self.waiting.remove(task)
        except ValueError:
            return False
        return True

    def release(self, task: EngineTask) -> None:
        """Free the task's slot for the next admission (rows already issued keep their own slot)."""
        if self.running.pop(task.task_id, None) is None:
            raise ValueError(f"task {task.task_id} holds no slot")
        heapq.heappush(self._free_slots, task.slot)
        for follower in task.followers:  # a leader that ends early: its followers prefill themselves
            follower.leader = None
        task.followers.clear()
        if task.leader is not None:
            task.leader.followers.remove(task)
            task.leader = None

    def plan(self) -> StepPlan:
        # One pass over the running tasks (it runs every step, for every slot).
        self._steps += 1
        plan = StepPlan(rows=[])
        prefilling: list[EngineTask] = []
        for task in self.running.values():
            if task.prefilling:
                prefilling.append(task)
            elif task.fed < task.sampled:  # else nothing new to feed: waiting for the host to see the task's end
                self._plan_generated_token(task, plan)
        feeding = [task for task in prefilling if not task.finished and task.leader is None]
        if self.shortest_first and len(feeding) > 1:
            aging = self.budget.prefill_chunk  # tokens a step of waiting is worth (module docstring)
            feeding.sort(key=lambda task: task.prompt_len - task.prompt_pos + aging * task.admitted_step)  # stable: ties by admission
        budget = self.budget.tokens(plan.decode_tokens, plan.sample_count)  # every sample so far is a decode row
        checkpoints = MAX_CHECKPOINTS_PER_STEP
        for index, task in enumerate(feeding):
            if budget == 0:
                break
            chunk = self.budget.chunk(budget, len(feeding) - index, self._whole_rest(task))
            row = self._plan_prefill_chunk(task, min(budget, chunk), plan, checkpoints)
            budget -= row.stop - row.start
            checkpoints -= len(row.checkpoints)
        return plan

    def _whole_rest(self, task: EngineTask) -> int | None:
        """The prompt tokens the task has left, offered whole to the budget's chunk rule; None when
        going whole would put a prefix-cache boundary inside the row. A boundary inside a row is
        captured by splitting that slot's WKV walk into pieces, run in extra launches a layer
        (wkv_dispatch.split_parts), while one at a row's end is saved from the slot after the
        step: a burst of prompts crossing a boundary would trade its chunks' free saves for
        those launches."""
        pos, length = task.prompt_pos, task.prompt_len
        if task.use_prefix_cache and (pos // self.prefix_boundary + 1) * self.prefix_boundary < length:
            return None
        return length - pos

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """How long an issued step took, as its decoding streams saw it (the worker measures it
        where the host already waits for the step's ids); the adaptive budget learns from it."""
        self.budget.observe(plan.prefill_tokens, plan.decode_tokens, seconds)

    def _plan_generated_token(self, task: EngineTask, plan: StepPlan) -> None:
        if task.finished:
            if not task.final_feed_pending:
                return
            task.final_feed_pending = False
            kind = RowKind.FEED
        elif task.wants_sample():
            kind = RowKind.DECODE
        elif task.save_key is not None:
            kind = RowKind.FEED  # the final state must include the last token
        else:
            return
        row = Row(task=task, slot=task.slot, kind=kind, input_row=task.last_sample_row)
        task.fed += 1
        if kind is RowKind.DECODE:
            self._assign_sample(task, row, plan)
        plan.rows.append(row)
        plan.decode_tokens += 1

    def _plan_prefill_chunk(self, task: EngineTask, limit: int, plan: StepPlan, checkpoints_left: int) -> Row:
        start = task.prompt_pos
        stop = start + min(task.prompt_len - start, limit)
        shared_until = task.prompt_len - 1 if task.followers else task.prompt_len
        if start < shared_until:
            stop = min(stop, shared_until)
        boundary = self.prefix_boundary
        inside: tuple[int, ...] = ()
        if task.use_prefix_cache:
            # The boundaries inside the chunk are captured by the forward, as many as the step
            # has left; past those the chunk ends at the next boundary (saved as its end).
            inside = tuple(range((start // boundary + 1) * boundary, stop, boundary))
            if len(inside) > checkpoints_left:
                stop, inside = inside[checkpoints_left], inside[:checkpoints_left]
        row = Row(task=task, slot=task.slot, kind=RowKind.PREFILL, start=start, stop=stop, checkpoints=inside)
        row.starts_followers = bool(task.followers) and stop == shared_until
        row.prefix_checkpoint = task.use_prefix_cache and (stop % boundary == 0 or stop == task.prompt_len)
        task.prompt_pos = stop
        if stop == task.prompt_len and task.wants_sample():
            self._assign_sample(task, row, plan)
        plan.rows.append(row)
        plan.prefill_tokens += stop - start
        return row

    @staticmethod
    def _assign_sample(task: EngineTask, row: Row, plan: StepPlan) -> None:
        row.sample_row = plan.sample_count
        plan.sample_count += 1
        task.sampled += 1
        task.last_sample_row = row.sample_row
