"""Run one batch-1 weight product many times, for Nsight Compute to profile (GPU).

`bench_int8.py kernels` says how long each few-row product takes; this says why. It runs the
int8 split-K GEMV, the fp16 split-K GEMV and fp16 cuBLAS on one shape, `--calls` times each in
that order, each call on another copy of the weights (so none is served from the 50 MB L2, as in
a decode step). Profile it with, for example (repository root's backend-python/):

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section LaunchStats --section Occupancy --launch-skip 20 --launch-count 6 \\
        python3 bench/ncu_small_products.py --shape 4096x4096

(--launch-skip passes the warm-up calls; each product is then profiled twice.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import cuda_ops, int8_dispatch, linear, ops
from albatross.quant import quantize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4096x4096", help="KxN of the weight (stored [in, out])")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--calls", type=int, default=12, help="calls of each product")
    parser.add_argument("--copies", type=int, default=8, help="weight copies cycled through")
    args = parser.parse_args()
    results = cuda_ops.enable_cuda_kernels()
    print({name: result.how for name, result in results.items()})
    K, N = (int(side) for side in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, K, generator=gen, device="cuda").half()
    dense = [(torch.randn(K, N, generator=gen, device="cuda") / K**0.5).half() for _ in range(args.copies)]
    packed = [quantize(weight) for weight in dense]
    counters = linear.counters(x.device)
    for call in range(args.calls):
        int8_dispatch.int8_gemv(x, packed[call % args.copies])
    for call in range(args.calls):
        ops.gemv(x, dense[call % args.copies], counters)
    for call in range(args.calls):
        torch.mm(x, dense[call % args.copies])
    torch.cuda.synchronize()
    print(f"{args.calls} calls each of int8_gemv, gemv and cuBLAS on {args.rows} x {K} @ {K} x {N}")


if __name__ == "__main__":
    main()
