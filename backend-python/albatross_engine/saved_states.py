"""A worker's traffic with the state store: where an admitted task's starting state comes from,
and which slot states are saved (docs/engine.md, "The state-store seam").

- `prepare(task)`: the saved state of `load_key` (404 when missing) or, with `use_prefix_cache`,
  the longest cached prefix of the prompt: every multiple of the boundary below its length and
  every prompt end saved since start-up, longest first; otherwise a state file's state when the
  task carries one (prefix keys are then salted with the file's id).
- `save_prefix(row)`: after a step that reaches a prefix checkpoint; a failure costs a future hit,
  never the request, so it is logged and swallowed. `save_prefix_state(task, length, state)`: the
  same for a state the step's forward captured inside a chunk (`Row.checkpoints`).
- `save_final(task)`: the state after the prompt and every generated token; raises on failure
  (the caller turns it into the task's error event).

States move through the `DeviceStep` as copies on the device, ordered after the issued steps:
no host sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from albatross.state import SlotState
from albatross_engine.initial_state import EngineInitialState
from albatross_engine.metrics import WorkerMetrics
from albatross_engine.state_store import PrefixHasher, PromptEndIndex, StateStore, prefix_lookup_lengths
from albatross_engine.tasks import EngineTask
from runner.interface import BackendError

if TYPE_CHECKING:
    from albatross_engine.device_step import DeviceStep
    from albatross_engine.scheduler import Row

logger = logging.getLogger(__name__)


class SavedStates:
    def __init__(self, device_step: DeviceStep, metrics: WorkerMetrics, prompt_ends: PromptEndIndex, store: StateStore | None = None) -> None:
        self.device_step = device_step
        self.metrics = metrics
        self.prompt_ends = prompt_ends  # shared by the engine's workers
        self.store = store
        self._initial: tuple[str, SlotState] | None = None  # (state file id, its state on the device)

    def prepare(self, task: EngineTask) -> None:
        """Write the task's starting state into its (already zeroed) slot: a saved state, else the
        longest cached prefix, else the state file's state (when one is set), else zeros."""
        if task.load_key is not None:
            self.device_step.write_state(task.slot, self._load(task.load_key))
            return
        if task.use_prefix_cache and self.store is not None:
            self._resume_prefix(task, self.store)
        if task.initial_state is not None and task.cached_prompt_tokens == 0:
            self.device_step.write_state(task.slot, self._initial_on_device(task.initial_state))

    def _initial_on_device(self, initial: EngineInitialState) -> SlotState:
        """The state file's state on this worker's device, copied there once per file."""
        if self._initial is None or self._initial[0] != initial.state_id:
            self._initial = (initial.state_id, initial.state.to(self.device_step.device))
        return self._initial[1]

    def _load(self, key: str) -> SlotState:
        state = None if self.store is None else self.store.get(key)
        if state is None:
            raise BackendError(404, f"state {key!r} not found")
        return state

    def _resume_prefix(self, task: EngineTask, store: StateStore) -> None:
        # Prompts fed from a state file's state have their own keys (initial_state.py).
        salt = b"" if task.initial_state is None else task.initial_state.prefix_salt
        task.prefix_hasher = PrefixHasher(task.prompt_tokens, salt)
        lookup = task.prefix_hasher.fork()  # hashes left to right: the keys come shortest first
        ends = self.prompt_ends.below(lookup.head, task.prompt_len)
        keys = [(length, lookup.key_at(length)) for length in reversed(prefix_lookup_lengths(task.prompt_len, ends))]
        for length, key in reversed(keys):
            state = store.get(key) if store.contains(key) else None
            if state is not None:
                self.device_step.write_state(task.slot, state)
                task.prompt_pos = task.cached_prompt_tokens = length
                break
        self.metrics.record_prefix_lookup(task.cached_prompt_tokens)

    def save_prefix(self, row: Row) -> None:
        self._save_prefix(row.task, row.stop, lambda: self.device_step.live_state(row.slot))

    def save_prefix_state(self, task: EngineTask, length: int, state: SlotState) -> None:
        """A prefix state the forward captured (the store keeps a copy: `state` is the step's buffer)."""
        self._save_prefix(task, length, lambda: state)

    def _save_prefix(self, task: EngineTask, length: int, state: Callable[[], SlotState]) -> None:
        assert task.prefix_hasher is not None
        try:
            key = task.prefix_hasher.key_at(length)
            if self.store is not None and not self.store.contains(key):
                self.store.put(key, state())
                self.metrics.record_state_save()
            if length == task.prompt_len:
                self.prompt_ends.add(task.prefix_hasher.head, length)
        except Exception:
            logger.exception("saving a prefix state failed")

    def save_final(self, task: EngineTask) -> None:
        assert task.save_key is not None
        if self.store is None:
            raise BackendError(400, "this albatross engine has no state cache")
        self.store.put(task.save_key, self.device_step.live_state(task.slot))
        self.metrics.record_state_save()
