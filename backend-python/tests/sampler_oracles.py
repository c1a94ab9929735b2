"""What a sampled id that differs from the twin's may be: the GPU tests' one judge of a differing row.

The kernel sums in fp32 in its own order, the twin in float64 (the rejection draw) or fp32 in id
order (the exact draw), so a uniform that lands within summation error of a bucket edge may pick
either neighbour. For the exact draw that is the end of it; for the rejection draw the neighbour
becomes the pivot and every later round differs, so a differing id is judged by a float64 replay of
the rejection draw that, at each round, follows every branch the kernel's rounding could take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from albatross import sampler

FP32_EPSILON = 2.0**-24  # unit roundoff of fp32


def rejection_slack(vocab: int) -> float:
    """Relative error bound of the kernel's fp32 masses: a sum of depth d has error at most
    d * 2**-24 of its total. Depth: a thread's walk over its quads (4 ids each), the warp scan (5),
    the sum over warp totals (32); plus 5 ulps for the weights' expf, the target's product and
    top_p * Z."""
    quads_per_thread = -(-((vocab + 3) // 4) // sampler.WALK_THREADS)
    return (4 * quads_per_thread + 5 + 32 + 5) * FP32_EPSILON


def exact_draw_accepts(adjusted: torch.Tensor, temperature: float, top_k: int, top_p: float, seed32: int, step: int, token: int) -> bool:
    """The exact draw (steps 3-4 with `sampler.uniform`) may give `token` when fp32 sums decide a
    boundary either way: its p is positive (rounding can move a top-k/top-p edge by a tie) and the
    target lies within 1e-5 of the kept mass of its cumulative interval, in id order."""
    probs = torch.softmax(adjusted.double() / temperature, dim=-1)
    kept = sampler.kept_mask(probs[None].float(), torch.tensor([top_k]), torch.tensor([top_p]))[0]
    masses = torch.where(kept, probs, torch.zeros_like(probs))
    cumulative = masses.cumsum(0)
    u = float(sampler.uniform(torch.tensor([seed32]), torch.tensor([step]))[0])
    target, slack = u * cumulative[-1].item(), 1e-5 * cumulative[-1].item()
    upper, lower = cumulative[token].item(), cumulative[token].item() - masses[token].item()
    return bool(probs[token] > 0) and lower - slack <= target <= upper + slack


@dataclass(frozen=True, slots=True)
class Replay:
    ids: frozenset[int]  # ids some branch of the rejection draw decides on
    falls_back: bool  # some branch is undecided after REJECTION_ROUNDS draws: the exact draw decides it


def rejection_replay(adjusted: torch.Tensor, temperature: float, top_k: int, top_p: float, seed32: int, step: int, slack: float | None = None) -> Replay:
    """The rejection draw of one row (docs/kernels.md "Rejection draw") in float64 with the twin's
    weights, uniforms, walk order and pivot rule, branching wherever a sum within `slack` (relative;
    default `rejection_slack`) could decide either way: a round's target within slack of a bucket
    edge follows both buckets, M within slack of top_p * Z both accepts and draws on. Branches that
    reach the same pivot share their later rounds."""
    vocab = adjusted.shape[-1]
    slack = rejection_slack(vocab) if slack is None else slack
    scaled = adjusted.float() / temperature
    weights = torch.exp(scaled - scaled.max())  # fp32, as twin and kernel
    order = sampler.walk_order(vocab)
    walked = weights[order].double()
    use_k, use_p = 0 < top_k < vocab, top_p < 1.0
    maxima_only, free = (use_k and top_k == 1) or top_p <= 0.0, not use_k and not use_p
    seed, row_step = torch.tensor([seed32]), torch.tensor([step])
    states: dict[float, set[int]] = {sampler._BELOW_ONE if maxima_only else 0.0: set()}  # pivot -> pending draws
    decided: set[int] = set()
    falls_back = False
    total = 0.0
    for round_index in range(sampler.REJECTION_ROUNDS + 1):
        following: dict[float, set[int]] = {}
        for pivot, pending in states.items():
            above = walked > pivot
            masses = torch.where(above, walked, torch.zeros_like(walked))
            cumulative = masses.cumsum(0)
            mass, count = float(cumulative[-1]), int(above.sum())
            if round_index == 0:
                total = mass
            else:
                count_kept = count == 0 or not use_k or count < top_k
                edge = top_p * total
                may_accept = count == 0 or (count_kept and (not use_p or mass < edge + slack * total))
                must_accept = count == 0 or (count_kept and (not use_p or mass < edge - slack * total))
                if may_accept:
                    decided |= pending
                if must_accept:
                    continue
            if round_index == sampler.REJECTION_ROUNDS:
                falls_back = True
                continue
            target = float(sampler.round_uniform(seed, row_step, round_index)[0]) * mass
            window = slack * mass
            near = above & (cumulative >= target - window) & (cumulative - masses <= target + window)
            for position in near.nonzero().flatten().tolist():
                token, weight = int(order[position]), float(weights[order[position]])
                if maxima_only or free:
                    decided.add(token)
                else:
                    following.setdefault(weight, set()).add(token)
        if not following:
            break
        states = following
    return Replay(frozenset(decided), falls_back)


def draw_accepts(adjusted: torch.Tensor, temperature: float, top_k: int, top_p: float, seed32: int, step: int, token: int, rejection: bool) -> bool:
    """Whether a sampled (temperature > 0) row may draw `token` given fp32 rounding: the rows the
    rejection draw serves (`rejection` on and no top_k) by its replay, the others (and a replay's
    fallback) by the exact draw."""
    vocab = adjusted.shape[-1]
    if rejection and not 0 < top_k < vocab:
        replay = rejection_replay(adjusted, temperature, top_k, top_p, seed32, step)
        if token in replay.ids:
            return True
        if not replay.falls_back:
            return False
    return exact_draw_accepts(adjusted, temperature, top_k, top_p, seed32, step, token)


def kernel_order_rejection(adjusted: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seed32: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel's rejection draw (`rejection_sample`) with its fp32 arithmetic in its order,
    for rows without top_k [R, V] (V a multiple of 4 * WALK_THREADS): each thread sums its quads
    in turn, a warp scan (Hillis-Steele, lane order) and a running sum over the warp totals give the
    offsets, the chosen thread re-walks its quads from its offset. (ids, decided). With torch.exp
    for expf it reproduced the H200's id on the row where kernel and twin first disagreed."""
    rows, vocab = adjusted.shape
    threads, warps = sampler.WALK_THREADS, sampler.WALK_THREADS // 32
    chunks = vocab // (4 * threads)
    scaled = adjusted / temperature[:, None]
    weights = torch.exp(scaled - scaled.max(dim=-1, keepdim=True).values)
    per_thread = weights.view(rows, chunks, threads, 4).permute(0, 2, 1, 3).reshape(rows, threads, 4 * chunks)
    ids = torch.arange(vocab).view(chunks, threads, 4).permute(1, 0, 2).reshape(threads, 4 * chunks)
    use_p = top_p < 1.0
    maxima_only, free = top_p <= 0.0, ~use_p
    pivot = torch.where(maxima_only, torch.full((rows,), sampler._BELOW_ONE), torch.zeros(rows))
    token = torch.zeros(rows, dtype=torch.int64)
    done = torch.zeros(rows, dtype=torch.bool)
    every = torch.arange(rows)
    total = torch.zeros(rows)
    for round_index in range(sampler.REJECTION_ROUNDS + 1):
        above = per_thread > pivot[:, None, None]
        masses = torch.where(above, per_thread, torch.zeros(()))
        local = torch.zeros(rows, threads)
        for column in range(masses.shape[2]):
            local = local + masses[:, :, column]
        scan = local.view(rows, warps, 32)
        shift = 1
        while shift < 32:  # lanes below the shift add nothing (x + 0 == x)
            scan = scan + torch.nn.functional.pad(scan[:, :, :-shift], (shift, 0))
            shift <<= 1
        inclusive = scan.reshape(rows, threads)
        offsets, mass = torch.zeros(rows, warps), torch.zeros(rows)
        for warp in range(warps):
            offsets[:, warp] = mass
            mass = mass + inclusive[:, 32 * warp + 31]
        count = above.sum(dim=(1, 2))
        if round_index == 0:
            total = mass
        else:
            done = done | ((count == 0) | ~use_p | (mass < top_p * total))
        if round_index == sampler.REJECTION_ROUNDS or bool(done.all()):
            break
        target = sampler.round_uniform(seed32, step, round_index) * mass
        exclusive = offsets.repeat_interleave(32, dim=1) + inclusive - local
        reaching = (local > 0) & (exclusive + local >= target[:, None])
        last_with_mass = threads - 1 - (local > 0).flip(1).to(torch.int8).argmax(dim=1)
        chosen = torch.where(reaching.any(dim=1), reaching.to(torch.int8).argmax(dim=1), last_with_mass)
        running = exclusive[every, chosen]
        pick = torch.full((rows,), -1)
        last = torch.full((rows,), -1)
        last_weight = torch.zeros(rows)
        for column in range(masses.shape[2]):
            live = (pick < 0) & above[every, chosen, column]
            running = torch.where(live, running + masses[every, chosen, column], running)
            last = torch.where(live, ids[chosen, column], last)
            last_weight = torch.where(live, per_thread[every, chosen, column], last_weight)
            pick = torch.where(live & (running >= target), last, pick)
        drawing = ~done
        token = torch.where(drawing, last, token)
        pivot = torch.where(drawing, last_weight, pivot)
        done = done | (drawing & (maxima_only | free))
    return token, done
