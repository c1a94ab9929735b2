"""The engine's host work against a simulated device: is Python fast enough to keep the GPU busy?

The real scheduler, worker, event delivery and adapter run; only `DeviceStep` is replaced by one
whose steps "run" on a simulated device clock (a step takes the time of the H200's measured step
profile, `engine_benchmark.py --step-profile`) and whose sampled ids arrive when that step is done
(the worker waits for them with the GIL released, as it does on a CUDA event). Whatever the host
adds on top of the device's busy time is host overhead: with enough host speed, the run takes the
sum of its step times.

    python bench/host_overhead.py                     # the 960-request workload of engine_benchmark.py
    python bench/host_overhead.py --requests 64 --batch 64 --max-tokens 64
    python bench/host_overhead.py --mixed 18,26,40 --latency --itl-target-ms 0    # static budget
    python bench/host_overhead.py --mixed 18,26,40 --latency --itl-target-ms 150  # adaptive budget
    python bench/host_overhead.py --constrained 0.1   # 10% of the requests under structured_benchmark.py's schema

With `--constrained`, the masked rows of a step are sampled on the simulated device once the worker
has filled their masks (an allowed id picked from each mask, on the host, timed and reported apart
so it can be discounted); the device waits for that call, so mask work that does not fit under the
forward shows up as idle time.

Prints the run's wall time, the simulated device's busy time, the idle time between steps, and
the CPU time per step of the worker threads, the caller's loop and the whole process. `--latency`
also times every request as engine_benchmark.py does (TTFT, inter-token gaps per token; it adds
that bookkeeping to the caller's loop), and `--itl-target-ms` / `--prefill-budget` /
`--prefill-chunk` set the engine's prefill policy, so the adaptive budget can be compared with the
static one against the same simulated device.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from albatross.constraints import MASK_WORDS, json_schema_grammar
from albatross.model import RWKV7
from albatross.random_checkpoint import random_state_dict
from albatross_engine import worker as worker_module
from albatross_engine.adapter import AlbatrossRWKV, parse_random_spec
from albatross_engine.device_step import IssuedStep, MaskedRows
from albatross_engine.scheduler import StepPlan
from engine_benchmark import RequestTiming, one_request, percentiles  # bench/ is the script's folder
from runner.interface import GenerationRequest, OutputConstraint, SamplingParams
from structured_benchmark import benchmark_schema


class _DeviceClock:
    """Steps run one after another; each starts when both it is issued and the previous one is done."""

    def __init__(self, decode_ms: float, mixed: tuple[float, float, float]) -> None:
        self.decode_ms = decode_ms
        self.mixed = mixed
        self.free_at = 0.0
        self.busy = 0.0
        self.idle = 0.0
        self.idle_by_kind: dict[str, float] = {}  # idle before a step, by the kind of that step
        self.lock = threading.Lock()

    def run_after(self, ms: float) -> float:
        """A call issued now that runs after everything queued (the masked rows' sampler call)."""
        now = time.perf_counter()
        with self.lock:
            if now > self.free_at:
                self.idle += now - self.free_at
                self.idle_by_kind["masked"] = self.idle_by_kind.get("masked", 0.0) + now - self.free_at
            self.free_at = max(now, self.free_at) + ms / 1000
            self.busy += ms / 1000
            return self.free_at

    def run(self, plan: StepPlan) -> float:
        ms = (self.decode_ms if not plan.prefill_tokens
              else self.mixed[0] + self.mixed[1] * plan.prefill_tokens / 1000 + self.mixed[2] * plan.decode_tokens / 1000)  # fmt: skip
        now = time.perf_counter()
        with self.lock:
            if self.free_at and now > self.free_at:
                self.idle += now - self.free_at
                kind = "mixed" if plan.prefill_tokens else "decode"
                self.idle_by_kind[kind] = self.idle_by_kind.get(kind, 0.0) + now - self.free_at
            start = max(now, self.free_at)
            self.free_at = start + ms / 1000
            self.busy += ms / 1000
            return self.free_at


class _Done:
    def __init__(self, at: float) -> None:
        self.at = at

    def synchronize(self) -> None:
        delay = self.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # releases the GIL, like waiting on a CUDA event


class SimulatedDeviceStep:
    """`DeviceStep`'s interface, with a device clock instead of a model."""

    timing: tuple[float, tuple[float, float, float]] = (38.7, (67.0, 20.9, 13.5))  # set by main()
    masked_ms = 0.5  # the masked rows' sampler call (mask copy, constrain and sample kernels); set by main()
    clocks: list[_DeviceClock] = []  # one per worker (each worker has its own device)
    pick_seconds = 0.0  # host time spent picking the simulated masked samples (not the engine's)

    def __init__(self, model: RWKV7, batch_size: int, state_dtype: str = "fp32", cuda_graphs: bool = True) -> None:
        self.clock = _DeviceClock(*self.timing)
        self.clocks.append(self.clock)
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.device = model.device
        self._rng = random.Random(0)
        self._np_rng = np.random.default_rng(0)
        self._masks = np.zeros((batch_size, MASK_WORDS), dtype=np.int32)
        self._masked_rows: dict[int, list[int]] = {}  # id(issued) -> the sample rows of its masked rows

    def issue(self, plan: StepPlan) -> IssuedStep:
        issued = IssuedStep(plan)
        done = self.clock.run(plan)
        ids = [self._rng.randrange(1, 65530) for _ in range(plan.sample_count)]
        issued.host_ids = torch.tensor(ids, dtype=torch.int64)
        masked = [row for row in plan.rows if row.samples and row.task.matcher is not None]
        if masked:
            issued.masked = MaskedRows(tasks=[row.task for row in masked], logits=None, inputs=None)  # type: ignore[arg-type]
            self._masked_rows[id(issued)] = [row.sample_row for row in masked]
        else:
            issued.copied = _Done(done)  # type: ignore[assignment]
        return issued

    def mask_rows(self, count: int) -> np.ndarray:
        return self._masks[:count]

    def sample_masked(self, issued: IssuedStep, mask_index: list[int], mask_count: int) -> None:
        """An allowed id per masked row: the lowest set bit of a random word, else of the first
        nonzero word (structural positions allow few ids)."""
        issued.masked = None
        started = time.perf_counter()
        sample_rows = self._masked_rows.pop(id(issued))
        assert issued.host_ids is not None
        words = self._masks[:mask_count].view(np.uint32)
        if mask_count:
            pick = self._np_rng.integers(0, MASK_WORDS, mask_count)
            chosen = words[np.arange(mask_count), pick]
            empty = chosen == 0
            if empty.any():
                first = np.argmax(words[empty] != 0, axis=1)
                pick[empty], chosen[empty] = first, words[empty][np.arange(len(first)), first]
            lowest = chosen & (~chosen + np.uint32(1))  # the word's lowest set bit
            bits = np.log2(np.maximum(lowest, 1)).astype(np.int64)
        ids = issued.host_ids.tolist()
        for n, sample_row in enumerate(sample_rows):
            k = mask_index[n]
            ids[sample_row] = 32 * int(pick[k]) + int(bits[k]) if k >= 0 else self._rng.randrange(1, 65530)
        issued.host_ids = torch.tensor(ids, dtype=torch.int64)
        SimulatedDeviceStep.pick_seconds += time.perf_counter() - started
        issued.copied = _Done(self.clock.run_after(self.masked_ms))  # type: ignore[assignment]

    def reset_slots(self, slots: list[int]) -> None:
        pass

    def copy_slot(self, source: int, targets: list[int]) -> None:
        pass

    def forget_last_step(self, step: IssuedStep | None = None) -> None:
        pass

    def peak_memory_bytes(self) -> int:
        return 0


async def _run(backend: AlbatrossRWKV, args: argparse.Namespace, timings: list[RequestTiming]) -> tuple[int, float]:
    """Every request at once; with `--latency` each one's timing is recorded into `timings`."""
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=0.6, top_k=50, stop=(), stop_token_ids=())
    constraint = OutputConstraint(json_schema_grammar(benchmark_schema()), "response_format json_schema")
    constrained = int(round(args.constrained * args.requests))
    requests = [
        GenerationRequest(
            [rng.randrange(1, 65530) for _ in range(rng.randint(args.prompt_min, args.prompt_max))],
            params,
            constraint=constraint if n % args.requests < constrained else None,
        )
        for n in range(args.requests)
    ]
    generated = 0

    async def one(request: GenerationRequest) -> None:
        nonlocal generated
        async for event in backend.async_generate(request):
            generated += len(event.token_ids)

    start = time.perf_counter()
    if args.latency:
        timings.extend(RequestTiming(prompt_tokens=len(r.prompt_tokens)) for r in requests)
        await asyncio.gather(*(one_request(backend, r, t, start) for r, t in zip(requests, timings)))
        generated = sum(t.tokens for t in timings)
    else:
        await asyncio.gather(*(one(r) for r in requests))
    return generated, time.perf_counter() - start


def _cpu_seconds(thread: threading.Thread) -> float:
    """CPU time a thread has used so far (Linux)."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1, help="workers, each with its own simulated device")
    parser.add_argument("--requests", type=int, default=960)
    parser.add_argument("--batch", type=int, default=960)
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-ms", type=float, default=38.7, help="a decode-only step (H200, 7.2B, 960 rows)")
    parser.add_argument("--constrained", type=float, default=0.0, help="fraction of the requests under structured_benchmark.py's 20-property schema")
    parser.add_argument("--masked-ms", type=float, default=0.5, help="the masked rows' sampler call on the device")
    parser.add_argument("--mixed", default="67,20.9,13.5",
                        help="a step with prompt chunks: ms, us per prompt token, us per decode row (H200 fit; "
                             "18,26,40 is the fit of docs/performance.md's adaptive-budget section)")  # fmt: skip
    parser.add_argument("--latency", action="store_true", help="time each request: TTFT and inter-token percentiles")
    parser.add_argument("--itl-target-ms", type=float, help="the adaptive prefill budget's target, 0: off (default: the engine's)")
    parser.add_argument("--prefill-budget", type=int, help="default: the engine's")
    parser.add_argument("--prefill-chunk", type=int, help="default: the engine's")
    args = parser.parse_args(argv)
    policy = {
        name: getattr(args, name) for name in ("itl_target_ms", "prefill_budget", "prefill_chunk") if getattr(args, name) is not None
    }

    SimulatedDeviceStep.timing = (args.decode_ms, tuple(float(x) for x in args.mixed.split(",")))  # type: ignore[assignment]
    SimulatedDeviceStep.masked_ms = args.masked_ms
    worker_module.DeviceStep = SimulatedDeviceStep  # type: ignore[misc,assignment]
    if args.workers == 1:
        shape, seed = parse_random_spec("2x64")
        model = RWKV7.from_state_dict(random_state_dict(shape, seed=seed), torch.device("cpu"), torch.float32, progress=False)
        backend = AlbatrossRWKV("random:2x64", 1, args.batch, model=model, overlap=True, **policy)
    else:  # one simulated device per worker, all on one device clock's timing each
        backend = AlbatrossRWKV("random:2x64", args.workers, args.batch, device="cpu", overlap=True, **policy)
    workers = [t for t in threading.enumerate() if t.name.startswith("albatross-worker")]
    main_thread = threading.main_thread()
    threads = [*workers, main_thread]
    cpu_before = [_cpu_seconds(t) for t in threads]
    process_before = time.process_time()
    timings: list[RequestTiming] = []
    try:
        generated, wall = asyncio.run(_run(backend, args, timings))
        used = [_cpu_seconds(t) - b for t, b in zip(threads, cpu_before)]
        process_cpu = time.process_time() - process_before
        worker_cpu, main_cpu = sum(used[:-1]), used[-1]
        status = backend.status()
        steps = int(status.get("steps", 0))  # type: ignore[call-overload]  # all workers' steps
        budgets = [worker._scheduler.budget.describe() for worker in backend.core.workers]  # the workers' own schedulers
        masked = int(status.get("masked_samples_total", 0))  # type: ignore[call-overload]
        fill_ms = float(status.get("mask_fill_ms_total", 0.0))  # type: ignore[arg-type]
    finally:
        backend.shutdown()
    clock = _DeviceClock(*SimulatedDeviceStep.timing)  # the workers' clocks, summed
    for one in SimulatedDeviceStep.clocks:
        clock.busy += one.busy
        clock.idle += one.idle
        for kind, seconds in one.idle_by_kind.items():
            clock.idle_by_kind[kind] = clock.idle_by_kind.get(kind, 0.0) + seconds
    print(f"{args.requests} requests, {args.workers} worker(s) of batch {args.batch}: {generated} tokens in {wall:.2f} s ({generated / wall:,.0f} tok/s); "
          f"simulated device busy {clock.busy:.2f} s, idle between steps {clock.idle:.2f} s "
          f"(host overhead {100 * clock.idle / max(clock.busy, 1e-9):.1f}% of device time)")  # fmt: skip
    print(f"CPU per step ({steps} steps): worker threads {1000 * worker_cpu / max(steps, 1):.2f} ms, "
          f"caller loop {1000 * main_cpu / max(steps, 1):.2f} ms, process {1000 * process_cpu / max(steps, 1):.2f} ms; idle before decode-only steps "
          f"{clock.idle_by_kind.get('decode', 0.0):.2f} s, before steps with prompt chunks {clock.idle_by_kind.get('mixed', 0.0):.2f} s")  # fmt: skip
    print(f"prefill policy: itl_target_ms={status.get('itl_target_ms')} prefill_budget={status.get('prefill_budget')} "
          f"prefill_chunk={status.get('prefill_chunk')}; fit per worker: {budgets}")  # fmt: skip
    if timings:
        ttft = percentiles([t.ttft_s for t in timings if t.tokens])
        itl = percentiles([g for t in timings for g in t.gaps_s])
        print(f"latency (simulated device, CPU host): TTFT p50 {ttft['p50']:.0f} / p90 {ttft['p90']:.0f} / p99 {ttft['p99']:.0f} ms; "
              f"inter-token p50 {itl['p50']:.1f} / p90 {itl['p90']:.1f} / p99 {itl['p99']:.1f} ms")  # fmt: skip
    if args.constrained:
        print(f"masked samples {masked} ({masked / max(steps, 1):.0f} a step): mask fill {fill_ms / max(steps, 1):.2f} ms a step "
              f"({1000 * fill_ms / max(masked, 1):.1f} us a mask); idle before masked sampler calls {clock.idle_by_kind.get('masked', 0.0):.2f} s; "
              f"the simulation's own picking of masked ids {1000 * SimulatedDeviceStep.pick_seconds / max(steps, 1):.2f} ms a step (worker CPU above includes it)")  # fmt: skip


if __name__ == "__main__":
    main()
