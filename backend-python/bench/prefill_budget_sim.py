"""The prefill budget on a simulated clock: the real Scheduler and PrefillBudget, a device whose step
time is a stated function of the step, and no host at all (no threads, no event delivery), so a
run is deterministic and takes seconds. host_overhead.py runs the same policy through the whole
engine against a simulated device; this isolates the policy.

    python bench/prefill_budget_sim.py                              # 960 requests at once, targets off,100..250
    python bench/prefill_budget_sim.py --decode-ms fit --json out/budget_sim.json
    python bench/prefill_budget_sim.py --rate 8 --prompt-max 3072                # Poisson arrivals
    python bench/prefill_budget_sim.py --targets 0 --orders shortest,arrival     # the prefill order

A step with prompt chunks takes `--mixed` (ms + us per prompt token + us per decode row: the H200
7.2B fit of docs/performance.md); a decode-only step `--decode-ms` (a CUDA graph: 38.7 ms for 960
rows on the H200, whatever the rows; `5.17+0.0329`, the line through the H200's 1- and 960-row
graph steps, for loads far from a full batch), or `fit` for the mixed formula without prompt tokens. Every
sampled token reaches its stream when its step ends: TTFT is the end of a request's first
sampling step (from its arrival), an inter-token gap the time between two of its tokens. With
`--rate` requests arrive as a Poisson process instead of all at once, and an idle device jumps to
the next arrival.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross_engine.scheduler import Scheduler, StepPlan
from albatross_engine.tasks import EngineTask, SyncChannel
from runner.interface import SamplingParams


@dataclass(frozen=True, slots=True)
class StepCost:
    base_ms: float
    us_per_prompt_token: float
    us_per_decode_row: float
    decode_only_ms: float | None  # None: decode-only steps follow the mixed formula
    decode_only_ms_per_row: float = 0.0  # a decode-only step's time also grows this much a row

    def seconds(self, plan: StepPlan) -> float:
        rows_ms = self.us_per_decode_row * plan.decode_tokens / 1000
        if not plan.prefill_tokens and self.decode_only_ms is not None:
            return (self.decode_only_ms + self.decode_only_ms_per_row * plan.decode_tokens) / 1000
        return (self.base_ms + self.us_per_prompt_token * plan.prefill_tokens / 1000 + rows_ms) / 1000


@dataclass(slots=True)
class Outcome:
    itl_target_ms: float  # 0: the static budget
    prefill_order: str
    steps: int
    mixed_steps: int
    wall_s: float
    tokens_per_s: float
    ttft_ms: dict[str, float]
    inter_token_ms: dict[str, float]


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {f"p{int(q * 100)}": 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99)}


def simulate(
    itl_target_ms: float, cost: StepCost, prompts: list[int], max_tokens: int, batch: int, arrivals: list[float],
    prefill_order: str = "shortest",
) -> Outcome:
    """The requests arrive at `arrivals` (seconds) into `batch` slots; the scheduler plans, the
    cost model "runs" each step and its time is fed back as the worker does."""
    target_s = itl_target_ms / 1000 if itl_target_ms > 0 else None
    scheduler = Scheduler(batch_size=batch, itl_target_s=target_s, prefill_order=prefill_order)
    params = SamplingParams(max_tokens=max_tokens)
    pending = [EngineTask(prompt_tokens=[1] * length, sampling=params, seed=1, channel=SyncChannel()) for length in prompts]
    arrived_at = {task.task_id: at for task, at in zip(pending, arrivals)}
    clock, steps, mixed, next_arrival = 0.0, 0, 0, 0
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    gaps: list[float] = []
    while scheduler.load or next_arrival < len(pending):
        if not scheduler.load:
            clock = max(clock, arrivals[next_arrival])  # an idle device waits for the next request
        while next_arrival < len(pending) and arrivals[next_arrival] <= clock:
            scheduler.add(pending[next_arrival])
            next_arrival += 1
        scheduler.admit()
        plan = scheduler.plan()
        if not plan:
            raise RuntimeError("the scheduler planned nothing with tasks left")
        seconds = cost.seconds(plan)
        scheduler.observe_step(plan, seconds)
        clock += seconds
        steps += 1
        mixed += bool(plan.prefill_tokens)
        for row in plan.rows:
            task = row.task
            if not row.samples:
                continue
            if task.task_id in last:
                gaps.append(clock - last[task.task_id])
            else:
                first[task.task_id] = clock - arrived_at[task.task_id]
            last[task.task_id] = clock
            task.completion_tokens += 1
            if task.completion_tokens >= max_tokens and not task.finished:
                task.finish_reason = "length"
                scheduler.release(task)
    return Outcome(
        itl_target_ms=itl_target_ms,
        prefill_order=prefill_order,
        steps=steps,
        mixed_steps=mixed,
        wall_s=clock,
        tokens_per_s=len(prompts) * max_tokens / clock,
        ttft_ms=_quantiles(list(first.values())),
        inter_token_ms=_quantiles(gaps),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=960)
    parser.add_argument("--batch", type=int, default=960)
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second; 0: every request at once")
    parser.add_argument("--targets", default="0,100,150,180,200,250", help="itl_target_ms values, 0: the static budget")
    parser.add_argument("--orders", default="shortest", help="prefill_order values (shortest, arrival), each with every target")
    parser.add_argument("--mixed", default="18,26,40", help="a step with prompt chunks: ms, us per prompt token, us per decode row")
    parser.add_argument("--decode-ms", default="38.7",
                        help="a decode-only step in ms; 'A+B': A ms + B ms a row (the H200's graph steps: 5.17+0.0329); or 'fit' for the mixed formula")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    base, per_token, per_row = (float(x) for x in args.mixed.split(","))
    if args.decode_ms == "fit":
        cost = StepCost(base, per_token, per_row, None)
    else:
        decode_ms, _, per_decode_row = args.decode_ms.partition("+")
        cost = StepCost(base, per_token, per_row, float(decode_ms), float(per_decode_row or 0.0))
    rng = random.Random(args.seed)
    prompts = [rng.randint(args.prompt_min, args.prompt_max) for _ in range(args.requests)]
    arrivals, at = [], 0.0
    for _ in prompts:
        arrivals.append(at)
        at += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    outcomes = [
        simulate(float(t), cost, prompts, args.max_tokens, args.batch, arrivals, order)
        for order in args.orders.split(",") for t in args.targets.split(",")
    ]  # fmt: skip
    how = f"Poisson arrivals at {args.rate:g}/s" if args.rate > 0 else "at once"
    print(f"{args.requests} requests {how}, batch {args.batch}, prompts {args.prompt_min}-{args.prompt_max}, "
          f"{args.max_tokens} tokens each; step cost {cost}")  # fmt: skip
    print(f"{'order':>9}{'target ms':>10}{'steps':>7}{'mixed':>7}{'wall s':>8}{'tok/s':>9}{'TTFT p50':>10}{'p90':>7}{'p99':>7}"
          f"{'ITL p50':>9}{'p90':>7}{'p99':>7}  (ms)")  # fmt: skip
    for o in outcomes:
        print(f"{o.prefill_order:>9}{o.itl_target_ms or 'off':>10}{o.steps:>7}{o.mixed_steps:>7}{o.wall_s:>8.2f}{o.tokens_per_s:>9,.0f}"
              f"{o.ttft_ms['p50']:>10.0f}{o.ttft_ms['p90']:>7.0f}{o.ttft_ms['p99']:>7.0f}"
              f"{o.inter_token_ms['p50']:>9.1f}{o.inter_token_ms['p90']:>7.1f}{o.inter_token_ms['p99']:>7.1f}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cost": asdict(cost), "outcomes": [asdict(o) for o in outcomes]}, indent=2))


if __name__ == "__main__":
    main()
