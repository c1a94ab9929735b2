"""`bench_int8.py kernels`: every W8A16 product on the 7.2B shapes against fp16 cuBLAS (GPU).

Each implementation is timed as a CUDA graph of many calls (as a decode step runs: no launch
overhead in the figure) over enough copies of its weights that no call finds them in the 50 MB L2,
and checked once against the reference (fp16 cuBLAS against the dense product, every int8 path
against the twin `quant.int8_mm_torch`). One JSON line per measurement is appended to the output
file and printed as soon as it is taken, so a run that is killed keeps what it measured; a last
line holds the best path per (shape, rows) and the `int8_dispatch.ROW_PATHS` those figures suggest.

Each implementation has a time budget for the whole run (`--cap`): its compile or autotune is
interrupted when the budget runs out, and its later rows are skipped with the reason printed, so
one slow library cannot eat the device call. A missing package or a failing call is a row that
says why.
"""

from __future__ import annotations

import functools
import json
import math
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from albatross import int8_dispatch, int8_triton
from albatross.quant import Int8Weight, int8_mm_torch, quantize

SHAPES = {"4096x4096": (4096, 4096), "4096x16384": (4096, 16384), "16384x4096": (16384, 4096), "head 4096x65536": (4096, 65536),
          "tiny": (128, 96)}  # fmt: skip  (tiny: the CPU dry run)
DEFAULT_SHAPES = ("4096x4096", "4096x16384", "16384x4096")
DEFAULT_ROWS = (1, 4, 64, 256, 960, 4096)
SLAB_MB = (2, 8, 16)  # the "slab" path's buffer sizes measured (int8_dispatch.L2_SLAB_BYTES is one)
ROTATION_BYTES = 192 << 20  # weights cycled per implementation: several times the L2
MIN_CALLS = 8  # calls in one timed graph
WRONG = 0.1  # an error (of the largest output) above this marks a row "wrong"

Product = Callable[[torch.Tensor], torch.Tensor]
# (the shape's fp16 matrices [K, N], their int8 twins) -> one product per copy of the weights
Maker = Callable[[list[torch.Tensor], list[Int8Weight]], list[Product]]


@dataclass(slots=True)
class Impl:
    name: str
    make: Maker
    path: str = ""  # the int8_dispatch path it stands for ("" for the others)
    max_rows: int = 1 << 62
    spent: float = 0.0  # seconds of this run so far
    products: list[Product] = field(default_factory=list)


class OverCap(Exception):
    pass


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block (a compile or an autotune: Python between launches) after `seconds`."""

    def expire(signum: int, frame: object) -> None:
        raise OverCap(f"over its time cap ({seconds:.0f} s left when this row started)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _warm(products: list[Product], x: torch.Tensor) -> None:
    """One call of each product (compiles and autotunes), on a side stream as a capture wants."""
    if not x.is_cuda:
        for product in products:
            product(x)
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for product in products:
            product(x)
    torch.cuda.current_stream().wait_stream(side)


def _time_us(calls: Sequence[Callable[[], object]], reps: int, device: str) -> tuple[float, str]:
    """us per call (median of `reps`): on a GPU the calls, already warm, captured in one graph and
    replayed, or back to back where the capture fails; on the CPU (a dry run of this script) the
    wall clock."""
    if device != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - start) * 1e6 / len(calls))
        return statistics.median(times), "cpu"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        run, how = graph.replay, "graph"
    except Exception:
        torch.cuda.synchronize()

        def run() -> None:
            for call in calls:
                call()

        how = "eager"
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(times), how


# ---------------------------------------------------------------------------------------------
# The implementations


def _ours(product: Callable[[torch.Tensor, Int8Weight], torch.Tensor]) -> Maker:
    def make(dense: list[torch.Tensor], weights: list[Int8Weight]) -> list[Product]:
        return [functools.partial(_call, product, weight=w) for w in weights]

    return make


def _call(product: Callable[[torch.Tensor, Int8Weight], torch.Tensor], x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    return product(x, weight)


def _fp16(dense: list[torch.Tensor], weights: list[Int8Weight]) -> list[Product]:
    return [functools.partial(torch.mm, mat2=d) for d in dense]


def _swap(config: int8_triton.SwapConfig) -> Callable[[torch.Tensor, Int8Weight], torch.Tensor]:
    return lambda x, w: int8_triton.w8a16_swap_mm(x, w.q, w.scale, config)


def _slab(mb: int) -> Callable[[torch.Tensor, Int8Weight], torch.Tensor]:
    return lambda x, w: int8_dispatch.int8_slab(x, w, mb << 20)


def _torch_int8pack(dense: list[torch.Tensor], weights: list[Int8Weight]) -> list[Product]:
    products: list[Product] = []
    for w in weights:
        q = w.q.t().contiguous()  # [out, in], torch's layout
        products.append(functools.partial(_int8pack_product, q=q, scale=w.scale.to(torch.float16)))
    return products


def _int8pack_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, q, scale)


def _torchao(dense: list[torch.Tensor], weights: list[Int8Weight]) -> list[Product]:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    layers: list[Product] = []
    for matrix in dense:
        layer = torch.nn.Linear(matrix.shape[0], matrix.shape[1], bias=False, device=matrix.device, dtype=matrix.dtype)
        layer.weight.data = matrix.t().contiguous()
        quantize_(layer, Int8WeightOnlyConfig())
        layers.append(layer)
    return layers


def _gemlite(dense: list[torch.Tensor], weights: list[Int8Weight]) -> list[Product]:
    from gemlite.helper import A16W8_INT8

    layers: list[Product] = []
    for matrix in dense:
        layer = torch.nn.Linear(matrix.shape[0], matrix.shape[1], bias=False, device=matrix.device, dtype=matrix.dtype)
        layer.weight.data = matrix.t().contiguous()
        layers.append(A16W8_INT8(device=str(matrix.device)).from_linear(layer))
    return layers


def _package(name: str) -> str:
    """'' when the package imports, else why not."""
    try:
        __import__(name)
        return ""
    except Exception as error:
        return f"{name} missing: {type(error).__name__}: {str(error)[:100]}"


def implementations() -> list[tuple[Impl, str]]:
    """(implementation, why it cannot run here or ''), in the order measured."""
    found: list[tuple[Impl, str]] = [
        (Impl("fp16 cuBLAS", _fp16), ""),
        (Impl("int8 GEMV", _ours(int8_dispatch.int8_gemv), "gemv", int8_dispatch.GEMV_MAX_ROWS), "" if int8_dispatch.gemv_enabled() else "the int8 library is not loaded"),
        (Impl("int8 tile (default)", _ours(int8_dispatch.int8_tile), "tile"), ""),
    ]
    found.extend((Impl(f"int8 swap {config.name}", _ours(_swap(config))), "") for config in int8_triton.SWAP_CONFIGS)
    found.extend((Impl(f"int8 slab {mb} MB", _ours(_slab(mb))), "") for mb in SLAB_MB)
    found.append((Impl("int8 dequantize + cuBLAS", _ours(int8_dispatch.int8_dequantized), "dequantize"), ""))
    found.append((Impl("torchao int8 weight-only", _torchao), _package("torchao")))
    found.append((Impl("gemlite A16W8", _gemlite), _package("gemlite")))
    found.append((Impl("torch _weight_int8pack_mm", _torch_int8pack), ""))
    return found


def _path_of(name: str, rows: int) -> str:
    """The int8_dispatch path whose figure this row is at `rows` (its default config, its slab size)."""
    if name == f"int8 swap {int8_triton.swap_config_for(rows).name}":
        return "swap"
    if name == f"int8 slab {int8_dispatch.L2_SLAB_BYTES >> 20} MB":
        return "slab"
    return {"int8 GEMV": "gemv", "int8 tile (default)": "tile", "int8 dequantize + cuBLAS": "dequantize"}.get(name, "")


# ---------------------------------------------------------------------------------------------
# The run


def _emit(out: TextIO | None, record: dict[str, object]) -> None:
    line = json.dumps(record, default=str)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def _copies(bytes_per_copy: int) -> int:
    return max(2, min(16, math.ceil(ROTATION_BYTES / bytes_per_copy)))


def _measure(impl: Impl, x: torch.Tensor, expected: torch.Tensor, reps: int, cap: float) -> dict[str, object]:
    started = time.perf_counter()
    device = x.device.type
    try:
        with torch.inference_mode():
            with _deadline(cap - impl.spent):  # compiles and autotunes happen here, outside any capture
                _warm(impl.products, x)
                y = impl.products[0](x)
            error = float((y.float() - expected).abs().max() / expected.abs().max())
            calls = [functools.partial(p, x) for p in impl.products] * math.ceil(MIN_CALLS / len(impl.products))
            us, how = _time_us(calls, reps, device)
        return {"us": us, "error": error, "timing": how, **({"wrong": True} if error > WRONG else {})}
    except OverCap as error:
        return {"skipped": str(error)}
    except Exception as error:
        return {"failed": f"{type(error).__name__}: {str(error)[:160]}"}
    finally:
        _sync(device)
        impl.spent += time.perf_counter() - started


def run(
    shapes: tuple[str, ...], rows_list: tuple[int, ...], reps: int, cap: float, only: tuple[str, ...], out: TextIO | None, device: str = "cuda"
) -> list[dict[str, object]]:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    header = {"what": "kernels", "device": name, "torch": torch.__version__, "shapes": shapes, "rows": rows_list,
              "reps": reps, "cap_s": cap, "L2_SLAB_BYTES": int8_dispatch.L2_SLAB_BYTES, "ROW_PATHS": int8_dispatch.ROW_PATHS}  # fmt: skip
    _emit(out, header)
    impls = []
    for impl, missing in implementations():
        if only and impl.name != "fp16 cuBLAS" and not any(word in impl.name for word in only):
            continue
        if missing:
            _emit(out, {"impl": impl.name, "skipped": missing})
            continue
        impls.append(impl)
    rows_out: list[dict[str, object]] = []
    for shape in shapes:
        K, N = SHAPES[shape]
        gen = torch.Generator(device=device).manual_seed(K + N)
        base = (torch.randn(K, N, generator=gen, device=device) / K**0.5).half()
        dense = [base] + [base.clone() for _ in range(_copies(2 * K * N) - 1)]
        quantized = quantize(base)
        weights = [quantized] + [Int8Weight(quantized.q.clone(), quantized.scale.clone()) for _ in range(_copies(K * N) - 1)]
        for impl in impls:
            impl.products = []
            if impl.spent >= cap:
                continue
            started = time.perf_counter()
            try:
                with _deadline(cap - impl.spent):
                    impl.products = impl.make(dense, weights)
            except Exception as error:  # OverCap included
                _emit(out, {"shape": shape, "impl": impl.name, "failed": f"building its weights: {type(error).__name__}: {str(error)[:160]}"})
            impl.spent += time.perf_counter() - started
        for rows in rows_list:
            x = torch.randn(rows, K, generator=gen, device=device).half()
            exact = torch.mm(x, base).float()
            twin = int8_mm_torch(x, quantized).float()
            fp16_us = None
            for impl in impls:
                if rows > impl.max_rows:
                    continue
                record: dict[str, object] = {"shape": shape, "rows": rows, "impl": impl.name}
                if impl.spent >= cap:
                    record["skipped"] = f"over its {cap:.0f} s cap"
                elif not impl.products:
                    record["skipped"] = "no weights built"
                else:
                    record.update(_measure(impl, x, exact if impl.name == "fp16 cuBLAS" else twin, reps, cap))
                if "us" in record:
                    if impl.name == "fp16 cuBLAS":
                        fp16_us = float(record["us"])  # type: ignore[arg-type]
                    if fp16_us:
                        record["vs_fp16"] = fp16_us / float(record["us"])  # type: ignore[arg-type]
                    path = _path_of(impl.name, rows)
                    if path:
                        record["path"] = path
                _emit(out, record)
                rows_out.append(record)
        for impl in impls:
            impl.products = []
        del dense, weights, quantized
        if device == "cuda":
            torch.cuda.empty_cache()
    summary = summarize(rows_out)
    _emit(out, summary)
    print_table(summary)
    return rows_out


# ---------------------------------------------------------------------------------------------
# The summary


def summarize(records: list[dict[str, object]]) -> dict[str, object]:
    """The best implementation and the best dispatchable path per (shape, rows), and the ROW_PATHS
    the paths' figures suggest: per row count above the GEMV's, the path with the best geometric
    mean of its ratio to fp16 over the shapes."""
    timed = [r for r in records if "vs_fp16" in r and not r.get("wrong")]
    best: list[dict[str, object]] = []
    for key in dict.fromkeys((str(r["shape"]), int(r["rows"])) for r in timed):  # type: ignore[call-overload]
        here = [r for r in timed if (r["shape"], r["rows"]) == key and r["impl"] != "fp16 cuBLAS"]
        fp16 = next((r for r in timed if (r["shape"], r["rows"]) == key and r["impl"] == "fp16 cuBLAS"), None)
        if not here or fp16 is None:
            continue
        top = max(here, key=lambda r: float(r["vs_fp16"]))  # type: ignore[arg-type]
        paths = [r for r in here if r.get("path")]
        top_path = max(paths, key=lambda r: float(r["vs_fp16"])) if paths else None  # type: ignore[arg-type]
        best.append({"shape": key[0], "rows": key[1], "fp16_us": fp16["us"], "best": top["impl"], "best_us": top["us"], "best_vs_fp16": top["vs_fp16"],
                     "best_path": top_path and top_path["path"], "best_path_vs_fp16": top_path and top_path["vs_fp16"]})  # fmt: skip
    suggested: list[tuple[int, str]] = []
    for rows in sorted({int(r["rows"]) for r in timed if int(r["rows"]) > int8_dispatch.GEMV_MAX_ROWS}):  # type: ignore[call-overload]
        scores: dict[str, list[float]] = {}
        for r in timed:
            if r["rows"] == rows and r.get("path") and r["path"] != "gemv":
                scores.setdefault(str(r["path"]), []).append(math.log(float(r["vs_fp16"])))  # type: ignore[arg-type]
        shapes = max((len(v) for v in scores.values()), default=0)
        complete = {path: sum(v) / len(v) for path, v in scores.items() if len(v) == shapes}
        if complete:
            path = max(complete, key=complete.__getitem__)
            if suggested and suggested[-1][1] == path:
                suggested[-1] = (rows, path)
            else:
                suggested.append((rows, path))
    if suggested:
        suggested[-1] = (1 << 62, suggested[-1][1])
    swap_best: list[tuple[int, str]] = []  # per row count, the swap config with the best geometric mean
    for rows in sorted({int(r["rows"]) for r in timed}):  # type: ignore[call-overload]
        ratios: dict[str, list[float]] = {}
        for r in timed:
            if r["rows"] == rows and str(r["impl"]).startswith("int8 swap "):
                ratios.setdefault(str(r["impl"])[len("int8 swap ") :], []).append(math.log(float(r["vs_fp16"])))  # type: ignore[arg-type]
        if ratios:
            swap_best.append((rows, max(ratios, key=lambda name: sum(ratios[name]) / len(ratios[name]))))
    return {"summary": best, "suggested_ROW_PATHS": suggested, "best_swap_config_by_rows": swap_best}


def print_table(summary: dict[str, object]) -> None:
    print(f"\n{'shape':<18}{'rows':>6}{'fp16 us':>10}  {'best implementation':<34}{'us':>9}{'vs fp16':>9}  best dispatch path (vs fp16)")
    for r in summary["summary"]:  # type: ignore[attr-defined]
        path = f"{r['best_path']} ({r['best_path_vs_fp16']:.2f}x)" if r["best_path"] else "-"
        print(f"{r['shape']:<18}{r['rows']:>6}{r['fp16_us']:>10.1f}  {r['best']:<34}{r['best_us']:>9.1f}{r['best_vs_fp16']:>8.2f}x  {path}")
    table = ", ".join(f"({'1 << 62' if most >= 1 << 62 else most}, {path!r})" for most, path in summary["suggested_ROW_PATHS"])  # type: ignore[attr-defined]
    print(f"suggested int8_dispatch.ROW_PATHS = ({table},)")
    print(f"best swap config by rows (for int8_triton.SWAP_DEFAULTS): {summary['best_swap_config_by_rows']}")


def kernels_main(
    shapes: tuple[str, ...], rows_list: tuple[int, ...], reps: int, cap: float, only: tuple[str, ...], json_path: Path | None, device: str = "cuda"
) -> list[dict[str, object]]:
    if json_path is None:
        return run(shapes, rows_list, reps, cap, only, None, device)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    with json_path.open("a") as out:
        return run(shapes, rows_list, reps, cap, only, out, device)
