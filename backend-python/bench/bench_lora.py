"""The fused LoRA kernels' tiles (albatross/lora_triton.py, `Tiles`) swept on a GPU: a block's four
small LoRAs at the 7.2B shapes (stack of 3, C 4096, rank 160, gate 480), timed as a decode step
runs them (a CUDA graph of 32 calls over 32 weight sets, so no call finds its weights in L2), and
each result checked against the eager path. The up kernel's tiles are swept with the down kernel's
at their defaults, then the down kernel's (and the splits) with the up kernel's, then the best of
each together.

    python bench/bench_lora.py --rows 1,2 --json out/lora.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import lora_triton, loras
from bench_gemv import rotating_graph_time  # bench/ is the script's folder
from gpu_json import write_gpu_json  # bench/ is the script's folder

SHAPE = {"n": 3, "C": 4096, "R": 160, "G": 480}  # a 7.2B block (random_checkpoint's ranks)
SETS = 32  # weight sets in the rotation: 32 x 14.6 MB, well past the 50 MB L2
TOLERANCE = 4e-3  # a configuration's largest relative error against eager: tests/test_lora_cuda.py's fp16 bound


@dataclass(slots=True)
class Result:
    sweep: str
    rows: int
    tiles: dict[str, int]
    us: float
    error: float  # largest |fused - eager| over the largest |eager|, lora and gate


def _operand_sets(rows: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    n, C, R, G = SHAPE["n"], SHAPE["C"], SHAPE["R"], SHAPE["G"]

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).half()

    mixes = randn(6, rows, C, scale=1.0)
    return [(mixes, randn(n, C, R, scale=C**-0.5), randn(n, R, C, scale=R**-0.5), randn(C, G, scale=C**-0.5), randn(G, C, scale=G**-0.5)) for _ in range(SETS)]


def _error(sets: list[tuple[torch.Tensor, ...]], tiles: lora_triton.Tiles) -> float:
    worst = 0.0
    for operands in sets[:2]:
        got = lora_triton.fused_loras(*operands, tiles=tiles)
        want = loras.loras_torch(*operands)
        for g, w in zip(got, want, strict=True):
            worst = max(worst, ((g.float() - w.float()).abs().max() / w.float().abs().max()).item())
    return worst


def _time(sets: list[tuple[torch.Tensor, ...]], tiles: lora_triton.Tiles | None, repeats: int) -> float:
    fn = loras.loras_torch if tiles is None else functools.partial(lora_triton.fused_loras, tiles=tiles)
    return rotating_graph_time(fn, sets, calls=len(sets), repeats=repeats)


def _up_sweep() -> list[lora_triton.Tiles]:
    base = lora_triton.TILES
    return [dataclasses.replace(base, up_block_k=k, up_block_n=n, up_warps=w) for k, n, w in itertools.product((32, 64, 128), (32, 64, 128), (4, 8))]


def _down_sweep() -> list[lora_triton.Tiles]:
    base = lora_triton.TILES
    return [dataclasses.replace(base, splits=s, down_block_k=k, down_block_n=n) for s, k, n in itertools.product((4, 8, 16), (64, 128), (32, 64))]


def bench_rows(rows: int, repeats: int) -> list[Result]:
    sets = _operand_sets(rows, torch.Generator(device="cuda").manual_seed(rows))
    results = [Result("eager", rows, {}, _time(sets, None, repeats), 0.0)]

    def run(sweep: str, candidates: list[lora_triton.Tiles]) -> Result:
        best: Result | None = None
        for tiles in candidates:
            result = Result(sweep, rows, asdict(tiles), _time(sets, tiles, repeats), _error(sets, tiles))
            results.append(result)
            print(asdict(result), flush=True)
            if result.error <= TOLERANCE and (best is None or result.us < best.us):
                best = result
        assert best is not None, f"no {sweep} configuration matched the eager path"
        return best

    default = run("default", [lora_triton.TILES])
    up = run("up", _up_sweep())
    down = run("down", _down_sweep())
    up_tiles, down_tiles = up.tiles, down.tiles
    both = {**down_tiles, **{key: up_tiles[key] for key in ("up_block_k", "up_block_n", "up_warps")}}
    best = run("best of both", [lora_triton.Tiles(**both)])
    print(f"rows {rows}: default {default.us:.2f} us, best up {up.us:.2f}, best down {down.us:.2f}, both {best.us:.2f}: {both}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora.py needs a CUDA GPU")
    results = [r for rows in (int(x) for x in args.rows.split(",") if x) for r in bench_rows(rows, args.repeats)]
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | fp16, 7.2B block {SHAPE}, graph of {SETS} calls")
    print(f"{'sweep':<14}{'rows':>5}{'us':>9}{'error':>10}  tiles")
    for r in results:
        if r.sweep in ("eager", "default", "best of both"):
            print(f"{r.sweep:<14}{r.rows:>5}{r.us:>9.2f}{r.error:>10.1e}  {r.tiles}")
    if args.json:
        write_gpu_json(args.json, shape=SHAPE, results=[asdict(r) for r in results])


if __name__ == "__main__":
    main()
