"""Quantized checkpoints: a `.pth` saved once with its large matrices in int8, as `.safetensors`, so
a `weights=int8` load reads half the bytes and needs no fp16 file.

    python -m albatross.int8_checkpoint models/rwkv7-7.2b.pth models/rwkv7-7.2b-int8.safetensors [--device cuda]

Layout: every tensor of the official state dict under its own key, except the matrices of
`quant.LARGE_MATRICES`, which are `<key>.q` (int8, `[in, out]`, the model's orientation) and
`<key>.scale` (fp32 `[out]`). Metadata: `format` = `albatross-int8-v1` and the source file's
`fingerprint`, which the loaded model keeps, so cached states are shared with the `.pth` it came
from. Loading validates the official key set and shapes as for a `.pth` (the int8 matrices stand
in as shape-only placeholders) and hands the int8 matrices to the model as they are.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from albatross.checkpoint import fingerprint, read_state_dict, resolve_checkpoint_path, validate_state_dict
from albatross.quant import LARGE_MATRICES, Int8Weight, quantize

FORMAT = "albatross-int8-v1"
SUFFIX = ".safetensors"
_Q, _SCALE = ".q", ".scale"


@dataclass(slots=True)
class Int8Checkpoint:
    """`state_dict`: official keys (int8 matrices as shape-only placeholders on the meta device);
    `matrices`: official matrix key -> its int8 weight (empty when read without tensors)."""

    state_dict: dict[str, torch.Tensor]
    fingerprint: str
    matrices: dict[str, Int8Weight] = field(default_factory=dict)


def is_int8_checkpoint(path: str | Path) -> bool:
    return Path(path).suffix == SUFFIX


def save(source: str | Path, target: str | Path, device: str | torch.device = "cpu") -> Path:
    """Quantize the `.pth` at `source` (on `device`, one matrix at a time) and write `target`."""
    target = Path(target)
    if target.suffix != SUFFIX:
        raise ValueError(f"an int8 checkpoint is a {SUFFIX} file, got {target}")
    resolved = resolve_checkpoint_path(source)
    state_dict = read_state_dict(resolved)
    validate_state_dict(state_dict)
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key.endswith(LARGE_MATRICES):
            weight = quantize(tensor.to(device).t())
            tensors[key + _Q] = weight.q.cpu().contiguous()
            tensors[key + _SCALE] = weight.scale.cpu().contiguous()
        else:
            tensors[key] = tensor.contiguous()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    save_file(tensors, str(partial), metadata={"format": FORMAT, "fingerprint": fingerprint(state_dict)})
    partial.replace(target)  # a crash never leaves a truncated file under the final name
    return target


def read(path: str | Path, tensors: bool = True) -> Int8Checkpoint:
    """Read an int8 checkpoint; with `tensors=False` only shapes and dtypes (for the memory plan)."""
    path = Path(path)
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != FORMAT or "fingerprint" not in metadata:
            raise ValueError(f"{path} is not an albatross int8 checkpoint (metadata format {metadata.get('format')!r})")
        keys = list(handle.keys())
        state_dict: dict[str, torch.Tensor] = {}
        matrices: dict[str, Int8Weight] = {}
        for key in keys:
            if key.endswith(_SCALE) and key[: -len(_SCALE)].endswith(LARGE_MATRICES):
                continue
            if key.endswith(_Q) and key[: -len(_Q)].endswith(LARGE_MATRICES):
                name = key[: -len(_Q)]
                if name + _SCALE not in keys:
                    raise ValueError(f"{path}: {key} has no {name + _SCALE}")
                in_features, out_features = handle.get_slice(key).get_shape()
                state_dict[name] = torch.empty(out_features, in_features, dtype=torch.float16, device="meta")
                if tensors:
                    matrices[name] = Int8Weight(handle.get_tensor(key), handle.get_tensor(name + _SCALE))
            elif tensors:
                state_dict[key] = handle.get_tensor(key)
            else:
                piece = handle.get_slice(key)
                state_dict[key] = torch.empty(piece.get_shape(), dtype=_DTYPES[piece.get_dtype()], device="meta")
    return Int8Checkpoint(state_dict, metadata["fingerprint"], matrices)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="an RWKV-7 .pth checkpoint")
    parser.add_argument("target", help=f"the {SUFFIX} file to write")
    parser.add_argument("--device", default="cpu", help="where to quantize (cuda is faster for large models)")
    args = parser.parse_args(argv)
    written = save(args.source, args.target, args.device)
    print(f"wrote {written} ({written.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
