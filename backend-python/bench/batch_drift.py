"""How far one row's logits move with what runs beside it (GPU).

A seeded request draws the same uniforms whatever else runs, so its tokens depend on the batch
only through its logits. This decodes one row alone and inside a batch of 11 (which takes the
CUDA ops) from the same prompt and the same fed tokens, three ways: with the three batch-1 Triton
paths (fused LoRAs, one-launch norm + mix, one-launch WKV step: 1-4 rows), with none of them
("plain"), and with the two CUDA decode ops (norm_mix_decode, wkv_decode_step). Per step it prints
the row's largest logit difference: the Triton paths against plain, alone and against the batch;
plain alone against plain in the batch (what the matrix products' shapes alone move); and the
CUDA ops against plain (0 if they are bit-identical, as they should be) and alone against in the
batch.

    python bench/batch_drift.py --shape 4x256 --seed 3 --steps 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import cuda_ops, loras, norm_mix, wkv_decode
from albatross.model import RWKV7
from albatross.random_checkpoint import CheckpointShape, random_state_dict

PATHS = (loras, norm_mix, wkv_decode)


def decode(model: RWKV7, prompt: list[int], crowd: list[list[int]], fed: list[int], triton: bool, cuda: bool) -> list[torch.Tensor]:
    """The target row's logits (fp32) at each fed token; `crowd` prompts run beside it if given.
    `triton`: the batch-1 Triton paths allowed; `cuda`: the CUDA decode ops allowed."""
    for path in PATHS:
        path.set_fused_allowed(triton)
    norm_mix.set_op_allowed(cuda)
    wkv_decode.set_step_op_allowed(cuda)
    try:
        pool = model.new_pool(len(crowd) + 1, torch.float16)
        slots = list(range(len(crowd) + 1))
        model.forward(pool, slots, [prompt, *crowd])
        out = []
        for step, token in enumerate(fed):
            others = [[(step * 7919 + 13 * slot) % 65000 + 1] for slot in slots[1:]]
            logits = model.forward(pool, slots, [[token], *others])
            out.append(logits[0].float())
        return out
    finally:
        for path in PATHS:
            path.set_fused_allowed(path.FUSED_BY_DEFAULT)
        norm_mix.set_op_allowed(norm_mix.OP_BY_DEFAULT)
        wkv_decode.set_step_op_allowed(wkv_decode.STEP_OP_BY_DEFAULT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4x256", help="LAYERSxWIDTH")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--device", default="cuda", help="cuda (cpu runs the ops' twins: a check of the script)")
    args = parser.parse_args()
    if args.device == "cuda":
        cuda_ops.enable_cuda_kernels()
    layers, width = (int(side) for side in args.shape.split("x"))
    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=layers, n_embd=width), seed=args.seed, device=args.device), args.device, torch.float16, progress=False)
    gen = torch.Generator().manual_seed(9)
    prompt = [11, 22, 33, 44, 55]
    crowd = [torch.randint(1, 65530, (8,), generator=gen).tolist() for _ in range(10)]
    fed = torch.randint(1, 65530, (args.steps,), generator=gen).tolist()
    paths = decode(model, prompt, [], fed, triton=True, cuda=False)
    plain = decode(model, prompt, [], fed, triton=False, cuda=False)
    batched = decode(model, prompt, crowd, fed, triton=False, cuda=False)
    ops_alone = decode(model, prompt, [], fed, triton=False, cuda=True)
    ops_batched = decode(model, prompt, crowd, fed, triton=False, cuda=True)
    print(f"{args.shape} seed {args.seed}, fp16 weights and state; largest |logit difference| of the row, and its logits' std")
    heads = ("Triton - plain", "Triton - batch", "plain - batch", "CUDA ops - plain", "CUDA ops - batch", "std")
    print(f"{'step':>4} " + " ".join(f"{head:>16}" for head in heads))
    for step, (a, b, c, d, e) in enumerate(zip(paths, plain, batched, ops_alone, ops_batched)):
        row = [(a - b).abs().max(), (a - c).abs().max(), (b - c).abs().max(), (d - b).abs().max(), (d - e).abs().max(), c.std()]
        print(f"{step:>4} " + " ".join(f"{value.item():>16.2e}" for value in row))


if __name__ == "__main__":
    main()
