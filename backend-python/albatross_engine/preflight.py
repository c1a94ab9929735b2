"""What a switch checks before the serving model is unloaded (runner.backends.preflight): that the
Albatross strategy's devices exist, and, for every backend, that the file is an RWKV-7 checkpoint
(its tensor directory is read: no weights are)."""

from __future__ import annotations

from pathlib import Path

import torch

from albatross.checkpoint import read_config
from albatross_engine.config import parse_albatross_strategy
from runner.backends import LoadRefused

RANDOM_MODEL_PREFIX = "random:"


def check_checkpoint(model_path: str, strategy: str) -> None:
    """LoadRefused (400, `model`) unless the file is an RWKV-7 checkpoint, `.pth` or int8
    `.safetensors` (key set and shapes)."""
    try:
        read_config(model_path)
    except Exception as exc:  # a failure to read the file is as much a wrong format as a bad key
        raise LoadRefused(f"{Path(model_path).name} is not a loadable RWKV-7 checkpoint: {exc}", "model") from exc


def check_load(model_path: str, strategy: str) -> None:
    config = parse_albatross_strategy(strategy)  # bad keys and values only warn, as documented
    if config.device is not None and config.device.startswith("cuda"):
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        first = int(config.device.partition(":")[2] or 0)
        if first + config.worker_num > visible:
            raise LoadRefused(
                f"strategy {strategy!r} needs {first + config.worker_num} GPUs from {config.device}, but {visible} "
                f"{'is' if visible == 1 else 'are'} visible",
                "strategy",
            )
    if not model_path.startswith(RANDOM_MODEL_PREFIX):
        check_checkpoint(model_path, strategy)
