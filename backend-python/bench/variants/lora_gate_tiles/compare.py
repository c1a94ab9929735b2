"""The lora_gate_tiles variant (this folder's lora_triton.py) against the committed fused LoRAs
(albatross/lora_triton.py) on a GPU, one process: each checked against the eager path at the 7.2B
block shapes (rows 1-4, fp16 and bf16), then timed as bench_lora.py times them (a CUDA graph of
32 calls over 32 weight sets), the variant at each gate tile. From backend-python/:

    python bench/variants/lora_gate_tiles/compare.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # backend-python/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/

import bench_lora
from bench_gemv import rotating_graph_time

from albatross import lora_triton, loras

TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3.2e-2}  # tests/test_lora_cuda.py's bounds


def _variant() -> object:
    spec = importlib.util.spec_from_file_location("lora_gate_tiles", Path(__file__).with_name("lora_triton.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lora_gate_tiles"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    variant = _variant()
    shape = bench_lora.SHAPE
    failed = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype, rows in itertools.product((torch.float16, torch.bfloat16), (1, 2, 3, 4)):
        n, C, R, G = shape["n"], shape["C"], shape["R"], shape["G"]
        mixes = torch.randn(6, rows, C, generator=gen, device="cuda").to(dtype)
        down, up = (torch.randn(n, C, R, generator=gen, device="cuda") * C**-0.5).to(dtype), (torch.randn(n, R, C, generator=gen, device="cuda") * R**-0.5).to(dtype)
        g1, g2 = (torch.randn(C, G, generator=gen, device="cuda") * C**-0.5).to(dtype), (torch.randn(G, C, generator=gen, device="cuda") * G**-0.5).to(dtype)
        want = loras.loras_torch(mixes, down, up, g1, g2)
        for name, module in (("committed", lora_triton), ("variant", variant)):
            got = module.fused_loras(mixes, down, up, g1, g2)  # type: ignore[attr-defined]
            error = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got, want))
            print(f"{name:<10} {str(dtype):<15} rows {rows}: error {error:.1e}", "ok" if error <= TOLERANCE[dtype] else "FAILED", flush=True)
            if error > TOLERANCE[dtype]:
                failed.append(f"{name} {dtype} rows {rows}")
    sets = bench_lora._operand_sets(1, torch.Generator(device="cuda").manual_seed(1))
    base = variant.TILES  # type: ignore[attr-defined]
    for turn in range(2):
        print(f"turn {turn}: committed {rotating_graph_time(lora_triton.fused_loras, sets, calls=len(sets), repeats=20):.2f} us a block", flush=True)
        for gate_n, gate_k in itertools.product((16, 32, 64), (32, 64)):
            tiles = dataclasses.replace(base, up_gate_block_n=gate_n, up_gate_block_k=gate_k)

            def fused(*operands: torch.Tensor, tiles: object = tiles) -> object:
                return variant.fused_loras(*operands, tiles=tiles)  # type: ignore[attr-defined]

            print(f"turn {turn}: variant, gate tiles {gate_n} x {gate_k}: {rotating_graph_time(fused, sets, calls=len(sets), repeats=20):.2f} us", flush=True)
    if failed:  # timed anyway, but the script fails: a wrong kernel's time is not a result
        raise SystemExit(f"outside the eager path's tolerance: {', '.join(failed)}")


if __name__ == "__main__":
    main()
