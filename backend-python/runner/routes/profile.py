"""Route-level profile counters (ALBATROSS_PROFILE=1)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from runner.context import context

router = APIRouter()


@router.get("/albatross/profile")
async def read_profile(request: Request, reset: bool = False) -> dict[str, object]:
    profile = context(request).profile
    if not profile.enabled:
        return {"enabled": False}
    snapshot = profile.snapshot()
    if reset:
        profile.reset()
    return snapshot


@router.post("/albatross/profile/reset")
async def reset_profile(request: Request) -> dict[str, object]:
    profile = context(request).profile
    profile.reset()
    return {"enabled": profile.enabled, "reset": True}
