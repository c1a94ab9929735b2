"""Reading and validating RWKV-7 (`x070`) checkpoints: the key set, the shapes, the config they
imply, and a content fingerprint that keys cached states.

Nothing here converts weights; `albatross.model` does that tensor by tensor.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from albatross.dtypes import SUPPORTED_DTYPES

_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")

# Per block, in the order the checks run, so the error names the first bad key of a file.
_ATT_VECTORS = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")

# Fingerprint sampling: tensors up to this many elements are hashed whole, larger ones by their
# first and last stretch. Every matrix of a 7.2B model is sampled, so hashing reads ~10 MB.
_FINGERPRINT_WHOLE_NUMEL = 65536
_FINGERPRINT_SAMPLE_NUMEL = 4096


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of an RWKV-7 model, read from its tensors."""

    n_layer: int
    n_embd: int
    n_head: int
    head_size: int
    vocab_size: int
    decay_rank: int  # w1/w2 LoRA
    a_rank: int  # a1/a2 LoRA (in-context learning rate)
    value_rank: int  # v1/v2 LoRA (value residual); 0 for a one-layer model
    gate_rank: int  # g1/g2 LoRA
    ffn_size: int  # channel-mix hidden width (4 * n_embd in released models)

    def __post_init__(self) -> None:
        if self.n_layer < 1 or self.n_embd < 1 or self.vocab_size < 1:
            raise ValueError(f"invalid model shape: {self}")
        if self.n_head * self.head_size != self.n_embd:
            raise ValueError(f"n_head * head_size ({self.n_head} * {self.head_size}) != n_embd ({self.n_embd})")


def resolve_checkpoint_path(path: str | Path) -> Path:
    """`models/x` and `models/x.pth` name the same file; the one that exists wins (an int8
    `.safetensors` file is named with its suffix)."""
    path = Path(path)
    if path.suffix == ".pth" or path.exists():
        candidate = path
    else:
        candidate = path.with_name(path.name + ".pth")
    if not candidate.is_file():
        raise FileNotFoundError(f"checkpoint not found: {candidate}")
    return candidate


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Memory-map a checkpoint: tensors are paged in only as they are converted."""
    resolved = resolve_checkpoint_path(path)
    loaded = torch.load(resolved, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"{resolved} is not a state dict of tensors")
    return loaded


def read_config(path: str | Path) -> ModelConfig:
    """The validated config of a `.pth` or an int8 `.safetensors` file, reading shapes only."""
    resolved = resolve_checkpoint_path(path)
    if resolved.suffix == ".safetensors":
        from albatross import int8_checkpoint  # it builds on this module

        return validate_state_dict(int8_checkpoint.read(resolved, tensors=False).state_dict)
    return validate_state_dict(read_state_dict(resolved))


def _shape_of(state_dict: Mapping[str, torch.Tensor], key: str, ndim: int) -> tuple[int, ...] | None:
    tensor = state_dict.get(key)
    if tensor is None or tensor.dim() != ndim:
        return None
    return tuple(tensor.shape)


def infer_config(state_dict: Mapping[str, torch.Tensor]) -> ModelConfig:
    """Read the model shape from tensor shapes. Keys it cannot read are reported by
    `validate_state_dict`, which checks every key in order; this only fails when even the
    embedding is unusable."""
    emb = _shape_of(state_dict, "emb.weight", 2)
    if emb is None:
        raise ValueError("not an RWKV-7 checkpoint: missing or misshaped key 'emb.weight' (expected [vocab, n_embd])")
    vocab_size, n_embd = emb
    r_k = _shape_of(state_dict, "blocks.0.att.r_k", 2)
    n_head, head_size = r_k if r_k is not None and r_k[0] * r_k[1] == n_embd else (max(1, n_embd // 64), 64)
    if n_head * head_size != n_embd:
        raise ValueError(f"not an RWKV-7 checkpoint: key 'emb.weight' width {n_embd} is not a multiple of 64")
    layer_ids = [int(m.group(1)) for key in state_dict if (m := _BLOCK_KEY.match(key))]
    n_layer = max(layer_ids) + 1 if layer_ids else 1

    def rank(key: str) -> int:
        shape = _shape_of(state_dict, key, 2)
        return shape[1] if shape is not None else 0

    value_key = "blocks.1.att.v1" if n_layer > 1 else "blocks.0.att.v1"
    ffn = _shape_of(state_dict, "blocks.0.ffn.key.weight", 2)
    return ModelConfig(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        head_size=head_size,
        vocab_size=vocab_size,
        decay_rank=rank("blocks.0.att.w1"),
        a_rank=rank("blocks.0.att.a1"),
        value_rank=rank(value_key),
        gate_rank=rank("blocks.0.att.g1"),
        ffn_size=ffn[0] if ffn is not None else 4 * n_embd,
    )


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every key of an RWKV-7 checkpoint of this shape, with its shape, in checking order."""
    C, V, F = config.n_embd, config.vocab_size, config.ffn_size
    vec = (1, 1, C)
    shapes: dict[str, tuple[int, ...]] = {
        "emb.weight": (V, C),
        "blocks.0.ln0.weight": (C,),
        "blocks.0.ln0.bias": (C,),
    }
    for i in range(config.n_layer):
        p = f"blocks.{i}."
        for name in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"):
            shapes[p + name] = (C,)
        a = p + "att."
        for name in _ATT_VECTORS:
            shapes[a + name] = vec
        shapes[a + "w0"] = vec
        shapes[a + "w1"] = (C, config.decay_rank)
        shapes[a + "w2"] = (config.decay_rank, C)
        shapes[a + "a0"] = vec
        shapes[a + "a1"] = (C, config.a_rank)
        shapes[a + "a2"] = (config.a_rank, C)
        if i > 0:
            shapes[a + "v0"] = vec
            shapes[a + "v1"] = (C, config.value_rank)
            shapes[a + "v2"] = (config.value_rank, C)
        shapes[a + "g1"] = (C, config.gate_rank)
        shapes[a + "g2"] = (config.gate_rank, C)
        shapes[a + "k_k"] = vec
        shapes[a + "k_a"] = vec
        shapes[a + "r_k"] = (config.n_head, config.head_size)
        for name in ("receptance", "key", "value", "output"):
            shapes[a + name + ".weight"] = (C, C)
        shapes[a + "ln_x.weight"] = (C,)
        shapes[a + "ln_x.bias"] = (C,)
        f = p + "ffn."
        shapes[f + "x_k"] = vec
        shapes[f + "key.weight"] = (F, C)
        shapes[f + "value.weight"] = (C, F)
    shapes["ln_out.weight"] = (C,)
    shapes["ln_out.bias"] = (C,)
    shapes["head.weight"] = (V, C)
    return shapes


def _optional_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    C = config.n_embd
    return {
        "blocks.0.att.v0": (1, 1, C),
        "blocks.0.att.v1": (C, config.value_rank),
        "blocks.0.att.v2": (config.value_rank, C),
    }


def validate_state_dict(state_dict: Mapping[str, torch.Tensor]) -> ModelConfig:
    """Return the config of a well-formed RWKV-7 state dict; otherwise raise a ValueError that
    names the first missing, misshaped, mistyped or unknown key."""
    config = infer_config(state_dict)
    expected = expected_shapes(config)
    for key, shape in expected.items():
        tensor = state_dict.get(key)
        if tensor is None:
            raise ValueError(f"not an RWKV-7 checkpoint: missing key {key!r}")
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"not an RWKV-7 checkpoint: key {key!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"key {key!r} has dtype {tensor.dtype}; supported: fp32, fp16, bf16")
    optional = _optional_shapes(config)
    for key, tensor in state_dict.items():
        if key in expected:
            continue
        if key in optional and tuple(tensor.shape) == optional[key]:
            continue
        raise ValueError(f"not an RWKV-7 checkpoint: unexpected key {key!r} with shape {list(tensor.shape)}")
    return config


def _sample_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    if flat.numel() > _FINGERPRINT_WHOLE_NUMEL:
        flat = torch.cat((flat[:_FINGERPRINT_SAMPLE_NUMEL], flat[-_FINGERPRINT_SAMPLE_NUMEL:]))
    return flat.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """A stable hex id of a checkpoint's content: sha256 over every key's name, shape and dtype
    (sorted by key), the whole bytes of each small tensor (<= 65536 elements: norms, mixing
    vectors, r_k, ...) and the first and last 4096 elements of each larger one. It reads a few MB
    whatever the file size, and changes when any layer is retrained or the storage dtype differs."""
    digest = hashlib.sha256(b"rwkv7-fingerprint-v1\n")
    for key in sorted(state_dict):
        tensor = state_dict[key]
        digest.update(f"{key}|{list(tensor.shape)}|{tensor.dtype}\n".encode())
        digest.update(_sample_bytes(tensor))
    return digest.hexdigest()
