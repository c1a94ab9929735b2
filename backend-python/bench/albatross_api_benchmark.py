"""HTTP benchmark: a concurrency sweep of streaming requests against a running server.

For each concurrency level it keeps that many streams open until `--requests` (default: the level)
have completed, and reports TTFT, generated tokens, wall time, tokens/s and the p50/p90/p99 of
TTFT and of the inter-token latency (time between content chunks, spread over the tokens they
carry). Prints a table and writes JSON.

    python main.py --model models/x.pth --strategy "albatross workers=1 batch=960" &
    python bench/albatross_api_benchmark.py --url http://127.0.0.1:8000 --concurrency 1,64,256,960 \
        --max-tokens 256 --json out/api.json

CPU check with a tiny model: `--concurrency 1,4 --max-tokens 8`. At hundreds of streams add
`--client-procs 8`: one Python client process cannot parse that many events a second.

Against `bench/bench_server.py`, `--device-report` reads the server's device report before and
after each level and prints the level's own: with `--device-step profiled`, the GPU time of each
kind of step, the mixed steps' time fit and the GPU's idle time between steps, so an HTTP run's
time can be split into the device's and the host's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from step_report import print_device_report  # bench/ is the script's folder
from timeline import print_timeline, timeline_point

WORDS = ("river", "engine", "quiet", "lantern", "orbit", "maple", "signal", "harbor", "copper", "meadow")


@dataclass(slots=True)
class StreamResult:
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft_s: float = 0.0
    completion_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # seconds since the request started
    chunk_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class LevelSummary:
    concurrency: int
    requests: int
    failed: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_ms: dict[str, float]
    inter_token_ms: dict[str, float]
    timeline: list[dict[str, float]] = field(default_factory=list)
    device_report: list[dict[str, object]] = field(default_factory=list)  # one per worker (--device-report)


def read_device_report(args: argparse.Namespace) -> list[dict[str, object]]:
    """bench_server.py's device reports: what each worker's device did since the previous read."""
    headers = {"Authorization": f"Bearer {args.password}"} if args.password else {}
    answer = httpx.get(f"{args.url}/bench/device-report", headers=headers, timeout=60.0)
    answer.raise_for_status()
    workers: list[dict[str, object]] = answer.json()["workers"]
    return workers


class StatusPoller:
    """Samples the server's engine counters (GET /status, "effective") while a level runs, so a slow
    ramp can be told apart from slow steps: the same timeline engine_benchmark.py prints."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._stop = threading.Event()
        self.points: list[dict[str, float]] = []
        self._thread = threading.Thread(target=self._run, name="status-poller", daemon=True)

    def __enter__(self) -> StatusPoller:
        self._started = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self._args.password}"} if self._args.password else {}
        with httpx.Client(base_url=self._args.url, timeout=5.0, headers=headers) as client:
            while True:
                try:
                    effective = client.get("/status").json().get("effective", {})
                    self.points.append(timeline_point(time.time() - self._started, effective))
                except (httpx.HTTPError, ValueError):
                    pass  # a busy server answers late or not at all; the gap shows in the timeline
                if self._stop.wait(self._args.poll_interval):
                    return


ROUTE_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "openai-native": "/openai/v1/chat/completions",
}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {f"p{int(q * 100)}": ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0 for q in (0.5, 0.9, 0.99)}


def make_body(args: argparse.Namespace, rng: random.Random) -> dict[str, object]:
    text = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
    body: dict[str, object] = {
        "model": "bench",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": 0.6,
        "stop": [],
        "stop_token_ids": [],  # stops off: every request generates exactly max_tokens
        "seed": rng.randrange(2**31),
    }
    if args.route in ("chat", "openai-native"):
        body["messages"] = [{"role": "user", "content": text}]
    if args.route == "openai-native":
        body["use_prefix_cache"] = args.prefix_cache == "on"
    else:
        body["prompt"] = text
    return body


async def one_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, object], headers: dict[str, str], result: StreamResult | None = None
) -> StreamResult:
    """One streaming request. `result` is filled as events arrive, so a caller that cancels the
    stream (a load's deadline) keeps what had come by then."""
    result = StreamResult() if result is None else result
    await rows_stream(client, path, body, headers, [result])
    return result


async def rows_stream(client: httpx.AsyncClient, path: str, body: dict[str, object], headers: dict[str, str], results: list[StreamResult]) -> None:
    """One streaming request whose events carry `len(results)` rows: a batch route's prompts, told
    apart by `choices[].index` (one row: every choice is it). Each result is filled as its events
    arrive; the server's usage count applies to a single row only."""
    start = time.perf_counter()

    def fail(error: str) -> None:
        for result in results:
            result.error = error

    try:
        async with client.stream("POST", path, json=body, headers=headers) as response:
            for result in results:
                result.status = response.status_code
            if response.status_code != 200:
                fail((await response.aread()).decode(errors="replace")[:200])
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    fail(str(data["error"])[:200])
                    return
                usage = data.get("usage")
                if usage and len(results) == 1:
                    results[0].completion_tokens = int(usage.get("completion_tokens", 0))
                for choice in data.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if text:
                        now = time.perf_counter() - start
                        result = results[int(choice.get("index", 0))] if len(results) > 1 else results[0]
                        if not result.chunk_times:
                            result.ttft_s = now
                        result.chunk_times.append(now)
                        result.chunk_tokens.append(1)
        for result in results:
            result.ok = True
            if not result.completion_tokens:
                result.completion_tokens = sum(result.chunk_tokens)
    except (httpx.HTTPError, json.JSONDecodeError, IndexError, ValueError) as error:
        fail(f"{type(error).__name__}: {error}")


def inter_token_gaps(result: StreamResult) -> list[float]:
    """Gaps between content chunks, each spread over the tokens the stream produced per chunk."""
    times = result.chunk_times
    if len(times) < 2:
        return []
    tokens_per_chunk = max(1.0, result.completion_tokens / len(times))
    return [(b - a) / tokens_per_chunk for a, b in zip(times, times[1:])]


async def run_lanes(args: argparse.Namespace, bodies: list[dict[str, object]], lanes: int) -> tuple[list[StreamResult], float, float]:
    """`lanes` streams at a time over `bodies`, in this process. Returns the results and the
    wall-clock start and end (time.time(), comparable across processes)."""
    headers = {"Authorization": f"Bearer {args.password}"} if args.password else {}
    path = ROUTE_PATHS[args.route]
    limits = httpx.Limits(max_connections=lanes + 8, max_keepalive_connections=lanes + 8)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    queue: asyncio.Queue[dict[str, object]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    results: list[StreamResult] = []
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=timeout) as client:

        async def lane() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                results.append(await one_stream(client, path, body, headers))

        started = time.time()
        await asyncio.gather(*(lane() for _ in range(min(lanes, len(bodies)))))
        ended = time.time()
    return results, started, ended


def _client_process(args: argparse.Namespace, bodies: list[dict[str, object]], lanes: int) -> tuple[list[StreamResult], float, float]:
    return asyncio.run(run_lanes(args, bodies, lanes))


def run_level(args: argparse.Namespace, concurrency: int) -> LevelSummary:
    """One concurrency level. With --client-procs P the streams are spread over P client processes,
    so that parsing ~10k SSE events a second is not the client's bottleneck."""
    total = args.requests or concurrency
    rng = random.Random(args.seed + concurrency)
    bodies = [make_body(args, rng) for _ in range(total)]
    procs = max(1, min(args.client_procs, concurrency))
    if args.device_report:
        read_device_report(args)  # drop what the device did before this level
    with StatusPoller(args) as poller:
        if procs == 1:
            results, started, ended = asyncio.run(run_lanes(args, bodies, concurrency))
        else:
            shares = [bodies[i::procs] for i in range(procs)]
            lanes = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
            with ProcessPoolExecutor(max_workers=procs, mp_context=multiprocessing.get_context("spawn")) as pool:
                parts = list(pool.map(_client_process, [args] * procs, shares, lanes))
            results = [r for part in parts for r in part[0]]
            started, ended = min(p[1] for p in parts), max(p[2] for p in parts)
    wall = ended - started
    good = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"  {len(failed)} failed at concurrency {concurrency}; first: {failed[0].status} {failed[0].error}")
    generated = sum(r.completion_tokens for r in good)
    return LevelSummary(
        concurrency=concurrency,
        requests=total,
        failed=len(failed),
        generated_tokens=generated,
        wall_s=wall,
        tokens_per_s=generated / wall if wall > 0 else 0.0,
        ttft_ms=percentiles([r.ttft_s for r in good if r.chunk_times]),
        inter_token_ms=percentiles([g for r in good for g in inter_token_gaps(r)]),
        timeline=poller.points,
        device_report=read_device_report(args) if args.device_report else [],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--password")
    parser.add_argument("--route", choices=sorted(ROUTE_PATHS), default="chat",
                        help="openai-native: /openai/v1/chat/completions, whose prefix cache --prefix-cache can turn off")
    parser.add_argument("--prefix-cache", choices=("on", "off"), default="on", help="with --route openai-native")
    parser.add_argument("--concurrency", default="1,16,64,256,960", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: the level)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-procs", type=int, default=1, help="client processes sharing the streams of a level")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /status samples")
    parser.add_argument("--device-report", action="store_true", help="print each level's device report (bench/bench_server.py)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    levels = [int(level) for level in args.concurrency.split(",") if level]
    summaries = []
    for level in levels:
        summary = run_level(args, level)
        summaries.append(summary)
        print(f"concurrency {level}: {summary.tokens_per_s:.1f} tok/s", flush=True)
        if level >= 64:
            print_timeline(summary.timeline, max(args.poll_interval, summary.wall_s / 40))
        for index, report in enumerate(summary.device_report):
            print_device_report(report, f" of worker {index} at concurrency {level}")

    print(f"\n{args.url} {args.route} max_tokens={args.max_tokens}")
    print(f"{'conc':>6}{'reqs':>6}{'fail':>6}{'gen tok':>10}{'wall s':>9}{'tok/s':>10}"
          f"{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'ITL p50':>9}{'p90':>8}{'p99':>8}  (ms)")
    for s in summaries:
        print(f"{s.concurrency:>6}{s.requests:>6}{s.failed:>6}{s.generated_tokens:>10}{s.wall_s:>9.2f}{s.tokens_per_s:>10.1f}"
              f"{s.ttft_ms['p50']:>10.1f}{s.ttft_ms['p90']:>9.1f}{s.ttft_ms['p99']:>9.1f}"
              f"{s.inter_token_ms['p50']:>9.2f}{s.inter_token_ms['p90']:>8.2f}{s.inter_token_ms['p99']:>8.2f}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"url": args.url, "route": args.route, "max_tokens": args.max_tokens,
                                         "levels": [asdict(s) for s in summaries]}, indent=2))  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
