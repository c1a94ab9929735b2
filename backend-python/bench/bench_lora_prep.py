"""A block's stacked LoRA up products and `wkv_prep`, two ways: the `bmm` then the CUDA
`wkv_prep` op (what the model runs by default), and one Triton kernel computing the up products
with wkv_prep as their epilogue (albatross/lora_prep_triton.py) at each tile shape of its
CANDIDATES. Prints us per call of each, the bmm alone and wkv_prep alone, the fused kernel's
bandwidth, and the share of its outputs that differ from the unfused path's, per row count
(7.2B block by default: C 4096, three LoRAs of rank 128).

    python bench/bench_lora_prep.py --rows 960,4096,16384,32768

Times are of eager launches, CUDA events around --iters calls, each way keeping its fastest of
--rounds turns. k and v are updated in place by both ways on every call; their values stay
bounded (k shrinks by a factor in (0, 1], v moves towards v_first), so repeated calls are alike.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import linear, ops
from gpu_json import write_gpu_json  # bench/ is the script's folder
from kernel_bench import ACTIVATION_DTYPES as DTYPES  # bench/ is the script's folder
from kernel_bench import fastest, fastest_of_rounds, require_kernel


@dataclass(slots=True)
class Result:
    rows: int
    dtype: str
    bmm_us: float
    prep_us: float
    unfused_us: float
    fused_us: dict[str, float] = field(default_factory=dict)  # by tile shape
    differ: dict[str, float] = field(default_factory=dict)  # share of w, -kk, kk*a, k, v elements unlike the unfused path's

    def best(self) -> tuple[str, float]:
        return fastest(self.fused_us)


def bench(rows: int, width: int, rank: int, dtype: str, iters: int, rounds: int) -> Result:
    from albatross import lora_prep_triton

    kind = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(kind)

    hidden, up = randn(3, rows, rank), randn(3, rank, width, scale=rank**-0.5)
    k, v, v_first = randn(rows, width), randn(rows, width), randn(rows, width)
    vectors = (randn(width), randn(width), randn(width), randn(width), torch.rand(width, generator=gen, device="cuda").to(kind))
    lora = linear.bmm(hidden, up)

    def unfused(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = linear.bmm(hidden, up)
        return ops.wkv_prep(k, v, out[1], out[2], out[0], v_first, *vectors)

    ways: dict[str, Callable[[], object]] = {
        "bmm": lambda: linear.bmm(hidden, up),
        "prep": lambda: ops.wkv_prep(k, v, lora[1], lora[2], lora[0], v_first, *vectors),
        "unfused": lambda: unfused(k, v),
    }
    for tiles in lora_prep_triton.CANDIDATES:
        ways[tiles.label()] = lambda tiles=tiles: lora_prep_triton.lora_prep(hidden, up, k, v, v_first, *vectors, tiles=tiles)
    best = fastest_of_rounds(ways, iters, rounds)
    result = Result(rows, dtype, best["bmm"], best["prep"], best["unfused"])
    for tiles in lora_prep_triton.CANDIDATES:
        k_a, v_a, k_b, v_b = k.clone(), v.clone(), k.clone(), v.clone()
        want = (*unfused(k_a, v_a), k_a, v_a)
        got = (*lora_prep_triton.lora_prep(hidden, up, k_b, v_b, v_first, *vectors, tiles=tiles), k_b, v_b)
        result.fused_us[tiles.label()] = best[tiles.label()]
        result.differ[tiles.label()] = max((g != w).double().mean().item() for g, w in zip(got, want))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="960,4096,16384,32768", help="row counts (32768: a 64 x 512 prefill, 4096: 1 x 4,096)")
    parser.add_argument("--width", type=int, default=4096, help="C, the 7.2B width")
    parser.add_argument("--rank", type=int, default=128, help="R, the stack's padded rank (7.2B: 128)")
    parser.add_argument("--dtypes", default="fp16", help="activation dtypes, of " + ",".join(DTYPES))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(require_kernel("bench_lora_prep", "fused", "wkv_prep"), flush=True)
    results = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        for rows in [int(r) for r in args.rows.split(",") if r]:
            results.append(bench(rows, args.width, args.rank, dtype, args.iters, args.rounds))
            print(asdict(results[-1]), flush=True)

    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | hidden [3, rows, {args.rank}] @ up [3, {args.rank}, {args.width}], then wkv_prep")
    labels = list(results[0].fused_us) if results else []
    print("us a call; fused tile shapes:", "; ".join(f"({i}) {label}" for i, label in enumerate(labels)))
    header = f"{'dtype':<6}{'rows':>7}{'bmm':>9}{'prep':>9}{'both':>9}" + "".join(f"{'(' + str(i) + ')':>9}" for i in range(len(labels)))
    print(header + f"{'best/both':>11}{'GB/s':>8}{'differ':>9}")
    for r in results:
        label, fused = r.best()
        moved = (8 * r.rows * args.width + 3 * r.rows * args.rank) * DTYPES[r.dtype].itemsize  # k, v, v_first in; k, v, w, a, b out
        line = f"{r.dtype:<6}{r.rows:>7}{r.bmm_us:>9,.1f}{r.prep_us:>9,.1f}{r.unfused_us:>9,.1f}" + "".join(f"{r.fused_us[t]:>9,.1f}" for t in labels)
        print(line + f"{fused / r.unfused_us:>11.3f}{moved / fused / 1e3:>8,.0f}{r.differ[label]:>9.2%}")
    if args.json:
        write_gpu_json(args.json, results=[asdict(r) for r in results])
    bad = [(r.rows, label) for r in results for label, share in r.differ.items() if share > 0.01]
    if bad:
        raise SystemExit(f"fused tile shapes that do not round as the bmm and wkv_prep: {bad}")


if __name__ == "__main__":
    main()
