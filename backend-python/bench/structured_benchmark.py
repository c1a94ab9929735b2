"""Constrained decoding inside the batch: decode throughput with 0%, 10% and 100% of the requests
under a JSON schema, on one backend (the same model and engine for every run), and what a new
schema costs its first request. Prints a table and writes JSON.

GPU (the lead's run; random weights built on the GPU):

    python bench/structured_benchmark.py --shape 7.2b --batch 960 --json out/structured.json

CPU check with a tiny model:

    python bench/structured_benchmark.py --shape 2x128 --device cpu --batch 8 --max-tokens 16 --prompt-len 8

Every request has a prompt of `--prompt-len` random ids and generates `--max-tokens` tokens with
sampling (temperature 1, top-p 0.6, top-k 50, penalties) and no stop tokens or strings. The schema
has 20 properties (strings, bounded integers, enums, a boolean, an array of integers) and ends with
an array of at least 64 non-empty strings, so that no constrained answer can be complete, and end
its request, before `--max-tokens` (256): every run decodes the same number of tokens at full
batch. Throughput is measured twice: over the whole run (prompts included, the same in every run)
and over the steps where every slot decodes (from the engine's counters, sampled every 0.1 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross.constraints import ConstraintCompiler, json_schema_grammar
from albatross_engine.adapter import AlbatrossRWKV
from engine_benchmark import build_backend, warm_up  # bench/ is the script's folder
from gpu_json import write_gpu_json
from runner.interface import GenerationRequest, OutputConstraint, SamplingParams

LONG_ARRAY_ITEMS = 64  # each item is at least `"x"` and a separator: more than 256 tokens in all


def benchmark_schema(variant: int = 0) -> dict[str, Any]:
    """20 properties; `variant` renames them (a new schema text: a cache miss)."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 32},
        {"type": "integer", "minimum": 0, "maximum": 100000},
        {"enum": ["red", "green", "blue", "unknown"]},
        {"type": "boolean"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 6},
    ]
    properties = {f"field_{variant}_{i}": kinds[i % len(kinds)] for i in range(19)}
    properties[f"notes_{variant}"] = {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": 24},
        "minItems": LONG_ARRAY_ITEMS,
        "maxItems": LONG_ARRAY_ITEMS + 16,
    }
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


@dataclass(slots=True)
class RunResult:
    constrained_fraction: float
    requests: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    full_batch_tokens_per_s: float  # over the samples where every slot was decoding
    finish_reasons: dict[str, int]
    masked_samples: int
    mask_fill_ms_per_step: float
    step_time_ms: float


@dataclass(slots=True)
class Report:
    device: str
    model: str
    batch: int
    max_tokens: int
    runs: list[RunResult] = field(default_factory=list)
    compile_ms: list[float] = field(default_factory=list)  # new 20-property schemas, one each
    cached_compile_ms: float = 0.0
    first_mask_ms: float = 0.0


async def one_run(backend: AlbatrossRWKV, args: argparse.Namespace, fraction: float, seed: int) -> RunResult:
    rng = random.Random(seed)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=1.0, top_p=0.6, top_k=50, presence_penalty=0.5,
        frequency_penalty=0.1, stop=(), stop_token_ids=(),
    )  # fmt: skip
    constraint = OutputConstraint(json_schema_grammar(benchmark_schema()), "response_format json_schema")
    constrained = round(fraction * args.batch)
    requests = [
        GenerationRequest([rng.randrange(1, 65530) for _ in range(args.prompt_len)], params, f"s-{n}", constraint=constraint if n < constrained else None)
        for n in range(args.batch)
    ]
    rng.shuffle(requests)  # constrained rows spread over the batch
    before = backend.status()
    reasons: dict[str, int] = {}
    samples: list[tuple[float, int, int]] = []  # (time, decode tokens so far, decoding slots)
    generated = 0

    async def one(request: GenerationRequest) -> None:
        nonlocal generated
        async for event in backend.async_generate(request):
            generated += len(event.token_ids)
            if event.finish_reason is not None:
                reasons[event.finish_reason] = reasons.get(event.finish_reason, 0) + 1

    async def sample_counters() -> None:
        while True:
            status = backend.status()
            samples.append((time.perf_counter(), int(status["decode_tokens_total"]), int(status["active_slots"])))  # type: ignore[call-overload]
            await asyncio.sleep(0.1)

    start = time.perf_counter()
    sampler = asyncio.create_task(sample_counters())
    await asyncio.gather(*(one(r) for r in requests))
    wall = time.perf_counter() - start
    sampler.cancel()
    after = backend.status()
    full = [(t, tokens) for t, tokens, active in samples if active == args.batch]
    window = full[-1][0] - full[0][0] if len(full) > 1 else 0.0
    steps = int(after["steps"]) - int(before["steps"])  # type: ignore[call-overload]
    masked = int(after["masked_samples_total"]) - int(before["masked_samples_total"])  # type: ignore[call-overload]
    fill_ms = float(after["mask_fill_ms_total"]) - float(before["mask_fill_ms_total"])  # type: ignore[arg-type]
    return RunResult(
        constrained_fraction=fraction,
        requests=len(requests),
        generated_tokens=generated,
        wall_s=wall,
        tokens_per_s=generated / wall,
        full_batch_tokens_per_s=(full[-1][1] - full[0][1]) / window if window > 0 else 0.0,
        finish_reasons=reasons,
        masked_samples=masked,
        mask_fill_ms_per_step=fill_ms / max(steps, 1),
        step_time_ms=float(after["step_time_ms"]),  # type: ignore[arg-type]
    )


def compile_costs(backend: AlbatrossRWKV, report: Report, schemas: int) -> None:
    """What a new schema's first request waits for (its compile), a cached one's, and a first mask."""
    import numpy as np

    from albatross.constraints import MASK_WORDS

    compiler = ConstraintCompiler(backend.tokenizer)  # the vocabulary's trie is built once per process
    compiler.compile(json_schema_grammar(benchmark_schema(1000)))  # warm-up on another schema
    for variant in range(1, schemas + 1):
        text = json_schema_grammar(benchmark_schema(variant))
        started = time.perf_counter()
        compiled = compiler.compile(text)
        report.compile_ms.append(1000 * (time.perf_counter() - started))
    started = time.perf_counter()
    compiler.compile(text)
    report.cached_compile_ms = 1000 * (time.perf_counter() - started)
    row = np.zeros(MASK_WORDS, dtype=np.int32)
    matcher = compiled.matcher()
    started = time.perf_counter()
    matcher.fill_bitmask(row)
    report.first_mask_ms = 1000 * (time.perf_counter() - started)
    matcher.free()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7.2b")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--batch", type=int, default=960, help="state slots, and requests per run (one full batch)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--fractions", default="0,0.1,1", help="constrained fractions, one run each")
    parser.add_argument("--schemas", type=int, default=5, help="new schemas whose compile is timed")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    # engine_benchmark's builder: one worker, the model built here; its knobs (the prefill policy
    # included) at the engine's defaults
    args.model, args.workers, args.overlap, args.state_dtype = None, 1, None, None
    args.prefill_chunk = args.prefill_budget = args.itl_target_ms = None
    args.worker_mode, args.step_profile = "thread", False  # the engine in this process, as the run times it

    backend = build_backend(args)
    device = str(backend.status()["device"])
    report = Report(device=device + (f" ({torch.cuda.get_device_name()})" if device.startswith("cuda") else ""),
                    model=f"random:{args.shape}", batch=args.batch, max_tokens=args.max_tokens)  # fmt: skip
    try:
        warm_up(backend)
        compile_costs(backend, report, args.schemas)
        for n, fraction in enumerate(float(f) for f in args.fractions.split(",")):
            report.runs.append(asyncio.run(one_run(backend, args, fraction, seed=n)))
    finally:
        backend.shutdown()

    base = report.runs[0]
    print(f"\n{report.model} on {report.device}, batch {report.batch}, {report.max_tokens} tokens a request")
    print(f"{'constrained':>12}{'gen tok':>9}{'wall s':>8}{'tok/s':>9}{'vs 0%':>7}{'full-batch tok/s':>18}{'vs 0%':>7}"
          f"{'step ms':>9}{'mask fill ms/step':>19}  finish")  # fmt: skip
    for run in report.runs:
        print(f"{run.constrained_fraction:>11.0%} {run.generated_tokens:>8}{run.wall_s:>8.2f}{run.tokens_per_s:>9.0f}"
              f"{run.tokens_per_s / base.tokens_per_s:>7.1%}{run.full_batch_tokens_per_s:>18.0f}"
              f"{run.full_batch_tokens_per_s / max(base.full_batch_tokens_per_s, 1e-9):>7.1%}{run.step_time_ms:>9.1f}"
              f"{run.mask_fill_ms_per_step:>19.2f}  {run.finish_reasons}")  # fmt: skip
    print(f"schema compile (new 20-property schemas): {', '.join(f'{ms:.1f}' for ms in report.compile_ms)} ms; "
          f"cached {report.cached_compile_ms:.3f} ms; first mask {report.first_mask_ms:.2f} ms")
    if args.json:
        if device.startswith("cuda"):
            write_gpu_json(args.json, **asdict(report))
        else:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(asdict(report), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
