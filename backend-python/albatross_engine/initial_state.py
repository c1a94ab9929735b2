"""A state-tuned file as the engine's starting state, and the key space that keeps the states made
from it apart from all others.

With a state file set, every task that neither continues a saved state nor hits a cached prefix
starts from the file's WKV matrices (token-shift states zero). A state made that way must never be
served to a request made without the file, nor the other way round, so:

- prefix-cache keys hash the file's id before the prompt's tokens (`prefix_salt`);
- session and dialogue keys, and the session counters, live under `initial-state:<id>/`: the state
  routes see the backend's store through `NamespacedStateStore`, which adds the prefix to every key
  and lists only its own keys. Without a state file they see the keys without any such prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from albatross.state import SlotState

NAMESPACE_PREFIX = "initial-state:"


@dataclass(frozen=True, slots=True)
class EngineInitialState:
    """What a task carries: the file's id and its state on the host (the worker keeps a copy on
    its device per id)."""

    state_id: str
    state: SlotState

    @property
    def key_namespace(self) -> str:
        return namespace_for(self.state_id)

    @property
    def prefix_salt(self) -> bytes:
        return f"{NAMESPACE_PREFIX}{self.state_id}\n".encode()


def namespace_for(state_id: str | None) -> str:
    return "" if state_id is None else f"{NAMESPACE_PREFIX}{state_id}/"


def slot_state_from_wkv(wkv: torch.Tensor, n_embd: int) -> SlotState:
    """A slot state with the given WKV matrices [L, H, N, N] and zero token shifts [L, C]."""
    layers = wkv.shape[0]
    zeros = torch.zeros(layers, n_embd, dtype=torch.float32)
    return SlotState(zeros, zeros.clone(), wkv.to(torch.float32).contiguous())


class NamespacedStateStore:
    """The state routes' view of a state cache, restricted to one key namespace (see the module
    doc). The empty namespace is every key that is in no `initial-state:` namespace."""

    def __init__(self, store: Any, namespace: str) -> None:
        self.store = store
        self.namespace = namespace

    def _key(self, key: str) -> str:
        return self.namespace + key

    def _mine(self, key: str) -> bool:
        if self.namespace:
            return key.startswith(self.namespace)
        return not key.startswith(NAMESPACE_PREFIX)

    def _strip(self, keys: Iterable[str]) -> set[str]:
        return {key[len(self.namespace) :] for key in keys if self._mine(key)}

    def get(self, key: str) -> Any:
        return self.store.get(self._key(key))

    def put(self, key: str, state: Any) -> None:
        self.store.put(self._key(key), state)

    def contains(self, key: str) -> bool:
        return bool(self.store.contains(self._key(key)))

    def delete(self, key: str) -> bool:
        return bool(self.store.delete(self._key(key)))

    def delete_prefix(self, prefix: str) -> list[str]:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        if not self.namespace and prefix.startswith(NAMESPACE_PREFIX):
            return []  # not this view's keys
        return sorted(self._strip(self.store.delete_prefix(self._key(prefix))))

    def keys_with_prefix(self, prefix: str) -> set[str]:
        return self._strip(self.store.keys_with_prefix(self._key(prefix)))

    def sessions(self) -> list[Any]:
        listed = []
        for info in self.store.sessions():
            if self._mine(info.key):
                listed.append(replace(info, key=info.key[len(self.namespace) :]))
        return listed

    def read_counter(self, name: str) -> int:
        return int(self.store.read_counter(self._key(name)))

    def raise_counter(self, name: str, value: int) -> None:
        self.store.raise_counter(self._key(name), value)

    def wait_persisted(self, key: str | None = None, timeout: float | None = None) -> bool:
        return bool(self.store.wait_persisted(None if key is None else self._key(key), timeout))

    def acquire_turn(self, lock_name: str) -> Any:
        return self.store.acquire_turn(self._key(lock_name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)  # stats(), flush(), close(), ...: the whole cache's
