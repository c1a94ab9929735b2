"""Model specs: what a worker loads, named so that a worker process can be told it.

A spec is a checkpoint path (`.pth` optional), or `random:<shape>[:<seed>]` for random weights of a
named shape (`albatross.random_checkpoint.NAMED_SHAPES`: tiny, 0.1b, ..., 7.2b) or of
`<layers>x<width>` (e.g. `random:2x128`), built directly on the worker's device. `model_loader`
turns a spec into the `ModelSource` a worker loads on its own thread (or in its own process: the
spec and the config are plain data, so they cross a process boundary where a loader could not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from albatross.checkpoint import ModelConfig, read_config
from albatross.dtypes import DTYPES
from albatross.model import RWKV7
from albatross.random_checkpoint import NAMED_SHAPES, CheckpointShape, random_state_dict
from albatross_engine.config import AlbatrossBackendConfig
from albatross_engine.device_step import free_device_memory
from albatross_engine.memory_plan import parameter_count, weight_bytes

RANDOM_MODEL_PREFIX = "random:"
ModelLoader = Callable[[torch.device], RWKV7]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What a worker loads: how to build the model on a device, and its shape before any weight
    is read (so the memory plan can refuse before loading; None: planned once built)."""

    build: ModelLoader
    config: Callable[[], ModelConfig] | None = None


def model_name(model_path: str) -> str:
    if model_path.startswith(RANDOM_MODEL_PREFIX):
        return "random-" + model_path[len(RANDOM_MODEL_PREFIX) :].replace(":", "-")
    name = Path(model_path).name
    return name[: -len(".pth")] if name.endswith(".pth") else name


def parse_random_spec(spec: str) -> tuple[CheckpointShape, int]:
    """`random:<shape>[:<seed>]` -> (shape, seed); shape a NAMED_SHAPES name or `<layers>x<width>`."""
    body = spec[len(RANDOM_MODEL_PREFIX) :] if spec.startswith(RANDOM_MODEL_PREFIX) else spec
    shape_name, _, seed_text = body.partition(":")
    seed = int(seed_text) if seed_text else 0
    if shape_name.lower() in NAMED_SHAPES:
        return NAMED_SHAPES[shape_name.lower()], seed
    layers, sep, width = shape_name.lower().partition("x")
    if sep and layers.isdigit() and width.isdigit():
        return CheckpointShape(n_layer=int(layers), n_embd=int(width)), seed
    raise ValueError(f"unknown random model shape {shape_name!r}; known: {', '.join(NAMED_SHAPES)} or <layers>x<width>")


def model_loader(model_path: str, config: AlbatrossBackendConfig) -> ModelSource:
    """How a worker loads `model_path` in the config's dtype and weight format."""
    if model_path.startswith(RANDOM_MODEL_PREFIX):
        shape, seed = parse_random_spec(model_path)

        def load_random(device: torch.device) -> RWKV7:
            dtype = config.effective_dtype(device.type)
            state_dict = random_state_dict(shape, seed=seed, dtype=DTYPES[dtype], device=_random_weights_device(shape, config, device))
            return RWKV7.from_state_dict(state_dict, device, dtype, name=model_name(model_path), progress=False, weights=config.weights)

        return ModelSource(load_random, lambda: shape_config(shape))

    def load_file(device: torch.device) -> RWKV7:
        return RWKV7.load(model_path, device, config.effective_dtype(device.type), progress=False, weights=config.weights)

    return ModelSource(load_file, lambda: read_config(model_path))  # shapes only: the file is memory-mapped


def shape_config(shape: CheckpointShape) -> ModelConfig:
    """The ModelConfig of `random_state_dict(shape)`, without generating it."""
    return ModelConfig(
        n_layer=shape.n_layer,
        n_embd=shape.n_embd,
        n_head=shape.n_embd // shape.head_size,
        head_size=shape.head_size,
        vocab_size=shape.vocab_size,
        decay_rank=shape.decay_rank,
        a_rank=shape.a_rank,
        value_rank=shape.value_rank if shape.n_layer > 1 else 0,
        gate_rank=shape.gate_rank,
        ffn_size=4 * shape.n_embd,
    )


def _random_weights_device(shape: CheckpointShape, config: AlbatrossBackendConfig, device: torch.device) -> torch.device:
    """Random weights are generated in fp32 as one dict before conversion: on the GPU that is fast,
    but needs four bytes a parameter beside the converted model; when that does not fit (a 7B on a
    12 GB card), they are generated in host memory and converted onto the GPU tensor by tensor."""
    if device.type != "cuda":
        return device
    model_config = shape_config(shape)
    dtype_bytes = DTYPES[config.effective_dtype(device.type)].itemsize
    needed = 4 * parameter_count(model_config) + weight_bytes(model_config, config.weights, dtype_bytes)
    return device if needed < 0.9 * free_device_memory(device) else torch.device("cpu")
