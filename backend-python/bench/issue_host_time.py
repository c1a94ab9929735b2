"""Where the host's time goes while the engine queues one step: `DeviceStep.issue` for a decode-only
step and for a mixed step (prompt chunks beside decode rows), as the worker issues them.

    python bench/issue_host_time.py --shape 7.2b --decode-rows 400 --prompt-tokens 15744

The 960-client burst's step profile (bench_server.py --device-step profiled) had each mixed step's
`issue` take ~255 ms of host time for ~435 ms of GPU time, and the GPU idle ~29 ms after every
mixed step. A host that blocks while queuing a step cannot process the previous step's ids in
that time, so the next step comes late. This script says why `issue` blocks:
- host ms of `issue` against the step's GPU ms (CUDA events), with the GPU busy beforehand (as in
  serving: a decode step in flight), with the GPU idle, and behind another mixed step still
  queued (as in a burst, where session 26 saw 359 ms of host time in the forward and no sync);
- the kernels the step launches (a launch blocks once the device's queue of pending launches is
  full, so a step of many kernels waits for the device to drain it);
- the CUDA runtime calls that took the most host time (torch.profiler), and any synchronizing
  call torch reports (`torch.cuda.set_sync_debug_mode`);
- the caching allocator's retries and device frees during the step (each a device sync).

Steps are built as the worker builds them: real `EngineTask`s and `Row`s, the engine's DeviceStep
(CUDA graphs for decode-only steps), the sampler over every sampling row. A CPU run with a tiny
shape (`--shape 2x64 --device cpu`) checks the script, not the figures. On the GPU machine, run it
after sourcing bench/session_start.sh, which installs the carried wheels: the engine imports
llguidance, which the GPU image lacks (a bare run in session 28 stopped at that import).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import cuda_ops
from albatross.model import RWKV7
from albatross.random_checkpoint import random_state_dict
from albatross_engine.device_step import DeviceStep, IssuedStep
from albatross_engine.model_specs import parse_random_spec
from albatross_engine.scheduler import Row, RowKind, StepPlan
from albatross_engine.tasks import EngineTask, SyncChannel
from runner.interface import SamplingParams

SAMPLING = SamplingParams(max_tokens=1 << 20, temperature=1.0, top_p=0.6, top_k=50, stop_token_ids=())
ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


class Steps:
    """Decode tasks in slots [0, rows) and prompt tasks after them, issued through one DeviceStep."""

    def __init__(self, step: DeviceStep, decode_rows: int, prompt_tokens: int, chunk: int, seed: int = 0) -> None:
        self.step, self.chunk = step, chunk
        generator = torch.Generator().manual_seed(seed)
        high = min(step.vocab_size, 65530)
        self.decoders = [self._task(torch.randint(1, high, (4,), generator=generator).tolist(), n) for n in range(decode_rows)]
        self.prompts = [self._task(torch.randint(1, high, (chunk,), generator=generator).tolist(), n) for n in range(prompt_tokens // chunk)]
        self.last: IssuedStep | None = None

    @staticmethod
    def _task(prompt: list[int], seed: int) -> EngineTask:
        task = EngineTask(prompt, SAMPLING, seed=seed, channel=SyncChannel())
        task.seed32 = seed
        return task

    def _plan(self, rows: list[Row]) -> StepPlan:
        for n, row in enumerate(rows):
            row.sample_row = n
            row.task.sampled += 1
        decode = sum(row.kind is RowKind.DECODE for row in rows)
        prefill = sum(row.stop - row.start for row in rows if row.kind is RowKind.PREFILL)
        return StepPlan(rows=rows, sample_count=len(rows), decode_tokens=decode, prefill_tokens=prefill)

    def _decode_rows(self) -> list[Row]:
        return [Row(task, slot, RowKind.DECODE, input_row=slot) for slot, task in enumerate(self.decoders)]

    def start(self) -> IssuedStep:
        """Every decoder's prompt in one step: their first sampled ids feed the decode rows."""
        rows = [Row(task, slot, RowKind.PREFILL, 0, len(task.prompt_tokens)) for slot, task in enumerate(self.decoders)]
        return self.issue(self._plan(rows))

    def decode(self) -> IssuedStep:
        return self.issue(self._plan(self._decode_rows()))

    def mixed(self) -> IssuedStep:
        first = len(self.decoders)
        prompts = [Row(task, first + n, RowKind.PREFILL, 0, self.chunk) for n, task in enumerate(self.prompts)]
        return self.issue(self._plan(self._decode_rows() + prompts))

    def issue(self, plan: StepPlan) -> IssuedStep:
        issued = self.step.issue(plan)
        self.last = issued
        return issued


def timed_issue(steps: Steps, kind: str, device: torch.device) -> tuple[float, float]:
    """(host ms of issue, GPU ms of the step) for one step of `kind` queued behind a decode step."""
    cuda = device.type == "cuda"
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    if start is not None:
        start.record()
    began = time.perf_counter()
    getattr(steps, kind)()
    host_ms = 1000 * (time.perf_counter() - began)
    if end is not None and start is not None:
        end.record()
        end.synchronize()
        return host_ms, start.elapsed_time(end)
    return host_ms, host_ms


def allocator_counts(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {key: 0 for key in ALLOCATOR_KEYS}
    stats = torch.cuda.memory_stats(device)
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_KEYS}


def profile_issue(steps: Steps, kind: str, device: torch.device, top: int) -> None:
    """One step of `kind`, queued behind a decode step, under torch.profiler and torch's sync debug
    mode: the runtime calls by host time, the kernels launched, and the synchronizing calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps.decode()  # the device busy, as in serving
    before = allocator_counts(device)
    caught: list[warnings.WarningMessage] = []
    with profile(activities=activities) as prof, warnings.catch_warnings(record=True) as caught_here:
        warnings.simplefilter("always")
        debug = torch.cuda.set_sync_debug_mode if device.type == "cuda" else None
        if debug is not None:
            debug("warn")
        try:
            began = time.perf_counter()
            getattr(steps, kind)()
            host_ms = 1000 * (time.perf_counter() - began)
        finally:
            if debug is not None:
                debug("default")
        caught = list(caught_here)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    after = allocator_counts(device)
    events = prof.events()
    runtime: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    kernels = 0
    for event in events:
        on_device = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        if on_device:
            kernels += 1
        elif event.name.startswith(("cuda", "cu")) and not event.name.startswith("cudnn"):
            runtime[event.name] += event.cpu_time_total
            calls[event.name] += 1
    print(f"\n== {kind} step under the profiler: issue took {host_ms:.1f} ms of host time, {kernels} device activities "
          f"(kernels and copies)")  # fmt: skip
    print(f"   allocator during the step: {', '.join(f'{k} +{after[k] - before[k]}' for k in ALLOCATOR_KEYS)}")
    print(f"   {'runtime call':<40} {'calls':>7} {'host ms':>9}")
    for name, us in runtime.most_common(top):
        print(f"   {name:<40} {calls[name]:>7} {us / 1000:>9.2f}")
    syncs = Counter(f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:90]}" for w in caught if "synchroniz" in str(w.message))
    print(f"   synchronizing calls torch reported: {sum(syncs.values())}")
    for where, count in syncs.most_common(top):
        print(f"     {count:>4} x {where}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    print("   ops by host (self CPU) time:")
    print("\n".join("   " + line for line in table.splitlines()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7.2b", help="a named shape or <layers>x<width>")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decode-rows", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=15744, help="a multiple of --chunk")
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--batch", type=int, default=960, help="the DeviceStep's slots (its decode graphs' buckets)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.prompt_tokens % args.chunk:
        raise SystemExit("--prompt-tokens must be a multiple of --chunk")
    slots = args.decode_rows + args.prompt_tokens // args.chunk
    if slots > args.batch:
        raise SystemExit(f"{slots} slots needed, --batch is {args.batch}")
    gpu = device.type == "cuda"
    if gpu:
        cuda_ops.enable_cuda_kernels()
    dtype = torch.float16 if gpu else torch.float32
    shape, _ = parse_random_spec(args.shape)
    model = RWKV7.from_state_dict(random_state_dict(shape, seed=0, device=device, dtype=dtype), device, dtype, progress=False)
    step = DeviceStep(model, args.batch, "fp16" if gpu else "fp32", cuda_graphs=gpu)
    steps = Steps(step, args.decode_rows, args.prompt_tokens, args.chunk)
    print(f"{args.shape} on {device}: {args.decode_rows} decode rows, {args.prompt_tokens} prompt tokens in chunks of {args.chunk}")
    steps.start()
    figures: dict[str, list[tuple[float, float]]] = {"decode": [], "mixed": []}
    for rep in range(args.reps + 1):  # the first round warms kernels and the allocator up
        for kind in ("decode", "mixed"):
            steps.decode()  # the device busy with a decode step, as in serving
            measured = timed_issue(steps, kind, device)
            if rep:
                figures[kind].append(measured)
    idle = []
    for _ in range(args.reps):  # the same mixed step queued on an idle device
        if gpu:
            torch.cuda.synchronize(device)
        idle.append(timed_issue(steps, "mixed", device))
    behind_mixed = []
    for _ in range(args.reps):  # queued while another mixed step's ~800 launches are still pending, as in a burst
        if gpu:
            torch.cuda.synchronize(device)
        steps.mixed()
        behind_mixed.append(timed_issue(steps, "mixed", device))
    # With a full launch queue the second step's host ms approaches the first one's GPU ms (its
    # GPU ms then starts late, counted from an event queued behind the first step).
    print(f"\n{'step':<26} {'host ms (issue)':>16} {'GPU ms':>8}")
    rows_by_label = (("decode, device busy", figures["decode"]), ("mixed, device busy", figures["mixed"]),
                     ("mixed, device idle", idle), ("mixed, behind a mixed step", behind_mixed))  # fmt: skip
    for label, rows in rows_by_label:
        print(f"{label:<26} {statistics.median(r[0] for r in rows):>16.1f} {statistics.median(r[1] for r in rows):>8.1f}")
    with contextlib.suppress(RuntimeError):  # a profiler some build lacks still leaves the table above
        profile_issue(steps, "mixed", device, args.top)


if __name__ == "__main__":
    main()
