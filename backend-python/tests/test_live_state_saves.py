"""A slot's state is saved from views of the running pool (`DeviceStep.live_state`), so every
store's `put` must take its copy before it returns, queued on the current stream: the next step
rewrites the slot. Each store is given a view and the slot is changed right after `put`; on a
GPU the copy stream is held up by a long sleep first, so a copy read there (or later) would see the
change. What the store kept must be the state as it was at `put`."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch

from albatross.model import RWKV7
from albatross.state import SlotState, StatePool
from albatross_engine import process_boundary as wire
from albatross_engine.state_cache import StateCache
from albatross_engine.state_cache.records import copy_stream
from albatross_engine.state_store import DictStateStore
from albatross_engine.worker_process_main import ServerLink

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]),
]
FIELDS = ("att_shift", "ffn_shift", "wkv")
KEY = "prefix:" + "ab" * 32


def _pool(checkpoint: Path, device: str) -> StatePool:
    pool = StatePool(RWKV7.load(checkpoint, device=device, progress=False), batch_size=3, state_dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    for tensor in (pool.att_shift, pool.ffn_shift, pool.wkv):
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    return pool


def _host(state: SlotState) -> SlotState:
    return SlotState(*(getattr(state, name).detach().cpu().clone() for name in FIELDS))


def _assert_same(actual: SlotState, expected: SlotState, what: str) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(_host(actual), name), getattr(expected, name)), f"{what}: {name} is not the state at put"


def _hold_copy_stream(pool: StatePool) -> None:
    """Host copies run on the copy stream beside the compute stream: make them run late."""
    if pool.device.type == "cuda":
        with torch.cuda.stream(copy_stream(pool.device)):
            torch.cuda._sleep(500_000_000)


def _rewrite_slot(pool: StatePool, slot: int) -> None:
    """What the next step does to a saved slot, queued on the current stream after the put."""
    for tensor in (pool.att_shift, pool.ffn_shift, pool.wkv):
        tensor[:, slot].mul_(-3.0).add_(1.0)


def test_a_pool_view_is_the_slot_without_a_copy(tiny_checkpoint: Path) -> None:
    pool = _pool(tiny_checkpoint, "cpu")
    view = pool.view(1)
    _assert_same(view, _host(pool.read(1)), "the view")
    assert all(getattr(view, name).data_ptr() == getattr(pool, name)[:, 1].data_ptr() for name in FIELDS), "the view is a copy"
    _rewrite_slot(pool, 1)
    _assert_same(view, _host(pool.read(1)), "the view after the slot changed")
    with pytest.raises(ValueError, match="out of range"):
        pool.view(3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store_kind", ["dict", "tiered", "tiered, demoted to host", "worker-process link"])
def test_put_keeps_the_state_as_it_was_when_the_slot_is_rewritten_right_after(
    tiny_checkpoint: Path, tmp_path: Path, open_caches: list[StateCache], device: str, store_kind: str
) -> None:
    pool = _pool(tiny_checkpoint, device)
    expected = _host(pool.read(2))
    read: Callable[[], SlotState]
    if store_kind == "worker-process link":
        mine, servers = Pipe()
        link = ServerLink(mine)
        _hold_copy_stream(pool)
        link.send_put(KEY, pool.view(2))
        _rewrite_slot(pool, 2)
        link.close()
        kind, key, payload = pickle.loads(servers.recv_bytes())
        assert (kind, key) == (wire.STORE_PUT, KEY)
        read = lambda: SlotState.from_bytes(payload)  # noqa: E731
    else:
        if store_kind == "dict":
            store: DictStateStore | StateCache = DictStateStore()
        else:
            one = pool.bytes_per_slot
            l1 = 0 if "demoted" in store_kind else 4 * one  # no room in L1: the put lands in host memory at once
            store = StateCache(tmp_path / "s.sqlite3", "model-a", device=device, l1_bytes=l1, l2_bytes=4 * one)
            open_caches.append(store)
        _hold_copy_stream(pool)
        store.put(KEY, pool.view(2))
        _rewrite_slot(pool, 2)
        if isinstance(store, StateCache):
            assert store.stats()["l2_entries"] == ("demoted" in store_kind), store.stats()
        read = lambda: store.get(KEY)  # type: ignore[return-value]  # noqa: E731
    if device == "cuda":
        torch.cuda.synchronize()
    _assert_same(read(), expected, store_kind)
