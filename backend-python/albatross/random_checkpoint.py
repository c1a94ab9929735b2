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
from dataclasses import dataclass
from pathlib import Path

import torch

from albatross.dtypes import DTYPES

HEAD_SIZE = 64
VOCAB_SIZE = 65536



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
    shape: CheckpointShape, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """A full RWKV-7 state dict with random weights (generated in fp32, stored in `dtype`).

    Generating on a GPU (`device="cuda"`) takes seconds even for the 7.2B shape, so benchmarks
    build their models in memory instead of writing and reading 15 GB files."""
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
    # Convert as we go would be leaner, but the dict is built first so that the random stream
    # (and so the weights) do not depend on the storage dtype.
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


def write_random_checkpoint(
    path: str | Path, shape: CheckpointShape, seed: int = 0, dtype: str = "fp32"
) -> Path:
    """Write a checkpoint to `path` (`.pth` is appended when missing) and return the final path."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    path = Path(path)
    if path.suffix != ".pth":
        path = path.with_name(path.name + ".pth")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    torch.save(random_state_dict(shape, seed=seed, dtype=DTYPES[dtype]), tmp)
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
    args = parser.parse_args(argv)
    base = NAMED_SHAPES[args.shape or "tiny"]
    shape = CheckpointShape(n_layer=args.layers or base.n_layer, n_embd=args.width or base.n_embd)
    path = write_random_checkpoint(args.output, shape, seed=args.seed, dtype=args.dtype)
    print(f"wrote {path} (layers={shape.n_layer}, width={shape.n_embd}, dtype={args.dtype})")


if __name__ == "__main__":
    main()
