"""The adaptive prefill budget with plain Python objects: a fake device whose step time is a known
function of the step's prompt tokens and decode rows, no model and no clock."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from albatross_engine.prefill_budget import PRIOR_MS, PrefillBudget, StepTimeModel
from albatross_engine.scheduler import RowKind, Scheduler, StepPlan
from albatross_engine.tasks import EngineTask, SyncChannel
from runner.interface import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

TARGET_S = 0.150


def _device(base_ms: float, us_per_token: float, us_per_row: float, noise: float = 0.0, seed: int = 0):
    """A step-time function: base + per token + per row, times a uniform +-noise factor."""
    rng = random.Random(seed)

    def seconds(prompt_tokens: int, decode_rows: int) -> float:
        ms = base_ms + us_per_token * prompt_tokens / 1000 + us_per_row * decode_rows / 1000
        return ms / 1000 * (1 + rng.uniform(-noise, noise))

    return seconds


def _drive(budget: PrefillBudget, device, rows_at, supply_at, steps: int) -> list[tuple[int, int, float]]:
    """Plan `steps` steps: the budget for that step's decode rows, prompt tokens as far as the
    supply allows, the device's time fed back. Returns (prompt tokens, rows, seconds) per step."""
    history = []
    for step in range(steps):
        rows = rows_at(step)
        tokens = min(budget.tokens(rows, rows), supply_at(step))
        seconds = device(tokens, rows)
        budget.observe(tokens, rows, seconds)
        history.append((tokens, rows, seconds))
    return history


def test_the_fit_converges_to_the_device_from_a_prior_that_is_far_off() -> None:
    """A device 2.5x slower per step, 2.3x per prompt token and 1.25x per row than the prior, with
    5% noise: after forty steps of varied compositions the coefficients are within 10% of the
    device's."""
    prior_base, prior_per_1000_tokens, prior_per_100_rows = PRIOR_MS
    true = (2.5 * prior_base, 2.3 * prior_per_1000_tokens, 1.25 * prior_per_100_rows * 10)  # ms, us a token, us a row
    device = _device(*true, noise=0.05, seed=1)
    budget = PrefillBudget(prefill_chunk=128, prefill_budget=16384, itl_target_s=TARGET_S)
    rng = random.Random(2)
    _drive(budget, device, lambda step: rng.randint(50, 900), lambda step: rng.randint(100, 2000), 40)
    base, per_token, per_row = budget.model.coefficients_ms()
    assert base == pytest.approx(true[0], rel=0.1)
    assert per_token * 1000 == pytest.approx(true[1], rel=0.1)
    assert per_row * 1000 == pytest.approx(true[2], rel=0.1)


@pytest.mark.parametrize("us_per_token", [8.0, 26.0, 120.0], ids=["faster", "h200", "slower"])
def test_steps_next_to_decoding_streams_meet_the_target_and_use_it(us_per_token: float) -> None:
    """With prompts to spare the budget settles where the step takes the target: never more than
    5% over it (the noise), and not much under (the tokens the target allows, for TTFT)."""
    device = _device(18.0, us_per_token, 40.0, noise=0.03, seed=3)
    budget = PrefillBudget(prefill_chunk=128, prefill_budget=1 << 20, itl_target_s=TARGET_S)
    history = _drive(budget, device, lambda step: 200 + 7 * step, lambda step: 1 << 20, 100)
    settled = history[10:]
    assert max(seconds for _, _, seconds in settled) <= TARGET_S * 1.06
    assert min(seconds for _, _, seconds in settled) >= TARGET_S * 0.9


def test_the_budget_follows_a_device_that_slows_down() -> None:
    budget = PrefillBudget(prefill_chunk=128, prefill_budget=1 << 20, itl_target_s=TARGET_S)
    _drive(budget, _device(18.0, 26.0, 40.0), lambda step: 400, lambda step: 1 << 20, 30)
    fast = budget.tokens(400, 400)
    slower = _device(18.0, 52.0, 40.0)  # twice the cost per prompt token
    history = _drive(budget, slower, lambda step: 400, lambda step: 1 << 20, 30)
    assert budget.tokens(400, 400) == pytest.approx(fast / 2, rel=0.05)
    assert max(seconds for _, _, seconds in history[10:]) <= TARGET_S * 1.01


def test_prefill_is_never_starved_when_decoding_alone_exceeds_the_target() -> None:
    device = _device(18.0, 26.0, 400.0)  # 960 rows: 402 ms before any prompt token
    budget = PrefillBudget(prefill_chunk=128, prefill_budget=16384, itl_target_s=TARGET_S)
    history = _drive(budget, device, lambda step: 960, lambda step: 1 << 20, 20)
    assert budget.min_budget == 512
    assert all(tokens == 512 for tokens, _, _ in history[3:]), "the floor: four chunks a step"


def test_a_step_without_decoding_streams_takes_the_whole_budget() -> None:
    budget = PrefillBudget(prefill_chunk=128, prefill_budget=16384, itl_target_s=TARGET_S)
    _drive(budget, _device(18.0, 26.0, 40.0), lambda step: 500, lambda step: 1 << 20, 20)
    assert budget.tokens(500, 500) < 16384
    assert budget.tokens(0, 0) == 16384, "nobody waits on a prefill-only step"
    assert budget.tokens(3, 0) == 16384, "rows that only feed a finished task's last token wait for nothing"


def test_one_outlier_moves_the_budget_a_bounded_step_and_fades() -> None:
    device = _device(18.0, 26.0, 40.0)
    budget = PrefillBudget(prefill_chunk=128, prefill_budget=1 << 20, itl_target_s=TARGET_S)
    _drive(budget, device, lambda step: 400, lambda step: 1 << 20, 30)
    settled = budget.tokens(400, 400)
    budget.observe(settled, 400, 12.0)  # a first-use compile or a GC pause: 12 s
    after = budget.tokens(400, 400)
    assert after >= budget.min_budget
    assert after >= settled / 8, f"one outlier cut the budget from {settled} to {after}"
    _drive(budget, device, lambda step: 400, lambda step: 1 << 20, 30)
    assert budget.tokens(400, 400) == pytest.approx(settled, rel=0.05), "the outlier is forgotten"


def test_only_steps_with_prompt_chunks_and_decode_rows_teach_the_fit() -> None:
    budget = PrefillBudget(prefill_chunk=128, prefill_budget=16384, itl_target_s=TARGET_S)
    budget.observe(0, 960, 0.039)  # decode-only: a CUDA graph, another cost
    budget.observe(16384, 0, 0.44)  # prefill only: may include the host's idle time before it
    assert budget.model.steps == 0
    budget.observe(2000, 300, 0.08)
    assert budget.model.steps == 1


def test_disabled_it_is_todays_static_budget() -> None:
    budget = PrefillBudget(prefill_chunk=128, prefill_budget=16384, itl_target_s=None)
    for tokens, rows in [(5000, 960), (100, 1), (16384, 500)]:
        budget.observe(tokens, rows, 0.5)
    assert budget.model.steps == 0
    assert budget.tokens(960, 960) == 16384 and budget.tokens(0, 0) == 16384
    assert budget.chunk(16384, 1) == 16384 and budget.chunk(16384, 500) == 128  # a lone prompt: one step


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefillBudget(prefill_chunk=128, prefill_budget=16384, itl_target_s=0.0)
    with pytest.raises(ValueError):
        PrefillBudget(prefill_chunk=0, prefill_budget=16384)
    with pytest.raises(ValueError):
        StepTimeModel(noise=0.0)


def test_non_finite_or_non_positive_times_are_ignored() -> None:
    model = StepTimeModel()
    before = model.coefficients_ms()
    for seconds in (0.0, -1.0, float("inf"), float("nan")):
        model.observe(1000, 100, seconds)
    assert model.steps == 0 and model.coefficients_ms() == before


# ---------------------------------------------------------------------------------------------
# through the scheduler


def _task(prompt_len: int, max_tokens: int) -> EngineTask:
    return EngineTask(
        prompt_tokens=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(max_tokens=max_tokens),
        seed=1,
        channel=SyncChannel(),
    )


def _run(scheduler: Scheduler, device, steps: int) -> list[tuple[StepPlan, float]]:
    """Plan and "run" steps on the fake device, feeding each step's time back; tasks whose samples
    reach max_tokens finish and leave (what the worker's result processing does)."""
    done: list[tuple[StepPlan, float]] = []
    for _ in range(steps):
        plan = scheduler.plan()
        if not plan:
            break
        seconds = device(plan.prefill_tokens, plan.decode_tokens)
        scheduler.observe_step(plan, seconds)
        done.append((plan, seconds))
        for row in plan.rows:
            task = row.task
            if row.samples:
                task.completion_tokens += 1
                if task.completion_tokens >= task.sampling.max_tokens and not task.finished:
                    task.finish_reason = "length"
                    scheduler.release(task)
    return done


def _burst(itl_target_s: float | None, prompt_lengths: list[int], slots: int) -> tuple[list[float], list[float]]:
    """Every prompt at once through a scheduler on the H200's fit (3% noise), on a simulated clock:
    the duration of each step that carried decoding streams and prompt chunks, and each task's
    time to its first sample."""
    scheduler = Scheduler(batch_size=slots, itl_target_s=itl_target_s)
    tasks = [_task(length, max_tokens=40) for length in prompt_lengths]
    for task in tasks:
        scheduler.add(task)
    device = _device(18.0, 26.0, 40.0, noise=0.03, seed=5)
    clock, mixed, first = 0.0, [], {}
    while scheduler.load:
        scheduler.admit()
        (plan, seconds), = _run(scheduler, device, 1)
        clock += seconds
        if plan.decode_tokens and plan.prefill_tokens:
            mixed.append(seconds)
        for row in plan.rows:
            if row.samples:
                first.setdefault(row.task.task_id, clock)
    assert all(task.finished for task in tasks), "every prompt was fed and every task finished"
    return mixed, [first[task.task_id] for task in tasks]


def test_a_burst_keeps_decoding_streams_under_the_target_while_prompts_keep_coming_in() -> None:
    """192 prompts of 300-3,000 tokens at once into 96 slots: with the target every step next to
    decoding streams stays within 10% of it (after the first few, while the fit learns), where
    today's budget stalls them for longer; and prompts are not fed slower for it."""
    rng = random.Random(4)
    lengths = [rng.randint(300, 3000) for _ in range(192)]
    adaptive, adaptive_ttft = _burst(TARGET_S, lengths, 96)
    static, static_ttft = _burst(None, lengths, 96)
    assert len(adaptive) > 20
    assert max(adaptive[5:]) <= TARGET_S * 1.1
    assert max(static) > TARGET_S * 1.5, "the static budget's mixed steps are the stalls the target removes"
    assert sum(adaptive_ttft) / len(lengths) <= sum(static_ttft) / len(lengths) * 1.05


def test_a_few_prompts_take_long_chunks_and_many_prompts_todays_chunks() -> None:
    scheduler = Scheduler(batch_size=64, itl_target_s=TARGET_S)
    lone = _task(4096, max_tokens=4)
    scheduler.add(lone)
    scheduler.admit()
    plan = scheduler.plan()
    assert [(row.start, row.stop) for row in plan.rows] == [(0, 4096)], "one prompt, nobody decoding: one chunk"
    crowd = [_task(1000, max_tokens=4) for _ in range(60)]
    for task in crowd:
        scheduler.add(task)
    scheduler.admit()
    plan = scheduler.plan()
    chunks = [row.stop - row.start for row in plan.rows if row.kind is RowKind.PREFILL]
    assert plan.decode_tokens == 1 and plan.prefill_tokens == scheduler.budget.last_tokens < 16384, "one stream decodes"
    assert max(chunks) == 128 and len(chunks) > 30, "many prompts share the budget in chunks of prefill_chunk"


def test_a_share_left_by_a_short_prompt_goes_to_the_next() -> None:
    scheduler = Scheduler(batch_size=4, prefill_chunk=16, prefill_budget=1000, itl_target_s=TARGET_S)
    short, long = _task(100, max_tokens=4), _task(5000, max_tokens=4)
    for task in (short, long):
        scheduler.add(task)
    scheduler.admit()
    plan = scheduler.plan()
    assert [(row.task, row.stop - row.start) for row in plan.rows] == [(short, 100), (long, 900)]


def test_without_a_target_the_scheduler_ignores_step_times() -> None:
    """Same tasks, same steps, observations or not: the static policy ignores step times."""

    def plans(observe: bool) -> list[list[tuple[int, int, int, int]]]:
        scheduler = Scheduler(batch_size=3, prefill_chunk=4, prefill_budget=6)
        for length in (9, 3, 14, 5):
            scheduler.add(_task(length, max_tokens=3))
        out = []
        for _ in range(12):
            scheduler.admit()
            plan = scheduler.plan()
            if observe:
                scheduler.observe_step(plan, 10.0)
            out.append([(row.task.task_id, row.kind, row.start, row.stop) for row in plan.rows])
            for row in plan.rows:
                if row.samples:
                    row.task.completion_tokens += 1
                    if row.task.completion_tokens >= 3 and not row.task.finished:
                        row.task.finish_reason = "length"
                        scheduler.release(row.task)
        return out

    first, second = plans(False), plans(True)
    strip = [[row[1:] for row in step] for step in first]
    assert strip == [[row[1:] for row in step] for step in second]
    assert all(sum(stop - start for _, kind, start, stop in step if kind is RowKind.PREFILL) <= 6 for step in first)


def test_the_simulation_script_reports_each_policy(tmp_path: Path) -> None:
    """bench/prefill_budget_sim.py on a small burst and a small Poisson load: the static budget's
    mixed steps stall the streams past the target, the adaptive budget's do not."""
    import prefill_budget_sim

    for rate in ("0", "20"):
        out = tmp_path / f"sim{rate}.json"
        prefill_budget_sim.main(["--requests", "120", "--batch", "64", "--max-tokens", "24", "--targets", "0,150",
                                 "--rate", rate, "--json", str(out)])  # fmt: skip
        static, adaptive = json.loads(out.read_text())["outcomes"]
        assert static["itl_target_ms"] == 0 and adaptive["itl_target_ms"] == 150
        assert adaptive["inter_token_ms"]["p99"] <= 150 * 1.001
        assert static["steps"] > 0 and adaptive["tokens_per_s"] > 0
