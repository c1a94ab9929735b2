"""One layer's WKV walk over prompt chunks, two ways: the three kernels the model runs by default
(`wkv_prep`, the WKV op at two state rows a thread straight in registers, `gn_bonus_gate`) and
the one-launch `wkv_prefill_fused` op. Prints us per layer of each, the ratio, and whether the
outputs and states are bit-identical, per shape and state dtype (activations fp16, block 1+).

    python bench/bench_prefill_walk.py --prefill 64x512,128x128,32x512 --state-dtypes fp16,fp32

Times are of eager launches, CUDA events around --iters calls, on fresh copies of k and v each
call of the three ops (wkv_prep updates them in place; the copies are outside the timed region).
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

N = ops.HEAD_SIZE
STATES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass(slots=True)
class Result:
    shape: str
    state: str
    three_ops_us: float
    fused_us: float
    identical: bool


def _operands(slots: int, length: int, heads: int, state_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(slots * length)
    rows, C = slots * length, heads * N

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale + shift).to(torch.float16)

    return {
        "state": (torch.randn(slots, heads, N, N, generator=gen, device="cuda") * 0.1).to(state_dtype),
        "slot_idx": torch.randperm(slots, generator=gen, device="cuda").to(torch.int32),
        "cu_seqlens": torch.arange(0, rows + 1, length, dtype=torch.int32, device="cuda"),
        "r": randn(rows, C, scale=0.5), "k": randn(rows, C, scale=0.5), "v": randn(rows, C, scale=0.5),
        "g": torch.sigmoid(randn(rows, C)), "w_lora": randn(rows, C, scale=0.5), "a_lora": randn(rows, C, scale=0.5),
        "v_lora": randn(rows, C, scale=0.5), "v_first": randn(rows, C, scale=0.5),
        "w0": randn(C, scale=0.5, shift=-1.0), "a0": randn(C, scale=0.5), "v0": randn(C, scale=0.5),
        "k_k": randn(C, scale=0.2, shift=0.8), "k_a": randn(C, scale=0.2, shift=1.0), "r_k": randn(C, scale=0.3),
        "ln_w": randn(C, scale=0.3, shift=1.0), "ln_b": randn(C, scale=0.1),
    }  # fmt: skip


ORDER = ("state", "slot_idx", "cu_seqlens", "r", "k", "v", "g", "w_lora", "a_lora", "v_lora", "v_first", "w0", "a0", "v0", "k_k", "k_a", "r_k", "ln_w", "ln_b")


def three_ops(o: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    w, a, b = ops.wkv_prep(k, v, o["w_lora"], o["a_lora"], o["v_lora"], o["v_first"], o["w0"], o["a0"], o["v0"], o["k_k"], o["k_a"])
    y = ops.wkv7(o["state"], o["slot_idx"], o["cu_seqlens"], o["r"], w, k, v, a, b, rows_per_thread=2, direct_rows=True)
    return ops.gn_bonus_gate(y, o["r"], k, v, o["g"], o["r_k"], o["ln_w"], o["ln_b"])


def fused(o: dict[str, torch.Tensor]) -> torch.Tensor:
    return ops.wkv_prefill_fused(*(o[name] for name in ORDER))


def _per_call_ms(call: Callable[[], object], iters: int) -> float:
    call()
    torch.cuda.synchronize()
    return timed_ms(call, iters)


def bench(slots: int, length: int, heads: int, state_name: str, iters: int) -> Result:
    o = _operands(slots, length, heads, STATES[state_name])
    start = o["state"].clone()
    a = dict(o, state=start.clone())
    b = dict(o, state=start.clone())
    identical = torch.equal(three_ops(a, o["k"].clone(), o["v"].clone()), fused(b)) and torch.equal(a["state"], b["state"])
    # The three ops update k and v in place: each timed call gets copies made before the timing
    # (one pair per call, so no call sees another's updates).
    copies = [(o["k"].clone(), o["v"].clone()) for _ in range(iters + 1)]
    it = iter(copies)
    three_ms = _per_call_ms(lambda: three_ops(o, *next(it)), iters)
    fused_ms = _per_call_ms(lambda: fused(o), iters)
    return Result(f"{slots}x{length}", state_name, 1e3 * three_ms, 1e3 * fused_ms, identical)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", default="64x512,128x128,32x512", help="shapes PROMPTSxLENGTH")
    parser.add_argument("--heads", type=int, default=64, help="64 heads of 64: the 7.2B shape (width 4096)")
    parser.add_argument("--state-dtypes", default="fp16,fp32", help=f"comma-separated, of {','.join(STATES)}")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(require_kernel("bench_prefill_walk", "fused", "fused"), flush=True)
    results = []
    for spec in [s for s in args.prefill.split(",") if s]:
        slots, length = (int(n) for n in spec.split("x"))
        for state_name in [s for s in args.state_dtypes.split(",") if s]:
            results.append(bench(slots, length, args.heads, state_name, args.iters))
            print(asdict(results[-1]), flush=True)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.heads} heads, fp16 activations, one layer")
    print(f"{'shape':<10}{'state':<7}{'three ops us':>14}{'fused us':>10}{'ratio':>8}  bit-identical")
    for r in results:
        print(f"{r.shape:<10}{r.state:<7}{r.three_ops_us:>14,.1f}{r.fused_us:>10,.1f}{r.fused_us / r.three_ops_us:>8.3f}  {r.identical}")
    if args.json:
        write_gpu_json(args.json, results=[asdict(r) for r in results])
    if not all(r.identical for r in results):
        raise SystemExit("the fused walk differs from the three ops")


if __name__ == "__main__":
    main()
