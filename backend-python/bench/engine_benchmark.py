"""Engine-level benchmark: many requests in flight through AlbatrossRWKV.async_generate, in process
(no HTTP). Reports tokens/s delivered to the adapter's callers, TTFT and inter-token latency
percentiles, and the engine's own step metrics. Prints a table and writes JSON.

GPU (the lead's run; random weights of a real shape, built on the GPU in seconds):

    python bench/engine_benchmark.py --shape 7.2b --requests 960 --batch 960 --json out/engine.json

CPU check with a tiny model:

    python bench/engine_benchmark.py --shape 2x128 --device cpu --requests 16 --batch 8 \
        --prompt-min 8 --prompt-max 32 --max-tokens 8

`--model PATH` serves a checkpoint file instead of random weights. Stops are off (no stop strings,
no stop token), so every request generates exactly `--max-tokens` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import cuda_ops
from albatross.model import RWKV7
from albatross.random_checkpoint import random_state_dict
from albatross_engine.adapter import AlbatrossRWKV, parse_random_spec
from step_profile import ProfiledDevice  # bench/ is the script's folder
from step_report import print_report
from timeline import print_timeline, timeline_point
from runner.interface import GenerationRequest, SamplingParams


@dataclass(slots=True)
class RequestTiming:
    prompt_tokens: int
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token-bearing events, per token
    tokens: int = 0
    finish_reason: str | None = None


@dataclass(slots=True)
class Summary:
    requests: int
    batch: int
    workers: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_ms: dict[str, float]
    inter_token_ms: dict[str, float]
    engine: dict[str, object]
    device: str
    model: str
    worker_mode: str = "thread"
    timeline: list[dict[str, float]] = field(default_factory=list)
    step_profile: list[dict[str, object]] = field(default_factory=list)  # one per worker (its GPU)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(ordered) * 1000.0}


def build_backend(args: argparse.Namespace) -> AlbatrossRWKV:
    extras: dict[str, object] = {
        name: getattr(args, name) for name in ("prefill_chunk", "prefill_budget", "itl_target_ms") if getattr(args, name) is not None
    }
    if args.overlap is not None:
        extras["overlap"] = args.overlap == "on"
    if args.state_dtype is not None:
        extras["state_dtype"] = args.state_dtype
    if args.worker_mode is not None:
        extras["worker_mode"] = args.worker_mode
    if args.step_profile and (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        extras["device_step_factory"] = ProfiledDevice()  # CUDA events around every step, in each worker
    if args.model or args.workers > 1 or args.worker_mode == "process":  # each worker loads its own copy (random weights: built on its GPU)
        return AlbatrossRWKV(args.model or f"random:{args.shape}", args.workers, args.batch, device=args.device, **extras)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        cuda_ops.enable_cuda_kernels()
    shape, seed = parse_random_spec(args.shape)
    started = time.perf_counter()
    weights = random_state_dict(shape, seed=seed, device=device, dtype=dtype)
    model = RWKV7.from_state_dict(weights, device, dtype, name=f"random-{args.shape}", progress=False)
    print(f"built random {args.shape} (layers {shape.n_layer}, width {shape.n_embd}) on {device} "
          f"in {time.perf_counter() - started:.1f}s", flush=True)
    return AlbatrossRWKV(f"random:{args.shape}", 1, args.batch, model=model, **extras)


async def one_request(backend: AlbatrossRWKV, request: GenerationRequest, timing: RequestTiming, start: float) -> None:
    last = start
    async for event in backend.async_generate(request):
        now = time.perf_counter()
        count = len(event.token_ids)
        if count:
            if timing.tokens == 0:
                timing.ttft_s = now - start
            else:
                timing.gaps_s.extend([(now - last) / count] * count)
            timing.tokens += count
            last = now
        if event.finish_reason is not None:
            timing.finish_reason = event.finish_reason


async def run(backend: AlbatrossRWKV, args: argparse.Namespace, timeline: list[dict[str, float]]) -> tuple[list[RequestTiming], float]:
    rng = random.Random(args.seed)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=1.0, top_p=0.6, top_k=50, presence_penalty=0.5,
        frequency_penalty=0.1, stop=(), stop_token_ids=(),
    )  # fmt: skip
    requests, timings = [], []
    for index in range(args.requests):
        length = rng.randint(args.prompt_min, args.prompt_max)
        prompt = [rng.randrange(1, 65530) for _ in range(length)]
        requests.append(GenerationRequest(prompt, params, request_id=f"bench-{index}"))
        timings.append(RequestTiming(prompt_tokens=length))
    start = time.perf_counter()

    async def sample_timeline() -> None:
        while True:
            timeline.append(timeline_point(time.perf_counter() - start, backend.status()))
            await asyncio.sleep(args.timeline_interval)

    sampler = asyncio.create_task(sample_timeline())
    await asyncio.gather(*(one_request(backend, r, t, start) for r, t in zip(requests, timings)))
    wall = time.perf_counter() - start
    sampler.cancel()
    timeline.append(timeline_point(wall, backend.status()))
    return timings, wall


def warm_up(backend: AlbatrossRWKV) -> None:
    request = GenerationRequest([1, 2, 3, 4], SamplingParams(max_tokens=4, stop_token_ids=()))
    for _ in backend.generate(request):
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7.2b", help="random weights: a named shape (0.1b .. 7.2b) or LxW (e.g. 2x128)")
    parser.add_argument("--model", help="a checkpoint path instead of random weights")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--workers", type=int, default=1, help="workers (one GPU each; more than one loads the model per worker)")
    parser.add_argument("--worker-mode", choices=("thread", "process"), help="default: the engine's (a process per GPU on cuda)")
    parser.add_argument("--requests", type=int, default=960)
    parser.add_argument("--batch", type=int, default=960, help="state slots (the engine's batch size)")
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prefill-chunk", type=int, help="default: the engine's (128)")
    parser.add_argument("--prefill-budget", type=int, help="default: the engine's (16384)")
    parser.add_argument("--itl-target-ms", type=float, help="the adaptive prefill budget's step-time target, 0: off (default: the engine's, 150)")
    parser.add_argument("--overlap", choices=("on", "off"), help="default: on for cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dtype", choices=("fp32", "fp16", "bf16"), help="default: the engine's (fp16 on cuda, fp32 on cpu)")
    parser.add_argument("--timeline-interval", type=float, default=0.25, help="seconds between engine-counter samples")
    parser.add_argument("--step-profile", action="store_true", help="CUDA events around every step: device time by step kind, GPU idle between steps")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    backend = build_backend(args)
    try:
        warm_up(backend)
        timeline: list[dict[str, float]] = []
        timings, wall = asyncio.run(run(backend, args, timeline))
        engine = backend.status()
        engine["prefill_budget_fit"] = backend.core.prefill_budget_fits()  # each worker's own scheduler
        step_profile = [report for report in backend.core.device_reports() if report] if args.step_profile else []
    finally:
        backend.shutdown()

    generated = sum(t.tokens for t in timings)
    unfinished = [t for t in timings if t.finish_reason != "length"]
    if unfinished:
        print(f"WARNING: {len(unfinished)} requests did not finish by length: {unfinished[0].finish_reason}", flush=True)
    device = str(engine.get("device"))
    if device.startswith("cuda"):
        device += f" ({torch.cuda.get_device_name()})"
    summary = Summary(
        requests=args.requests,
        batch=args.batch,
        workers=args.workers,
        prompt_tokens=sum(t.prompt_tokens for t in timings),
        generated_tokens=generated,
        wall_s=wall,
        tokens_per_s=generated / wall if wall > 0 else 0.0,
        ttft_ms=percentiles([t.ttft_s for t in timings if t.tokens]),
        inter_token_ms=percentiles([g for t in timings for g in t.gaps_s]),
        engine={k: engine[k] for k in ("step_time_ms", "decode_tokens_per_step", "prefill_tokens_per_step",
                                       "peak_device_memory_bytes", "steps", "itl_target_ms", "prefill_budget_fit") if k in engine},
        device=device,
        model=args.model or f"random:{args.shape}",
        worker_mode=backend.worker_mode,
        timeline=timeline,
        step_profile=step_profile,
    )  # fmt: skip

    for index, report in enumerate(step_profile):
        print_report(report, f" of worker {index}")
    print(f"\n{summary.model} on {summary.device}, {summary.workers} worker {summary.worker_mode}(s) | torch {torch.__version__} | python {platform.python_version()}")
    print(f"{'requests':>9}{'batch':>7}{'prompt tok':>12}{'gen tok':>10}{'wall s':>9}{'tok/s':>10}"
          f"{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'ITL p50':>9}{'p90':>8}{'p99':>8}  (ms)")
    print(f"{summary.requests:>9}{summary.batch:>7}{summary.prompt_tokens:>12}{summary.generated_tokens:>10}"
          f"{summary.wall_s:>9.2f}{summary.tokens_per_s:>10.1f}{summary.ttft_ms['p50']:>10.1f}{summary.ttft_ms['p90']:>9.1f}"
          f"{summary.ttft_ms['p99']:>9.1f}{summary.inter_token_ms['p50']:>9.2f}{summary.inter_token_ms['p90']:>8.2f}"
          f"{summary.inter_token_ms['p99']:>8.2f}")  # fmt: skip
    print(f"engine: {summary.engine}")
    print_timeline(timeline, max(args.timeline_interval, wall / 40))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(summary), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
