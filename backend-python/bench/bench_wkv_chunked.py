"""Chunked WKV prefill (Triton) against the sequential CUDA kernel, one 7.2B layer (64 heads):
us per call for each case and kernel variant, the final-state and output errors of both against
a float64 reference (model-range inputs of bench/external/wkv_compare.py), and the switch point
the measurements imply for `albatross.wkv_dispatch.ChunkedPolicy`.

    python bench/bench_wkv_chunked.py --json out/wkv_chunked.json

Variants: `--chunks` tokens a chunk (16/32/64), `--blocks` value rows per program (16/32/64),
`--precisions` of the products ("ieee": fp32 FMA; "tf32x3": three tf32 tensor-core products,
about fp32 accuracy), `--prepare` warps, precision and inverse of the prepare kernel, `--warps` per scan program and `--layouts` of the scan's state rows
(`key`: transposed, `wkv7_chunked_triton(key_major=True)`). The sequential kernel runs with the
launch shape the dispatch gives the case (`wkv_dispatch.LAYOUT`: one state row a thread, or two
rows, direct and scaled, once the slots fill the GPU), as in the model; until session 30 it ran
one row a thread at every case, 1.3x slower than the model's walk at 64 x 512. `--baseline FILE` also times another
version of `albatross/wkv_chunked_triton.py` (a copy of an earlier commit's, say) at its own
defaults, for an A/B in the same run; the implied policy ignores it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "external"))

from albatross import ops, wkv_dispatch
from albatross.wkv_dispatch import ChunkedPolicy
from gpu_json import write_gpu_json
from kernel_bench import event_ms, require_kernel  # bench/ is the script's folder
from wkv_compare import make_inputs, parse_cases, reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(slots=True)
class Timing:
    case: str
    sequences: int
    length: int
    state: str
    kernel: str  # "sequential" or "chunked bv=B prec"
    us: float
    mtok_per_s: float


@dataclass(slots=True)
class Accuracy:
    case: str
    kernel: str
    y_rel_rms: float
    state_max_error: float


def _kernels(chunks: list[int], blocks: list[int], precisions: list[str], warps: list[int], layouts: list[str], baseline: Path | None,
             prepares: list[tuple[int, str, str]] | None = None):
    from albatross.wkv_chunked_triton import PREPARE_WARPS, wkv7_chunked_triton

    def sequential(state, inputs, lengths):
        launch = wkv_dispatch.LAYOUT.launch(len(lengths), min(lengths), state.shape[1], wkv_dispatch.multiprocessors(state.get_device()))
        return ops.wkv7(state, inputs.slot_idx, inputs.cu_seqlens, inputs.r, inputs.w, inputs.k, inputs.v, inputs.a, inputs.b, False, *launch)

    def chunked(state, inputs, lengths, kernel=wkv7_chunked_triton, **options):
        return kernel(
            state, inputs.slot_idx, inputs.cu_seqlens, inputs.r, inputs.w, inputs.k, inputs.v, inputs.a, inputs.b, lengths=lengths, **options
        )  # fmt: skip

    variants = {"sequential": sequential}
    if baseline is not None:
        spec = importlib.util.spec_from_file_location("baseline_wkv_chunked_triton", baseline)
        assert spec and spec.loader, baseline
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        variants["baseline (its defaults)"] = functools.partial(chunked, kernel=module.wkv7_chunked_triton)
    for precision in precisions:
        for chunk in chunks:
            for num_warps in warps:
                for block in blocks:
                    for layout in layouts:
                        for prepare_warps, prepare_precision, inverse in prepares or [(PREPARE_WARPS, "", "substitution")]:
                            name = f"chunked L={chunk} bv={block} w{num_warps} {precision}" + (" keys" if layout == "key" else "")
                            if prepares:
                                name += f" prep w{prepare_warps} {prepare_precision or precision}" + (" sq" if inverse == "squaring" else "")
                            variants[name] = functools.partial(
                                chunked, chunk=chunk, block_values=block, precision=precision, num_warps=num_warps, key_major=layout == "key",
                                prepare_warps=prepare_warps, prepare_precision=prepare_precision or None, prepare_inverse=inverse,
                            )  # fmt: skip
    return variants


def _prepare_spec(spec: str) -> tuple[int, str, str]:
    """WARPS:PRECISION[:INVERSE] -> (warps, precision or "" for the scan's, inverse)."""
    warps, _, rest = spec.partition(":")
    precision, _, inverse = rest.partition(":")
    return int(warps), precision, inverse or "substitution"


def recommend(timings: list[Timing], heads: int) -> ChunkedPolicy:
    """The policy the timings imply: the shortest single-sequence length from which the best
    chunked variant beats the sequential kernel, and the most sequences x heads it still wins at."""
    by_case: dict[tuple[int, int, str], dict[str, float]] = {}
    for t in timings:
        by_case.setdefault((t.sequences, t.length, t.state), {})[t.kernel] = t.us
    wins = []
    for (sequences, length, _), us in by_case.items():
        best_chunked = min(v for k, v in us.items() if k.startswith("chunked"))
        wins.append((sequences, length, best_chunked < us["sequential"]))
    single = sorted(length for sequences, length, won in wins if sequences == 1 and won and length > 1)
    losing_single = [length for sequences, length, won in wins if sequences == 1 and not won and length > 1]
    min_tokens = max(2, single[0] if single else max(losing_single, default=1) * 2)
    won_heads = [sequences * heads for sequences, length, won in wins if won and length >= min_tokens]
    return ChunkedPolicy(min_tokens=min_tokens, max_long_heads=max(won_heads, default=heads))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1x16,1x17,1x64,1x256,1x1024,1x4096,1x4097,4x1024,16x2048,64x512")
    parser.add_argument("--accuracy-cases", default="1x4096,64x512,16x2048", help="also measured against float64")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--state-dtypes", default="fp32,fp16")
    parser.add_argument("--chunks", default="16,32")
    parser.add_argument("--blocks", default="16,32,64")
    parser.add_argument("--precisions", default="ieee,tf32x3")
    parser.add_argument("--warps", default="4,8", help="num_warps of the scan kernel")
    parser.add_argument("--layouts", default="value,key", help="the scan's state rows: value (the state's layout) and/or key (transposed)")
    parser.add_argument("--prepare", default="", help="prepare-kernel variants WARPS:PRECISION[:INVERSE], e.g. 2:,2::squaring,4:ieee "
                        "(PRECISION empty: the scan's; INVERSE substitution or squaring); default: the kernel's own")
    parser.add_argument("--baseline", type=Path, help="another wkv_chunked_triton.py to time beside, at its defaults")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    require_kernel("bench_wkv_chunked", "wkv7", "WKV")
    variants = _kernels(
        [int(c) for c in args.chunks.split(",")],
        [int(b) for b in args.blocks.split(",")],
        args.precisions.split(","),
        [int(w) for w in args.warps.split(",")],
        args.layouts.split(","),
        args.baseline,
        [_prepare_spec(spec) for spec in args.prepare.split(",") if spec],
    )
    timings: list[Timing] = []
    accuracy: list[Accuracy] = []
    for state_name in args.state_dtypes.split(","):
        for case in parse_cases(args.cases, args.heads):
            inputs = make_inputs(case, "cuda", seed=case.tokens)
            state = inputs.state0.to(DTYPES[state_name])
            lengths = [case.length] * case.sequences
            for name, fn in variants.items():
                us = 1000 * event_ms(functools.partial(fn, state, inputs, lengths), args.iters)
                timings.append(Timing(case.label, case.sequences, case.length, state_name, name, us, case.tokens / us))
                print(asdict(timings[-1]), flush=True)
            del inputs, state
            torch.cuda.empty_cache()
    for case in parse_cases(args.accuracy_cases, args.heads) if args.accuracy_cases else []:
        inputs = make_inputs(case, "cuda", seed=case.tokens + 1)
        y_ref, state_ref = reference(inputs, case)
        lengths = [case.length] * case.sequences
        for name, fn in variants.items():
            state = inputs.state0.clone()
            y = fn(state, inputs, lengths).double()
            rms = ((y - y_ref).norm() / y_ref.norm()).item()
            accuracy.append(Accuracy(case.label, name, rms, (state.double() - state_ref).abs().max().item()))
            print(asdict(accuracy[-1]), flush=True)
        del inputs
        torch.cuda.empty_cache()

    policy = recommend(timings, args.heads)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.heads} heads, fp16 activations")
    print(f"{'case':<18}{'state':>6}  {'kernel':<34}{'us':>10}{'Mtok/s':>9}")
    for t in timings:
        print(f"{t.case:<18}{t.state:>6}  {t.kernel:<34}{t.us:>10.1f}{t.mtok_per_s:>9.2f}")
    print(f"\n{'case':<18}  {'kernel':<34}{'y rel RMS':>11}{'state max err':>15}")
    for a in accuracy:
        print(f"{a.case:<18}  {a.kernel:<34}{a.y_rel_rms:>11.2e}{a.state_max_error:>15.2e}")
    print(f"\nimplied policy: ChunkedPolicy(min_tokens={policy.min_tokens}, max_long_heads={policy.max_long_heads})")
    if args.json:
        write_gpu_json(
            args.json, heads=args.heads, timings=[asdict(t) for t in timings], accuracy=[asdict(a) for a in accuracy],
            implied_policy={"min_tokens": policy.min_tokens, "max_long_heads": policy.max_long_heads},
        )  # fmt: skip


if __name__ == "__main__":
    main()
