"""The engine's host work against simulated devices: is Python fast enough to keep the GPUs busy?

The real scheduler, worker, event delivery and adapter run; only `DeviceStep` is replaced by a
simulated device (bench/simulated_device.py) whose steps take the H200's measured step times and
whose sampled ids arrive when the step is done. Whatever the host adds on top of the devices' busy
time is host overhead: with enough host speed, N workers deliver N times one worker's tokens/s.

    python bench/host_overhead.py                                   # one worker, 960 requests, thread mode
    python bench/host_overhead.py --workers 1,2,4,8 --worker-mode thread,process --json out.json
    python bench/host_overhead.py --requests 64 --batch 64 --max-tokens 64
    python bench/host_overhead.py --mixed 18,26,40 --latency --itl-target-ms 0    # static budget
    python bench/host_overhead.py --mixed 18,26,40 --latency --itl-target-ms 150  # adaptive budget
    python bench/host_overhead.py --constrained 0.1   # 10% of the requests under structured_benchmark.py's schema

`--requests` and `--batch` are per worker (each simulated GPU gets the 960-request workload of
engine_benchmark.py). For each (mode, N) it prints tokens/s and the speed-up over one worker of
the same mode, the devices' idle time between steps, and the CPU time per step of the workers
(threads, or their processes), of the server process's link threads (worker processes: decoding
a step's events from the pipe and handing them to the callers), of the callers' loop, and of the
whole server process. In thread mode it also times the worker's result processing (detokenize,
stop matching, events): the per-step work a boundary that sent token ids would move into the
server process. A machine needs a core per worker process plus the server's for the process rows
to mean anything; `--decode-ms` stretches the simulated steps to see the scaling on fewer cores.

`--latency` also times every request as engine_benchmark.py does (TTFT, inter-token gaps per
token; it adds that bookkeeping to the caller's loop), and `--itl-target-ms` / `--prefill-budget` /
`--prefill-chunk` set the engine's prefill policy, so the adaptive budget can be compared with the
static one against the same simulated devices; each run prints the budget's fit per worker.
`--constrained F` puts that fraction of the requests under structured_benchmark.py's schema: the
real matchers fill the masks, the simulated device picks allowed ids and runs the masked rows'
sampler call after the forward (`--masked-ms`), so mask work that does not fit under the forward
shows up as idle time before those calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross_engine.adapter import AlbatrossRWKV
from albatross_engine.results import ResultProcessor
from albatross_engine.worker_process import WorkerProcess
from bench.simulated_device import H200_DECODE_MS, H200_MIXED, SimulatedDevice
from albatross.constraints import json_schema_grammar
from engine_benchmark import RequestTiming, one_request, percentiles  # bench/ is the script's folder
from runner.interface import GenerationRequest, OutputConstraint, SamplingParams
from structured_benchmark import benchmark_schema


@dataclass(slots=True)
class RunResult:
    worker_mode: str
    workers: int
    requests: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float  # over one worker of the same mode
    steps: int
    device_busy_s: float  # summed over the devices
    device_idle_s: float  # between steps, summed over the devices
    worker_cpu_ms_per_step: float  # worker threads or worker processes, per step of one worker
    results_ms_per_step: float  # thread mode: ResultProcessor.process, per step of one worker
    link_cpu_ms_per_step: float  # process mode: the server's link threads, per step of one worker
    caller_loop_ms_per_step: float  # per step of one worker
    server_cpu_ms_per_step: float  # the whole server process, per step of one worker
    prefill_policy: dict[str, object]  # itl_target_ms, prefill_budget, prefill_chunk as the engine runs them
    prefill_budget_fit: list[dict[str, float | int | None]]  # per worker
    ttft_ms: dict[str, float]  # --latency: percentiles, else empty
    inter_token_ms: dict[str, float]
    masked_samples: int  # --constrained: every worker's masked samples
    mask_fill_ms_per_step: float  # the workers' mask filling, per step of one worker
    masked_idle_s: float  # the devices' idle time before the masked rows' sampler calls, summed
    pick_ms_per_step: float  # the simulation's own picking of masked ids (in the worker CPU above)


class _ResultTimer:
    """Times ResultProcessor.process in this process (worker threads only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._original: Callable[..., None] = ResultProcessor.process

    def __enter__(self) -> _ResultTimer:
        original, timer = self._original, self

        def timed(processor: ResultProcessor, issued: object, advanced: Callable[[], None] | None = None) -> None:
            started = time.thread_time()
            try:
                original(processor, issued, advanced)
            finally:
                with timer._lock:
                    timer.seconds += time.thread_time() - started

        ResultProcessor.process = timed  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        ResultProcessor.process = self._original  # type: ignore[method-assign]


async def _load(backend: AlbatrossRWKV, args: argparse.Namespace, count: int, timings: list[RequestTiming]) -> tuple[int, float]:
    """Every request at once; with `--latency` each one's timing is recorded into `timings`."""
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=0.6, top_k=50, stop=(), stop_token_ids=())
    constraint = OutputConstraint(json_schema_grammar(benchmark_schema()), "response_format json_schema")
    constrained = int(round(args.constrained * count))
    requests = [
        GenerationRequest(
            [rng.randrange(1, 65530) for _ in range(rng.randint(args.prompt_min, args.prompt_max))],
            params,
            constraint=constraint if n < constrained else None,
        )
        for n in range(count)
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


def _thread_cpu(thread: threading.Thread) -> float:
    """CPU time a thread has used so far (Linux)."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _process_cpu(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(args: argparse.Namespace, mode: str, workers: int) -> RunResult:
    device = SimulatedDevice(args.decode_ms, tuple(float(x) for x in args.mixed.split(",")), args.masked_ms)  # type: ignore[arg-type]
    policy = {name: getattr(args, name) for name in ("itl_target_ms", "prefill_budget", "prefill_chunk") if getattr(args, name) is not None}
    backend = AlbatrossRWKV("random:2x64", workers, args.batch, device="cpu", overlap=True, worker_mode=mode, device_step_factory=device, **policy)
    timings: list[RequestTiming] = []
    try:
        engine_workers = backend.core.workers
        threads = {t.name: t for t in threading.enumerate()}
        worker_threads = [t for name, t in threads.items() if name.startswith("albatross-worker-") and not name.endswith("-link")]
        link_threads = [t for name, t in threads.items() if name.endswith("-link")]
        pids = [w.pid for w in engine_workers if isinstance(w, WorkerProcess) and w.pid is not None]
        main = threading.main_thread()

        def cpu() -> tuple[float, float, float, float]:
            workers_cpu = sum(map(_thread_cpu, worker_threads)) + sum(map(_process_cpu, pids))
            return workers_cpu, sum(map(_thread_cpu, link_threads)), _thread_cpu(main), time.process_time()

        before = cpu()
        with _ResultTimer() as results:
            generated, wall = asyncio.run(_load(backend, args, args.requests * workers, timings))
        after = cpu()
        status = backend.status()
        steps = int(status.get("steps", 0))  # type: ignore[call-overload]  # every worker's
        reports = backend.core.device_reports()
        fits = backend.core.prefill_budget_fits()
    finally:
        backend.shutdown()
    per_step = [1000 * (b - a) / max(steps, 1) for a, b in zip(before, after)]
    idle_by_kind = [r.get("idle_by_kind_s", {}) for r in reports]
    return RunResult(
        worker_mode=mode, workers=workers, requests=args.requests * workers, generated_tokens=generated, wall_s=wall,
        tokens_per_s=generated / wall, speedup=1.0, steps=steps,
        device_busy_s=sum(float(r.get("busy_s", 0.0)) for r in reports),  # type: ignore[arg-type]
        device_idle_s=sum(float(r.get("idle_s", 0.0)) for r in reports),  # type: ignore[arg-type]
        worker_cpu_ms_per_step=per_step[0], results_ms_per_step=1000 * results.seconds / max(steps, 1),
        link_cpu_ms_per_step=per_step[1], caller_loop_ms_per_step=per_step[2], server_cpu_ms_per_step=per_step[3],
        prefill_policy={name: status.get(name) for name in ("itl_target_ms", "prefill_budget", "prefill_chunk")}, prefill_budget_fit=fits,
        ttft_ms=percentiles([t.ttft_s for t in timings if t.tokens]) if timings else {},
        inter_token_ms=percentiles([g for t in timings for g in t.gaps_s]) if timings else {},
        masked_samples=int(status.get("masked_samples_total", 0)),  # type: ignore[call-overload]
        mask_fill_ms_per_step=float(status.get("mask_fill_ms_total", 0.0)) / max(steps, 1),  # type: ignore[arg-type]
        masked_idle_s=sum(float(kinds.get("masked", 0.0)) for kinds in idle_by_kind),  # type: ignore[union-attr]
        pick_ms_per_step=1000 * sum(float(r.get("pick_s", 0.0)) for r in reports) / max(steps, 1),  # type: ignore[arg-type]
    )  # fmt: skip


def print_table(results: list[RunResult], args: argparse.Namespace) -> None:
    print(f"\nsimulated device: decode step {args.decode_ms} ms, mixed step {args.mixed} (ms, us/prompt token, us/decode row); "
          f"{args.requests} requests per worker, batch {args.batch}, {args.max_tokens} tokens each; {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'mode':>8}{'N':>3}{'tok/s':>10}{'x N=1':>7}{'wall s':>8}{'idle %':>8}"
          f"{'worker ms':>11}{'results':>9}{'link':>7}{'loop':>7}{'server':>8}  (CPU ms per step of one worker)")  # fmt: skip
    for r in results:
        idle = 100 * r.device_idle_s / max(r.device_busy_s, 1e-9)
        print(f"{r.worker_mode:>8}{r.workers:>3}{r.tokens_per_s:>10,.0f}{r.speedup:>7.2f}{r.wall_s:>8.2f}{idle:>8.1f}"
              f"{r.worker_cpu_ms_per_step:>11.2f}{r.results_ms_per_step:>9.2f}{r.link_cpu_ms_per_step:>7.2f}"
              f"{r.caller_loop_ms_per_step:>7.2f}{r.server_cpu_ms_per_step:>8.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1", help="comma-separated worker counts, each worker with its own simulated device")
    parser.add_argument("--worker-mode", default="thread", help="comma-separated: thread, process")
    parser.add_argument("--requests", type=int, default=960, help="per worker")
    parser.add_argument("--batch", type=int, default=960, help="state slots per worker")
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-ms", type=float, default=H200_DECODE_MS, help="a decode-only step (H200, 7.2B, 960 rows)")
    parser.add_argument("--mixed", default=",".join(map(str, H200_MIXED)),
                        help="a step with prompt chunks: ms, us per prompt token, us per decode row (H200 fit; "
                             "18,26,40 is the fit of docs/performance.md's adaptive-budget section)")  # fmt: skip
    parser.add_argument("--latency", action="store_true", help="time each request: TTFT and inter-token percentiles")
    parser.add_argument("--itl-target-ms", type=float, help="the adaptive prefill budget's target, 0: off (default: the engine's)")
    parser.add_argument("--prefill-budget", type=int, help="default: the engine's")
    parser.add_argument("--prefill-chunk", type=int, help="default: the engine's")
    parser.add_argument("--constrained", type=float, default=0.0, help="fraction of the requests under structured_benchmark.py's 20-property schema")
    parser.add_argument("--masked-ms", type=float, default=0.5, help="the masked rows' sampler call on the device")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    results: list[RunResult] = []
    for mode in args.worker_mode.split(","):
        single: float | None = None
        for workers in (int(n) for n in args.workers.split(",")):
            result = run_one(args, mode, workers)
            single = result.tokens_per_s if workers == 1 else single
            result.speedup = result.tokens_per_s / single if single else float("nan")
            results.append(result)
            print(f"{mode} x{workers}: {result.generated_tokens} tokens in {result.wall_s:.2f} s ({result.tokens_per_s:,.0f} tok/s)", flush=True)
            print(f"  prefill policy: {result.prefill_policy}; fit per worker: {result.prefill_budget_fit}")
            if result.ttft_ms:
                ttft, itl = result.ttft_ms, result.inter_token_ms
                print(f"  latency (simulated device, CPU host): TTFT p50 {ttft['p50']:.0f} / p90 {ttft['p90']:.0f} / p99 {ttft['p99']:.0f} ms; "
                      f"inter-token p50 {itl['p50']:.1f} / p90 {itl['p90']:.1f} / p99 {itl['p99']:.1f} ms", flush=True)  # fmt: skip
            if args.constrained:
                m = result
                print(f"  masked samples {m.masked_samples} ({m.masked_samples / max(m.steps, 1):.0f} a step): mask fill {m.mask_fill_ms_per_step:.2f} ms "
                      f"a step; idle before masked sampler calls {m.masked_idle_s:.2f} s; the simulation's own picking of masked ids "
                      f"{m.pick_ms_per_step:.2f} ms a step (worker CPU includes it)", flush=True)  # fmt: skip
    print_table(results, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": [asdict(r) for r in results]}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
