"""Our kernels against maintained libraries (issue #3), on the GPU, at equal inputs:

1. wkv: `albatross.ops.wkv7` (CUDA) vs flash-linear-attention's Triton RWKV-7 kernels (chunk,
   fused_recurrent, fused_mul_recurrent) on one 7.2B layer (64 heads): 1x4096, 64x512 and 16x2048
   prefill, 960x1 decode; ms per call, tok/s, equivalent TB/s, max error of y and of the final
   state against a float64 reference (bench/external/wkv_compare.py says how parameters map).
2. sampling: `albatross.ops.sample` vs FlashInfer's joint top-k/top-p kernels (our
   binding of its header-only kernels, bench/external/flashinfer_sampling*), vocab 65536, fp32
   logits, batch 1/64/256/960: ms per call, and total variation of many draws from the exact
   truncated distribution (bench/external/sampling_compare.py says what differs).

Each part is skipped with a line saying why when its library or the GPU is missing; a failing
item prints its error and the run goes on. The JSON is rewritten after every row.

    python bench/bench_external.py --json out/external.json           (the GPU run)
    python bench/bench_external.py --prebuild flashinfer              (build the binding only)
    python bench/bench_external.py --warm-fla chunk                   (autotune one fla kernel only)

bench/external_gpu_session.sh installs the carried wheels and headers (.whl-ext) and runs this.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR / "external"))

import sampling_compare
import wkv_compare
from albatross import cuda_ops
from flashinfer_build import DEFAULT_EXT_ROOT, load
from report import Report
from timing import Deadline

PARTS = ("wkv", "sampling")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--wkv-shapes", default="1x4096,64x512,16x2048,960x1", help="SEQUENCESxLENGTH, comma-separated")
    parser.add_argument("--heads", type=int, default=64, help="heads of 64 (7.2B: 64)")
    parser.add_argument("--fla-kernels", default="chunk,recurrent,mul_recurrent")
    parser.add_argument("--batches", default="1,64,256,960", help="sampling batch sizes")
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--logit-scale", type=float, default=3.0, help="timing logits are N(0, 1) times this")
    parser.add_argument("--draw-rows", type=int, default=1024, help="rows per call in the distribution check")
    parser.add_argument("--draw-calls", type=int, default=100, help="calls per filter in the distribution check")
    parser.add_argument("--ext-root", default=str(DEFAULT_EXT_ROOT), help="where the FlashInfer/cuRAND headers were carried")
    parser.add_argument("--wkv-budget-s", type=float, default=140.0, help="later wkv cases are skipped past this")
    parser.add_argument("--sampling-budget-s", type=float, default=60.0, help="later sampling items are skipped past this")
    parser.add_argument(
        "--prebuild", nargs="?", const="all", choices=("all", "ours", "flashinfer"),
        help="only build (our kernels, the FlashInfer binding or both), then exit",
    )  # fmt: skip
    parser.add_argument(
        "--warm-fla", metavar="KERNEL",
        help="only call this fla kernel once per wkv case, filling Triton's disk cache for the main run, then exit",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts.split(",")) - set(PARTS) - {""})
    if unknown:
        parser.error(f"unknown --parts {unknown}; known: {', '.join(PARTS)}")
    unknown = sorted(set(args.fla_kernels.split(",")) - set(wkv_compare.FLA_KERNELS) - {""})
    if unknown:
        parser.error(f"unknown --fla-kernels {unknown}; known: {', '.join(wkv_compare.FLA_KERNELS)}")
    if args.warm_fla is not None and args.warm_fla not in wkv_compare.FLA_KERNELS:
        parser.error(f"unknown --warm-fla {args.warm_fla!r}; known: {', '.join(wkv_compare.FLA_KERNELS)}")
    try:
        wkv_compare.parse_cases(args.wkv_shapes, args.heads)
    except ValueError:
        parser.error(f"--wkv-shapes {args.wkv_shapes!r}: expected SEQUENCESxLENGTH,...")
    return args


def prebuild(what: str, ext_root: Path) -> None:
    """Compile what this benchmark loads, so background runs of this overlap the compiles with
    the GPU work of the main run (torch's build lock makes the main run wait for a build)."""
    start = time.perf_counter()
    if what in ("all", "ours"):
        try:
            results = cuda_ops.enable_cuda_kernels()
            print(f"our kernels ({time.perf_counter() - start:.0f}s): " + "; ".join(r.describe() for r in results.values()), flush=True)
        except Exception as error:  # the main run reports it again and skips our rows
            print(f"our kernels not loaded: {type(error).__name__}: {error}", flush=True)
    if what in ("all", "flashinfer"):
        if not torch.cuda.is_available():
            print("FlashInfer binding not built: no CUDA GPU", flush=True)
            return
        try:
            load(ext_root)
            print(f"FlashInfer binding ready after {time.perf_counter() - start:.0f}s", flush=True)
        except Exception as error:  # a failed build is reported, the main run skips those rows
            print(f"FlashInfer binding not built: {type(error).__name__}: {error}", flush=True)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = None
    return found


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.prebuild:
        prebuild(args.prebuild, Path(args.ext_root))
        return
    if args.warm_fla:
        wkv_compare.warm_fla(args.warm_fla, wkv_compare.parse_cases(args.wkv_shapes, args.heads))
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
    report = Report(args.json, {"device": device, **versions(), "date": time.strftime("%Y-%m-%d"), "args": vars(args)})
    print(f"{device} | " + " | ".join(f"{k} {v}" for k, v in versions().items()), flush=True)
    parts = [p for p in args.parts.split(",") if p]
    if "wkv" in parts:
        print("\n== wkv: ours vs flash-linear-attention", flush=True)
        try:
            wkv_compare.run(args, report, Deadline(args.wkv_budget_s))
        except Exception as error:  # one failing part must not cost the other
            report.error("wkv", error)
    if "sampling" in parts:
        print("\n== sampling: ours vs FlashInfer", flush=True)
        try:
            sampling_compare.run(args, report, Deadline(args.sampling_budget_s))
        except Exception as error:
            report.error("sampling", error)
    if report.data["errors"]:
        print(f"\n{len(report.data['errors'])} error(s): " + "; ".join(report.data["errors"]), flush=True)


if __name__ == "__main__":
    main()
