"""Shared fixtures: tiny random-weight RWKV-7 checkpoints, written once per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from albatross.random_checkpoint import CheckpointShape, write_random_checkpoint

if TYPE_CHECKING:
    from albatross_engine.state_cache import StateCache

os.environ.setdefault("RWKV_V7_ON", "1")  # the official package reads this at import time
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_dir: Path) -> Path:
    """2 layers, width 128: the default model of CPU tests."""
    return write_random_checkpoint(checkpoint_dir / "rwkv7-tiny.pth", CheckpointShape(n_layer=2, n_embd=128), seed=1)


@pytest.fixture(scope="session")
def small_checkpoint(checkpoint_dir: Path) -> Path:
    """3 layers, width 256 (4 heads): a second shape for numerical tests."""
    return write_random_checkpoint(checkpoint_dir / "rwkv7-small.pth", CheckpointShape(n_layer=3, n_embd=256), seed=2)


@pytest.fixture
def open_caches() -> Iterator[list[StateCache]]:
    """State caches a test opens: each is closed when the test ends, pass or fail."""
    caches: list[StateCache] = []
    yield caches
    for cache in caches:
        cache.close()
