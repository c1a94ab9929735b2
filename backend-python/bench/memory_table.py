"""The memory plan's answer for each model size on common cards: which weights fit, and the largest
batch (CPU only: plain arithmetic, albatross_engine/memory_plan.py). Prints the markdown table of
docs/deployment.md.

    python bench/memory_table.py [--context-gb 0.8] [--state-dtype fp16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross.random_checkpoint import NAMED_SHAPES
from albatross_engine.adapter import shape_config
from albatross_engine.config import DEFAULT_PREFILL_BUDGET, DEFAULT_PREFILL_CHUNK
from albatross_engine.memory_plan import MemoryPlanError, MemoryRequest, plan_memory, weight_bytes

CARDS_GB = (8, 12, 16, 24, 48, 80)
SHAPES = ("0.4b", "1.5b", "2.9b", "7.2b")
ASKED_BATCH = 960


def cell(shape: str, weights: str, card_gb: int, context_gb: float, state_bytes: int) -> str:
    config = shape_config(NAMED_SHAPES[shape])
    request = MemoryRequest(config, weights, 2, state_bytes, ASKED_BATCH, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_BUDGET, True)
    try:
        plan = plan_memory(request, int((card_gb - context_gb) * 1e9))
    except MemoryPlanError:
        return "-"
    return f"{plan.batch_size}" + ("" if plan.prefill_budget == DEFAULT_PREFILL_BUDGET else f" ({plan.prefill_budget})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-gb", type=float, default=0.8, help="what the driver, CUDA context and desktop take first")
    parser.add_argument("--state-dtype", choices=("fp16", "fp32"), default="fp16")
    args = parser.parse_args(argv)
    state_bytes = 2 if args.state_dtype == "fp16" else 4
    print("| model | weights | " + " | ".join(f"{gb} GB" for gb in CARDS_GB) + " |")
    print("|---|---|" + "---:|" * len(CARDS_GB))
    for shape in SHAPES:
        config = shape_config(NAMED_SHAPES[shape])
        for weights in ("fp16", "int8"):
            size = weight_bytes(config, weights, 2) / 1e9
            cells = [cell(shape, weights, gb, args.context_gb, state_bytes) for gb in CARDS_GB]
            print(f"| {shape.upper()} | {weights} ({size:.1f} GB) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
