"""What the state cache knows about a state besides its tensors: size, layout, copies, checksums.

The cache treats a state as an opaque dataclass of tensors that can serialise itself
(`to_bytes()` / `from_bytes()`, as `albatross.state.SlotState` does). Everything here works on any
such dataclass, so the cache never depends on the state's field names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, Self, TypeVar

import torch

Tier = Literal["L1", "L2", "L3"]


class SerializableState(Protocol):
    """What the cache relies on in a state (`albatross.state.SlotState` is one): a dataclass whose
    tensor fields are the state, and its own byte format for the disk tier."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_bytes(self) -> bytes: ...

    @classmethod
    def from_bytes(cls, data: bytes) -> Self: ...


StateT = TypeVar("StateT", bound=SerializableState)


def tensor_fields(state: SerializableState) -> dict[str, torch.Tensor]:
    if not dataclasses.is_dataclass(state):
        raise TypeError(f"a cached state must be a dataclass of tensors, got {type(state).__name__}")
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if isinstance(getattr(state, f.name), torch.Tensor)}


def state_nbytes(state: SerializableState) -> int:
    return sum(t.numel() * t.element_size() for t in tensor_fields(state).values())


def state_layout(state: SerializableState) -> str:
    """A canonical text of every tensor's name, shape and dtype: stored next to the bytes and checked
    again after decoding, so a row whose payload decodes to another shape is never loaded."""
    layout = {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in sorted(tensor_fields(state).items())}
    return json.dumps(layout, separators=(",", ":"))


def state_dtype(state: SerializableState) -> str:
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensor_fields(state).values()})
    return ",".join(dtypes)


def copy_state(state: StateT, device: torch.device) -> StateT:
    """A deep copy on `device`: cached entries and running slots never share memory. Copies between
    device memory and pinned host memory are issued without making the calling thread wait; they
    are ordered on the current stream like every other use of the state."""
    copies = {
        name: t.detach().to(device=device, copy=True, non_blocking=t.is_pinned() or t.device.type == device.type)
        for name, t in tensor_fields(state).items()
    }
    return dataclasses.replace(state, **copies)


def copy_into(state: StateT, destination: StateT) -> torch.cuda.Event:
    """Copy a device state into page-locked host tensors of the same layout without waiting; the
    returned event completes once the copy has landed (recorded on the source's current stream)."""
    sources = tensor_fields(state)
    targets = tensor_fields(destination)
    for name, source in sources.items():
        targets[name].copy_(source.detach(), non_blocking=True)
    device = next(iter(sources.values())).device
    landed = torch.cuda.Event()
    landed.record(torch.cuda.current_stream(device))
    return landed


def copy_to_host(state: StateT) -> tuple[StateT, torch.cuda.Event | None]:
    """A host copy of a state, and the CUDA event that completes once it has landed (None for a
    state already on the host, copied synchronously).

    A device state is copied into pinned memory on its device's current stream, so the caller (the
    engine's worker) never waits for the step in flight; whoever reads the host bytes waits on the
    event first (the disk writer), and a copy back to the device needs no wait at all."""
    tensors = tensor_fields(state)
    devices = {t.device for t in tensors.values()}
    if all(d.type == "cpu" for d in devices):
        return copy_state(state, torch.device("cpu")), None
    if len(devices) != 1:
        raise ValueError(f"a state's tensors must share one device, got {sorted(map(str, devices))}")
    pinned = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for name, t in tensors.items()}
    destination = dataclasses.replace(state, **pinned)
    return destination, copy_into(state, destination)


def checksum(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


@dataclass(slots=True)
class CachedEntry:
    """One state held in memory (L1 or L2)."""

    state: SerializableState
    nbytes: int
    last_updated: float  # wall-clock seconds of the put that created it
    dirty: bool  # not on disk and no write queued: flush() or eviction must write it
    landed: torch.cuda.Event | None = None  # a host copy still in flight completes this (copy_to_host)
    slot: int | None = None  # the HostSlab slot an L2 entry's tensors live in
    checksum: str | None = None  # of the L3 record this entry equals (None: not known to be on L3)
    seq: int = 0  # the put that made it; its disk write reports back to the entry it belongs to


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """One row of the L3 table, as written and as read back."""

    key: str
    layout: str
    dtype: str
    nbytes: int
    checksum: str
    payload: bytes
    last_updated: float


@dataclass(frozen=True, slots=True)
class CacheEntryInfo:
    """A key as /state/status lists it: once, at the fastest tier that holds it."""

    key: str
    tier: Tier
    last_updated: float
