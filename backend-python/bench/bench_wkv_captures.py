"""One layer's WKV call with prefix-cache captures inside rows (the steps where a prompt chunk
crosses a 256-token boundary), three ways: the call without captures (the floor), each capturing
slot's pieces a launch of their own with the other slots in runs between them and one row a
thread (the dispatch before session 24), and the pieces in stages on gathered rows with the
capturing slots last and every launch shaped by its own slots (now: wkv_dispatch.split_parts,
RWKV7.forward_ids). Prints us a layer and each way's excess over the floor, and the largest
output difference against the call without captures.

    python bench/bench_wkv_captures.py --json /tmp/out/wkv_captures.json

Cases (64 heads, fp16 inputs and state): a burst's tail step (100 prompt rows of 130-260 tokens,
7 crossing a boundary), a burst's middle step (64 rows of 256, 16 crossing one), and a Poisson
step of long prompts (6 rows of 2,000 beside 200 decode rows, 16 captures over three of them).
Times are CUDA events around --iters eager calls.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "external"))

from albatross import ops, wkv_dispatch
from gpu_json import write_gpu_json  # bench/ is the script's folder
from kernel_bench import event_ms, require_kernel
from wkv_compare import WkvCase, make_inputs

HEADS = 64


@dataclass(slots=True)
class Result:
    case: str
    rows: int
    capturing_slots: int
    captures: int
    floor_us: float
    pieces_us: float
    staged_us: float
    pieces_launches: int
    staged_launches: int
    staged_max_diff: float


def _case(name: str, gen: torch.Generator) -> tuple[list[int], list[tuple[int, ...]]]:
    """Slot lengths and cuts, capturing slots spread through the call as the scheduler plans them."""
    if name == "burst tail":
        lengths = torch.randint(130, 261, (100,), generator=gen).tolist()
        cuts = [(int(torch.randint(1, n, (1,), generator=gen)),) if i % 14 == 5 else () for i, n in enumerate(lengths)]
    elif name == "burst middle":
        lengths = [256] * 64
        cuts = [(128,) if i % 4 == 1 else () for i in range(64)]
    else:  # long prompts beside decode rows
        lengths = [1] * 100 + [2000] * 6 + [1] * 100
        cuts = [()] * len(lengths)
        cuts[100], cuts[102], cuts[104] = tuple(range(200, 1992, 256)), tuple(range(56, 1800, 256)), (100, 356)
    return lengths, cuts


def _pieces_parts(batch: ops.FlatBatch, cuts: tuple[tuple[int, ...], ...]) -> list[wkv_dispatch.Part]:
    """The dispatch before session 24: slots without cuts in runs between the capturing slots,
    each capturing slot's pieces a launch each, in row order, one row a thread everywhere."""
    device = batch.cu_seqlens.device
    parts = []
    bounds = [0]
    for n in batch.lengths:
        bounds.append(bounds[-1] + n)
    captured, slot = 0, 0
    while slot < len(cuts):
        if cuts[slot]:
            edges = [0, *cuts[slot], batch.lengths[slot]]
            for j in range(len(edges) - 1):
                start, stop = bounds[slot] + edges[j], bounds[slot] + edges[j + 1]
                capture = (captured + j,) if j < len(cuts[slot]) else ()
                parts.append(
                    wkv_dispatch.Part(
                        chunked=False,
                        spans=((start, stop),),
                        slot_idx=batch.slot_idx[slot : slot + 1],
                        cu_seqlens=torch.tensor([0, stop - start], dtype=torch.int32, device=device),
                        lengths=(stop - start,),
                        offsets=None,
                        capture=capture,
                        capture_at=torch.tensor(capture, dtype=torch.int64, device=device) if capture else None,
                        capture_from=batch.slot_idx[slot : slot + 1] if capture else None,
                    )
                )
            captured += len(cuts[slot])
            slot += 1
            continue
        last = slot + 1
        while last < len(cuts) and not cuts[last]:
            last += 1
        lengths = batch.lengths[slot:last]
        rebased = [0]
        for n in lengths:
            rebased.append(rebased[-1] + n)
        parts.append(
            wkv_dispatch.Part(
                chunked=False,
                spans=((bounds[slot], bounds[last]),),
                slot_idx=batch.slot_idx[slot:last],
                cu_seqlens=torch.tensor(rebased, dtype=torch.int32, device=device),
                lengths=lengths,
                offsets=None,
            )
        )
        slot = last
    return parts


def bench(name: str, iters: int) -> Result:
    gen = torch.Generator().manual_seed(len(name))
    lengths, cut_list = _case(name, gen)
    cuts = tuple(cut_list)
    total = sum(lengths)
    inputs = make_inputs(WkvCase(1, total, HEADS), "cuda", seed=total)
    rows = (inputs.r, inputs.w, inputs.k, inputs.v, inputs.a, inputs.b)
    pool = len(lengths) + 8
    slots = torch.randperm(pool, generator=gen)[: len(lengths)].tolist()
    state0 = (torch.randn(pool, HEADS, 64, 64, generator=torch.Generator().manual_seed(1)) * 0.3).half().cuda()
    count = sum(len(c) for c in cuts)
    captures = torch.empty((count, HEADS, 64, 64), dtype=torch.float16, device="cuda")

    batch = ops.FlatBatch.build(slots, lengths, torch.device("cuda"))
    old_parts = _pieces_parts(batch, cuts)
    # Now: the capturing slots last (as RWKV7.forward_ids moves them), then the staged split.
    order = sorted(range(len(cuts)), key=lambda s: bool(cuts[s]))
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    index = torch.tensor([r for s in order for r in range(starts[s], starts[s + 1])], device="cuda")
    moved_rows = tuple(x.index_select(0, index) for x in rows)
    moved = ops.FlatBatch.build([slots[s] for s in order], [lengths[s] for s in order], torch.device("cuda"))
    moved_cuts = tuple(cuts[s] for s in order)

    def floor() -> torch.Tensor:
        return wkv_dispatch.wkv7(state0.clone(), batch, *rows)

    def pieces() -> torch.Tensor:
        return wkv_dispatch.run_parts(state0.clone(), old_parts, rows, wkv_dispatch._no_chunked_kernel, ops.wkv7, captures)

    def staged() -> torch.Tensor:
        return wkv_dispatch.wkv7(state0.clone(), moved, *moved_rows, cuts=moved_cuts, captures=captures)

    clone_us = event_ms(lambda: state0.clone(), iters) * 1000  # every way starts from a fresh state copy
    floor_us = event_ms(floor, iters) * 1000 - clone_us
    pieces_us = event_ms(pieces, iters) * 1000 - clone_us
    staged_us = event_ms(staged, iters) * 1000 - clone_us
    reference = floor()
    back = torch.empty_like(reference)
    back.index_copy_(0, index, staged())
    diff = ((back.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
    staged_parts = wkv_dispatch._parts(moved, None, moved_cuts, state0)
    return Result(name, total, sum(1 for c in cuts if c), count, floor_us, pieces_us, staged_us, len(old_parts), len(staged_parts), diff)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="burst tail,burst middle,long prompts")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(require_kernel("bench_wkv_captures.py", "wkv7", "WKV"))
    results = [bench(name, args.iters) for name in args.cases.split(",")]
    print(f"{torch.cuda.get_device_name()}, {HEADS} heads, fp16 state; us a layer (excess over the call without captures)")
    print("| case | rows | capturing slots / captures | no captures | a launch a piece | staged (now) | launches before / now | staged max rel diff |")
    print("|---|---:|---|---:|---:|---:|---|---:|")
    for r in results:
        print(
            f"| {r.case} | {r.rows:,} | {r.capturing_slots} / {r.captures} | {r.floor_us:,.0f} | {r.pieces_us:,.0f} (+{r.pieces_us - r.floor_us:,.0f}) "
            f"| {r.staged_us:,.0f} (+{r.staged_us - r.floor_us:,.0f}) | {r.pieces_launches} / {r.staged_launches} | {r.staged_max_diff:.1e} |"
        )
    if args.json:
        write_gpu_json(args.json, results=[asdict(r) for r in results])


if __name__ == "__main__":
    main()
