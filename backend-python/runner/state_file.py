"""State-tuned files (RWKV-Runner's `state` setting): a `.pth` holding `blocks.{i}.att.time_state`
of shape [heads, 64, 64] for every layer, used as the initial WKV state of completions that start
from scratch (the token-shift states stay zero), as the Runner's `load_rwkv_state` does for RWKV-7.

The GUI matches two messages of the Runner, so they are kept word for word at the start of ours:
`state shape mismatch` and `file format of the model or state model not supported`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.backends import LoadRefused
from runner.interface import BackendError

if TYPE_CHECKING:
    import torch

SHAPE_MISMATCH = "state shape mismatch"
UNSUPPORTED_FORMAT = "file format of the model or state model not supported"
_TIME_STATE_KEY = re.compile(r"^blocks\.(\d+)\.att\.time_state$")


@dataclass(frozen=True, slots=True)
class InitialState:
    """A loaded state file: WKV matrices `wkv [L, H, N, N]` (fp32, on the CPU) and an id that
    names its content (caches key the states they keep by it)."""

    path: str
    wkv: torch.Tensor
    state_id: str

    @property
    def n_layer(self) -> int:
        return int(self.wkv.shape[0])

    @property
    def n_head(self) -> int:
        return int(self.wkv.shape[1])

    @property
    def head_size(self) -> int:
        return int(self.wkv.shape[2])

    def check_fits(self, n_layer: int, n_head: int, head_size: int) -> None:
        """BackendError 400 `state shape mismatch ...` unless it fits a model of this shape."""
        if (self.n_layer, self.n_head, self.head_size) != (n_layer, n_head, head_size):
            raise BackendError(
                400,
                f"{SHAPE_MISMATCH}: {Path(self.path).name} holds {self.n_layer} layers of {self.n_head} heads x "
                f"{self.head_size}, the loaded model has {n_layer} layers of {n_head} heads x {head_size}",
            )


def _refuse(path: Path, reason: str) -> LoadRefused:
    return LoadRefused(f"{UNSUPPORTED_FORMAT}: {path.name}: {reason}", "state")


def load_state_file(path: Path) -> InitialState:
    """Reads and checks a state file (LoadRefused 400 `file format ... not supported` when it is
    not one). Only tensors are loaded (`weights_only`): a state file runs no code."""
    import torch

    if path.suffix != ".pth":
        raise _refuse(path, "state files are .pth files")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise _refuse(path, f"it does not load as a PyTorch file ({exc})") from exc
    if not isinstance(loaded, dict) or not loaded:
        raise _refuse(path, "it does not hold a dict of tensors")
    layers: dict[int, torch.Tensor] = {}
    for key, value in loaded.items():
        match = _TIME_STATE_KEY.match(str(key))
        if match is None or not isinstance(value, torch.Tensor):
            raise _refuse(path, f"unexpected entry {key!r} (a state file holds only blocks.N.att.time_state tensors)")
        layers[int(match.group(1))] = value
    if sorted(layers) != list(range(len(layers))):
        raise _refuse(path, f"the layers are not numbered 0..{len(layers) - 1}")
    shapes = {tuple(t.shape) for t in layers.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3 or next(iter(shapes))[1] != next(iter(shapes))[2]:
        raise _refuse(path, f"time_state tensors must all be [heads, N, N]; got {sorted(shapes)}")
    wkv = torch.stack([layers[i].detach().to(torch.float32) for i in range(len(layers))]).contiguous()
    if not bool(torch.isfinite(wkv).all()):
        raise _refuse(path, "it holds values that are not finite")
    digest = hashlib.sha256(b"rwkv7-state-file-v1\n")
    digest.update(str(list(wkv.shape)).encode())
    digest.update(wkv.numpy().tobytes())
    return InitialState(str(path), wkv, digest.hexdigest()[:32])
