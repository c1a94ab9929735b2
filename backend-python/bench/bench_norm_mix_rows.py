"""One layer's residual layer norm and token-shift mixes over prompt rows, two ways: the two
kernels the model ran before (`add_layer_norm` in place, then `shift_mix`) and the one-launch
`norm_mix_rows` op (the residual out of place). Prints us per call of each and the ratio, per
shape, number of mixes (6: a time-mix block's, 1: a channel mix's) and activation dtype (fp16
by default; fp16 rows are normed two at a time, bf16 and fp32 rows one at a time), and whether
the results are bit-identical.

    python bench/bench_norm_mix_rows.py --shapes 64x512,1x4096,128x128,960x1 --width 4096 --dtypes fp16,bf16

Times are of eager launches, CUDA events around --iters calls. Both ways start from a fresh copy
of x (the two ops update it in place): the copy's own time, timed alone, is subtracted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import ops
from gpu_json import write_gpu_json  # bench/ is the script's folder
from kernel_bench import require_kernel, timed_ms  # bench/ is the script's folder


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(slots=True)
class Result:
    shape: str
    mixes: int
    dtype: str
    two_ops_us: float
    one_op_us: float
    identical: bool


def bench(slots: int, length: int, mixes: int, width: int, iters: int, dtype: str = "fp16") -> Result:
    gen = torch.Generator(device="cuda").manual_seed(slots * length + mixes)
    rows = slots * length
    kind = DTYPES[dtype]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(kind)

    x, delta, weight, bias = randn(rows, width), randn(rows, width), randn(width), randn(width)
    shift = randn(slots + 1, width)
    coefficients = torch.rand(*((mixes, width) if mixes > 1 else (width,)), generator=gen, device="cuda").to(kind)
    slot_idx = torch.randperm(slots + 1, generator=gen, device="cuda")[:slots].to(torch.int32)
    cu = torch.arange(0, rows + 1, length, dtype=torch.int32, device="cuda")

    def two_ops(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x.clone()
        h = ops.add_layer_norm(residual, delta, weight, bias)
        return residual, ops.shift_mix(h, state, slot_idx, cu, coefficients)

    def one_op(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.norm_mix_rows(x.clone(), delta, weight, bias, state, slot_idx, cu, coefficients)

    a, b = shift.clone(), shift.clone()
    identical = all(torch.equal(p, q) for p, q in zip(two_ops(a), one_op(b))) and torch.equal(a, b)

    def per_call_us(call: Callable[[], object]) -> float:
        call()
        torch.cuda.synchronize()
        return 1e3 * timed_ms(call, iters)

    copy = per_call_us(x.clone)
    return Result(f"{slots}x{length}", mixes, dtype, per_call_us(lambda: two_ops(a)) - copy, per_call_us(lambda: one_op(b)) - copy, identical)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="64x512,1x4096,128x128,960x1", help="SLOTSxROWS: prompt chunks (960x1: one-row slots)")
    parser.add_argument("--mixes", default="6,1")
    parser.add_argument("--width", type=int, default=4096, help="the 7.2B width")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtypes", default="fp16", help="activation dtypes, of " + ",".join(DTYPES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(require_kernel("bench_norm_mix_rows", "fused", "fused"), flush=True)
    results = []
    for spec in [s for s in args.shapes.split(",") if s]:
        slots, length = (int(n) for n in spec.split("x"))
        for mixes in [int(m) for m in args.mixes.split(",") if m]:
            for dtype in [d for d in args.dtypes.split(",") if d]:
                results.append(bench(slots, length, mixes, args.width, args.iters, dtype))
                print(asdict(results[-1]), flush=True)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | width {args.width}")
    print(f"{'shape':<10}{'mixes':>6}{'dtype':>6}{'two ops us':>12}{'one op us':>11}{'ratio':>8}  bit-identical")
    for r in results:
        print(f"{r.shape:<10}{r.mixes:>6}{r.dtype:>6}{r.two_ops_us:>12,.1f}{r.one_op_us:>11,.1f}{r.one_op_us / r.two_ops_us:>8.3f}  {r.identical}")
    if args.json:
        write_gpu_json(args.json, results=[asdict(r) for r in results])
    if not all(r.identical for r in results):
        raise SystemExit("norm_mix_rows differs from the two ops")


if __name__ == "__main__":
    main()
