"""Split-K GEMV (albatross/cuda/gemv.cu) against cuBLAS (torch.mm / torch.bmm) for the 7.2B
model's products at 1-4 rows: us per call and the weight bytes read per second, each timed as a
CUDA graph of many calls (as a decode step runs), plus one whole layer's products back to back.

    python bench/bench_gemv.py --json out/gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import linear
from gpu_json import write_gpu_json
from kernel_bench import require_kernel  # bench/ is the script's folder

# (name, batch of matrices or None, K, N): one 7.2B layer's weight products, then the head
LAYER_7B = [
    ("rkv (bmm)", 3, 4096, 4096),
    ("output", None, 4096, 4096),
    ("ffn key", None, 4096, 16384),
    ("ffn value", None, 16384, 4096),
    ("lora down (w1)", None, 4096, 160),
    ("lora up (w2)", None, 160, 4096),
    ("gate down (g1)", None, 4096, 480),
    ("gate up (g2)", None, 480, 4096),
]
HEAD_7B = ("head", None, 4096, 65536)


@dataclass(slots=True)
class Result:
    product: str
    rows: int
    kernel: str
    us: float
    tb_per_s: float  # weight bytes / time


def _graph_time(fn, calls: int, repeats: int) -> float:
    """us per call of `fn`, captured `calls` times in one graph and replayed `repeats` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * repeats)


def rotating_graph_time(fn, operand_sets: list, calls: int, repeats: int) -> float:
    """us per call of `fn(*operands)`, the calls cycling through `operand_sets` (weight copies that
    together overflow the L2, so no call finds its weights cached), `calls` of them per graph."""
    sets = itertools.cycle(operand_sets)
    return _graph_time(lambda: fn(*next(sets)), calls=calls, repeats=repeats)


def _operands(batch: int | None, rows: int, K: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    lead = () if batch is None else (batch,)
    # Several copies of the weights, cycled, so that no call finds them in the 50 MB L2.
    x = torch.randn(*lead, rows, K, device="cuda", dtype=torch.float16)
    W = torch.randn(*lead, K, N, device="cuda", dtype=torch.float16) / K**0.5
    return x, W


def bench_product(name: str, batch: int | None, K: int, N: int, rows: int, calls: int, repeats: int) -> list[Result]:
    copies = max(2, (256 << 20) // (2 * K * N * (batch or 1)))  # >= 256 MB of weights in the rotation
    operands = [_operands(batch, rows, K, N) for _ in range(min(copies, 16))]
    weight_bytes = 2 * K * N * (batch or 1)
    torch_fn = torch.bmm if batch else torch.mm
    results = []
    for kernel, fn in (("gemv", linear.gemv), ("cublas", torch_fn)):
        us = rotating_graph_time(fn, operands, calls=len(operands) * max(1, calls // len(operands)), repeats=repeats)
        results.append(Result(name, rows, kernel, us, weight_bytes / us / 1e6))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--calls", type=int, default=32, help="calls captured per graph")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    require_kernel("bench_gemv", "gemv", "GEMV")
    results: list[Result] = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, batch, K, N in [*LAYER_7B, HEAD_7B]:
            for result in bench_product(name, batch, K, N, rows, args.calls, args.repeats):
                results.append(result)
                print(asdict(result), flush=True)
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | fp16, one graph of {args.calls} calls per figure")
    print(f"{'product':<16}{'rows':>5}{'gemv us':>10}{'TB/s':>7}{'cuBLAS us':>11}{'TB/s':>7}{'speed-up':>10}")
    layer = {"gemv": {}, "cublas": {}}
    for result in results:
        layer[result.kernel][(result.product, result.rows)] = result
    for (product, rows), mine in layer["gemv"].items():
        theirs = layer["cublas"][(product, rows)]
        print(f"{product:<16}{rows:>5}{mine.us:>10.1f}{mine.tb_per_s:>7.2f}{theirs.us:>11.1f}{theirs.tb_per_s:>7.2f}{theirs.us / mine.us:>9.2f}x")
    per_layer = {
        kernel: {rows: sum(r.us for (p, n), r in by.items() if n == rows and p != "head") for rows in {n for _, n in by}}
        for kernel, by in layer.items()
    }
    for rows in sorted(per_layer["gemv"]):
        print(f"one layer's products, {rows} row(s): gemv {per_layer['gemv'][rows]:.1f} us, cuBLAS {per_layer['cublas'][rows]:.1f} us")
    if args.json:
        write_gpu_json(args.json, results=[asdict(r) for r in results], per_layer_us=per_layer)


if __name__ == "__main__":
    main()
