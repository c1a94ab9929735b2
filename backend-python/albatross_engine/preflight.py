"""What a switch to the Albatross backend checks before the serving model is unloaded: that the
strategy's devices exist and that the file is an RWKV-7 checkpoint (runner.backends.preflight)."""

from __future__ import annotations

import torch

from albatross_engine.config import parse_albatross_strategy
from runner.backends import LoadRefused
from runner.model_files import check_rwkv7_checkpoint

RANDOM_MODEL_PREFIX = "random:"


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
        check_rwkv7_checkpoint(model_path)
