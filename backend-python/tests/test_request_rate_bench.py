"""The request-rate benchmark's pieces that need no server: the request pool and its stated
length mix, Poisson arrivals, what each server dialect sends, the per-rate summary, the plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from runner_fakes import live_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import plot_request_rate
import request_rate_benchmark as rate_bench


def test_pool_has_the_stated_mix_and_is_the_same_every_time() -> None:
    pool = rate_bench.request_pool()
    assert len(pool) == rate_bench.POOL_SIZE == 1200
    counts = {c.name: sum(1 for r in pool if r.kind == c.name) for c in rate_bench.LENGTH_MIX}
    assert counts == {"chat turn": 600, "long context": 360, "generation": 240}
    for request in pool:
        kind = next(c for c in rate_bench.LENGTH_MIX if c.name == request.kind)
        assert kind.prompt_words[0] <= request.prompt_words <= kind.prompt_words[1]
        assert kind.max_tokens[0] <= request.max_tokens <= kind.max_tokens[1]
    assert pool == rate_bench.request_pool()
    assert len(rate_bench.prompt_text(pool[0]).split()) == pool[0].prompt_words


def test_poisson_arrivals_have_the_rate_as_mean_gap() -> None:
    times = rate_bench.poisson_arrivals(4000, rate=8.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8, rel=0.1)  # exponential: sd == mean


def test_each_dialect_sends_streaming_requests_with_stops_off() -> None:
    request = rate_bench.request_pool(10)[0]
    ours_path, ours = rate_bench.DIALECTS["albatross"](request, 1.0)
    assert ours_path == "/v1/chat/completions" and ours["stop"] == [] and ours["stop_token_ids"] == []
    lightning_path, lightning = rate_bench.DIALECTS["lightning"](request, 1.0)
    assert lightning_path == "/openai/v1/chat/completions" and lightning["stop_tokens"] == []
    runner_path, runner = rate_bench.DIALECTS["runner"](request, 1.0)
    assert runner_path == "/v1/chat/completions"
    for body in (ours, lightning, runner):
        assert body["stream"] is True and body["max_tokens"] == request.max_tokens


def test_summary_counts_outcomes_and_takes_nearest_rank_quantiles() -> None:
    Outcome = rate_bench.Outcome
    done = [Outcome(i, "chat turn", i * 0.5, 0.0, 200, True, "", True, 0.1 * (i + 1), 1.0 + i, 10, 10, [0.02] * 9) for i in range(4)]
    rejected = Outcome(4, "chat turn", 2.0, 0.0, 429, False, "queue full", True)
    open_stream = Outcome(5, "generation", 2.5, 0.0)
    summary = rate_bench.summarize(2.0, [*done, rejected, open_stream], requests=6, procs=1)
    assert (summary.completed, summary.failed, summary.rejected, summary.unfinished, summary.no_first_token) == (4, 1, 1, 1, 1)
    assert summary.output_tokens == summary.expected_tokens == 40 and summary.unfinished_tokens == 0
    # the open stream had no first token: it is the slowest of five, not left out
    assert summary.ttft_ms["p50"] == pytest.approx(300.0) and summary.ttft_ms["p99"] == math.inf
    assert summary.e2e_ms["p50"] == pytest.approx(3000.0) and summary.e2e_ms["p99"] == math.inf
    assert summary.itl_ms["p50"] == pytest.approx(20.0)
    assert summary.wall_s == pytest.approx(1.5 + 4.0)  # first arrival 0 to the last token at 1.5 + 4.0
    assert math.isnan(rate_bench.quantiles([])["p50"])


def test_a_stream_open_at_the_deadline_keeps_its_tokens_so_far() -> None:
    """Over a real loopback server: one request finishes, the other sends three tokens and then
    nothing. The load's deadline closes the second; its status, first token and three tokens are
    kept and count toward throughput (a slow peer's window is measured, not dropped)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            for _ in range(3 if body["max_tokens"] > 1000 else body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'delta': {'content': 'x'}}]})}\n\n"
            if body["max_tokens"] > 1000:
                await asyncio.Event().wait()  # the rest never comes
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    pool = [rate_bench.PlannedRequest(0, "chat turn", 5, 4, 1), rate_bench.PlannedRequest(1, "generation", 5, 5000, 2)]
    with live_server(app) as url:
        args = argparse.Namespace(dialect="albatross", password=None, url=url, timeout=60.0, temperature=1.0, drain=3.0)
        outcomes = asyncio.run(rate_bench._run_share(args, [(pool[0], 0.0), (pool[1], 0.0)], time.time()))
    done, open_ = sorted(outcomes, key=lambda o: o.index)
    assert (done.finished, done.ok, done.completion_tokens) == (True, True, 4)
    assert (open_.finished, open_.ok, open_.status, open_.completion_tokens) == (False, False, 200, 3)
    assert 0 < open_.ttft_s <= open_.e2e_s and len(open_.gaps_s) == 2
    summary = rate_bench.summarize(math.inf, outcomes, requests=2, procs=1)
    assert (summary.completed, summary.unfinished, summary.no_first_token) == (1, 1, 0)
    assert (summary.output_tokens, summary.unfinished_tokens, summary.expected_tokens) == (7, 3, 4)
    assert summary.e2e_ms["p99"] == math.inf and math.isfinite(summary.ttft_ms["p99"])


def test_client_processes_grow_with_the_token_rate() -> None:
    assert rate_bench.client_processes(1, 200, 0) == 1
    assert rate_bench.client_processes(64, 250, 0) == 4
    assert rate_bench.client_processes(64, 250, 8) == 8


def test_plots_are_written_from_the_json(tmp_path: Path) -> None:
    def run(label: str, scale: float) -> dict:
        rates = []
        for rate in (1, 2, 4):
            q = {"p50": 100.0 * rate * scale, "p99": 300.0 * rate * scale}
            rates.append({"rate": rate, "output_tokens_per_s": 100.0 * rate, "e2e_ms": q, "ttft_ms": q, "itl_ms": q})
        return {"label": label, "length_mix": rate_bench.describe_mix(), "rates": rates}

    (tmp_path / "a.json").write_text(json.dumps(run("albatross", 1.0)))
    (tmp_path / "b.json").write_text(json.dumps({"servers": [run("classic", 3.0)]}))
    plot_request_rate.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--output", str(tmp_path / "img")])
    for name in ("request_rate_latency.png", "request_rate_throughput.png"):
        assert (tmp_path / "img" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_burst_alone_writes_no_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = {"p50": 100.0, "p99": 300.0}
    burst = {"rate": math.inf, "output_tokens_per_s": 900.0, "e2e_ms": q, "ttft_ms": q, "itl_ms": q}
    (tmp_path / "burst.json").write_text(json.dumps({"servers": [{"label": "albatross", "rates": [burst]}]}))
    plot_request_rate.main([str(tmp_path / "burst.json"), "--output", str(tmp_path / "img")])
    assert "no plots" in capsys.readouterr().out
    assert not (tmp_path / "img").exists()


def test_request_records_keep_every_request_in_arrival_order_and_name_the_slowest() -> None:
    pool = rate_bench.request_pool(6)
    Outcome = rate_bench.Outcome
    outcomes = [
        Outcome(pool[2].index, pool[2].kind, 0.5, 0.001, 200, True, "", True, 1.25, 3.0, 64, 64, [0.01, 0.2]),
        Outcome(pool[0].index, pool[0].kind, 0.0, 0.0, 200, True, "", True, 0.05, 2.0, 64, 64, [0.01]),
        Outcome(pool[1].index, pool[1].kind, 0.25, 0.0, 429, False, "queue full", True),
        Outcome(pool[3].index, pool[3].kind, 0.75, 0.0, 200, True, "", False, 0.3, 0.0, 5, 64, []),
    ]
    records = rate_bench.request_records(outcomes, pool)
    assert [r["index"] for r in records] == [pool[0].index, pool[1].index, pool[2].index, pool[3].index]
    slow = records[2]
    assert slow["prompt_words"] == pool[2].prompt_words and slow["ttft_ms"] == 1250.0 and slow["longest_gap_ms"] == 200.0
    assert records[1]["status"] == 429 and records[1]["error"] == "queue full"
    json.dumps(records)  # the JSON holds them as they are
    # the refused request and the one still streaming are not among the slowest finished ones
    line = rate_bench.slowest_first_tokens(records, count=3)
    assert line.startswith(f"#{pool[2].index} ") and "1250 ms" in line and f"#{pool[1].index} " not in line and f"#{pool[3].index} " not in line


def test_a_batch_dialect_sends_a_burst_in_groups_and_measures_each_row() -> None:
    """rwkv_lightning's batch route over a real loopback server of the same shape: prompts that
    arrive together go as requests of up to `batch_group` prompts, and each row's events
    (`choices[].index`) make that prompt's own first token and token count."""
    received: list[int] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def batch(body: dict) -> StreamingResponse:
        rows = len(body["contents"])
        received.append(rows)
        assert body["stream"] is True and body["stop_tokens"] == [] and body["chunk_size"] == 1

        async def events() -> AsyncIterator[str]:
            for step in range(body["max_tokens"]):  # row i stops after max_tokens - i steps
                choices = [{"index": i, "delta": {"content": "y"}} for i in range(rows) if step < body["max_tokens"] - i]
                yield f"data: {json.dumps({'object': 'chat.completion.chunk', 'choices': choices})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    pool = [rate_bench.PlannedRequest(i, "wave-1 burst", 4, 6, i) for i in range(5)]
    share = [(request, 0.0) for request in pool]
    assert [len(g) for g in rate_bench.request_groups(share, "lightning-batch", 3)] == [3, 2]
    assert [len(g) for g in rate_bench.request_groups(share, "lightning", 3)] == [1] * 5
    with live_server(app) as url:
        args = argparse.Namespace(dialect="lightning-batch", password=None, url=url, timeout=60.0, temperature=1.0, drain=30.0, batch_group=3)
        outcomes = asyncio.run(rate_bench._run_share(args, share, time.time()))
    assert sorted(received) == [2, 3]
    by_index = {o.index: o for o in outcomes}
    assert sorted(by_index) == [0, 1, 2, 3, 4]
    assert all(o.finished and o.ok and o.status == 200 and o.ttft_s > 0 for o in outcomes)
    # position in its request: 0,1,2 then 0,1 -> 6,5,4 then 6,5 tokens
    assert [by_index[i].completion_tokens for i in range(5)] == [6, 5, 4, 6, 5]
