"""Sampler kernel benchmark: the exact draw (candidate narrowing) against the rejection draw
(docs/kernels.md "Rejection draw") on the real vocabulary, per batch and filter. Prints ms per call
and, for the rejection draw, how many rows of the timed batch drew what the exact draw drew (they
use other uniforms, so about as many as chance gives) and whether every id is a kept id.

    python bench/bench_sampler.py --batches 1,64,960 --json out/sampler.json

The kernel is loaded as the server loads it (prebuilt when the manifest matches the sources, else a
JIT build). Times are of eager calls, CUDA events around --iters calls, penalties updated as in
serving (each call reads and decays its rows' penalties). Logits are N(0, 1) times --logit-scale.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import ops, sampler
from gpu_json import write_gpu_json  # bench/ is the script's folder
from kernel_bench import event_ms, require_kernel  # bench/ is the script's folder


@dataclass(frozen=True, slots=True)
class Filter:
    name: str
    temperature: float
    top_k: int
    top_p: float
    penalties: bool = False  # presence/frequency penalties and a pool with earlier penalties in it


FILTERS = (
    Filter("top-k 50 + top-p 0.6", 1.0, 50, 0.6),
    Filter("top-p 0.9", 1.0, 0, 0.9),
    Filter("greedy", 0.0, 0, 1.0),
    Filter("top-k 50 + top-p 0.6, penalties", 1.0, 50, 0.6, penalties=True),
)


@dataclass(slots=True)
class Result:
    filter: str
    batch: int
    exact_ms: float
    rejection_ms: float
    speedup: float
    same_ids: int  # rows where both draws gave the same id
    kept: bool  # every rejection id is kept by the exact filter


def _batch(rows: int, filt: Filter, gen: torch.Generator) -> sampler.SamplingBatch:
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device="cuda")

    penalty = 0.3 if filt.penalties else 0.0
    return sampler.SamplingBatch(
        temperature=full(filt.temperature),
        top_p=full(filt.top_p),
        top_k=full(filt.top_k, torch.int64),
        presence=full(penalty),
        frequency=full(penalty),
        decay=full(0.996 if filt.penalties else 1.0),
        seed32=torch.randint(0, 2**32, (rows,), generator=gen, dtype=torch.int64).cuda(),
        step=torch.randint(0, 10_000, (rows,), generator=gen, dtype=torch.int64).cuda(),
    )


def _pool(rows: int, vocab: int, filt: Filter, gen: torch.Generator) -> sampler.PenaltyPool:
    pool = sampler.PenaltyPool(rows, vocab, device="cuda")
    if filt.penalties:  # earlier tokens' penalties on 1% of the ids
        pool.penalties.copy_((torch.rand(rows, vocab, generator=gen) * (torch.rand(rows, vocab, generator=gen) < 0.01)).cuda())
    return pool


def bench(rows: int, filt: Filter, vocab: int, scale: float, iters: int) -> Result:
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen) * scale).cuda()
    slots = torch.randperm(rows, generator=gen).cuda()
    batch = _batch(rows, filt, gen)
    pool = _pool(rows, vocab, filt, gen)
    start = sampler.PenaltyPool.wrap(pool.penalties.clone(), pool.seen.clone())
    exact_ids = ops.sample(logits, slots, batch, start, update_penalties=False, rejection=False)
    rejection_ids = ops.sample(logits, slots, batch, start, update_penalties=False, rejection=True)
    adjusted = logits - start.penalties[slots]
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    kept = sampler.kept_mask(torch.softmax(adjusted / temperature[:, None], dim=-1), batch.top_k, batch.top_p)
    every_kept = bool(kept[torch.arange(rows, device="cuda"), rejection_ids].all())
    exact_ms = event_ms(lambda: ops.sample(logits, slots, batch, pool, rejection=False), iters)
    rejection_ms = event_ms(lambda: ops.sample(logits, slots, batch, pool, rejection=True), iters)
    same = int((exact_ids == rejection_ids).sum())
    return Result(filt.name, rows, exact_ms, rejection_ms, exact_ms / rejection_ms, same, every_kept)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,960")
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--logit-scale", type=float, default=3.0)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(require_kernel("bench_sampler", "sampler", "sampler"), flush=True)

    results: list[Result] = []
    for filt in FILTERS:
        for rows in (int(b) for b in args.batches.split(",") if b):
            result = bench(rows, filt, args.vocab, args.logit_scale, args.iters)
            results.append(result)
            print(asdict(result), flush=True)
            torch.cuda.empty_cache()

    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | vocab {args.vocab}, logits N(0, 1) x {args.logit_scale}")
    print(f"{'filter':<34}{'batch':>6}{'exact ms':>10}{'rejection ms':>14}{'speedup':>9}{'same ids':>10}{'kept':>6}")
    for r in results:
        print(f"{r.filter:<34}{r.batch:>6}{r.exact_ms:>10.3f}{r.rejection_ms:>14.3f}{r.speedup:>9.2f}{r.same_ids:>10}{'yes' if r.kept else 'NO':>6}")
    if args.json:
        write_gpu_json(args.json, vocab=args.vocab, logit_scale=args.logit_scale, results=[asdict(r) for r in results])


if __name__ == "__main__":
    main()
