"""Model-level GPU benchmark: decode and prefill throughput of random weights of a real shape,
fp32 vs 16-bit WKV state (speed and accuracy). Prints a table and writes JSON.

    python bench/bench_model.py --shape 7.2b --json out/bench_model.json

Decode steps include sampling (the CUDA sampler, top-p 0.6 / top-k 50 / penalties) and the one
host copy of the sampled ids per step, as the engine does them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import cuda_ops, linear, lora_prep, loras, norm_mix, ops, sampler, wkv_decode, wkv_dispatch
from albatross.cuda_graphs import DecodeGraphRunner
from albatross.model import RWKV7
from albatross.random_checkpoint import NAMED_SHAPES, random_state_dict
from albatross.state import StatePool
from gpu_json import write_gpu_json  # bench/ is the script's folder


@dataclass(slots=True)
class Result:
    name: str
    shape: str
    batch: int
    tokens_per_s: float
    ms_per_step: float
    note: str = ""


def bench_sampling(rows: int, device: torch.device) -> sampler.SamplingBatch:
    """The benchmarks' sampling settings for `rows` rows: top-p 0.6, top-k 50, penalties, decay."""
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=device)

    return sampler.SamplingBatch(
        temperature=full(1.0), top_p=full(0.6), top_k=full(50, torch.int64), presence=full(0.5),
        frequency=full(0.1), decay=full(0.996), seed32=torch.arange(rows, dtype=torch.int64, device=device) * 7919,
        step=torch.zeros(rows, dtype=torch.int64, device=device),
    )  # fmt: skip


def bench_decode(model: RWKV7, pool: StatePool, batch: int, steps: int, shape: str, graphs: DecodeGraphRunner | None = None) -> Result:
    device = model.device
    slots = list(range(batch))
    slot_tensor = torch.arange(batch, device=device)
    penalties = sampler.PenaltyPool(pool.batch_size, model.config.vocab_size, device)
    sampling = bench_sampling(batch, device)
    tokens = torch.randint(0, model.config.vocab_size, (batch,)).tolist()
    model.forward(pool, slots, [[t] for t in tokens])  # warm-up (kernels, cuBLAS)

    def step(tokens: list[int]) -> list[int]:
        if graphs is None:
            logits = model.forward(pool, slots, [[t] for t in tokens])
        else:
            logits = graphs.decode(slot_tensor, torch.tensor(tokens, device=device))
        ids = ops.sample(logits, slot_tensor, sampling, penalties)
        sampling.step += 1
        return ids.tolist()  # the one host sync per step

    tokens = step(tokens)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        tokens = step(tokens)
    elapsed = time.perf_counter() - start
    name = "decode+sample" + (" (graph)" if graphs else "")
    return Result(name, shape, batch, batch * steps / elapsed, 1000 * elapsed / steps)


def graph_decode_rows(
    model: RWKV7, pool: StatePool, batches: list[int], steps_of: Callable[[int], int], shape: str, note: str
) -> list[Result]:
    """Decode + sampling from graphs captured once for `batches` (each row printed as measured)."""
    runner = DecodeGraphRunner(model, pool, scratch_slot=pool.batch_size - 1, buckets=batches)
    rows = []
    for batch in batches:
        result = bench_decode(model, pool, batch, steps_of(batch), shape, runner)
        result.note = note
        rows.append(result)
        print(asdict(result), flush=True)
    return rows


def bench_prefill(model: RWKV7, pool: StatePool, prompts: int, length: int, shape: str, chunk: int) -> Result:
    gen = torch.Generator().manual_seed(prompts * length)
    data = torch.randint(0, model.config.vocab_size, (prompts, length), generator=gen).tolist()
    slots = list(range(prompts))
    # Warm-up with the measured call's shape, so a kernel that the dispatch picks by length (the
    # chunked WKV from 256 tokens, compiled by Triton on its first call) is built before the clock.
    model.forward(pool, slots, [d[:chunk] for d in data])
    pool.reset(slots)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for lo in range(0, length, chunk):
        model.forward(pool, slots, [d[lo : lo + chunk] for d in data])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return Result("prefill", shape, prompts, prompts * length / elapsed, 1000 * elapsed, f"{prompts}x{length}, chunk {chunk}")


def profile_decode(model: RWKV7, pool: StatePool, batch: int, steps: int = 3) -> str:
    """Where a decode step's GPU time goes: the top kernels of a few eager steps with sampling."""
    from torch.profiler import ProfilerActivity, profile

    slots = list(range(batch))
    slot_tensor = torch.arange(batch, device=model.device)
    penalties = sampler.PenaltyPool(pool.batch_size, model.config.vocab_size, model.device)
    sampling = bench_sampling(batch, model.device)
    tokens = [1] * batch
    model.forward(pool, slots, [[t] for t in tokens])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            logits = model.forward(pool, slots, [[t] for t in tokens])
            tokens = ops.sample(logits, slot_tensor, sampling, penalties).tolist()
        torch.cuda.synchronize()
    return _kernel_table(prof)


def profile_graph_decode(model: RWKV7, pool: StatePool, batch: int, replays: int = 10) -> str:
    """Where a captured decode step's GPU time goes (the kernels of `replays` graph replays, no
    sampling): how the batch-1 LoRA stacking and the vectorised layer norm were found."""
    from torch.profiler import ProfilerActivity, profile

    runner = DecodeGraphRunner(model, pool, scratch_slot=pool.batch_size - 1, buckets=[batch])
    slots = torch.arange(batch, device=model.device)
    tokens = torch.ones(batch, dtype=torch.int64, device=model.device)
    for _ in range(3):
        runner.decode(slots, tokens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            runner.decode(slots, tokens)
        torch.cuda.synchronize()
    del runner
    kernels = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    lines = [f"{total / 1e3 / replays:.3f} ms of kernels a step, {sum(e.count for e in kernels) // replays} kernels a step"]
    lines += [f"{e.self_device_time_total / 1e3 / replays:8.3f} ms {e.count // replays:5d}x {e.self_device_time_total / max(1, e.count):7.1f} us  {e.key[:100]}"
              for e in kernels[:40]]  # fmt: skip
    return "\n".join(lines)


def profile_prefill(model: RWKV7, pool: StatePool, prompts: int, length: int) -> str:
    """Where a prefill call's GPU time goes: `prompts` chunks of `length` tokens in one forward."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, model.config.vocab_size, (prompts, length), generator=gen).tolist()
    slots = list(range(prompts))
    model.forward(pool, slots, data)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        model.forward(pool, slots, data)
        torch.cuda.synchronize()
        wall_ms = 1000 * (time.perf_counter() - start)
    return _device_busy(prof, wall_ms) + "\n" + _kernel_table(prof)


def _device_busy(prof: object, wall_ms: float) -> str:
    """Where a call's wall time went on the device: the span from its first kernel or copy to its
    last, how much of that span some kernel or copy was running (the union of their intervals), and
    the idle rest, against the call's wall time (host work before the first launch and after the
    last shows as wall minus span)."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()  # type: ignore[attr-defined]
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)  # fmt: skip
    if not intervals:
        return f"wall {wall_ms:.1f} ms; no device events recorded"
    busy, (lo, hi) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > hi:
            busy, lo, hi = busy + hi - lo, start, end
        else:
            hi = max(hi, end)
    busy += hi - lo
    span = max(end for _, end in intervals) - intervals[0][0]  # us, as the profiler's time ranges
    return (f"wall {wall_ms:.1f} ms (profiled), device span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, "
            f"idle inside the span {(span - busy) / 1e3:.1f} ms, outside it {wall_ms - span / 1e3:.1f} ms")


def _kernel_table(prof: object) -> str:
    events = prof.key_averages()  # type: ignore[attr-defined]
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return events.table(sort_by=key, row_limit=18, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            continue
    return events.table(row_limit=18)


PRECISIONS = {  # name: (weights dtype, WKV state dtype); the reference is fp32 weights and state
    "fp16 weights, fp32 state": (torch.float16, torch.float32),
    "fp16 weights, fp16 state": (torch.float16, torch.float16),
    "fp16 weights, bf16 state": (torch.float16, torch.bfloat16),
}


def precision_accuracy(shape_name: str, streams: int, steps: int) -> dict[str, dict[str, float]]:
    """Teacher-force the greedy stream of an all-fp32 model (the official package's precision)
    through each served precision, token by token (decode rounds a 16-bit state every step): mean
    log-loss difference to the fp32 model and how often the argmax agrees with it. The fp16-weights
    + fp32-state row is the cost the GPU default already pays; a 16-bit state is judged against it."""
    shape = NAMED_SHAPES[shape_name]

    def build(dtype: torch.dtype) -> RWKV7:  # the same random values (generated in fp32), stored in dtype
        weights = random_state_dict(shape, seed=1, device="cuda", dtype=dtype)
        return RWKV7.from_state_dict(weights, "cuda", dtype, progress=False)

    reference = build(torch.float32)
    half = build(torch.float16)
    runs = {"fp32 weights, fp32 state": (reference, StatePool(reference, streams, torch.float32))}
    runs |= {name: (half, StatePool(half, streams, state)) for name, (_, state) in PRECISIONS.items()}
    slots = list(range(streams))
    prompts = torch.randint(0, shape.vocab_size, (streams, 16), generator=torch.Generator().manual_seed(3)).tolist()
    logits = {name: model.forward(pool, slots, prompts).float() for name, (model, pool) in runs.items()}
    totals = {name: {"loss": 0.0, "agree": 0} for name in PRECISIONS}
    for _ in range(steps):
        truth = logits["fp32 weights, fp32 state"]
        tokens = truth.argmax(-1)
        truth_lp = torch.log_softmax(truth, -1).gather(-1, tokens[:, None])
        for name in PRECISIONS:
            variant = logits[name]
            totals[name]["agree"] += int((variant.argmax(-1) == tokens).sum())
            # positive = the served precision is worse than fp32 on the reference's own stream
            totals[name]["loss"] += float((truth_lp - torch.log_softmax(variant, -1).gather(-1, tokens[:, None])).sum())
        feed = [[t] for t in tokens.tolist()]
        logits = {name: model.forward(pool, slots, feed).float() for name, (model, pool) in runs.items()}
    count = streams * steps
    del runs, reference, half, logits
    torch.cuda.empty_cache()
    return {
        name: {"mean_logloss_diff": t["loss"] / count, "greedy_agreement": t["agree"] / count, "tokens": count}
        for name, t in totals.items()
    }


@contextmanager
def batch1_paths(lora: bool, norm: bool, wkv: bool) -> Iterator[None]:
    """The batch-1 Triton paths on or off (fused LoRAs, one-launch norm + mix, one-launch WKV
    step) for what runs or is captured inside, then back to their defaults."""
    paths = ((loras, lora), (norm_mix, norm), (wkv_decode, wkv))
    for module, allowed in paths:
        module.set_fused_allowed(allowed)
    try:
        yield
    finally:
        for module, _ in paths:
            module.set_fused_allowed(module.FUSED_BY_DEFAULT)


def on_off_settings(text: str) -> list[bool]:
    """"on", "off" or "on,off" as a list of settings to run in turn."""
    values = {"on": True, "off": False}
    words = [v.strip() for v in text.split(",") if v.strip()]
    if not words or any(word not in values for word in words):
        raise SystemExit(f"expected on, off or on,off; got {text!r}")
    return [values[word] for word in words]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7.2b", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--batches", default="1,64,256,960")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--graph-batches", default="1,64")
    parser.add_argument("--fp16-graph-batches", default="1,960",
                        help="graph decode with the fp16 state (the engine's default), at these batches")
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    parser.add_argument("--accuracy-shape", default="0.4b", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--profile-batches", default="", help="print a kernel profile of eager decode at these batches")
    parser.add_argument("--profile-prefill", default="", help="kernel profiles of one prefill call, e.g. 8x512,64x512")
    parser.add_argument("--profile-graph-batches", default="", help="kernel profiles of captured decode steps (fp16 state) at these batches")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--wkv-chunked", default="on", help="prefill with the chunked WKV kernel where its policy says (on), "
                        "never (off), for every slot of the policy's min_tokens or more (always), or several in turn (on,off,always)")
    parser.add_argument("--wkv-rows", default="auto", help="prefill rows with the sequential kernel's layout as its dispatch picks it (auto), "
                        "one state row a thread always (1), the dispatch's layout with the plain or the scaled two-row walk (plain, scaled), "
                        "or several in turn (e.g. plain,scaled,plain,scaled)")
    parser.add_argument("--norm-rows-op", default="on" if norm_mix.ROWS_OP_BY_DEFAULT else "off",
                        help="prefill with the CUDA norm_mix_rows op (on: the residual layer norm and token-shift mixes of prompt rows "
                        "in one launch, bit-identical to the two ops), without (off), or several in turn (on,off or off,on,off,on)")
    parser.add_argument("--gemv", default="on" if linear.GEMV_BY_DEFAULT else "off", help="graph decode with the GEMV kernel for 1-4 rows (on), cuBLAS (off), or both")
    parser.add_argument("--fused-lora", default="on" if loras.FUSED_BY_DEFAULT else "off", help="the fp16-state graph decode rows with the fused LoRA kernels for "
                        "1-4 rows (on; albatross/lora_triton.py), the eager LoRAs (off), or both (on,off)")
    parser.add_argument("--fused-norm-mix", default="on" if norm_mix.FUSED_BY_DEFAULT else "off",
                        help="the fp16-state graph decode rows with the one-launch layer norm + token-shift mix for 1-4 rows "
                        "(on; albatross/norm_mix_triton.py), the two ops (off), or both (on,off)")
    parser.add_argument("--fused-wkv", default="on" if wkv_decode.FUSED_BY_DEFAULT else "off",
                        help="the fp16-state graph decode rows with the one-launch WKV step (prep, WKV, group norm) for 1-4 rows "
                        "(on; albatross/wkv_decode_triton.py), the three ops (off), or both (on,off)")
    parser.add_argument("--decode-ops", default="on" if wkv_decode.STEP_OP_BY_DEFAULT and norm_mix.OP_BY_DEFAULT else "off",
                        help="the fp16-state graph decode rows with the CUDA decode ops (on: norm_mix_decode and wkv_decode_step, "
                        "one launch each where two and three ran, bit-identical to them), without (off), or both (on,off)")
    parser.add_argument("--fp32-logits", default="on" if linear.FP32_PRODUCT_OUT_BY_DEFAULT else "off",
                        help="the fp16-state graph decode rows with the LM head's product written in fp32 by cuBLAS (on), "
                        "or in fp16 then converted (off), or both (on,off)")
    parser.add_argument("--fused-relu-square", default="on" if linear.FUSED_RELU_SQUARE_BY_DEFAULT else "off",
                        help="prefill with the channel mix's key product and relu^2 in one Triton kernel where it applies (on; "
                        "albatross/relu_square_triton.py), cuBLAS then the relu_square pass (off), or several in turn (on,off)")
    parser.add_argument("--fused-lora-prep", default="on" if lora_prep.FUSED_BY_DEFAULT else "off",
                        help="prefill with the LoRA up products and wkv_prep in one Triton kernel where it applies (on; "
                        "albatross/lora_prep_triton.py), the bmm then the wkv_prep op (off), or several in turn (on,off)")
    parser.add_argument("--lora-prep-tiles", type=int, default=0,
                        help="the fused LoRA + prep kernel's tile shape: an index into lora_prep_triton.CANDIDATES (0: its TILES)")
    parser.add_argument("--relu-square-tiles", type=int, default=0,
                        help="the fused kernel's tile shape: an index into relu_square_triton.CANDIDATES (0: its TILES)")
    parser.add_argument("--weights", default="fp16", choices=("fp16", "int8"), help="the large matrices' format (int8: W8A16)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_model needs a CUDA GPU")
    cuda_ops.enable_cuda_kernels()
    batches = [int(b) for b in args.batches.split(",")]
    graph_batches = [int(b) for b in args.graph_batches.split(",") if b]
    shape = NAMED_SHAPES[args.shape]
    relu_tiles_label = ""
    if "on" in args.fused_relu_square:
        from albatross import relu_square_triton

        relu_square_triton.TILES = relu_square_triton.CANDIDATES[args.relu_square_tiles]
        relu_tiles_label = relu_square_triton.TILES.label()
    prep_tiles_label = ""
    if "on" in args.fused_lora_prep:
        from albatross import lora_prep_triton

        lora_prep_triton.TILES = lora_prep_triton.CANDIDATES[args.lora_prep_tiles]
        prep_tiles_label = lora_prep_triton.TILES.label()
    build = time.perf_counter()
    model = RWKV7.from_state_dict(random_state_dict(shape, seed=0, device="cuda", dtype=torch.float16), "cuda", torch.float16, progress=False, weights=args.weights)
    print(f"built {args.shape} (layers {shape.n_layer}, width {shape.n_embd}, {args.weights} weights) in {time.perf_counter() - build:.1f}s", flush=True)
    results: list[Result] = []
    for state_dtype in (torch.float32, torch.float16):
        pool = StatePool(model, max(batches) + 1, state_dtype)
        tag = "fp32 state" if state_dtype == torch.float32 else "fp16 state"
        for batch in batches:
            if state_dtype == torch.float16 and batch != max(batches):
                continue
            steps = args.steps if batch > 1 else 3 * args.steps
            result = bench_decode(model, pool, batch, steps, args.shape)
            result.note = tag
            results.append(result)
            print(asdict(result), flush=True)
        if state_dtype == torch.float32:
            every_long_slot = f"chunked WKV for any slot of {wkv_dispatch.DEFAULT_POLICY.min_tokens}+"
            wkv_notes = {"on": "chunked WKV where the policy says", "off": "sequential WKV", "always": every_long_slot}
            layouts = {"auto": (wkv_dispatch.LAYOUT, ""), "1": (wkv_dispatch.SequentialLayout(min_tokens=1 << 30), ", one state row a thread"),
                       "plain": (dataclasses.replace(wkv_dispatch.LAYOUT, scaled_rows=False), ", plain walk"),
                       "scaled": (dataclasses.replace(wkv_dispatch.LAYOUT, scaled_rows=True), ", scaled walk")}  # fmt: skip
            for setting in [v.strip() for v in args.wkv_chunked.split(",") if v.strip()]:
                if setting not in wkv_notes:
                    raise SystemExit(f"--wkv-chunked takes on, off and always; got {setting!r}")
                wkv_dispatch.POLICY = wkv_dispatch.ChunkedPolicy(enabled=setting != "off", max_long_heads=1 << 30 if setting == "always" else wkv_dispatch.DEFAULT_POLICY.max_long_heads)
                for rows in [v.strip() for v in args.wkv_rows.split(",") if v.strip()]:
                    if rows not in layouts:
                        raise SystemExit(f"--wkv-rows takes {', '.join(layouts)}; got {rows!r}")
                    wkv_dispatch.LAYOUT, layout_note = layouts[rows]
                    for rows_op, fused_key, fused_prep in itertools.product(
                        on_off_settings(args.norm_rows_op), on_off_settings(args.fused_relu_square), on_off_settings(args.fused_lora_prep)
                    ):
                        norm_mix.set_rows_op_allowed(rows_op)
                        linear.set_fused_relu_square(fused_key)
                        lora_prep.set_fused_allowed(fused_prep)
                        for prompts, length in ((1, 4096), (64, 512)):
                            result = bench_prefill(model, pool, prompts, length, args.shape, args.prefill_chunk)
                            result.note += ", " + wkv_notes[setting] + layout_note
                            result.note += ", norm_mix_rows" if rows_op else ", add_layer_norm + shift_mix"
                            result.note += f", key product + relu^2 fused ({relu_tiles_label})" if fused_key else ""
                            result.note += f", LoRA up + wkv_prep fused ({prep_tiles_label})" if fused_prep else ""
                            results.append(result)
                            print(asdict(result), flush=True)
                    norm_mix.set_rows_op_allowed(norm_mix.ROWS_OP_BY_DEFAULT)
                    linear.set_fused_relu_square(linear.FUSED_RELU_SQUARE_BY_DEFAULT)
                    lora_prep.set_fused_allowed(lora_prep.FUSED_BY_DEFAULT)
            wkv_dispatch.POLICY = wkv_dispatch.DEFAULT_POLICY
            wkv_dispatch.LAYOUT = layouts["auto"][0]
            for gemv in on_off_settings(args.gemv) if graph_batches else ():
                linear.set_gemv_allowed(gemv)  # captured into the graphs below
                note = tag + (", GEMV for <= 4 rows" if linear.gemv_enabled() else ", cuBLAS")
                results += graph_decode_rows(model, pool, graph_batches, lambda batch: 3 * args.steps, args.shape, note)
                linear.set_gemv_allowed(linear.GEMV_BY_DEFAULT)
        if state_dtype == torch.float16:
            for batch in [int(b) for b in args.profile_graph_batches.split(",") if b]:
                print(f"\n== profile: graph decode, batch {batch}, fp16 state, {args.shape}\n{profile_graph_decode(model, pool, batch)}", flush=True)
            fp16_graph_batches = [int(b) for b in args.fp16_graph_batches.split(",") if b and int(b) < pool.batch_size]
            settings = [(gemv, fused, norm, wkv, step, fp32) for gemv in on_off_settings(args.gemv) for fused in on_off_settings(args.fused_lora)
                        for norm in on_off_settings(args.fused_norm_mix) for wkv in on_off_settings(args.fused_wkv)
                        for step in on_off_settings(args.decode_ops)
                        for fp32 in on_off_settings(args.fp32_logits)] if fp16_graph_batches else []  # fmt: skip
            for gemv, fused, norm, wkv, step, fp32 in settings:  # what the engine runs: a captured step per bucket
                linear.set_gemv_allowed(gemv)  # all six captured into the graphs below
                linear.set_fp32_product_out(fp32)
                wkv_decode.set_step_op_allowed(step)  # the CUDA ops take precedence over the Triton paths
                norm_mix.set_op_allowed(step)
                note = tag + (", GEMV for <= 4 rows" if linear.gemv_enabled() else ", cuBLAS") + (", fused LoRAs" if fused else "")
                note += (", one-launch norm + mix" if norm else "") + (", one-launch WKV step" if wkv else "")
                note += ", CUDA decode ops" if step else ""
                note += ", fp32 logits from cuBLAS" if fp32 else ""
                with batch1_paths(fused, norm, wkv):
                    results += graph_decode_rows(model, pool, fp16_graph_batches, lambda batch: 3 * args.steps if batch == 1 else args.steps,
                                                 args.shape, note)  # fmt: skip
                linear.set_gemv_allowed(linear.GEMV_BY_DEFAULT)
                linear.set_fp32_product_out(linear.FP32_PRODUCT_OUT_BY_DEFAULT)
                wkv_decode.set_step_op_allowed(wkv_decode.STEP_OP_BY_DEFAULT)
                norm_mix.set_op_allowed(norm_mix.OP_BY_DEFAULT)
        if state_dtype == torch.float32:
            for batch in [int(b) for b in args.profile_batches.split(",") if b]:
                print(f"\n== profile: eager decode + sampling, batch {batch}, {args.shape}\n{profile_decode(model, pool, batch)}", flush=True)
            for spec in [s for s in args.profile_prefill.split(",") if s]:
                prompts, length = (int(n) for n in spec.split("x"))
                print(f"\n== profile: prefill {prompts} x {length}, {args.shape}\n{profile_prefill(model, pool, prompts, length)}", flush=True)
        del pool
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    accuracy = {} if args.skip_accuracy else precision_accuracy(args.accuracy_shape, 32, 128)

    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.shape}")
    print(f"{'what':<24}{'batch':>7}{'tok/s':>12}{'ms/step':>10}  note")
    for r in results:
        print(f"{r.name:<24}{r.batch:>7}{r.tokens_per_s:>12,.0f}{r.ms_per_step:>10.2f}  {r.note}")
    for name, acc in accuracy.items():
        print(f"{name} vs fp32 weights and state ({args.accuracy_shape}, {acc['tokens']} decode tokens): mean log-loss diff "
              f"{acc['mean_logloss_diff']:+.2e}, greedy agreement {acc['greedy_agreement']:.4f}")
    if args.json:
        write_gpu_json(args.json, shape=args.shape, results=[asdict(r) for r in results],
                       state_accuracy={"shape": args.accuracy_shape, **accuracy})  # fmt: skip
    if any(math.isnan(r.tokens_per_s) for r in results):
        raise SystemExit("a benchmark produced NaN")


if __name__ == "__main__":
    main()
