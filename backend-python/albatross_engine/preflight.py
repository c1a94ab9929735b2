"""What a switch checks before the serving model is unloaded (runner.backends.preflight): that the
Albatross strategy's devices exist, that on the CPU its workers fit the machine (cores, and host
memory by the memory plan's sizes), and, for every backend, that the file is an RWKV-7 checkpoint
(its tensor directory is read: no weights are)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from albatross.checkpoint import read_config
from albatross.dtypes import DTYPES
from albatross.int8_dispatch import dequantize_above_rows
from albatross_engine.config import AlbatrossBackendConfig, parse_albatross_strategy
from albatross_engine.memory_plan import MemoryRequest, estimate
from albatross_engine.model_specs import model_loader
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
    if config.effective_device(torch.cuda.is_available()) == "cpu":
        check_host_fits(model_path, strategy, config)


def check_host_fits(model_path: str, strategy: str, config: AlbatrossBackendConfig) -> None:
    """LoadRefused (400, `strategy`) for CPU workers the machine cannot hold: more workers than
    cores (they share them, and each holds its own states and buffers), or more host memory than
    the machine has. The GPU path has the memory plan against each device's free memory; on the
    CPU nothing else stops a request such as `workers=999` or `batch=100000000` before the process
    is killed for memory or the load fails after the serving model is gone. The bound is the
    weights once plus each worker's states, step buffers and reserve: what a load needs at the
    least, so only a strategy that cannot fit is refused."""
    cores = os.cpu_count() or 1
    if config.worker_num > cores:
        raise LoadRefused(
            f"strategy {strategy!r} asks for {config.worker_num} CPU workers, but this machine has {cores} cores, which the workers share",
            "strategy",
        )
    source = model_loader(model_path, config)
    if source.config is None:
        return
    request = MemoryRequest(
        config=source.config(),
        weights=config.weights,
        dtype_bytes=DTYPES[config.effective_dtype("cpu")].itemsize,
        state_dtype_bytes=DTYPES[config.effective_state_dtype("cpu")].itemsize,
        batch_size=config.batch_size,
        prefill_chunk=config.prefill_chunk,
        prefill_budget=config.prefill_budget,
        cuda_graphs=False,
    )
    plan = estimate(request, None, dequantize_above_rows("cpu"))
    per_worker = plan.planned_bytes - plan.weights_bytes
    needed = plan.weights_bytes + config.worker_num * per_worker
    physical = _physical_memory()
    if physical is not None and needed > physical:
        raise LoadRefused(
            f"strategy {strategy!r} needs at least {needed / 1e9:.1f} GB of host memory (weights {plan.weights_bytes / 1e9:.1f} GB, "
            f"then {per_worker / 1e9:.1f} GB for each of {config.worker_num} workers: {config.batch_size} state slots and step buffers), "
            f"more than this machine's {physical / 1e9:.1f} GB; lower batch, prefill_budget or workers",
            "strategy",
        )


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return None
