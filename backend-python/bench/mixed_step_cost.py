"""What a step that carries prompt chunks next to decoding streams costs, on a grid of prompt
tokens and decode rows: the engine's step time model measured head-on, instead of fitted from a
burst's steps (where every mixed step carries the whole prefill budget, so the base cost and the
cost per prompt token cannot be told apart).

    python bench/mixed_step_cost.py --shape 7.2b --decode-rows 0,16,64,240,960 \
        --prompt-tokens 0,1024,4096,16384 --chunks 128,256 --json out/mixed.json

Each cell (P prompt tokens in chunks of `chunk` tokens, one slot a chunk; R decode rows, one token
a slot) is timed with CUDA events, the median of `--reps` after a warm-up, each step followed by
the sampler over every row that samples (the R decode rows and one row per chunk):
- `mixed`: the engine's step today, one eager forward over all rows (`model.forward`); with R = 0
  it is a prefill step, with P = 0 an eager decode step;
- `split` (P and R both > 0): the decode rows replayed from the captured decode graph, then an
  eager forward over the prompt chunks alone, one sampler call over both: the layout a
  graph-decode-plus-prefill step would have;
- `graph decode` (once per R): the captured decode step alone, as the engine runs decode-only
  steps (eager on the CPU, which has no graphs).

Then least-squares fits over the grid, per chunk size: `ms = a + b * P + c * R` for `mixed` and
`split` (what the adaptive prefill budget, albatross_engine/prefill_budget.py, learns while
serving), and `ms = a + c * R` for `graph decode`. The state pool holds every row of the largest
cell (decode slots first, then one slot per chunk) in the engine's GPU state dtype. A CPU run with
a tiny shape (`--shape 2x64 --device cpu`) checks the script, not the figures.

`--one-prompt` makes each cell one chunk of P tokens (one slot): a lone prompt's step, so the
table also says what feeding the longest P takes in steps of each shorter P (a lone long prompt's
time to first token under each chunk size; the chunked WKV kernel takes one slot from 512 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import cuda_ops, ops, sampler
from albatross.cuda_graphs import DecodeGraphRunner
from albatross.model import RWKV7
from albatross.random_checkpoint import random_state_dict
from albatross.state import StatePool
from albatross_engine.device_step import graph_buckets
from albatross_engine.model_specs import parse_random_spec
from bench_model import bench_sampling  # bench/ is the script's folder
from gpu_json import write_gpu_json

WAYS = ("mixed", "split")


@dataclass(slots=True)
class Cell:
    chunk: int
    prompt_tokens: int
    decode_rows: int
    ms: dict[str, float]  # way -> median ms; a way that has no rows in the cell is absent


@dataclass(slots=True)
class Fit:
    way: str
    chunk: int
    base_ms: float
    us_per_prompt_token: float
    us_per_decode_row: float
    worst_residual_ms: float


def fit_linear(points: list[tuple[int, int, float]], columns: tuple[str, ...] = ("P", "R")) -> tuple[float, float, float, float] | None:
    """Least squares `ms = a + b * P + c * R` over (P, R, ms) points, with only the `columns` named
    ("P", "R") free (the others fixed at 0): (a, b, c, the largest residual), or None when the
    points cannot tell the free columns apart."""
    if len(points) < 1 + len(columns):
        return None
    design = torch.tensor([[1.0] + [float(p if name == "P" else r) for name in columns] for p, r, _ in points], dtype=torch.float64)
    target = torch.tensor([[ms] for _, _, ms in points], dtype=torch.float64)
    if int(torch.linalg.matrix_rank(design)) < design.shape[1]:
        return None
    solution = torch.linalg.lstsq(design, target).solution
    residual = float((design @ solution - target).abs().max())
    free = dict(zip(columns, solution.squeeze(1).tolist()[1:]))
    return float(solution[0, 0]), free.get("P", 0.0), free.get("R", 0.0), residual


def grid_fits(cells: list[Cell], decode_ms: dict[int, float]) -> list[Fit]:
    fits = []
    for chunk in sorted({c.chunk for c in cells}):
        for way in WAYS:
            found = fit_linear([(c.prompt_tokens, c.decode_rows, c.ms[way]) for c in cells if c.chunk == chunk and way in c.ms])
            if found is not None:
                fits.append(Fit(way, chunk, found[0], 1000 * found[1], 1000 * found[2], found[3]))
    found = fit_linear([(0, rows, ms) for rows, ms in decode_ms.items()], ("R",))
    if found is not None:
        fits.append(Fit("graph decode", 0, found[0], 0.0, 1000 * found[2], found[3]))
    return fits


class Timer:
    """Median milliseconds of a callable: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps

    def __call__(self, work: Callable[[], object]) -> float:
        work()  # warm-up: kernels, cuBLAS heuristics, Triton compiles of this shape
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                work()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                work()
                times.append(1000 * (time.perf_counter() - began))
        return statistics.median(times)


class Grid:
    def __init__(self, model: RWKV7, pool: StatePool, graphs: DecodeGraphRunner | None, timer: Timer, seed: int = 0) -> None:
        self.model, self.pool, self.graphs, self.timer = model, pool, graphs, timer
        self.device = model.device
        self.vocab = model.config.vocab_size
        self.penalties = sampler.PenaltyPool(pool.batch_size, self.vocab, self.device)
        self.generator = torch.Generator().manual_seed(seed)

    def _ids(self, count: int) -> list[int]:
        return torch.randint(1, 65530 if self.vocab > 65530 else self.vocab, (count,), generator=self.generator).tolist()

    def _sample(self, logits: torch.Tensor, slots: list[int]) -> None:
        rows = len(slots)
        ops.sample(logits, torch.tensor(slots, device=self.device), bench_sampling(rows, self.device), self.penalties)

    def cell(self, chunk: int, prompt_tokens: int, decode_rows: int) -> Cell:
        decode_slots = list(range(decode_rows))
        chunks = prompt_tokens // chunk
        prefill_slots = list(range(decode_rows, decode_rows + chunks))
        decode_ids = self._ids(decode_rows)
        prompts = [self._ids(chunk) for _ in range(chunks)]
        model, pool = self.model, self.pool
        decode_index = torch.tensor(decode_slots, dtype=torch.int64, device=self.device)
        decode_tokens = torch.tensor(decode_ids, dtype=torch.int64, device=self.device)

        def decode_logits() -> torch.Tensor:
            if self.graphs is not None:
                return self.graphs.decode(decode_index, decode_tokens)
            logits = model.forward(pool, decode_slots, [[t] for t in decode_ids])
            assert isinstance(logits, torch.Tensor)
            return logits

        def prefill_logits() -> torch.Tensor:
            logits = model.forward(pool, prefill_slots, prompts)
            assert isinstance(logits, torch.Tensor)
            return logits

        def mixed() -> None:
            logits = model.forward(pool, decode_slots + prefill_slots, [[t] for t in decode_ids] + prompts)
            assert isinstance(logits, torch.Tensor)
            self._sample(logits, decode_slots + prefill_slots)

        def split() -> None:
            self._sample(torch.cat([decode_logits(), prefill_logits()]), decode_slots + prefill_slots)

        ms: dict[str, float] = {}
        if decode_rows or chunks:
            ms["mixed"] = self.timer(mixed)
        if decode_rows and chunks:
            ms["split"] = self.timer(split)
        return Cell(chunk, prompt_tokens, decode_rows, ms)

    def graph_decode(self, decode_rows: int) -> float:
        """The decode-only step the engine replays (eager without graphs), with its sampler call."""
        slots = list(range(decode_rows))
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        ids = self._ids(decode_rows)
        tokens = torch.tensor(ids, dtype=torch.int64, device=self.device)

        def step() -> None:
            if self.graphs is not None:
                logits = self.graphs.decode(index, tokens)
            else:
                forwarded = self.model.forward(self.pool, slots, [[t] for t in ids])
                assert isinstance(forwarded, torch.Tensor)
                logits = forwarded
            self._sample(logits, slots)

        return self.timer(step)


def print_tables(cells: list[Cell], decode_ms: dict[int, float], fits: list[Fit]) -> None:
    """Per cell: the mixed step, the split one, and what its two parts take alone (the mixed step
    of the same chunks without decode rows, and the graph decode of the same rows)."""
    alone = {(c.chunk, c.prompt_tokens): c.ms["mixed"] for c in cells if c.decode_rows == 0}
    print(f"\n{'chunk':>6}{'prompt tok':>12}{'decode rows':>13}{'mixed ms':>11}{'split ms':>11}{'split/mixed':>13}{'prefill ms':>12}{'graph dec ms':>14}")
    for c in cells:
        cols = [f"{c.ms['mixed']:.2f}", f"{c.ms['split']:.2f}" if "split" in c.ms else "-",
                f"{c.ms['split'] / c.ms['mixed']:.3f}" if "split" in c.ms else "-",
                f"{alone[(c.chunk, c.prompt_tokens)]:.2f}" if c.prompt_tokens and (c.chunk, c.prompt_tokens) in alone else "-",
                f"{decode_ms[c.decode_rows]:.2f}" if c.decode_rows in decode_ms else "-"]  # fmt: skip
        print(f"{c.chunk:>6}{c.prompt_tokens:>12}{c.decode_rows:>13}{cols[0]:>11}{cols[1]:>11}{cols[2]:>13}{cols[3]:>12}{cols[4]:>14}")
    print(f"\n{'way':>13}{'chunk':>7}{'base ms':>10}{'us/prompt tok':>15}{'us/decode row':>15}{'worst residual ms':>19}")
    for f in fits:
        print(f"{f.way:>13}{f.chunk or '-':>7}{f.base_ms:>10.2f}{f.us_per_prompt_token:>15.3f}{f.us_per_decode_row:>15.3f}{f.worst_residual_ms:>19.2f}")


def print_lone_prompt(cells: list[Cell]) -> None:
    """The longest prompt fed in steps of each shorter chunk: steps x that chunk's step time."""
    longest = max(c.prompt_tokens for c in cells)
    print(f"\na lone prompt of {longest} tokens fed in chunks of C tokens (steps x the step's mixed ms):")
    print(f"{'C':>7}{'decode rows':>13}{'steps':>7}{'ms':>10}{'prompt tok/s':>14}")
    for c in cells:
        if c.prompt_tokens and longest % c.prompt_tokens == 0:
            steps = longest // c.prompt_tokens
            total = steps * c.ms["mixed"]
            print(f"{c.prompt_tokens:>7}{c.decode_rows:>13}{steps:>7}{total:>10.1f}{1000 * longest / total:>14,.0f}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7.2b", help="a named shape or <layers>x<width>")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decode-rows", default="0,16,64,240,960")
    parser.add_argument("--prompt-tokens", default="0,1024,4096,16384", help="multiples of every chunk size")
    parser.add_argument("--chunks", default="128", help="prompt chunk sizes (the engine's prefill_chunk)")
    parser.add_argument("--state-dtype", default=None, choices=("fp16", "fp32"), help="default: fp16 on a GPU, fp32 on the CPU (the engine's)")
    parser.add_argument("--one-prompt", action="store_true", help="each cell one chunk of P tokens (--chunks ignored)")
    parser.add_argument("--no-graphs", action="store_true", help="decode rows eager in the split and decode ways too")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    decode_rows, prompt_tokens, chunks = _ints(args.decode_rows), _ints(args.prompt_tokens), _ints(args.chunks)
    odd = [] if args.one_prompt else [(p, c) for p in prompt_tokens for c in chunks if p % c]
    if odd:
        raise SystemExit(f"--prompt-tokens must be multiples of every chunk size; {odd[0][0]} is not of {odd[0][1]}")
    gpu = device.type == "cuda"
    if gpu:
        cuda_ops.enable_cuda_kernels()
    dtype = torch.float16 if gpu else torch.float32
    state_dtype = {"fp16": torch.float16, "fp32": torch.float32}[args.state_dtype or ("fp16" if gpu else "fp32")]
    shape, _ = parse_random_spec(args.shape)
    built = time.perf_counter()
    model = RWKV7.from_state_dict(random_state_dict(shape, seed=0, device=device, dtype=dtype), device, dtype, progress=False)
    rows = max(decode_rows) + (1 if args.one_prompt else max(p // min(chunks) for p in prompt_tokens))
    pool = StatePool(model, rows + 1, state_dtype)  # + the decode graphs' scratch slot
    graphs = None
    if gpu and not args.no_graphs and max(decode_rows) > 0:
        graphs = DecodeGraphRunner(model, pool, scratch_slot=rows, buckets=graph_buckets(max(decode_rows)))
    print(f"{args.shape} (layers {shape.n_layer}, width {shape.n_embd}) on {device}, {dtype} weights, {state_dtype} state, "
          f"decode {'graphs' if graphs else 'eager'}, built in {time.perf_counter() - built:.1f}s", flush=True)  # fmt: skip
    grid = Grid(model, pool, graphs, Timer(device, args.reps))
    cells = []
    plan = [(p, p) for p in prompt_tokens if p] if args.one_prompt else [(chunk, p) for chunk in chunks for p in prompt_tokens]
    for chunk, p in plan:
        for r in decode_rows:
            if p or r:
                cells.append(grid.cell(chunk or 1, p, r))
                print(asdict(cells[-1]), flush=True)
    decode_ms = {r: grid.graph_decode(r) for r in decode_rows if r}
    print(f"graph decode ms by rows: {decode_ms}", flush=True)
    fits = [] if args.one_prompt else grid_fits(cells, decode_ms)
    print_tables(cells, decode_ms, fits)
    if args.one_prompt:
        print_lone_prompt(cells)
    if args.json:
        figures = {"shape": args.shape, "state_dtype": str(state_dtype), "graphs": graphs is not None, "cells": [asdict(c) for c in cells],
                   "graph_decode_ms": decode_ms, "fits": [asdict(f) for f in fits]}  # fmt: skip
        if gpu:
            write_gpu_json(args.json, **figures)
        else:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(__import__("json").dumps(figures, indent=2))


if __name__ == "__main__":
    main()
