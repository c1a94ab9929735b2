"""Side by side: the same HTTP loads against several servers on one weights file, one server at a
time on the same GPU, in one run, so every headline figure is a ratio measured in one session.

Servers: ours with the Albatross engine (`albatross`) or the classic `rwkv`-package backend
(`classic`), RWKV-Runner's backend-python (`runner`, its Albatross strategy) and rwkv_lightning
(`lightning`: its OpenAI route; `lightning-batch`: its batch route, a burst sent as requests of
`--batch-group` prompts), the peers from checkouts the user places in `.peers/` (ignored by git, never
committed; each with its own Python dependencies installed):

    git clone https://github.com/josStorer/RWKV-Runner .peers/RWKV-Runner
    git clone https://github.com/RWKV-Vibe/rwkv_lightning .peers/rwkv_lightning
    python -m albatross.random_checkpoint --shape 7.2b --dtype fp16 --device cuda \
        --impossible-ids 0,65530-65535 --layer0-value-weights --output /tmp/w/rwkv7-7.2b-safe.pth
    python bench/side_by_side.py --weights /tmp/w/rwkv7-7.2b-safe.pth --servers albatross,runner,lightning --out out/

Random weights make a server sample ids the tokenizer does not define (65530-65535) and EOS (0);
the weights file has those ids impossible (random_checkpoint --impossible-ids), so no server dies
of an undefined id and every stream runs to its max_tokens. `--layer0-value-weights` writes block
0's value weights, as trained checkpoints carry them: RWKV-Runner's Albatross fails to load
without. Each server gets the loads of request_rate_benchmark.py (Poisson rates over the same
1,200-request pool) and a burst (all `--burst` requests at once, the 960-stream load of the
wave-1 workload unless `--burst-mix pool`); the JSON holds every server's summaries and
plot_request_rate.py draws them. A load ends at its deadline (`--drain` after the last arrival,
`--burst-drain` after the burst): streams still open then are closed, their tokens so far count
toward its throughput, and they count as infinitely late in its latency quantiles (TTFT too when
no first token had come), so a server slower than the window is measured rather than dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import request_rate_benchmark as rate_bench

BACKEND = Path(__file__).resolve().parents[1]
ROOT = BACKEND.parent


@dataclass(frozen=True, slots=True)
class ServerSpec:
    name: str
    dialect: str  # request_rate_benchmark.DIALECTS
    cwd: Path
    ready_path: str  # GET that answers 200 once the server can take requests

    def command(self, weights: Path, port: int, batch: int, classic_strategy: str = "cuda fp16") -> list[str]:
        if self.name in ("albatross", "classic"):
            strategy = f"albatross workers=1 batch={batch}" if self.name == "albatross" else classic_strategy
            return [sys.executable, "main.py", "--model-path", str(weights), "--strategy", strategy,
                    "--port", str(port), "--max-tokens", "4096"]  # fmt: skip
        if self.name == "runner":
            return [sys.executable, "main.py", "--port", str(port), "--no-access-log"]
        return [sys.executable, "app.py", "--model-path", str(weights), "--port", str(port)]

    def after_start(self, client: httpx.Client, weights: Path, batch: int) -> None:
        """RWKV-Runner starts empty: its model is loaded through /switch-model, as its GUI does."""
        if self.name == "runner":
            body = {"model": str(weights), "strategy": f"albatross workers=1 batch={batch}", "tokenizer": None, "customCuda": False}
            response = client.post("/switch-model", json=body, timeout=900)
            response.raise_for_status()

    def ready(self, client: httpx.Client) -> bool:
        try:
            response = client.get(self.ready_path, timeout=5)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        if self.name in ("albatross", "classic"):
            return response.json().get("status") == 3  # a model is loaded and serving
        return True


def server_specs(peers: Path) -> dict[str, ServerSpec]:
    return {
        "albatross": ServerSpec("albatross", "albatross", BACKEND, "/status"),
        "classic": ServerSpec("classic", "albatross", BACKEND, "/status"),
        "runner": ServerSpec("runner", "runner", peers / "RWKV-Runner" / "backend-python", "/status"),
        "lightning": ServerSpec("lightning", "lightning", peers / "rwkv_lightning", "/openai/v1/models"),
        # the same server through its batch route (request_rate_benchmark.BATCH_DIALECTS): its OpenAI
        # route serves one request at a time, so a burst there measures its queue, not its batching
        "lightning-batch": ServerSpec("lightning-batch", "lightning-batch", peers / "rwkv_lightning", "/openai/v1/models"),
    }


class RunningServer:
    """A server process for the duration of a `with` block; its output goes to `log`."""

    def __init__(self, spec: ServerSpec, args: argparse.Namespace) -> None:
        self.spec, self.weights, self.port, self.batch = spec, args.weights, args.port, args.batch
        self.log, self.ready_timeout = args.out / "servers.log", args.ready_timeout
        self.argv = spec.command(args.weights, args.port, args.batch, args.classic_strategy)
        self.url = f"http://127.0.0.1:{args.port}"

    def __enter__(self) -> RunningServer:
        if not self.spec.cwd.is_dir():
            raise FileNotFoundError(f"{self.spec.name}: no checkout at {self.spec.cwd} (see this script's docstring)")
        self._log = self.log.open("a")
        self._log.write(f"\n==== {self.spec.name}: {' '.join(self.argv)}\n")
        self._log.flush()
        env = dict(os.environ, RWKV_V7_ON="1", PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            self.argv, cwd=self.spec.cwd, env=env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        started = time.time()
        try:
            with httpx.Client(base_url=self.url) as client:
                while not self.spec.ready(client):
                    if self.process.poll() is not None:
                        raise RuntimeError(f"{self.spec.name} exited with {self.process.returncode} (see {self.log})")
                    if time.time() - started > self.ready_timeout:
                        raise TimeoutError(f"{self.spec.name} not ready after {self.ready_timeout:.0f} s (see {self.log})")
                    time.sleep(2)
                self.spec.after_start(client, self.weights, self.batch)
        except BaseException:  # a failed start (a 500 from RWKV-Runner's /switch-model too) stops the server:
            self.__exit__(None, None, None)  # left running, it would hold the port the next server needs
            raise
        print(f"{self.spec.name} ready at {self.url} after {time.time() - started:.0f} s", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and whatever it started (its own session)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


# The shape of the burst behind the README's headline figures (albatross_api_benchmark.py's
# wave-1 workload: 200-word prompts, 256 tokens each, all at once), in this pool's words (one or
# two tokens each, so somewhat more prompt tokens). The rate pool's mix as a burst is ~1M prompt
# tokens, which did not drain in 25 s on an H100 (docs/performance.md, "Session 24").
WAVE1_MIX = (rate_bench.RequestClass("wave-1 burst", 1.0, (200, 200), (256, 256)),)


def burst_pool(args: argparse.Namespace, pool: list[rate_bench.PlannedRequest]) -> list[rate_bench.PlannedRequest]:
    """The requests of the burst: the wave-1 workload, or the rate pool's first `--burst`."""
    if args.burst_mix == "pool":
        return pool
    burst = rate_bench.request_pool(args.burst, args.seed, WAVE1_MIX)
    return [rate_bench.capped(r, args.cap_words, args.cap_tokens) for r in burst] if args.cap_words or args.cap_tokens else burst


def describe_burst(args: argparse.Namespace) -> str:
    return rate_bench.describe_mix(WAVE1_MIX) if args.burst_mix == "wave1" else "the rate pool's first requests"


def burst_summary(
    args: argparse.Namespace, pool: list[rate_bench.PlannedRequest], count: int
) -> tuple[rate_bench.RateSummary, list[rate_bench.Outcome]]:
    """All `count` requests at once (rate = inf): the many-streams load, over several processes."""
    per_request = args.batch_group if args.dialect in rate_bench.BATCH_DIALECTS else 120  # a process's share
    procs = args.client_procs or max(1, min(16, math.ceil(count / per_request)))
    load = argparse.Namespace(**{**vars(args), "client_procs": procs, "drain": args.burst_drain})
    return rate_bench.run_rate(load, pool, math.inf, count=count)


def run_server(args: argparse.Namespace, spec: ServerSpec, pool: list[rate_bench.PlannedRequest]) -> dict:
    rates = [float(r) for r in (args.rates_for.get(spec.name) or args.rates).split(",") if r]
    summaries, records = [], []
    with RunningServer(spec, args) as server:
        load = argparse.Namespace(**{**vars(args), "url": server.url, "dialect": spec.dialect, "password": None,
                                     "temperature": 1.0, "timeout": 600.0, "seed": args.seed})  # fmt: skip
        for rate in rates:
            summary, outcomes = rate_bench.run_rate(load, pool, rate)
            summaries.append(summary)
            records.append(rate_bench.request_records(outcomes, pool))
            print(f"{spec.name} {rate_bench.load_line(summary, records[-1])}", flush=True)
        if args.burst:
            burst = burst_pool(args, pool)
            summary, outcomes = burst_summary(load, burst, args.burst)
            summaries.append(summary)
            records.append(rate_bench.request_records(outcomes, burst))
            print(f"{spec.name} burst of {args.burst}, {rate_bench.load_line(summary, records[-1])}", flush=True)
    rate_bench.print_table(spec.name, summaries)
    # "requests": one list a load, in the order of "rates" (request_rate_benchmark.request_records)
    return {"label": spec.name, "dialect": spec.dialect, "length_mix": rate_bench.describe_mix(), "burst_mix": describe_burst(args),
            "rates": [asdict(s) for s in summaries], "requests": records}  # fmt: skip


def _ratio(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) else float("nan")


def print_ratios(servers: list[dict]) -> None:
    """Each server's throughput and latency medians relative to the first one's, per load."""
    base = {r["rate"]: r for r in servers[0]["rates"]}
    print(f"\nrelative to {servers[0]['label']} (x: throughput ratio; latency ratios > 1 are slower)")
    print(f"{'server':<12}{'load':>8}{'tok/s':>10}{'x':>7}{'TTFT p50 x':>12}{'ITL p50 x':>11}{'e2e p99 x':>11}")
    for server in servers:
        for r in server["rates"]:
            b = base.get(r["rate"])
            if b is None:
                continue
            load = "burst" if math.isinf(r["rate"]) else f"{r['rate']:g}/s"
            tput = _ratio(r["output_tokens_per_s"], b["output_tokens_per_s"])
            print(f"{server['label']:<12}{load:>8}{r['output_tokens_per_s']:>10.0f}{tput:>7.2f}"
                  f"{_ratio(r['ttft_ms']['p50'], b['ttft_ms']['p50']):>12.2f}{_ratio(r['itl_ms']['p50'], b['itl_ms']['p50']):>11.2f}"
                  f"{_ratio(r['e2e_ms']['p99'], b['e2e_ms']['p99']):>11.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, required=True, help="one .pth for every server (random_checkpoint --impossible-ids)")
    parser.add_argument("--servers", default="albatross,runner,lightning", help="in order; ratios are against the first")
    parser.add_argument("--peers", type=Path, default=ROOT / ".peers", help="where the peer checkouts are")
    parser.add_argument("--rates", default="4,16,64", help="Poisson rates (requests/s) for every server")
    parser.add_argument("--rates-for", action="append", default=[], metavar="SERVER=RATES",
                        help="other rates for one server, e.g. classic=1,2 (one request at a time saturates early)")
    parser.add_argument("--burst", type=int, default=960, help="also send this many requests at once (0: no burst)")
    parser.add_argument("--burst-mix", choices=("wave1", "pool"), default="wave1",
                        help="the burst's requests: the wave-1 workload (200 words, 256 tokens) or the rate pool's first ones")  # fmt: skip
    parser.add_argument("--batch-group", type=int, default=480,
                        help="lightning-batch: the burst's prompts per request (rwkv_lightning admits ~928 prompt rows at a time at 7.2B)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    parser.add_argument("--drain", type=float, default=45.0, help="seconds after the last arrival before open streams are closed")
    parser.add_argument("--burst-drain", type=float, default=60.0,
                        help="seconds after the burst is sent before open streams are closed (their tokens so far still count)")  # fmt: skip
    parser.add_argument("--pool", type=int, default=rate_bench.POOL_SIZE)
    parser.add_argument("--client-procs", type=int, default=0)
    parser.add_argument("--batch", type=int, default=960, help="state slots of the batching servers")
    parser.add_argument("--classic-strategy", default="cuda fp16", help="the classic backend's strategy (cpu fp32 on a CPU)")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--ready-timeout", type=float, default=420.0, help="seconds for a server to load (peers JIT their kernels)")
    parser.add_argument("--cap-words", type=int, default=0, help="shorten prompts (a quick CPU check)")
    parser.add_argument("--cap-tokens", type=int, default=0, help="cap max_tokens (a quick CPU check)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    args.rates_for = dict(item.split("=", 1) for item in args.rates_for)
    args.weights = args.weights.resolve()
    if not args.weights.is_file():
        raise SystemExit(f"no weights file {args.weights}")
    args.out.mkdir(parents=True, exist_ok=True)
    specs = server_specs(args.peers.resolve())
    names = [n for n in args.servers.split(",") if n]
    unknown = sorted(set(names) - set(specs))
    if unknown:
        raise SystemExit(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(sorted(specs))}")
    pool = rate_bench.request_pool(args.pool, args.seed)
    if args.cap_words or args.cap_tokens:
        pool = [rate_bench.capped(r, args.cap_words, args.cap_tokens) for r in pool]
    print(f"weights {args.weights}; pool of {len(pool)}: {rate_bench.describe_mix()}", flush=True)
    if args.burst:
        print(f"burst of {args.burst}: {describe_burst(args)}", flush=True)
    # a SIGTERM (the session script's timeout) unwinds through RunningServer.__exit__, which stops the
    # server's process group: started with its own session, it would outlive the call otherwise
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers = []
    for name in names:
        try:
            servers.append(run_server(args, specs[name], pool))
        except (OSError, RuntimeError, TimeoutError, httpx.HTTPError) as error:  # one missing peer does not lose the others' figures
            print(f"{name}: skipped: {error}", flush=True)
        write_result(args, servers)  # after each server: a timeout keeps the finished servers' figures
    if servers:
        print_ratios(servers)
    print(f"wrote {args.out / 'side_by_side.json'}")


def write_result(args: argparse.Namespace, servers: list[dict]) -> None:
    result = {"weights": str(args.weights), "date": time.strftime("%Y-%m-%d"), "servers": servers}
    (args.out / "side_by_side.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
