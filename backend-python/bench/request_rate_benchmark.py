"""Request-rate benchmark: streaming requests arriving as a Poisson process at 1, 2, 4 ... 64
requests/s against a running server; median and p99 of end-to-end latency (to the last token),
time to first token and inter-token latency, plus throughput, per rate. Prints a table and
writes JSON (bench/plot_request_rate.py turns one JSON per server into the latency-vs-rate plots).

    python main.py --model-path random:7.2b --strategy "albatross workers=1 batch=960" --port 8123 &
    python bench/request_rate_benchmark.py --url http://127.0.0.1:8123 --label albatross --json out/rate_albatross.json

The prompt pool is 1,200 requests drawn once from a fixed seed (LENGTH_MIX, stated in the output
and the JSON); the run at rate r sends the first min(1200, r x --duration) of them, so every rate
and every server sees the same requests. Stops are off: a request generates exactly its
max_tokens. `--dialect` adapts path and body to the server (ours, RWKV-Runner, rwkv_lightning).
At high rates the streams are spread over several client processes (one Python process parses
at most ~11k tokens/s of SSE events); the output says how many each rate used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from albatross_api_benchmark import StreamResult, inter_token_gaps, one_stream, rows_stream  # bench/ is the script's folder

WORDS = (
    "river engine quiet lantern orbit maple signal harbor copper meadow winter garden silver market "
    "window forest bridge candle thunder planet morning letter pocket island shadow feather mirror "
    "travel golden number simple yellow summer castle village ocean rabbit marble basket pencil"
).split()


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    share: float  # fraction of the pool
    prompt_words: tuple[int, int]  # uniform range; a word is one or two tokens
    max_tokens: tuple[int, int]  # uniform range of generated tokens (stops off)


# A chat service's mix: mostly conversational turns, a share of long-context prompts (documents,
# retrieval) and of generation-heavy requests (stories, code).
LENGTH_MIX = (
    RequestClass("chat turn", 0.5, (64, 512), (64, 256)),
    RequestClass("long context", 0.3, (1024, 3072), (64, 256)),
    RequestClass("generation", 0.2, (16, 128), (256, 512)),
)
POOL_SIZE = 1200


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    kind: str
    prompt_words: int
    max_tokens: int
    seed: int


def request_pool(size: int = POOL_SIZE, seed: int = 0, mix: tuple[RequestClass, ...] = LENGTH_MIX) -> list[PlannedRequest]:
    """`size` requests with the mix's shares exactly (rounded), shuffled with `seed`."""
    rng = random.Random(seed)
    counts = [round(c.share * size) for c in mix]
    counts[0] += size - sum(counts)
    kinds = [c for c, n in zip(mix, counts) for _ in range(n)]
    rng.shuffle(kinds)
    return [
        PlannedRequest(i, c.name, rng.randint(*c.prompt_words), rng.randint(*c.max_tokens), rng.randrange(2**31))
        for i, c in enumerate(kinds)
    ]


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` per second; the first at 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def prompt_text(request: PlannedRequest) -> str:
    rng = random.Random(request.seed)
    return " ".join(rng.choice(WORDS) for _ in range(request.prompt_words))


# ----------------------------------------------------------------------------------------------
# what each server takes


def _ours(request: PlannedRequest, temperature: float) -> tuple[str, dict[str, object]]:
    return "/v1/chat/completions", {
        "model": "bench", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt_text(request)}],
        "max_tokens": request.max_tokens, "temperature": temperature, "top_p": 0.6, "top_k": 50,
        "stop": [], "stop_token_ids": [], "seed": request.seed,
    }  # fmt: skip


def _runner(request: PlannedRequest, temperature: float) -> tuple[str, dict[str, object]]:
    return "/v1/chat/completions", {
        "model": "rwkv", "stream": True, "messages": [{"role": "user", "content": prompt_text(request)}],
        "max_tokens": request.max_tokens, "temperature": temperature, "top_p": 0.6,
        "presence_penalty": 0, "frequency_penalty": 0, "stop": [],
    }  # fmt: skip


def _lightning(request: PlannedRequest, temperature: float) -> tuple[str, dict[str, object]]:
    return "/openai/v1/chat/completions", {
        "model": "rwkv7", "stream": True, "messages": [{"role": "user", "content": prompt_text(request)}],
        "max_tokens": request.max_tokens, "temperature": temperature, "top_p": 0.6, "top_k": 50,
        "stop_tokens": [], "alpha_presence": 0, "alpha_frequency": 0, "use_prefix_cache": False,
    }  # fmt: skip


def _lightning_batch(requests: list[PlannedRequest], temperature: float) -> tuple[str, dict[str, object]]:
    # rwkv_lightning's batch route takes raw prompts (its OpenAI route formats the chat turn the same
    # way); one max_tokens for the batch, chunk_size 1 so each row's tokens stream as they come
    return "/v1/chat/completions", {
        "model": "rwkv7", "stream": True, "contents": [f"User: {prompt_text(r)}\n\nAssistant:" for r in requests],
        "max_tokens": max(r.max_tokens for r in requests), "temperature": temperature, "top_p": 0.6, "top_k": 50,
        "stop_tokens": [], "alpha_presence": 0, "alpha_frequency": 0, "chunk_size": 1,
    }  # fmt: skip


DIALECTS: dict[str, Callable[[PlannedRequest, float], tuple[str, dict[str, object]]]] = {
    "albatross": _ours,  # our server, any backend (albatross or classic)
    "runner": _runner,  # RWKV-Runner's backend-python
    "lightning": _lightning,  # rwkv_lightning's OpenAI route
}
# Servers whose best route takes many prompts in one request and streams every row's tokens in
# one event a step (`choices[].index` is the row): requests that arrive together go as one
# request of up to `--batch-group` prompts, each prompt still measured as its own stream.
BATCH_DIALECTS: dict[str, Callable[[list[PlannedRequest], float], tuple[str, dict[str, object]]]] = {
    "lightning-batch": _lightning_batch,  # rwkv_lightning's /v1/chat/completions with `contents`
}


# ----------------------------------------------------------------------------------------------
# one rate


@dataclass(slots=True)
class Outcome:
    index: int
    kind: str
    arrival_s: float  # scheduled offset from the load's start
    send_lag_s: float  # how late the client sent it (a saturated client shows here)
    status: int = 0
    ok: bool = False
    error: str = ""
    finished: bool = False  # False: still streaming when the drain ended
    ttft_s: float = 0.0  # 0: no first token (yet)
    e2e_s: float = 0.0  # to the last token (of an unfinished stream: the last one before the deadline)
    completion_tokens: int = 0  # the server's usage count, else the content chunks seen (so far)
    max_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)


def request_groups(
    share: list[tuple[PlannedRequest, float]], dialect: str, batch_group: int
) -> list[list[tuple[PlannedRequest, float]]]:
    """The HTTP requests a share is sent as: one a prompt, or, for a batch dialect, the prompts
    that arrive at the same moment (a burst) in groups of up to `batch_group`."""
    if dialect not in BATCH_DIALECTS:
        return [[item] for item in share]
    groups: list[list[tuple[PlannedRequest, float]]] = []
    for item in share:
        last = groups[-1] if groups else None
        if last is not None and last[0][1] == item[1] and len(last) < batch_group:
            last.append(item)
        else:
            groups.append([item])
    return groups


async def _run_share(args: argparse.Namespace, share: list[tuple[PlannedRequest, float]], start_at: float) -> list[Outcome]:
    headers = {"Authorization": f"Bearer {args.password}"} if args.password else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=timeout) as client:

        async def one(group: list[tuple[PlannedRequest, float]]) -> None:
            arrival = group[0][1]
            await asyncio.sleep(max(0.0, start_at + arrival - time.time()))
            lag = time.time() - start_at - arrival
            mine = [Outcome(r.index, r.kind, arrival, lag, max_tokens=r.max_tokens) for r, _ in group]
            outcomes.extend(mine)
            results = [StreamResult() for _ in group]
            try:
                if args.dialect in BATCH_DIALECTS:
                    path, body = BATCH_DIALECTS[args.dialect]([r for r, _ in group], args.temperature)
                    await rows_stream(client, path, body, headers, results)
                else:
                    path, body = DIALECTS[args.dialect](group[0][0], args.temperature)
                    await one_stream(client, path, body, headers, results[0])
                for outcome in mine:
                    outcome.finished = True
            finally:  # a stream closed at the deadline keeps its status, first token and tokens so far
                for outcome, result in zip(mine, results):
                    outcome.status, outcome.ok, outcome.error = result.status, result.ok, result.error
                    outcome.ttft_s = result.ttft_s
                    outcome.e2e_s = result.chunk_times[-1] if result.chunk_times else 0.0
                    outcome.completion_tokens = result.completion_tokens or sum(result.chunk_tokens)
                    outcome.gaps_s = inter_token_gaps(result)

        tasks = [asyncio.create_task(one(group)) for group in request_groups(share, args.dialect, getattr(args, "batch_group", 1))]
        last_arrival = max((arrival for _, arrival in share), default=0.0)
        deadline = start_at + last_arrival + args.drain
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.time()))
        for task in pending:  # requests still streaming at the deadline: closed (the server aborts them)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return outcomes


def _client_process(args: argparse.Namespace, share: list[tuple[PlannedRequest, float]], start_at: float) -> list[Outcome]:
    return asyncio.run(_run_share(args, share, start_at))


def client_processes(rate: float, mean_tokens: float, requested: int) -> int:
    """Processes for a rate: `requested`, or enough that none parses more than ~4k tokens/s."""
    if requested > 0:
        return requested
    if math.isinf(rate):
        return 16
    return max(1, min(16, math.ceil(rate * mean_tokens / 4000)))


@dataclass(slots=True)
class RateSummary:
    rate: float
    requests: int
    completed: int
    failed: int
    rejected: int  # 429: the server's queue was full
    unfinished: int  # still streaming (or waiting) when the load's deadline closed them
    no_first_token: int  # of the unfinished: closed before their first token
    client_procs: int
    output_tokens: int  # every token delivered before the deadline, unfinished streams' included
    unfinished_tokens: int  # of output_tokens: those of the unfinished streams
    expected_tokens: int  # the completed requests' max_tokens: stops are off, so a gap means a server stopped early or merged chunks
    wall_s: float
    output_tokens_per_s: float
    completed_per_s: float
    # Over the completed and the unfinished requests (not the refused or failed ones). An
    # unfinished request counts as infinitely late for e2e, and for TTFT when no first token came,
    # so a server that finishes few requests in the window is not judged by those few alone.
    e2e_ms: dict[str, float]
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    max_send_lag_ms: float


def quantiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 in ms (nearest rank); inf where that rank had not come by the deadline."""
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]  # noqa: E731
    return {"p50": 1000 * pick(0.5), "p99": 1000 * pick(0.99)}


def summarize(rate: float, outcomes: list[Outcome], requests: int, procs: int) -> RateSummary:
    done = [o for o in outcomes if o.finished and o.ok]
    failed = [o for o in outcomes if o.finished and not o.ok]
    open_ = [o for o in outcomes if not o.finished]  # sent, closed at the deadline
    served = done + open_
    tokens = sum(o.completion_tokens for o in served)
    first = min((o.arrival_s for o in outcomes), default=0.0)
    last = max((o.arrival_s + o.send_lag_s + o.e2e_s for o in served if o.e2e_s > 0), default=first)
    wall = max(last - first, 1e-9)
    unfinished = requests - len(done) - len(failed)  # the sent ones closed at the deadline, and any never sent
    return RateSummary(
        rate=rate, requests=requests, completed=len(done), failed=len(failed),
        rejected=sum(1 for o in failed if o.status == 429), unfinished=unfinished,
        no_first_token=unfinished - sum(1 for o in open_ if o.ttft_s > 0),
        client_procs=procs, output_tokens=tokens, unfinished_tokens=sum(o.completion_tokens for o in open_),
        expected_tokens=sum(o.max_tokens for o in done), wall_s=wall, output_tokens_per_s=tokens / wall,
        completed_per_s=len(done) / wall,
        e2e_ms=quantiles([o.e2e_s for o in done] + [math.inf] * len(open_)),
        ttft_ms=quantiles([o.ttft_s if o.ttft_s > 0 else math.inf for o in served]),
        itl_ms=quantiles([g for o in served for g in o.gaps_s]),
        max_send_lag_ms=1000 * max((o.send_lag_s for o in outcomes), default=0.0),
    )  # fmt: skip


def run_rate(
    args: argparse.Namespace, pool: list[PlannedRequest], rate: float, count: int | None = None
) -> tuple[RateSummary, list[Outcome]]:
    """One load: the first `count` requests of the pool (default: rate x duration), arriving as
    a Poisson process of `rate` per second (`math.inf`: all at once)."""
    if count is None:
        count = min(len(pool), max(1, round(rate * args.duration)))
    count = min(count, len(pool))
    seed = args.seed + (10**6 if math.isinf(rate) else int(rate * 1000))
    planned = list(zip(pool[:count], poisson_arrivals(count, rate, seed=seed)))
    procs = client_processes(rate, sum(r.max_tokens for r in pool[:count]) / count, args.client_procs)
    start_at = time.time() + (3.0 if procs > 1 else 0.5)  # time for the client processes to start
    if procs == 1:
        outcomes = _client_process(args, planned, start_at)
    else:
        shares = [planned[i::procs] for i in range(procs)]
        with ProcessPoolExecutor(max_workers=procs, mp_context=multiprocessing.get_context("spawn")) as executor:
            outcomes = [o for part in executor.map(_client_process, [args] * procs, shares, [start_at] * procs) for o in part]
    return summarize(rate, outcomes, count, procs), outcomes


def request_records(outcomes: list[Outcome], pool: list[PlannedRequest]) -> list[dict[str, object]]:
    """One record a request, in arrival order: what a percentile is made of (which request, how
    long its prompt, when it came, what it waited for). `pool` is the list the load drew from."""
    words = {r.index: r.prompt_words for r in pool}
    return [
        {"index": o.index, "kind": o.kind, "prompt_words": words.get(o.index, 0), "max_tokens": o.max_tokens,
         "arrival_s": round(o.arrival_s, 3), "send_lag_ms": round(o.send_lag_s * 1e3, 1), "status": o.status, "ok": o.ok,
         "finished": o.finished, "error": o.error, "ttft_ms": round(o.ttft_s * 1e3, 1), "e2e_ms": round(o.e2e_s * 1e3, 1),
         "tokens": o.completion_tokens, "longest_gap_ms": round(max(o.gaps_s, default=0.0) * 1e3, 1)}
        for o in sorted(outcomes, key=lambda o: (o.arrival_s, o.index))
    ]  # fmt: skip


def slowest_first_tokens(records: list[dict[str, object]], count: int = 3) -> str:
    """The `count` longest waits for a first token among the finished requests, for a log line."""
    done = [r for r in records if r["ok"] and r["finished"]]
    slow = sorted(done, key=lambda r: -float(r["ttft_ms"]))[:count]  # type: ignore[arg-type]
    return ", ".join(f"#{r['index']} {r['kind']} {r['prompt_words']} words at {r['arrival_s']} s: {r['ttft_ms']:.0f} ms" for r in slow)


def load_line(summary: RateSummary, records: list[dict[str, object]]) -> str:
    """A load's one progress line: completions, throughput, client processes, slowest first tokens."""
    done_tokens = summary.output_tokens - summary.unfinished_tokens
    unfinished = (f"; {summary.unfinished} unfinished at the deadline ({summary.unfinished_tokens} tokens, "
                  f"{summary.no_first_token} without a first token)") if summary.unfinished else ""
    return (f"rate {summary.rate:g}/s: {summary.completed}/{summary.requests} done, {summary.output_tokens_per_s:.0f} tok/s "
            f"({done_tokens} of {summary.expected_tokens} expected tokens{unfinished}), {summary.client_procs} client process(es); "
            f"slowest first tokens: {slowest_first_tokens(records)}")  # fmt: skip


def capped(request: PlannedRequest, words: int, tokens: int) -> PlannedRequest:
    """The request with at most `words` prompt words and `tokens` max_tokens (0: no cap)."""
    return replace(request, prompt_words=min(request.prompt_words, words or request.prompt_words),
                   max_tokens=min(request.max_tokens, tokens or request.max_tokens))  # fmt: skip


def describe_mix(mix: tuple[RequestClass, ...] = LENGTH_MIX) -> str:
    return "; ".join(
        f"{c.share:.0%} {c.name}: prompt {c.prompt_words[0]}-{c.prompt_words[1]} words, {c.max_tokens[0]}-{c.max_tokens[1]} tokens out"
        for c in mix
    )


def print_table(label: str, summaries: list[RateSummary]) -> None:
    print(f"\n{label}: Poisson arrivals, streaming; latencies in ms (e2e: to the last token; inf: not by the deadline)")
    print(f"{'req/s':>6}{'sent':>6}{'done':>6}{'fail':>5}{'429':>5}{'left':>5}{'procs':>6}{'out tok/s':>11}"
          f"{'e2e p50':>9}{'p99':>9}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}")  # fmt: skip
    for s in summaries:
        print(f"{s.rate:>6g}{s.requests:>6}{s.completed:>6}{s.failed:>5}{s.rejected:>5}{s.unfinished:>5}{s.client_procs:>6}"
              f"{s.output_tokens_per_s:>11.1f}{s.e2e_ms['p50']:>9.0f}{s.e2e_ms['p99']:>9.0f}{s.ttft_ms['p50']:>10.0f}"
              f"{s.ttft_ms['p99']:>9.0f}{s.itl_ms['p50']:>9.1f}{s.itl_ms['p99']:>8.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--password")
    parser.add_argument("--label", default="server", help="the name of this server in tables and plots")
    parser.add_argument("--dialect", choices=sorted({*DIALECTS, *BATCH_DIALECTS}), default="albatross")
    parser.add_argument("--batch-group", type=int, default=1, help="batch dialects: prompts arriving together per request")
    parser.add_argument("--rates", default="1,2,4,8,16,32,64", help="requests per second, comma-separated")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate (capped by the pool)")
    parser.add_argument("--drain", type=float, default=60.0, help="seconds after the last arrival before open streams are closed")
    parser.add_argument("--pool", type=int, default=POOL_SIZE)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--client-procs", type=int, default=0, help="client processes per rate (0: by the rate)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap-words", type=int, default=0, help="shorten prompts to this many words (a quick CPU check)")
    parser.add_argument("--cap-tokens", type=int, default=0, help="cap max_tokens (a quick CPU check)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    pool = request_pool(args.pool, args.seed)
    if args.cap_words or args.cap_tokens:
        pool = [capped(r, args.cap_words, args.cap_tokens) for r in pool]
        print(f"capped: prompts <= {args.cap_words or '-'} words, max_tokens <= {args.cap_tokens or '-'}")
    print(f"{args.label} at {args.url} ({args.dialect}); pool of {len(pool)}: {describe_mix()}", flush=True)
    summaries, records = [], []
    for rate in (float(r) for r in args.rates.split(",") if r):
        summary, outcomes = run_rate(args, pool, rate)
        summaries.append(summary)
        records.append(request_records(outcomes, pool))
        print(load_line(summary, records[-1]), flush=True)
    print_table(args.label, summaries)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "label": args.label, "url": args.url, "dialect": args.dialect, "length_mix": describe_mix(),
            "pool": len(pool), "duration_s": args.duration, "drain_s": args.drain, "date": time.strftime("%Y-%m-%d"),
            "rates": [asdict(s) for s in summaries], "requests": records,
        }, indent=2))  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
