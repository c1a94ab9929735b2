"""Write random-weight RWKV-7 checkpoints in the official `.pth` key layout.

Tests, benchmarks and the demo server use these: no weights can be downloaded, throughput does not
depend on weight values, and correctness is checked against the reference on the same file.
The scales follow a trained model's ranges closely enough that activations stay finite over long
prompts and the next-token distribution is peaked (top-2 margins are not razor-thin).

    python -m albatross.random_checkpoint --layers 2 --width 128 --output models/tiny.pth
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from albatross.dtypes import DTYPES

HEAD_SIZE = 64
VOCAB_SIZE = 65536
# The RWKV world tokenizer defines ids 0..65529 of the 65,536-row head; a server that samples one
# of the rest from random weights fails to decode it (some peers crash).
UNDEFINED_IDS = tuple(range(65530, VOCAB_SIZE))
IMPOSSIBLE_LOGIT = -100.0



def _lora_rank(width: int, factor: float, power: float) -> int:
    # The released models size each LoRA as factor * width**power, rounded to a multiple of 32.
    return max(32, int(round(factor * width**power / 32)) * 32)


@dataclass(frozen=True, slots=True)
class CheckpointShape:
    n_layer: int
    n_embd: int
    vocab_size: int = VOCAB_SIZE
    head_size: int = HEAD_SIZE

    def __post_init__(self) -> None:
        if self.n_layer < 1:
            raise ValueError("n_layer must be >= 1")
        if self.n_embd < self.head_size or self.n_embd % self.head_size:
            raise ValueError(f"n_embd must be a positive multiple of the head size {self.head_size}")

    @property
    def decay_rank(self) -> int:
        return _lora_rank(self.n_embd, 2.5, 0.5)

    @property
    def a_rank(self) -> int:
        return _lora_rank(self.n_embd, 2.5, 0.5)

    @property
    def value_rank(self) -> int:
        return _lora_rank(self.n_embd, 1.7, 0.5)

    @property
    def gate_rank(self) -> int:
        return _lora_rank(self.n_embd, 0.6, 0.8)


# Real model shapes used by the benchmarks.
NAMED_SHAPES: dict[str, CheckpointShape] = {
    "tiny": CheckpointShape(n_layer=2, n_embd=128),
    "0.1b": CheckpointShape(n_layer=12, n_embd=768),
    "0.4b": CheckpointShape(n_layer=24, n_embd=1024),
    "1.5b": CheckpointShape(n_layer=24, n_embd=2048),
    "2.9b": CheckpointShape(n_layer=32, n_embd=2560),
    "7.2b": CheckpointShape(n_layer=32, n_embd=4096),
}


def random_state_dict(
    shape: CheckpointShape,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    impossible_ids: Sequence[int] = (),
    layer0_value_weights: bool = False,
) -> dict[str, torch.Tensor]:
    """A full RWKV-7 state dict with random weights (generated in fp32, stored in `dtype`).

    Generating on a GPU (`device="cuda"`) takes seconds even for the 7.2B shape, so benchmarks
    build their models in memory instead of writing and reading 15 GB files. `impossible_ids`:
    token ids that no server can sample from these weights (`make_ids_impossible`).
    `layer0_value_weights`: also block 0's value-residual weights (`att.v0/v1/v2`). Trained
    checkpoints carry them and every implementation ignores them (block 0 makes v_first), but
    RWKV-Runner's Albatross sizes its weight groups from them at load and fails without them."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    C, V = shape.n_embd, shape.vocab_size
    H = C // shape.head_size
    L = shape.n_layer

    def randn(*size: int, std: float) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device) * std

    def uniform(*size: int, low: float, high: float) -> torch.Tensor:
        return torch.rand(*size, generator=gen, device=device) * (high - low) + low

    def mix() -> torch.Tensor:
        return uniform(1, 1, C, low=0.0, high=1.0)

    sd: dict[str, torch.Tensor] = {}
    sd["emb.weight"] = randn(V, C, std=1.0)
    sd["blocks.0.ln0.weight"] = 1.0 + randn(C, std=0.1)
    sd["blocks.0.ln0.bias"] = randn(C, std=0.1)
    inv = 1.0 / math.sqrt(C)
    for i in range(L):
        p = f"blocks.{i}."
        sd[p + "ln1.weight"] = 1.0 + randn(C, std=0.1)
        sd[p + "ln1.bias"] = randn(C, std=0.05)
        sd[p + "ln2.weight"] = 1.0 + randn(C, std=0.1)
        sd[p + "ln2.bias"] = randn(C, std=0.05)
        a = p + "att."
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[a + name] = mix()
        sd[a + "w0"] = uniform(1, 1, C, low=-6.0, high=1.0)
        sd[a + "w1"] = randn(C, shape.decay_rank, std=inv)
        sd[a + "w2"] = randn(shape.decay_rank, C, std=0.1 / math.sqrt(shape.decay_rank))
        sd[a + "a0"] = randn(1, 1, C, std=0.5)
        sd[a + "a1"] = randn(C, shape.a_rank, std=inv)
        sd[a + "a2"] = randn(shape.a_rank, C, std=0.5 / math.sqrt(shape.a_rank))
        if i > 0:  # block 0 defines v_first and has no value-residual weights
            sd[a + "v0"] = randn(1, 1, C, std=0.5)
            sd[a + "v1"] = randn(C, shape.value_rank, std=inv)
            sd[a + "v2"] = randn(shape.value_rank, C, std=0.5 / math.sqrt(shape.value_rank))
        sd[a + "g1"] = randn(C, shape.gate_rank, std=inv)
        sd[a + "g2"] = randn(shape.gate_rank, C, std=1.0 / math.sqrt(shape.gate_rank))
        sd[a + "k_k"] = uniform(1, 1, C, low=0.5, high=1.0)
        sd[a + "k_a"] = uniform(1, 1, C, low=0.5, high=1.5)
        sd[a + "r_k"] = randn(H, shape.head_size, std=0.3)
        sd[a + "receptance.weight"] = randn(C, C, std=inv)
        sd[a + "key.weight"] = randn(C, C, std=inv)
        sd[a + "value.weight"] = randn(C, C, std=inv)
        sd[a + "output.weight"] = randn(C, C, std=0.5 * inv)
        sd[a + "ln_x.weight"] = 1.0 + randn(C, std=0.1)
        sd[a + "ln_x.bias"] = randn(C, std=0.05)
        f = p + "ffn."
        sd[f + "x_k"] = mix()
        sd[f + "key.weight"] = randn(4 * C, C, std=inv)
        sd[f + "value.weight"] = randn(C, 4 * C, std=0.5 / math.sqrt(4 * C))
    sd["ln_out.weight"] = 1.0 + randn(C, std=0.1)
    sd["ln_out.bias"] = randn(C, std=0.05)
    # A head that is large relative to the unit-variance final layer norm makes the next-token
    # distribution peaked, as in a trained model.
    sd["head.weight"] = randn(V, C, std=4.0 * inv)
    if layer0_value_weights:  # drawn last, so every other weight is the same with or without them
        sd["blocks.0.att.v0"] = randn(1, 1, C, std=0.5)
        sd["blocks.0.att.v1"] = randn(C, shape.value_rank, std=inv)
        sd["blocks.0.att.v2"] = randn(shape.value_rank, C, std=0.5 / math.sqrt(shape.value_rank))
    if impossible_ids:
        make_ids_impossible(sd, impossible_ids)
    # Convert as we go would be leaner, but the dict is built first so that the random stream
    # (and so the weights) do not depend on the storage dtype.
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


def make_ids_impossible(sd: dict[str, torch.Tensor], ids: Sequence[int], channel: int = 0) -> None:
    """Give `ids` the logit IMPOSSIBLE_LOGIT for every input, in every implementation: channel
    `channel` of the final layer norm becomes the constant 1 (weight 0, bias 1), the head rows of
    `ids` read only that channel (weight -100, exact in fp16), and no other row reads it. The other
    logits lose one channel of 4,096 (of 128 in the tiny shape), so the distribution stays peaked;
    a random head's logits stay within about +-20, so these ids get probability ~e^-120."""
    vocab = sd["head.weight"].shape[0]
    rows = sorted(set(ids))
    if not rows or rows[0] < 0 or rows[-1] >= vocab:
        raise ValueError(f"impossible ids must be in [0, {vocab}), got {list(ids)[:8]}")
    sd["ln_out.weight"][channel] = 0.0
    sd["ln_out.bias"][channel] = 1.0
    head = sd["head.weight"]
    head[:, channel] = 0.0
    index = torch.tensor(rows, dtype=torch.int64, device=head.device)
    head[index] = 0.0
    head[index, channel] = IMPOSSIBLE_LOGIT


def parse_ids(text: str) -> tuple[int, ...]:
    """`"0,65530-65535"` -> (0, 65530, ..., 65535)."""
    ids: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, _, high = part.partition("-")
        ids.extend(range(int(low), int(high or low) + 1))
    return tuple(ids)


def write_random_checkpoint(
    path: str | Path, shape: CheckpointShape, seed: int = 0, dtype: str = "fp32", impossible_ids: Sequence[int] = (),
    device: str | torch.device = "cpu",
    layer0_value_weights: bool = False,
) -> Path:
    """Write a checkpoint to `path` (`.pth` is appended when missing) and return the final path.
    `device="cuda"` generates the weights on a GPU (the 7.2B shape in seconds)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    path = Path(path)
    if path.suffix != ".pth":
        path = path.with_name(path.name + ".pth")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    weights = random_state_dict(
        shape, seed=seed, dtype=DTYPES[dtype], device=device, impossible_ids=impossible_ids, layer0_value_weights=layer0_value_weights
    )
    torch.save({key: value.cpu() for key, value in weights.items()}, tmp)
    tmp.replace(path)  # a crash never leaves a truncated checkpoint under the final name
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="checkpoint path (.pth added when missing)")
    parser.add_argument("--shape", choices=sorted(NAMED_SHAPES), help="a named model shape")
    parser.add_argument("--layers", type=int, help="layer count (overrides --shape)")
    parser.add_argument("--width", type=int, help="embedding width, a multiple of 64 (overrides --shape)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--impossible-ids", default="", help="ids no server can sample, e.g. 65530-65535 "
                        "(the tokenizer's undefined ids) or 0,65530-65535 (also EOS: every stream runs to max_tokens)")
    parser.add_argument("--device", default="cpu", help="generate on this device (cuda: seconds for 7.2B)")
    parser.add_argument("--layer0-value-weights", action="store_true",
                        help="also write block 0's att.v0/v1/v2 (ignored by every model; RWKV-Runner's Albatross needs them to load)")  # fmt: skip
    args = parser.parse_args(argv)
    base = NAMED_SHAPES[args.shape or "tiny"]
    shape = CheckpointShape(n_layer=args.layers or base.n_layer, n_embd=args.width or base.n_embd)
    impossible = parse_ids(args.impossible_ids)
    path = write_random_checkpoint(
        args.output, shape, seed=args.seed, dtype=args.dtype, impossible_ids=impossible, device=args.device,
        layer0_value_weights=args.layer0_value_weights,
    )  # fmt: skip
    note = f", {len(impossible)} impossible ids" if impossible else ""
    print(f"wrote {path} (layers={shape.n_layer}, width={shape.n_embd}, dtype={args.dtype}{note})")


if __name__ == "__main__":
    main()
