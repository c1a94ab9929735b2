"""The scheduling policy, with plain task objects and no model."""

from __future__ import annotations

from albatross_engine.scheduler import RowKind, Scheduler, StepPlan
from albatross_engine.tasks import EngineTask, SyncChannel
from runner.interface import SamplingParams


def make_task(prompt_len: int, max_tokens: int = 8, save_key: str | None = None, prefix_cache: bool = False) -> EngineTask:
    return EngineTask(
        prompt_tokens=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(max_tokens=max_tokens),
        seed=1,
        channel=SyncChannel(),
        save_key=save_key,
        use_prefix_cache=prefix_cache,
    )


def test_admission_is_first_come_first_served_into_the_lowest_free_slots() -> None:
    scheduler = Scheduler(batch_size=2)
    tasks = [make_task(3) for _ in range(3)]
    for task in tasks:
        scheduler.add(task)
    admitted = scheduler.admit()
    assert admitted == tasks[:2], "the two oldest tasks fill the two slots"
    assert [t.slot for t in admitted] == [0, 1]
    assert list(scheduler.waiting) == [tasks[2]], "the third waits for a slot"
    scheduler.release(tasks[0])
    assert scheduler.admit() == [tasks[2]] and tasks[2].slot == 0, "a released slot goes to the next task"


def test_a_prompt_ending_chunk_samples_and_then_the_task_decodes_one_token_per_step() -> None:
    scheduler = Scheduler(batch_size=1)
    task = make_task(5)
    scheduler.add(task)
    scheduler.admit()
    first = scheduler.plan()
    assert [(r.kind, r.start, r.stop, r.sample_row) for r in first.rows] == [(RowKind.PREFILL, 0, 5, 0)]
    second = scheduler.plan()
    assert [(r.kind, r.input_row, r.sample_row) for r in second.rows] == [(RowKind.DECODE, 0, 0)]
    assert (task.sampled, task.fed) == (2, 1)


def test_long_prompts_are_chunked_and_decoding_is_never_starved_by_prefill() -> None:
    scheduler = Scheduler(batch_size=2, prefill_chunk=4, prefill_budget=6)
    decoding, long_prompt = make_task(2), make_task(10)
    scheduler.add(decoding)
    scheduler.admit()
    scheduler.plan()  # decoding's prompt, sampled
    scheduler.add(long_prompt)
    scheduler.admit()
    steps = [scheduler.plan() for _ in range(2)]
    for step in steps:
        kinds = {r.task: r.kind for r in step.rows}
        assert kinds[decoding] is RowKind.DECODE, "the decoding task gets a token every step"
    chunks = [(r.start, r.stop) for step in steps for r in step.rows if r.task is long_prompt]
    assert chunks == [(0, 6), (6, 10)], f"the one waiting prompt takes the step's whole budget, got {chunks}"
    assert [r.samples for step in steps for r in step.rows if r.task is long_prompt] == [False, True]


def first_plan(scheduler: Scheduler, tasks: list[EngineTask]) -> StepPlan:
    for task in tasks:
        scheduler.add(task)
    scheduler.admit()
    return scheduler.plan()


def test_prompts_share_a_step_in_prefill_chunks_or_equal_shares_when_few() -> None:
    crowd = [make_task(10) for _ in range(8)]
    plan = first_plan(Scheduler(batch_size=8, prefill_chunk=4, prefill_budget=24), crowd)
    assert [(r.task, r.stop - r.start) for r in plan.rows] == [(task, 4) for task in crowd[:6]], "many: prefill_chunk each"
    pair = [make_task(30), make_task(5)]
    plan = first_plan(Scheduler(batch_size=8, prefill_chunk=4, prefill_budget=24), pair)
    # 24 tokens for 2 prompts: 12 each; the short one goes first, and the long one takes what it left.
    assert [(r.task, r.start, r.stop) for r in plan.rows] == [(pair[1], 0, 5), (pair[0], 0, 19)]
    pair = [make_task(30), make_task(5)]
    plan = first_plan(Scheduler(batch_size=8, prefill_chunk=4, prefill_budget=24, prefill_order="arrival"), pair)
    # In arrival order the short one comes last, so its unused share is not handed back.
    assert [(r.task, r.start, r.stop) for r in plan.rows] == [(pair[0], 0, 12), (pair[1], 0, 5)]


def test_prompts_of_equal_length_share_the_budget_oldest_admission_first() -> None:
    for order in ("shortest", "arrival"):
        tasks = [make_task(6) for _ in range(3)]
        plan = first_plan(Scheduler(batch_size=3, prefill_chunk=100, prefill_budget=10, prefill_order=order), tasks)
        assert [(r.task, r.start, r.stop) for r in plan.rows] == [(tasks[0], 0, 6), (tasks[1], 0, 4)], order
        assert plan.prefill_tokens == 10 and plan.decode_tokens == 0


def test_the_fewest_prompt_tokens_left_go_first_and_arrival_order_keeps_admission_order() -> None:
    lengths = [13, 3, 20, 9, 11]
    tasks = [make_task(n) for n in lengths]
    scheduler = Scheduler(batch_size=5, prefill_chunk=4, prefill_budget=16)
    plan = first_plan(scheduler, tasks)
    assert [(r.task.prompt_len, r.stop - r.start) for r in plan.rows] == [(3, 3), (9, 4), (11, 4), (13, 4), (20, 1)]
    # What is left counts, not the prompt's length: 5 (the 9), 7 (the 11), 9 (the 13), then the
    # 20's 19; a rest of at most two chunks goes in whole, so the 9 and the 11 finish here.
    plan = scheduler.plan()
    assert [(r.task.prompt_len, r.start, r.stop) for r in plan.rows if r.kind is RowKind.PREFILL] == [
        (9, 4, 9), (11, 4, 11), (13, 4, 8),
    ]
    tasks = [make_task(n) for n in lengths]
    plan = first_plan(Scheduler(batch_size=5, prefill_chunk=4, prefill_budget=16, prefill_order="arrival"), tasks)
    assert [(r.task.prompt_len, r.stop - r.start) for r in plan.rows] == [(13, 4), (3, 3), (20, 4), (9, 4), (11, 1)]


def test_a_rest_of_at_most_two_chunks_is_fed_whole_rather_than_left_for_another_step() -> None:
    tasks = [make_task(n) for n in (8, 9, 30)]
    plan = first_plan(Scheduler(batch_size=3, prefill_chunk=4, prefill_budget=100), tasks)
    # Shares of 33: the 8 and the 9 go in whole, and the 30 takes a share of what they left (83 / 1).
    assert [(r.task.prompt_len, r.stop - r.start) for r in plan.rows] == [(8, 8), (9, 9), (30, 30)]
    crowd = [make_task(n) for n in (8, 9, 12, 12)]
    plan = first_plan(Scheduler(batch_size=4, prefill_chunk=4, prefill_budget=16), crowd)
    # Shares of 4: the 8 goes in whole (two chunks), the 9 does not (a chunk and a token more).
    assert [(r.task.prompt_len, r.stop - r.start) for r in plan.rows] == [(8, 8), (9, 4), (12, 4)]


def test_a_whole_rest_does_not_carry_a_prefix_boundary_inside_its_row() -> None:
    """A boundary inside a row splits the slot's WKV walk into launches; at a row's end it is a
    free save. So a prefix-cache prompt goes whole only up to a rest that crosses no boundary."""
    scheduler = Scheduler(batch_size=8, prefill_chunk=4, prefill_budget=16, prefix_boundary=8)
    crossing, ending, plain = make_task(10, prefix_cache=True), make_task(8, prefix_cache=True), make_task(10)
    crowd = [make_task(40) for _ in range(2)]
    plan = first_plan(scheduler, [crossing, ending, plain, *crowd])
    rows = [(r.task, r.start, r.stop, r.checkpoints, r.prefix_checkpoint) for r in plan.rows]
    # Shares of 4. The 8 with the prefix cache goes whole (its boundary is its end); the 10 with it
    # takes a share (whole, 8 would fall inside), as does the 10 without it (more than two shares).
    assert rows == [(ending, 0, 8, (), True), (crossing, 0, 4, (), False), (plain, 0, 4, (), False)], rows
    plan = scheduler.plan()
    rows = [(r.task, r.start, r.stop, r.checkpoints) for r in plan.rows if r.kind is RowKind.PREFILL]
    # The 10's rest of 6 crosses its boundary at 8 still: a share of 4 ends on it (a free save),
    # and the plain 10 finishes whole.
    assert rows[:2] == [(crossing, 4, 8, ()), (plain, 4, 10, ())], rows


def test_a_long_prompt_is_passed_over_by_later_short_ones_only_for_a_bounded_number_of_steps() -> None:
    """One chunk a step; a 4-token prompt arrives before every step. Shortest first with no aging
    would feed the newcomers forever; the aging (a chunk's worth of tokens a step of delay) lets
    the newcomers pass only while they are shorter by more than that."""
    scheduler = Scheduler(batch_size=64, prefill_chunk=4, prefill_budget=4)
    long_prompt = make_task(40)
    scheduler.add(long_prompt)
    scheduler.admit()
    fed_long: list[int] = []
    for step in range(1, 31):
        plan = scheduler.plan()
        if any(r.task is long_prompt and r.kind is RowKind.PREFILL for r in plan.rows):
            fed_long.append(step)
        for row in plan.rows:
            if row.samples:
                row.task.finish_reason = "length"
                scheduler.release(row.task)
        scheduler.add(make_task(4, max_tokens=1))
        scheduler.admit()
    # Step 1 feeds it alone (36 left); the newcomer admitted after step k ranks at 4 + 4k, so those
    # of steps 1-7 pass it, the one of step 8 ties and goes after it (admitted later), and from
    # then on its shrinking rest keeps it ahead of every newcomer.
    assert fed_long == [1, *range(9, 18)], fed_long
    assert not long_prompt.prefilling


def test_prefix_cache_boundaries_inside_a_chunk_are_captured_and_its_end_saved() -> None:
    scheduler = Scheduler(batch_size=1, prefill_chunk=1000, prefill_budget=1000, prefix_boundary=256)
    task = make_task(600, prefix_cache=True)
    scheduler.add(task)
    scheduler.admit()
    (row,) = scheduler.plan().rows
    assert (row.start, row.stop, row.checkpoints, row.prefix_checkpoint, row.samples) == (0, 600, (256, 512), True, True)


def test_a_chunk_past_the_steps_checkpoints_ends_at_a_boundary() -> None:
    scheduler = Scheduler(batch_size=2, prefill_chunk=16, prefill_budget=10_000, prefix_boundary=16, prefill_order="arrival")
    first, second = make_task(400, prefix_cache=True), make_task(100, prefix_cache=True)
    for task in (first, second):
        scheduler.add(task)
    scheduler.admit()
    rows = scheduler.plan().rows
    # 16 checkpoints a step: the first prompt's 16 boundaries inside [0, 272), then its chunk
    # ends at the 17th (272, saved from the slot); the second finds none left and stops at 16.
    assert [(r.task, r.start, r.stop, len(r.checkpoints), r.prefix_checkpoint) for r in rows] == [
        (first, 0, 272, 16, True), (second, 0, 16, 0, True),
    ]
    assert rows[0].checkpoints == tuple(range(16, 272, 16))
    rows = scheduler.plan().rows
    assert [(r.start, r.stop, r.checkpoints[:1]) for r in rows] == [(272, 400, (288,)), (16, 100, (32,))]


def test_a_task_at_max_tokens_is_not_decoded_again_but_fed_once_when_its_state_is_saved() -> None:
    scheduler = Scheduler(batch_size=2)
    plain, saving = make_task(2, max_tokens=1), make_task(2, max_tokens=1, save_key="s")
    for task in (plain, saving):
        scheduler.add(task)
    scheduler.admit()
    scheduler.plan()  # both prompts, one sample each: max_tokens reached
    plan = scheduler.plan()
    assert [(r.task, r.kind, r.samples) for r in plan.rows] == [(saving, RowKind.FEED, False)]
    assert scheduler.plan().rows == [], "nothing left to feed"


def test_max_tokens_zero_feeds_the_prompt_without_sampling() -> None:
    scheduler = Scheduler(batch_size=1)
    task = make_task(3, max_tokens=0)
    scheduler.add(task)
    scheduler.admit()
    plan = scheduler.plan()
    assert [(r.kind, r.stop, r.samples) for r in plan.rows] == [(RowKind.PREFILL, 3, False)]
    assert plan.sample_count == 0


def test_a_finished_task_waiting_for_its_final_feed_gets_exactly_one_feed_row() -> None:
    scheduler = Scheduler(batch_size=1)
    task = make_task(2, max_tokens=5, save_key="s")
    scheduler.add(task)
    scheduler.admit()
    scheduler.plan()
    task.finish_reason = "stop"  # the host saw a stop string in the first token
    task.final_feed_pending = True
    assert [r.kind for r in scheduler.plan().rows] == [RowKind.FEED]
    assert scheduler.plan().rows == []


def test_released_slots_are_reused_and_none_leak() -> None:
    scheduler = Scheduler(batch_size=3)
    for round_index in range(5):
        tasks = [make_task(1 + round_index) for _ in range(3)]
        for task in tasks:
            scheduler.add(task)
        assert len(scheduler.admit()) == 3
        for task in tasks:
            scheduler.release(task)
    assert scheduler.free_slot_count == 3 and not scheduler.running


def test_samples_of_one_prompt_prefill_it_once_then_each_feeds_the_last_token() -> None:
    scheduler = Scheduler(batch_size=4, prefill_chunk=64)
    leader, follower, other = make_task(10), make_task(10), make_task(7)
    for task in (leader, follower, other):
        scheduler.add(task)
    admitted = scheduler.admit()
    scheduler.share_prefills(admitted)
    assert follower.leader is leader and leader.followers == [follower] and other.leader is None
    first = scheduler.plan()
    rows = {row.task.task_id: row for row in first.rows}
    assert follower.task_id not in rows, "a follower feeds nothing while its leader prefills"
    lead_row = rows[leader.task_id]
    assert (lead_row.start, lead_row.stop, lead_row.samples, lead_row.starts_followers) == (0, 9, False, True)
    assert scheduler.start_followers(leader) == [follower]
    assert follower.prompt_pos == 9 and follower.leader is None and leader.followers == []
    second = scheduler.plan()
    last_tokens = {row.task.task_id: (row.start, row.stop, row.samples) for row in second.rows}
    assert last_tokens[leader.task_id] == (9, 10, True) and last_tokens[follower.task_id] == (9, 10, True)


def test_followers_of_a_leader_that_ends_early_prefill_themselves() -> None:
    scheduler = Scheduler(batch_size=3)
    leader, follower = make_task(6), make_task(6)
    for task in (leader, follower):
        scheduler.add(task)
    scheduler.share_prefills(scheduler.admit())
    leader.finish_reason = "abort"
    scheduler.release(leader)
    assert follower.leader is None
    rows = scheduler.plan().rows
    assert [(row.task, row.start, row.stop) for row in rows] == [(follower, 0, 6)]


def test_a_late_sample_follows_a_running_leader_only_while_it_is_short_of_its_last_token() -> None:
    scheduler = Scheduler(batch_size=3, prefill_chunk=4, prefill_budget=4)
    leader = make_task(10)
    scheduler.add(leader)
    scheduler.share_prefills(scheduler.admit())
    scheduler.plan()  # the leader feeds [0, 4)
    joiner = make_task(10)
    scheduler.add(joiner)
    scheduler.share_prefills(scheduler.admit())
    assert joiner.leader is leader, "the leader is still short of its last token"
    chunk = next(row for row in scheduler.plan().rows if row.task is leader)
    assert (chunk.start, chunk.stop, chunk.starts_followers) == (4, 8, False)
    chunk = next(row for row in scheduler.plan().rows if row.task is leader)
    assert (chunk.start, chunk.stop, chunk.starts_followers) == (8, 9, True)
    scheduler.start_followers(leader)
    late = make_task(10)
    scheduler.add(late)
    scheduler.share_prefills(scheduler.admit())
    assert late.leader is None, "a leader at its last token takes no more followers"
