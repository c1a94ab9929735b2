"""The seam between the engine and a state cache (sessions, dialogue nodes, prompt prefixes).

The worker only needs these three calls; `albatross_engine/state_cache/` implements them with
three tiers (device, host RAM, SQLite) keyed by the model's fingerprint. Tests use `DictStateStore`.
"""

from __future__ import annotations

import copy
import hashlib
import sys
import threading
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from runner import interface
from runner.interface import PREFIX_CACHE_KEY_PREFIX

if TYPE_CHECKING:
    from albatross.state import SlotState

PREFIX_BOUNDARY_TOKENS = 256  # prompts are checkpointed every this many tokens and at their end
PROMPT_HEAD_TOKENS = 16  # prompt ends are indexed by the prefix key of this many first tokens


@runtime_checkable
class StateStore(interface.StateStore, Protocol):
    """What a worker needs from a state cache: slot states by key."""

    def get(self, key: str) -> SlotState | None:
        """A copy of the state saved under `key` (the caller may write into it), or None."""
        ...

    def put(self, key: str, state: SlotState) -> None:
        """Keep a copy of `state`, taken before returning (on a GPU: queued on the current stream).
        `state` may be views of a running slot (`DeviceStep.live_state`) that the next step
        overwrites, so a copy read later, or on another stream, would see the wrong state."""
        ...


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian unsigned 32-bit integers: the bytes a prefix key hashes."""
    packed = array("I", token_ids)  # "I" is 4 bytes on every platform torch supports
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def prefix_key(token_ids: Sequence[int]) -> str:
    """`prefix:<sha256 of the ids as little-endian uint32>`: the key of the state after `token_ids`."""
    return PREFIX_CACHE_KEY_PREFIX + hashlib.sha256(token_bytes(token_ids)).hexdigest()


class PrefixHasher:
    """Hashes a prompt once, left to right, yielding the prefix key at any length reached so far.
    A `salt` (the id of the state the prompt starts from, when not zeros) is hashed first, so
    prompts fed from different starting states never share a key."""

    __slots__ = ("_hash", "_tokens", "_length", "head")

    def __init__(self, tokens: Sequence[int], salt: bytes = b"") -> None:
        self._hash = hashlib.sha256(salt)
        self._tokens = tokens
        self._length = 0
        self.head: str | None = None  # the key at PROMPT_HEAD_TOKENS, what PromptEndIndex groups by
        if len(tokens) >= PROMPT_HEAD_TOKENS:
            head = self._hash.copy()
            head.update(token_bytes(tokens[:PROMPT_HEAD_TOKENS]))
            self.head = PREFIX_CACHE_KEY_PREFIX + head.hexdigest()

    @property
    def length(self) -> int:
        return self._length

    def fork(self) -> PrefixHasher:
        """A hasher at this one's point that goes on independently (the head is not hashed again)."""
        other = copy.copy(self)
        other._hash = self._hash.copy()  # the one field the two must not share
        return other

    def key_at(self, length: int) -> str:
        if length < self._length or length > len(self._tokens):
            raise ValueError(f"prefix length {length} outside [{self._length}, {len(self._tokens)}]")
        self._hash.update(token_bytes(self._tokens[self._length : length]))
        self._length = length
        return PREFIX_CACHE_KEY_PREFIX + self._hash.copy().hexdigest()


class DictStateStore:
    """An unbounded in-memory store (tests, and a reference for the protocol's semantics)."""

    def __init__(self) -> None:
        self._states: dict[str, SlotState] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> SlotState | None:
        with self._lock:
            state = self._states.get(key)
        return None if state is None else _clone(state)

    def put(self, key: str, state: SlotState) -> None:
        clone = _clone(state)
        with self._lock:
            self._states[key] = clone

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._states

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._states)


def _clone(state: SlotState) -> SlotState:
    clone = getattr(state, "clone", None)
    if callable(clone):
        return clone()
    return copy.deepcopy(state)


class PromptEndIndex:
    """Lengths of prompts whose end state was saved, grouped by the prompt's head: the prefix key
    of its first `PROMPT_HEAD_TOKENS` tokens (None for shorter prompts), newest last, bounded in
    all. A prompt's end is rarely a multiple of the boundary, so lookups also try these lengths: a
    conversation's next prompt usually extends the previous one, and so starts with its head.
    Only ends under the prompt's own head (and the few short ones) are worth a store lookup: with
    one list for every prompt, each admission of a 960-prompt burst looked up ~28 unrelated ends,
    and a long prompt up to the whole capacity (docs/performance.md, "Session 27")."""

    def __init__(self, capacity: int = 4096) -> None:
        self._entries: dict[tuple[str | None, int], None] = {}  # in order of use, oldest first
        self._by_head: dict[str | None, set[int]] = {}
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, head: str | None, length: int) -> None:
        """`head`: the prompt's prefix key at `PROMPT_HEAD_TOKENS`, None when it is shorter."""
        if (head is None) != (length < PROMPT_HEAD_TOKENS):
            raise ValueError(f"a prompt end of {length} tokens is indexed {'without' if head is None else 'with'} a head")
        with self._lock:
            self._entries.pop((head, length), None)
            self._entries[(head, length)] = None
            self._by_head.setdefault(head, set()).add(length)
            while len(self._entries) > self._capacity:
                old_head, old_length = next(iter(self._entries))
                del self._entries[(old_head, old_length)]
                lengths = self._by_head[old_head]
                lengths.discard(old_length)
                if not lengths:
                    del self._by_head[old_head]

    def below(self, head: str | None, limit: int) -> list[int]:
        """Ends below `limit` of prompts that start like this one: those under `head` (the
        prompt's own, None when it is shorter than the head) and those shorter than a head."""
        with self._lock:
            short = [length for length in self._by_head.get(None, ()) if length < limit]
            same = [length for length in self._by_head.get(head, ()) if length < limit] if head is not None else []
        return short + same


def prefix_lookup_lengths(prompt_len: int, known_ends: list[int], boundary: int = PREFIX_BOUNDARY_TOKENS) -> list[int]:
    """Prefix lengths worth looking up for a prompt, longest first. A full-prompt hit is useless
    (the first sample needs the last prompt token's logits), so every length is below `prompt_len`."""
    lengths = set(range(boundary, prompt_len, boundary))
    lengths.update(length for length in known_ends if 0 < length < prompt_len)
    return sorted(lengths, reverse=True)
