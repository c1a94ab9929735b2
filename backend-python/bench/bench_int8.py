"""int8 weights (W8A16): accuracy against the float model, the matmul paths on the 7.2B shapes, and
model-level speed against fp16. Prints tables and writes JSON.

    python bench/bench_int8.py accuracy --device cpu --shapes 4x256,6x512      (runs on the CPU)
    python bench/bench_int8.py accuracy --device cuda --shapes 0.4b,1.5b
    python bench/bench_int8.py kernels --reps 5 --json out/int8_kernels.jsonl (GPU; bench/int8_kernels.py)
    python bench/bench_int8.py kernels --device cpu --matrices tiny --rows 8   (a dry run of that script)
    python bench/bench_int8.py model --shape 7.2b --json out/int8_model.json  (GPU)

Accuracy is measured as the WKV state dtype was (docs/performance.md): teacher-force the greedy
stream of an all-fp32 model through each served precision, token by token, and report the mean
next-token log-loss increase and how often the argmax agrees. `per-group G` rows quantize with one
scale per G input rows of each column instead of one per column (simulated: the dequantized
matrices loaded as float weights), to decide between the two.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import int8_kernels  # bench/ is this script's folder
from albatross import cuda_ops, int8_dispatch, loras, norm_mix, wkv_decode
from albatross.model import RWKV7
from albatross.quant import LARGE_MATRICES, QMAX, quantize
from albatross.random_checkpoint import NAMED_SHAPES, CheckpointShape, random_state_dict
from albatross.state import StatePool

# ---------------------------------------------------------------------------------------------
# Accuracy


@dataclass(frozen=True, slots=True)
class Variant:
    weights: str  # "fp16" or "int8"
    dtype: torch.dtype  # weights (fp16 format) and activations
    state_dtype: torch.dtype
    group: int = 0  # > 0: simulate per-group scales of this many input rows (float weights)


def variants(device: str) -> dict[str, Variant]:
    if device == "cpu":  # fp32 activations isolate what the weights' rounding costs (CPU fp16 products are slow)
        fp32 = torch.float32
        return {
            "int8 weights (fp32 activations and state)": Variant("int8", fp32, fp32),
            "int8 per-channel, simulated (fp32 activations)": Variant("fp16", fp32, fp32, group=-1),
            "int8 per-group 128, simulated (fp32 activations)": Variant("fp16", fp32, fp32, group=128),
            "int8 per-group 64, simulated (fp32 activations)": Variant("fp16", fp32, fp32, group=64),
        }
    half = torch.float16
    return {
        "fp16 weights, fp32 state": Variant("fp16", half, torch.float32),
        "int8 weights, fp32 state": Variant("int8", half, torch.float32),
        "fp16 weights, fp16 state": Variant("fp16", half, torch.float16),
        "int8 weights, fp16 state": Variant("int8", half, torch.float16),
        "int8 per-group 128 (simulated), fp32 state": Variant("fp16", half, torch.float32, group=128),
    }


def _group_quantized(weight: torch.Tensor, group: int) -> torch.Tensor:
    """A checkpoint matrix `[out, in]` after int8 with one scale per `group` inputs of each output
    (group -1: one per output, as `quantize`), dequantized back to fp32."""
    matrix = weight.float().t()  # [in, out], as the model stores it
    if group < 0:
        return quantize(matrix).dequantize(torch.float32).t()
    K, N = matrix.shape
    blocks = matrix.reshape(K // group, group, N)
    scale = blocks.abs().amax(dim=1, keepdim=True) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / scale).clamp(-QMAX, QMAX) * scale).reshape(K, N).t()


def _build(shape: CheckpointShape, device: str, variant: Variant) -> RWKV7:
    weights = random_state_dict(shape, seed=1, device=device)
    if variant.group:
        for key in [k for k in weights if k.endswith(LARGE_MATRICES)]:
            weights[key] = _group_quantized(weights[key], variant.group)
    return RWKV7.from_state_dict(weights, device, variant.dtype, progress=False, weights=variant.weights)


def accuracy(shape_name: str, device: str, streams: int, steps: int) -> dict[str, dict[str, float]]:
    shape = _shape(shape_name)
    reference = _build(shape, device, Variant("fp16", torch.float32, torch.float32))  # all fp32
    chosen = variants(device)
    runs: dict[str, tuple[RWKV7, StatePool]] = {"reference": (reference, StatePool(reference, streams, torch.float32))}
    models: dict[tuple[str, torch.dtype, int], RWKV7] = {}
    for name, variant in chosen.items():
        key = (variant.weights, variant.dtype, variant.group)
        if key not in models:
            models[key] = _build(shape, device, variant)
        runs[name] = (models[key], StatePool(models[key], streams, variant.state_dtype))
    slots = list(range(streams))
    prompts = torch.randint(0, shape.vocab_size, (streams, 16), generator=torch.Generator().manual_seed(3)).tolist()
    logits = {name: model.forward(pool, slots, prompts).float() for name, (model, pool) in runs.items()}
    totals = {name: {"loss": 0.0, "agree": 0} for name in chosen}
    for _ in range(steps):
        truth = logits["reference"]
        tokens = truth.argmax(-1)
        truth_lp = torch.log_softmax(truth, -1).gather(-1, tokens[:, None])
        for name in chosen:
            variant_logits = logits[name]
            totals[name]["agree"] += int((variant_logits.argmax(-1) == tokens).sum())
            # positive: the served precision is worse than fp32 on the reference's own stream
            totals[name]["loss"] += float((truth_lp - torch.log_softmax(variant_logits, -1).gather(-1, tokens[:, None])).sum())
        feed = [[t] for t in tokens.tolist()]
        logits = {name: model.forward(pool, slots, feed).float() for name, (model, pool) in runs.items()}
    count = streams * steps
    return {
        name: {"mean_logloss_diff": t["loss"] / count, "greedy_agreement": t["agree"] / count, "tokens": count}
        for name, t in totals.items()
    }


def _shape(name: str) -> CheckpointShape:
    if name in NAMED_SHAPES:
        return NAMED_SHAPES[name]
    layers, width = (int(n) for n in name.split("x"))
    return CheckpointShape(n_layer=layers, n_embd=width)


# ---------------------------------------------------------------------------------------------
# Model level


MODEL_CASES = ("decode1", "decode960", "prefill64x512", "prefill1x4096")


def model_speed(
    shape_name: str, steps: int, fused_lora: tuple[bool, ...] = (False,), weights_list: tuple[str, ...] = ("fp16", "int8"),
    cases: tuple[str, ...] = MODEL_CASES,
    fused_norm_mix: tuple[bool, ...] = (False,),
    fused_wkv: tuple[bool, ...] = (False,),
) -> list[dict[str, object]]:
    """fp16 against int8 weights on one shape: batch-1 decode from a CUDA graph (`decode1`, once per
    `fused_lora`, `fused_norm_mix` and `fused_wkv` setting: 1-4 rows take the fused LoRA kernels
    or not, the one-launch layer norm + token-shift mix or not, the one-launch WKV step or not; LoRAs stay 16-bit in both weight formats), batch 960 eager decode with sampling, prefill 64 x 512 and 1 x 4096
    (bench_model.py's timings). A device call that only compares batch-1 variants asks for
    `cases=("decode1",)` and saves the other cases' minutes."""
    from albatross.cuda_graphs import DecodeGraphRunner
    from bench_model import Result, batch1_paths, bench_decode, bench_prefill  # bench/ is this script's folder

    shape = NAMED_SHAPES[shape_name]
    rows: list[dict[str, object]] = []
    for weights in weights_list:
        start = time.perf_counter()
        model = RWKV7.from_state_dict(random_state_dict(shape, seed=0, device="cuda", dtype=torch.float16), "cuda", torch.float16, progress=False, weights=weights)
        print(f"built {shape_name} {weights} in {time.perf_counter() - start:.1f}s: {model.weight_bytes() / 1e9:.2f} GB of weights", flush=True)
        pool = StatePool(model, 961, torch.float16)
        found: list[tuple[bool, bool, bool, Result]] = []
        settings = [(f, n, w) for f in fused_lora for n in fused_norm_mix for w in fused_wkv] if "decode1" in cases else []
        for fused, norm, wkv in settings:
            with batch1_paths(fused, norm, wkv):  # all three captured into this runner's graph
                runner = DecodeGraphRunner(model, pool, scratch_slot=960, buckets=(1,))
                found.append((fused, norm, wkv, bench_decode(model, pool, 1, 3 * steps, shape_name, runner)))
            del runner
        default = (loras.FUSED_BY_DEFAULT, norm_mix.FUSED_BY_DEFAULT, wkv_decode.FUSED_BY_DEFAULT)
        if "decode960" in cases:
            found.append((*default, bench_decode(model, pool, 960, steps, shape_name)))
        for prompts, length in ((64, 512), (1, 4096)):
            if f"prefill{prompts}x{length}" in cases:
                found.append((*default, bench_prefill(model, pool, prompts, length, shape_name, length if prompts == 1 else 512)))
        for fused, norm, wkv, result in found:
            # The CUDA decode ops take precedence over the Triton norm + mix and WKV step where allowed
            # (their defaults here): the rows then differ only in the fused LoRAs.
            decode_ops = {"norm_mix_op": norm_mix.OP_BY_DEFAULT, "wkv_step_op": wkv_decode.STEP_OP_BY_DEFAULT}
            rows.append({"weights": weights, "fused_lora": fused, "fused_norm_mix": norm, "fused_wkv": wkv, **decode_ops, **asdict(result)})
            print(rows[-1], flush=True)
        del pool, model
        torch.cuda.empty_cache()
    floors = {"decode+sample (graph)": 1.6, "decode+sample": 0.9, "prefill": 0.8}
    for row in rows:
        if row["weights"] != "int8":
            continue
        same = (r for r in rows if r["weights"] == "fp16" and r["name"] == row["name"] and r["batch"] == row["batch"] and r["fused_lora"] == row["fused_lora"] and r["fused_norm_mix"] == row["fused_norm_mix"] and r["fused_wkv"] == row["fused_wkv"])
        fp16 = next(same, None)
        if fp16 is None:
            continue
        row["vs_fp16"] = float(row["tokens_per_s"]) / float(fp16["tokens_per_s"])  # type: ignore[arg-type]
        floor = floors.get(str(row["name"]))
        if floor is not None and (row["name"] != "prefill" or row["batch"] == 64):
            row["floor"] = floor
    return rows


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("accuracy", "kernels", "model"))
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--shapes", default="0.4b,1.5b", help="accuracy: named shapes or LAYERSxWIDTH")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--shape", default="7.2b", help="model: the named shape")
    parser.add_argument("--reps", type=int, default=5, help="kernels: graph replays timed per row (median)")
    parser.add_argument("--rows", default=",".join(str(r) for r in int8_kernels.DEFAULT_ROWS), help="kernels: row counts")
    parser.add_argument("--matrices", default=",".join(int8_kernels.DEFAULT_SHAPES), help=f"kernels: of {', '.join(int8_kernels.SHAPES)}")
    parser.add_argument("--cap", type=float, default=20.0, help="kernels: seconds each implementation may take in all")
    parser.add_argument("--only", default="", help="kernels: comma-separated words; only implementations named with one (and fp16)")
    parser.add_argument("--fused-lora", default="on" if loras.FUSED_BY_DEFAULT else "off", help="model: the batch-1 graph rows with the fused LoRA kernels (on), without (off), or both (on,off)")
    parser.add_argument("--fused-norm-mix", default="on" if norm_mix.FUSED_BY_DEFAULT else "off",
                        help="model: the batch-1 graph rows with the one-launch layer norm + token-shift mix (on), the two ops (off), or both")
    parser.add_argument("--fused-wkv", default="on" if wkv_decode.FUSED_BY_DEFAULT else "off",
                        help="model: the batch-1 graph rows with the one-launch WKV step (on), the three ops (off), or both")
    parser.add_argument("--weights", default="fp16,int8", help="model: the weight formats timed")
    parser.add_argument("--cases", default=",".join(MODEL_CASES), help=f"model: of {', '.join(MODEL_CASES)}")
    parser.add_argument("--json", type=Path, help="kernels: JSON Lines, appended row by row; the others: one JSON file at the end")
    args = parser.parse_args(argv)
    if args.what == "model" or args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"bench_int8 {args.what} needs a CUDA GPU")
        cuda_ops.enable_cuda_kernels()
        print(f"int8 paths enabled: {int8_dispatch.enabled()}", flush=True)
    if args.what == "accuracy":
        figures: object = {shape: accuracy(shape, args.device, args.streams, args.steps) for shape in args.shapes.split(",")}
        for shape, table in figures.items():  # type: ignore[union-attr]
            print(f"\n{shape}, {args.device}, vs all-fp32 ({args.streams} streams x {args.steps} steps)")
            print(f"{'served precision':<52}{'log-loss diff':>15}{'greedy agreement':>18}")
            for name, acc in table.items():
                print(f"{name:<52}{acc['mean_logloss_diff']:>+15.2e}{acc['greedy_agreement']:>18.4f}")
    elif args.what == "kernels":
        rows = tuple(int(r) for r in args.rows.split(","))
        only = tuple(word for word in args.only.split(",") if word)
        int8_kernels.kernels_main(tuple(args.matrices.split(",")), rows, args.reps, args.cap, only, args.json, args.device)
        return
    else:
        from bench_model import on_off_settings

        weights = tuple(w.strip() for w in args.weights.split(",") if w.strip())
        cases = tuple(c.strip() for c in args.cases.split(",") if c.strip())
        unknown = [c for c in cases if c not in MODEL_CASES] + [w for w in weights if w not in ("fp16", "int8")]
        if unknown or not weights or not cases:
            raise SystemExit(f"model: unknown or empty --cases/--weights: {unknown or 'empty'}")
        fused, norms, wkvs = (tuple(on_off_settings(text)) for text in (args.fused_lora, args.fused_norm_mix, args.fused_wkv))
        figures = model_speed(args.shape, args.steps, fused, weights, cases, norms, wkvs)
        print(f"\n{'weights':<8}{'what':<24}{'batch':>7}{'tok/s':>12}{'ms/step':>10}  {'fused LoRAs':<12}{'norm+mix':<10}{'WKV step':<10}vs fp16 (floor)")
        for r in figures:  # type: ignore[union-attr]
            ratio = f"{r['vs_fp16']:.2f}x" + (f" ({r['floor']}x)" if "floor" in r else "") if "vs_fp16" in r else ""
            lora = "on" if r["fused_lora"] else "off"
            norm = "CUDA op" if r.get("norm_mix_op") else "one" if r["fused_norm_mix"] else "two"
            wkv = "CUDA op" if r.get("wkv_step_op") else "one" if r["fused_wkv"] else "three"
            print(f"{r['weights']:<8}{r['name']:<24}{r['batch']:>7}{r['tokens_per_s']:>12,.0f}{r['ms_per_step']:>10.2f}  {lora:<12}{norm:<10}{wkv:<10}{ratio}")
    if args.json:
        payload = {"what": args.what, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "figures": figures}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, default=str))


if __name__ == "__main__":
    main()
