"""State sessions (rwkv_lightning API, see docs/api.md): a conversation that continues a saved RWKV state
(`/state/chat/completions`), immutable dialogue nodes that can branch (`/multi_state/...`), and
listing / deleting saved states.

The engine loads `StateRef.load_key` into the slot and, only after a turn that completed (stop or
length), saves the final state under `save_key`; these routes choose the keys (a session and a
dialogue tree of the same name live in separate key spaces: runner.sessions), keep one turn in
flight per session on every replica sharing the store (its turn locks), and reply only once the
saved state is stored.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from runner.context import context
from runner.errors import ApiError, error_payload
from runner.interface import StateRef
from runner.native_batch import NativeSpec, run_native
from runner.native_schemas import StateChatRequest, StateDeleteRequest, StateStatusRequest
from runner.schemas import read_json_object, validate_body
from runner.sessions import (
    SessionBusy,
    SessionStateStore,
    StateName,
    TurnLease,
    dialogue_counter_name,
    names_of,
    next_dialogue_index,
    node_index,
    node_key,
    node_space,
    parse_state_key,
    session_key,
    session_store_of,
    session_turn_lock,
    tree_turn_lock,
)

router = APIRouter()

STATE_ID = "rwkv7-batch"
MULTI_STATE_ID = "rwkv7-multi-state"
PERSIST_TIMEOUT_S = 60.0
CACHE_LEVELS = {"L1": "L1 (VRAM)", "L2": "L2 (RAM)", "L3": "Database (Disk)"}


def _store(request: Request) -> SessionStateStore:
    backend = context(request).manager.require_backend()
    store = session_store_of(backend)
    if store is None or not backend.concurrent:
        raise ApiError(400, f"unsupported feature on this backend: state sessions need the albatross backend (loaded: {backend.backend_name})")
    return store


async def _reserve(store: SessionStateStore, lock_name: str, session_id: str) -> TurnLease:
    try:
        return await asyncio.to_thread(store.acquire_turn, lock_name)
    except SessionBusy:
        raise ApiError(409, f"session {session_id!r} already has a turn in flight; wait for it to finish", "session_id") from None


def _single_prompt(body: StateChatRequest) -> tuple[str, str]:
    if not body.session_id:
        raise ApiError(400, "missing session_id", "session_id")
    if len(body.contents) != 1:
        raise ApiError(400, f"a state turn takes exactly one prompt in contents (got {len(body.contents)})", "contents")
    return body.session_id, body.contents[0]


def continued_prompt(prompt: str) -> str:
    """A later turn starts on a new paragraph of the saved conversation."""
    return prompt if prompt.startswith("\n\n") else "\n\n" + prompt


async def _wait_on_disk(store: SessionStateStore, key: str, name: str) -> None:
    if not await asyncio.to_thread(store.wait_persisted, key, PERSIST_TIMEOUT_S):
        raise ApiError(500, f"the state of {name!r} was not stored within {PERSIST_TIMEOUT_S:.0f} s")


@router.post("/state/chat/completions")
async def state_chat(request: Request) -> Response:
    body = validate_body(StateChatRequest, await read_json_object(request), request.url.path)
    session_id, prompt = _single_prompt(body)
    store = _store(request)
    key = session_key(session_id)
    reservation = await _reserve(store, session_turn_lock(session_id), session_id)
    try:
        continuing = await asyncio.to_thread(store.contains, key)
    except BaseException:
        reservation.release()
        raise
    state = StateRef(load_key=key if continuing else None, save_key=key)

    async def saved() -> dict[str, Any] | None:
        await _wait_on_disk(store, key, session_id)
        await asyncio.to_thread(reservation.release)  # free before the reply: the next turn may follow at once
        return None

    spec = NativeSpec([continued_prompt(prompt) if continuing else prompt], body.sampling(), body.model, STATE_ID, body.stream, body.chunk_size, state=state)
    return await run_native(request, spec, after_success=saved, on_finish=reservation.release)


@router.post("/multi_state/chat/completions")
async def multi_state_chat(request: Request) -> Response:
    payload = await read_json_object(request)
    body = validate_body(StateChatRequest, payload, request.url.path)
    session_id, prompt = _single_prompt(body)
    if body.dialogue_idx is None:
        raise ApiError(400, "missing dialogue_idx (0 starts from the empty root)", "dialogue_idx")
    store = _store(request)
    # One turn per tree at a time, so node numbers follow each other without gaps.
    reservation = await _reserve(store, tree_turn_lock(session_id), session_id)
    try:
        parent = None if body.dialogue_idx == 0 else node_key(session_id, body.dialogue_idx)
        if parent is not None and not await asyncio.to_thread(store.contains, parent):
            raise ApiError(404, f"unknown dialogue node {StateName('dialogue_node', session_id, body.dialogue_idx).public!r}", "dialogue_idx")
        number = await asyncio.to_thread(next_dialogue_index, store, session_id)
    except BaseException:
        reservation.release()
        raise
    node = StateName("dialogue_node", session_id, number)

    async def saved() -> dict[str, Any]:
        await _wait_on_disk(store, node.key, node.public)
        await asyncio.to_thread(store.raise_counter, dialogue_counter_name(session_id), number)
        await asyncio.to_thread(reservation.release)  # free before the reply: the next turn may follow at once
        return {"dialogue_idx": number}

    def stream_event(fields: dict[str, Any]) -> dict[str, Any]:
        return {"object": "multi_state.dialogue_idx", "session_id": node.public, "dialogue_idx": fields["dialogue_idx"]}

    text = prompt if parent is None else continued_prompt(prompt)
    spec = NativeSpec([text], body.sampling(), body.model, MULTI_STATE_ID, body.stream, body.chunk_size, state=StateRef(load_key=parent, save_key=node.key))
    return await run_native(request, spec, after_success=saved, stream_trailer=stream_event, on_finish=reservation.release)


def _session_entry(name: StateName, tier: str, last_updated: float) -> dict[str, Any]:
    return {
        "session_id": name.public,
        "kind": name.kind,
        "cache_level": CACHE_LEVELS[tier],
        "last_updated": datetime.fromtimestamp(last_updated).strftime("%Y-%m-%d %H:%M:%S"),
        "timestamp": last_updated,
    }


@router.post("/state/status")
async def state_status(request: Request) -> Response:
    raw = await request.body()
    if raw.strip():
        validate_body(StateStatusRequest, await read_json_object(request), request.url.path)
    store = _store(request)
    entries = [(name, e) for e in await asyncio.to_thread(store.sessions) if (name := parse_state_key(e.key)) is not None]
    entries.sort(key=lambda pair: (pair[0].public, pair[0].kind))
    counts = {tier: sum(1 for _, e in entries if e.tier == tier) for tier in CACHE_LEVELS}
    return JSONResponse(
        {
            "status": "success",
            "total_sessions": len(entries),
            "l1_cache_count": counts["L1"],
            "l2_cache_count": counts["L2"],
            "database_count": counts["L3"],
            "sessions": [_session_entry(name, e.tier, e.last_updated) for name, e in entries],
        }
    )


@router.post("/state/delete")
async def state_delete(request: Request) -> Response:
    body = validate_body(StateDeleteRequest, await read_json_object(request), request.url.path)
    if not body.session_id:
        raise ApiError(400, "missing session_id", "session_id")
    store = _store(request)
    session_id = body.session_id

    def delete() -> list[str]:
        """The name's state session and the node it names, and with delete_prefix every node of
        the tree `session_id` (never those of a tree named `<session_id>:...`)."""
        keys = [name.key for name in names_of(session_id)]
        if body.delete_prefix:
            nodes = [key for key in store.keys_with_prefix(node_space(session_id)) if node_index(key, session_id) is not None]
            keys += sorted(nodes, key=lambda key: node_index(key, session_id) or 0)
        removed: list[str] = []
        for key in dict.fromkeys(keys):
            name = parse_state_key(key)
            if store.delete(key) and name is not None:
                removed.append(name.public)
        return removed

    removed = await asyncio.to_thread(delete)
    if not removed:
        # rwkv_lightning's clients read `status` and `message`; `error` is every other 4xx's shape.
        message = f"no saved state matches session {session_id!r}"
        return JSONResponse({"status": "not_found", "message": message, **error_payload(404, message, "session_id")}, status_code=404)
    return JSONResponse({"status": "success", "message": f"deleted {len(removed)} state(s) of session {session_id!r}", "deleted": removed})
