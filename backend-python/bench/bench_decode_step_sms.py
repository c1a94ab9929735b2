"""The fused decode step (`ops.wkv_decode_step`, one layer of 7.2B at batch 960 by default) timed on
fewer SMs than the GPU has, through CUDA green contexts, next to a large fp16 product as a check
that the partition took effect.

Why: the step is bound by its state traffic. On an H100 it runs near the memory roof (2.5 of 3.35
TB/s at batch 960), while on the H200 it ran at 2.68 of 4.8 TB/s with about the same time per
block per SM (docs/performance.md, sessions 16 and 17): there it waits on latency, not bandwidth.
An H100 limited to ~92 SMs has the H200's memory bandwidth per SM, so a change that hides latency
(more bytes in flight per SM) shows there when no H200 is at hand. Time scales by 132 / SMs when
each SM's throughput is the limit, by less when memory bandwidth is.

    python bench/bench_decode_step_sms.py --sms 0,96,64 --json out/step-sms.json    (0: the whole GPU)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import ops
from gpu_json import write_gpu_json  # bench/ is the script's folder
from kernel_bench import event_ms, require_kernel  # bench/ is the script's folder

N = ops.HEAD_SIZE


@dataclass(slots=True)
class Result:
    sms: int  # the partition's SMs (the whole GPU's count when not partitioned)
    step_us: float  # one layer's fused decode step
    state_tb_s: float  # the state read and written once, per second
    matmul_us: float  # [4096, 4096] @ [4096, 4096] fp16: should scale with 1 / SMs


def _operands(rows: int, heads: int, state_dtype: torch.dtype, gen: torch.Generator) -> list[object]:
    """The op's arguments in `wkv_decode_step`'s order, random, in a trained model's ranges."""
    C = heads * N

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale + shift).to(dtype)

    state = randn(rows + 8, heads, N, N, scale=0.3, dtype=state_dtype)
    slots = torch.randperm(rows + 8, generator=gen, device="cuda")[:rows].to(torch.int32)
    return [state, slots, randn(rows, C), randn(rows, C), randn(rows, C), torch.sigmoid(randn(rows, C)),
            randn(rows, C, scale=0.5), randn(rows, C, scale=0.5), randn(rows, C, scale=0.5), randn(rows, C),
            randn(C, scale=0.5, shift=-1.0), randn(C, scale=0.5), randn(C, scale=0.5), randn(C, scale=0.2, shift=0.8),
            randn(C, scale=0.2, shift=1.0), randn(C, scale=0.3), randn(C, scale=0.3, shift=1.0), randn(C, scale=0.1)]  # fmt: skip


def measure(sms: int, rows: int, heads: int, state_dtype: torch.dtype, iters: int) -> Result:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    args = _operands(rows, heads, state_dtype, gen)
    a = torch.randn(4096, 4096, generator=gen, device="cuda").half()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    context = None
    stream = torch.cuda.current_stream()
    if 0 < sms < total:
        from torch.cuda.green_contexts import GreenContext

        context = GreenContext.create(sms, 0)
        context.set_context()
        stream = context.Stream()
    try:
        with torch.cuda.stream(stream):
            step_ms = event_ms(lambda: ops.wkv_decode_step(*args), iters)
            matmul_ms = event_ms(lambda: a @ a, iters)
    finally:
        if context is not None:
            context.pop_context()
    state = args[0]
    assert isinstance(state, torch.Tensor)
    traffic = 2 * rows * heads * N * N * state.element_size()
    return Result(sms if context is not None else total, 1e3 * step_ms, traffic / step_ms / 1e9, 1e3 * matmul_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sms", default="0,96,64", help="SM counts to run on (0: the whole GPU, no partition)")
    parser.add_argument("--rows", type=int, default=960)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--state-dtype", default="fp16", choices=("fp16", "fp32"))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(require_kernel("bench_decode_step_sms", "fused", "fused decode step"), flush=True)
    state_dtype = torch.float16 if args.state_dtype == "fp16" else torch.float32
    results = [measure(int(n), args.rows, args.heads, state_dtype, args.iters) for n in args.sms.split(",") if n]
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.rows} rows, {args.heads} heads, {args.state_dtype} state")
    print(f"{'SMs':>5}{'step us':>10}{'state TB/s':>12}{'matmul us':>11}")
    for r in results:
        print(f"{r.sms:>5}{r.step_us:>10.1f}{r.state_tb_s:>12.2f}{r.matmul_us:>11.1f}")
    if args.json:
        write_gpu_json(args.json, results=[asdict(r) for r in results])


if __name__ == "__main__":
    main()
