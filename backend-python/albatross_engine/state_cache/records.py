"""What the state cache knows about a state besides its tensors: size, layout, copies, checksums.

The cache treats a state as an opaque dataclass of tensors that can serialise itself
(`to_bytes()` / `from_bytes()`, as `albatross.state.SlotState` does). Everything here works on any
such dataclass, so the cache never depends on the state's field names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
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
    returned event completes once the copy has landed.

    The copy runs on the device's copy stream (`copy_stream`), after everything already issued on
    the current stream, and beside what is issued there next: a 7.2B prompt-end state is 32.5 MB,
    ~0.6 ms over PCIe, and a burst's mixed step saves ~64 of them. On the compute stream those
    copies left the SMs idle ~29 ms after every mixed step of the H100's 960-client burst
    (docs/performance.md, "Session 15"). The sources are marked as used by the copy stream, so the
    caching allocator does not hand their memory to new work before the copy has read it."""
    sources = tensor_fields(state)
    targets = tensor_fields(destination)
    device = next(iter(sources.values())).device
    stream = copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for name, source in sources.items():
            targets[name].copy_(source.detach(), non_blocking=True)
            source.record_stream(stream)
        landed = torch.cuda.Event()
        landed.record(stream)
    return landed


_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}
_COPY_STREAMS_LOCK = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that carries a device's state copies to the host (one per device, made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _COPY_STREAMS_LOCK:
        stream = _COPY_STREAMS.get(index)
        if stream is None:
            stream = _COPY_STREAMS[index] = torch.cuda.Stream(device=torch.device("cuda", index))
        return stream


def copy_to_host(state: StateT) -> tuple[StateT, torch.cuda.Event | None]:
    """A host copy of a state, and the CUDA event that completes once it has landed (None for a
    state already on the host, copied synchronously).

    A device state is copied into pinned memory on its device's copy stream (`copy_into`), so the
    caller (the engine's worker) never waits for the step in flight; whoever reads the host bytes waits on the
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
