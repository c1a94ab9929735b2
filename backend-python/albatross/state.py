"""Recurrent state: a preallocated pool of per-sequence slots, and one slot's state detached from
the pool (for caches: device or host tensors, or compact bytes for SQLite).

Per slot and layer: the time-mix and channel-mix token-shift vectors `[C]` (model dtype) and one
WKV matrix per head `[H, N, N]` (indexed `[head, value_i, key_j]`, fp32 by default).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from albatross.checkpoint import ModelConfig
from albatross.dtypes import SUPPORTED_DTYPES, dtype_named, torch_name
from albatross.ops import host_to_device

if TYPE_CHECKING:
    from albatross.model import RWKV7

_MAGIC = b"RWKV7ST1"
_HEADER_LEN = struct.Struct("<I")
_FIELDS = ("att_shift", "ffn_shift", "wkv")


def slot_bytes(config: ModelConfig, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
    """Exact bytes of one slot: two shift vectors per layer in `dtype`, H matrices N x N per
    layer in `state_dtype`."""
    shift = 2 * config.n_layer * config.n_embd * _itemsize(dtype)
    wkv = config.n_layer * config.n_head * config.head_size * config.head_size * _itemsize(state_dtype)
    return shift + wkv


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class SlotState:
    """One sequence's state: `att_shift [L, C]`, `ffn_shift [L, C]`, `wkv [L, H, N, N]`."""

    att_shift: torch.Tensor
    ffn_shift: torch.Tensor
    wkv: torch.Tensor

    def __post_init__(self) -> None:
        if self.att_shift.dim() != 2 or self.ffn_shift.shape != self.att_shift.shape:
            raise ValueError(
                f"shift vectors must both be [L, C]; got {list(self.att_shift.shape)} and {list(self.ffn_shift.shape)}"
            )
        if self.wkv.dim() != 4 or self.wkv.shape[0] != self.att_shift.shape[0]:
            raise ValueError(f"wkv must be [L, H, N, N] with the shifts' L; got {list(self.wkv.shape)}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.att_shift, self.ffn_shift, self.wkv))

    @property
    def device(self) -> torch.device:
        return self.wkv.device

    def to(self, device: str | torch.device, non_blocking: bool = False) -> SlotState:
        return SlotState(
            self.att_shift.to(device, non_blocking=non_blocking),
            self.ffn_shift.to(device, non_blocking=non_blocking),
            self.wkv.to(device, non_blocking=non_blocking),
        )

    def clone(self) -> SlotState:
        return SlotState(self.att_shift.clone(), self.ffn_shift.clone(), self.wkv.clone())

    def to_bytes(self) -> bytes:
        """`RWKV7ST1`, a little-endian u32 header length, a JSON header (dtype and shape of each
        tensor), then the raw tensor bytes in header order."""
        tensors = [getattr(self, name).detach().cpu().contiguous() for name in _FIELDS]
        header = json.dumps(
            {name: [torch_name(t.dtype), list(t.shape)] for name, t in zip(_FIELDS, tensors)},
            separators=(",", ":"),
        ).encode()
        parts = [_MAGIC, _HEADER_LEN.pack(len(header)), header]
        parts += [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> SlotState:
        data = bytes(data)
        prefix = len(_MAGIC) + _HEADER_LEN.size
        if len(data) < prefix or data[: len(_MAGIC)] != _MAGIC:
            raise ValueError("not a serialized RWKV-7 slot state (bad magic)")
        (header_len,) = _HEADER_LEN.unpack_from(data, len(_MAGIC))
        try:
            header = json.loads(data[prefix : prefix + header_len])
            specs = [(dtype_named(header[name][0]), [int(d) for d in header[name][1]]) for name in _FIELDS]
        except (KeyError, ValueError, TypeError, IndexError) as error:
            raise ValueError(f"corrupt slot state header: {error}") from error
        offset = prefix + header_len
        tensors: list[torch.Tensor] = []
        for dtype, shape in specs:
            size = _itemsize(dtype)
            for dim in shape:
                size *= dim
            if offset + size > len(data):
                raise ValueError(f"slot state truncated: need {offset + size} bytes, have {len(data)}")
            raw = torch.frombuffer(bytearray(data[offset : offset + size]), dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(shape))
            offset += size
        if offset != len(data):
            raise ValueError(f"slot state has {len(data) - offset} trailing bytes")
        return cls(*tensors)


class StatePool:
    """`batch_size` state slots preallocated on the model's device, addressed by index.

    Tensors: `att_shift [L, B, C]`, `ffn_shift [L, B, C]` (model dtype), `wkv [L, B, H, N, N]`
    (`state_dtype`). Slots start zeroed. Every method touches only the slots it is given."""

    def __init__(self, model: RWKV7, batch_size: int, state_dtype: torch.dtype = torch.float32) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if state_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"state_dtype must be one of fp32, fp16, bf16; got {state_dtype}")
        config = model.config
        self.config: ModelConfig = config
        self.batch_size = batch_size
        self.dtype: torch.dtype = model.dtype
        self.state_dtype = state_dtype
        self.device: torch.device = model.device
        self.bytes_per_slot = slot_bytes(config, self.dtype, state_dtype)
        self._check_memory()
        L, B, C, H, N = config.n_layer, batch_size, config.n_embd, config.n_head, config.head_size
        self.att_shift = torch.zeros(L, B, C, dtype=self.dtype, device=self.device)
        self.ffn_shift = torch.zeros(L, B, C, dtype=self.dtype, device=self.device)
        self.wkv = torch.zeros(L, B, H, N, N, dtype=state_dtype, device=self.device)

    def _check_memory(self) -> None:
        if self.device.type != "cuda":
            return
        free, _total = torch.cuda.mem_get_info(self.device)
        needed = self.bytes_per_slot * self.batch_size
        if needed > free:
            fits = free // self.bytes_per_slot
            raise MemoryError(
                f"{self.batch_size} state slots need {needed / 2**30:.2f} GiB "
                f"({self.bytes_per_slot / 2**20:.2f} MiB each) but {self.device} has {free / 2**30:.2f} GiB free: "
                f"at most {fits} slots fit"
            )

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.batch_size

    def _index(self, slots: Iterable[int] | int) -> torch.Tensor:
        ids = [slots] if isinstance(slots, int) else list(slots)
        for slot in ids:
            self.check_slot(slot)
        return host_to_device(torch.tensor(ids, dtype=torch.int64), self.device)

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.batch_size:
            raise ValueError(f"slot {slot!r} out of range: the pool has slots 0..{self.batch_size - 1}")

    @torch.no_grad()
    def reset(self, slots: Sequence[int] | int) -> None:
        """Zero the given slots (a fresh sequence)."""
        index = self._index(slots)
        for tensor in (self.att_shift, self.ffn_shift, self.wkv):
            tensor.index_fill_(1, index, 0)

    @torch.no_grad()
    def copy(self, src_slot: int, dst_slots: Sequence[int] | int) -> None:
        """Copy one slot's state into other slots (e.g. `n` samples sharing one prefill)."""
        self.check_slot(src_slot)
        index = self._index(dst_slots)
        for tensor in (self.att_shift, self.ffn_shift, self.wkv):
            source = tensor[:, src_slot : src_slot + 1]
            tensor.index_copy_(1, index, source.expand(-1, index.numel(), *source.shape[2:]).contiguous())

    def view(self, slot: int) -> SlotState:
        """One slot's state as views of the pool (no copy): what later steps write into the slot shows."""
        self.check_slot(slot)
        return SlotState(*(t[:, slot] for t in (self.att_shift, self.ffn_shift, self.wkv)))

    @torch.no_grad()
    def read(self, slot: int, device: str | torch.device | None = None) -> SlotState:
        """A copy of one slot's state on `device` (default: the host)."""
        self.check_slot(slot)
        target = torch.device("cpu") if device is None else torch.device(device)
        parts = [t[:, slot].to(target, copy=True) for t in (self.att_shift, self.ffn_shift, self.wkv)]
        return SlotState(*parts)

    @torch.no_grad()
    def write(self, slot: int, state: SlotState) -> None:
        """Overwrite one slot with `state` (any device; dtypes are converted to the pool's)."""
        self.check_slot(slot)
        L, C, H, N = self.config.n_layer, self.config.n_embd, self.config.n_head, self.config.head_size
        expected = {"att_shift": (L, C), "ffn_shift": (L, C), "wkv": (L, H, N, N)}
        for name, shape in expected.items():
            actual = tuple(getattr(state, name).shape)
            if actual != shape:
                raise ValueError(f"state {name} has shape {list(actual)}, this pool expects {list(shape)}")
        self.att_shift[:, slot].copy_(state.att_shift)
        self.ffn_shift[:, slot].copy_(state.ffn_shift)
        self.wkv[:, slot].copy_(state.wkv)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of one layer: `att_shift [B, C]`, `ffn_shift [B, C]`, `wkv [B, H, N, N]`."""
        return self.att_shift[index], self.ffn_shift[index], self.wkv[index]
