"""The channel mix's key product and its relu^2, two ways: cuBLAS's product then the CUDA
`relu_square` pass (what the model runs by default), and one Triton kernel with the square in the
product's epilogue (albatross/relu_square_triton.py) at each tile shape of its CANDIDATES. Prints
us per call of each, cuBLAS's product alone and the pass alone, TFLOP/s, and how the fastest fused
shape's result compares: the share of elements that differ from the unfused path's (both round
the product to 16 bits, then its square; only the order of the fp32 sums differs) and both
errors against float64, per row count (7.2B width by default).

    python bench/bench_ffn_key.py --rows 960,4096,16384,32768 --width 4096 --dtypes fp16

Times are of eager launches, CUDA events around --iters calls; the ways take turns for --rounds
rounds and each keeps its fastest round, so a clock drift during the run does not favour one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import ops
from gpu_json import write_gpu_json  # bench/ is the script's folder
from kernel_bench import ACTIVATION_DTYPES as DTYPES  # bench/ is the script's folder
from kernel_bench import fastest, fastest_of_rounds, require_kernel


@dataclass(slots=True)
class Result:
    rows: int
    dtype: str
    product_us: float  # cuBLAS's product alone
    pass_us: float  # relu_square alone
    unfused_us: float  # the two
    fused_us: dict[str, float] = field(default_factory=dict)  # by tile label
    unfused_error: float = 0.0
    fused_error: dict[str, float] = field(default_factory=dict)
    differ: dict[str, float] = field(default_factory=dict)  # share of elements unlike the unfused path's

    def best(self) -> tuple[str, float]:
        return fastest(self.fused_us)


def bench(rows: int, width: int, hidden: int, dtype: str, iters: int, rounds: int, error_rows: int) -> Result:
    from albatross import relu_square_triton

    kind = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, width, generator=gen, device="cuda").to(kind)
    weight = (torch.randn(width, hidden, generator=gen, device="cuda") * width**-0.5).to(kind)
    key = torch.mm(x, weight)

    ways: dict[str, Callable[[], object]] = {
        "product": lambda: torch.mm(x, weight),
        "pass": lambda: ops.relu_square(key),
        "unfused": lambda: ops.relu_square(torch.mm(x, weight)),
    }
    for tiles in relu_square_triton.CANDIDATES:
        ways[tiles.label()] = lambda tiles=tiles: relu_square_triton.product_relu_square(x, weight, tiles)
    best = fastest_of_rounds(ways, iters, rounds)

    # Errors on the first error_rows rows against float64, relative to the largest output.
    head = x[:error_rows]
    exact = torch.relu(head.double() @ weight.double()).square()
    scale = exact.abs().max()

    def error(got: torch.Tensor) -> float:
        return ((got[:error_rows].double() - exact).abs().max() / scale).item()

    unfused = ops.relu_square(torch.mm(head, weight))
    result = Result(rows, dtype, best["product"], best["pass"], best["unfused"], unfused_error=error(unfused))
    for tiles in relu_square_triton.CANDIDATES:
        fused = relu_square_triton.product_relu_square(head, weight, tiles)
        result.fused_us[tiles.label()] = best[tiles.label()]
        result.fused_error[tiles.label()] = error(fused)
        result.differ[tiles.label()] = (fused != unfused).double().mean().item()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="960,2048,4096,16384,32768", help="row counts (32768: a 64 x 512 prefill, 4096: 1 x 4,096)")
    parser.add_argument("--width", type=int, default=4096, help="C, the 7.2B width")
    parser.add_argument("--hidden", type=int, default=0, help="F, the channel mix's width (default 4 C)")
    parser.add_argument("--dtypes", default="fp16", help="activation dtypes, of " + ",".join(DTYPES))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--error-rows", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(require_kernel("bench_ffn_key", "fused", "relu_square"), flush=True)
    hidden = args.hidden or 4 * args.width
    results = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        for rows in [int(r) for r in args.rows.split(",") if r]:
            results.append(bench(rows, args.width, hidden, dtype, args.iters, args.rounds, min(args.error_rows, rows)))
            print(asdict(results[-1]), flush=True)

    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | x [rows, {args.width}] @ W [{args.width}, {hidden}], then relu^2")
    labels = list(results[0].fused_us) if results else []
    print("us a call; fused tile shapes:", "; ".join(f"({i}) {label}" for i, label in enumerate(labels)))
    header = f"{'dtype':<6}{'rows':>7}{'cuBLAS':>10}{'pass':>9}{'both':>10}" + "".join(f"{'(' + str(i) + ')':>10}" for i in range(len(labels)))
    print(header + f"{'best/both':>11}{'TFLOP/s':>9}{'err both':>10}{'err best':>10}{'differ':>9}")
    for r in results:
        label, fused = r.best()
        flops = 2 * r.rows * args.width * hidden
        line = f"{r.dtype:<6}{r.rows:>7}{r.product_us:>10,.1f}{r.pass_us:>9,.1f}{r.unfused_us:>10,.1f}"
        line += "".join(f"{r.fused_us[t]:>10,.1f}" for t in labels)
        print(line + f"{fused / r.unfused_us:>11.3f}{flops / fused / 1e6:>9.0f}{r.unfused_error:>10.2e}{r.fused_error[label]:>10.2e}{r.differ[label]:>9.2%}")
    for r in results:
        label, fused = r.best()
        print(f"{r.dtype} {r.rows} rows: best {label}, cuBLAS product at {2 * r.rows * args.width * hidden / r.product_us / 1e6:.0f} TFLOP/s")
    if args.json:
        write_gpu_json(args.json, results=[asdict(r) for r in results])
    bad = [(r.rows, label) for r in results for label in r.fused_us if r.differ[label] > 0.01 or r.fused_error[label] > 1.5 * r.unfused_error + 1e-6]
    if bad:
        raise SystemExit(f"fused tile shapes that do not round as cuBLAS and the pass: {bad}")


if __name__ == "__main__":
    main()
