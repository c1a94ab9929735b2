"""What a burst's admissions cost the worker thread in prefix-cache lookups (CPU, no model).

    python bench/prefix_lookup_cost.py --prompts 960 --lengths 230-290
    python bench/prefix_lookup_cost.py --prompts 1 --lengths 3000-3000 --known-ends 4096

Each prompt is admitted as `SavedStates.prepare` admits it (keys hashed, the store asked longest
first) against a real `StateCache` (SQLite under a temporary folder), then its end is saved, as
the engine saves it once the prompt is fed. Unrelated prompts (random tokens) never hit; the
table says how many store lookups an admission made and the worker time they took. With
`--known-ends N`, N ends of other prompts are saved first (a server that has run a while).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross.state import SlotState
from albatross_engine.metrics import WorkerMetrics
from albatross_engine.saved_states import SavedStates
from albatross_engine.state_cache import StateCache
from albatross_engine.state_store import PromptEndIndex
from albatross_engine.tasks import EngineTask, SyncChannel
from runner.interface import SamplingParams


class _Slots:
    """The part of DeviceStep that admission touches: a slot's starting state is written."""

    def write_state(self, slot: int, state: SlotState) -> None:
        pass


class _CountingCache(StateCache):
    lookups = 0  # the store lookups so far

    def contains(self, key: str) -> bool:
        self.lookups += 1
        return super().contains(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=960)
    parser.add_argument("--lengths", default="230-290", help="prompt lengths in tokens, uniform in LOW-HIGH")
    parser.add_argument("--known-ends", type=int, default=0, help="ends of other prompts saved before the run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    low, high = (int(n) for n in args.lengths.split("-"))
    rng = random.Random(args.seed)
    state = SlotState(torch.zeros(2, 64), torch.zeros(2, 64), torch.zeros(2, 1, 64, 64))
    with tempfile.TemporaryDirectory() as folder:
        cache = _CountingCache(Path(folder) / "states.sqlite3", "prefix-lookup-cost", device="cpu")
        saved = SavedStates(_Slots(), WorkerMetrics(), PromptEndIndex(), cache)  # type: ignore[arg-type]

        def admit(length: int) -> tuple[int, float]:
            task = EngineTask([rng.randrange(1, 65530) for _ in range(length)], SamplingParams(max_tokens=1), seed=1,
                              channel=SyncChannel(), use_prefix_cache=True)  # fmt: skip
            before, began = cache.lookups, time.perf_counter()
            saved.prepare(task)
            spent = time.perf_counter() - began
            lookups = cache.lookups - before
            saved.save_prefix_state(task, length, state)
            return lookups, spent

        for _ in range(args.known_ends):
            admit(rng.randint(20, 6000))
        runs = [admit(rng.randint(low, high)) for _ in range(args.prompts)]
        cache.close()
    lookups = [n for n, _ in runs]
    spent = [s for _, s in runs]
    print(f"{'prompts':>8}{'lengths':>12}{'known ends':>12}{'lookups/admission':>19}{'max':>6}{'ms/admission':>14}{'ms in all':>11}")
    print(f"{args.prompts:>8}{args.lengths:>12}{args.known_ends:>12}{statistics.mean(lookups):>19.1f}{max(lookups):>6}"
          f"{1000 * statistics.mean(spent):>14.3f}{1000 * sum(spent):>11.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
