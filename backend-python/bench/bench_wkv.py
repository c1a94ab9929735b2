"""WKV kernel benchmark: one layer's WKV op for decode steps (every slot one token) and prefill
calls (PROMPTS x LENGTH tokens), per state dtype. Prints us per layer, the state traffic of decode
in TB/s (state read and written once, activations counted too) or the tokens/s of prefill, and the
relative difference of the output to the torch twin on the same fresh inputs.

    python bench/bench_wkv.py --batches 1,64,256,960 --prefill 1x4096,8x512,64x512 --json out/wkv.json
    python bench/bench_wkv.py --batches= --prefill 4x512,8x512,64x512 --rows-per-thread 1,2   (the prefill kernel's two layouts)

The kernel is loaded as the server loads it (prebuilt when the manifest matches the sources, else a
JIT build). Times are of eager launches, CUDA events around --iters calls. Decode rows are timed
with the decode kernel (`single_token`) and again with the general kernel ("decode, general").
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import ops
from gpu_json import write_gpu_json  # bench/ is the script's folder
from kernel_bench import event_ms, require_kernel  # bench/ is the script's folder

N = ops.HEAD_SIZE
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(slots=True)
class Result:
    case: str
    state: str
    slots: int
    tokens: int
    us_per_layer: float
    rate: float  # decode: TB/s of traffic; prefill: million tokens/s of this one layer
    rel_diff: float  # y against the torch twin on the same inputs


def _inputs(rows: int, heads: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """r, w, k, v, a, b in a trained model's ranges (decay in (0.1, 0.97), a = -kk, b = kk * gate)."""
    C = heads * N
    kk = F.normalize(torch.randn(rows, heads, N, generator=gen, device="cuda"), dim=-1).view(rows, C)
    r, k, v = (torch.randn(rows, C, generator=gen, device="cuda") * 0.5 for _ in range(3))
    w = -0.5 - 4.5 * torch.rand(rows, C, generator=gen, device="cuda")
    gate = torch.rand(rows, C, generator=gen, device="cuda")
    return [x.to(dtype) for x in (r, w, k, v, -kk, kk * gate)]


def bench(
    slots: int, length: int, heads: int, state_dtype: torch.dtype, act_dtype: torch.dtype, iters: int, general: bool = False,
    rows_per_thread: int = 1,
    direct_rows: bool = False,
    scaled_rows: bool = False,
) -> Result:
    """One case; decode (length 1) takes the decode kernel unless `general`. `rows_per_thread`,
    `direct_rows` and `scaled_rows` are the general kernel's launch shape (the op's arguments;
    wkv_dispatch.LAYOUT picks them in serving)."""
    single = length == 1 and not general
    gen = torch.Generator(device="cuda").manual_seed(slots * length)
    state = (torch.randn(slots, heads, N, N, generator=gen, device="cuda") * 0.1).to(state_dtype)
    slot_idx = torch.randperm(slots, generator=gen, device="cuda").to(torch.int32)  # unsorted, as in serving
    cu = torch.arange(0, slots * length + 1, length, dtype=torch.int32, device="cuda")
    inputs = _inputs(slots * length, heads, act_dtype, gen)
    expected = ops.wkv7_torch(state.clone(), slot_idx, cu, *inputs).double()
    shape = {"single_token": single, "rows_per_thread": rows_per_thread, "direct_rows": direct_rows, "scaled_rows": scaled_rows}
    got = ops.wkv7(state.clone(), slot_idx, cu, *inputs, **shape).double()
    diff = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    seconds = event_ms(lambda: ops.wkv7(state, slot_idx, cu, *inputs, **shape), iters) / 1000
    state_name = next(name for name, dtype in DTYPES.items() if dtype == state_dtype)
    if length == 1:
        traffic = 2 * state.numel() * state.element_size() + 7 * inputs[0].numel() * inputs[0].element_size()
        case = "decode, general" if general else "decode"
        return Result(case, state_name, slots, slots, 1e6 * seconds, traffic / seconds / 1e12, diff)
    case = f"prefill {slots}x{length}" + (f" r{rows_per_thread}" if rows_per_thread != 1 else "") + (" direct" if direct_rows else "") + (" scaled" if scaled_rows else "")
    return Result(case, state_name, slots, slots * length, 1e6 * seconds, slots * length / seconds / 1e6, diff)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256,960", help="decode: slots of one token each")
    parser.add_argument("--prefill", default="1x4096,8x512,64x512", help="prefill shapes PROMPTSxLENGTH (empty: none)")
    parser.add_argument("--heads", type=int, default=64, help="64 heads of 64: the 7.2B shape (width 4096)")
    parser.add_argument("--state-dtypes", default="fp32,fp16", help=f"comma-separated, of {','.join(DTYPES)}")
    parser.add_argument("--act-dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rows-per-thread", default="1", help="prefill: the general kernel's launch shapes to time, e.g. 1,2,2d,2s,2ds "
                        "(d: two rows straight to registers; s: the scaled walk)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(require_kernel("bench_wkv", "wkv7", "WKV"), flush=True)

    decode = [int(b) for b in args.batches.split(",") if b]
    known = {"1": (1, False, False), "2": (2, False, False), "2d": (2, True, False), "2s": (2, False, True), "2ds": (2, True, True)}
    words = [n.strip() for n in args.rows_per_thread.split(",") if n.strip()]
    if any(word not in known for word in words):
        raise SystemExit(f"--rows-per-thread takes {', '.join(known)}; got {args.rows_per_thread!r}")
    layouts = [known[word] for word in words]
    cases = [(b, 1, False, (1, False, False)) for b in decode] + [(b, 1, True, (1, False, False)) for b in decode]  # decode kernel, then the general one
    cases += [(*(int(n) for n in spec.split("x")), False, shape) for spec in args.prefill.split(",") if spec for shape in layouts]  # type: ignore[misc]
    results: list[Result] = []
    for state_name in args.state_dtypes.split(","):
        for slots, length, general, (rows, direct, scaled) in cases:
            iters = args.iters if length == 1 else max(3, args.iters // 10)
            result = bench(slots, length, args.heads, DTYPES[state_name], DTYPES[args.act_dtype], iters, general, rows, direct, scaled)
            results.append(result)
            print(asdict(result), flush=True)
            torch.cuda.empty_cache()

    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.heads} heads, {args.act_dtype} activations")
    print(f"{'case':<27}{'state':>6}{'slots':>7}{'us/layer':>11}{'TB/s | Mtok/s':>15}{'rel diff':>10}")
    for r in results:
        print(f"{r.case:<27}{r.state:>6}{r.slots:>7}{r.us_per_layer:>11.1f}{r.rate:>15.2f}{r.rel_diff:>10.1e}")
    if args.json:
        write_gpu_json(args.json, act_dtype=args.act_dtype, results=[asdict(r) for r in results])


if __name__ == "__main__":
    main()
