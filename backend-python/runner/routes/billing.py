"""`GET /dashboard/billing/credit_grants`: OpenAI's old billing query, which some chat clients call
to show a balance. RWKV-Runner answers it with a fixed grant; so does this server."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()


@router.get("/dashboard/billing/credit_grants")
async def credit_grants() -> dict[str, object]:
    grant = {"object": "credit_grant", "grant_amount": 10000, "used_amount": 0, "effective_at": 1672531200, "expires_at": 33229440000}
    return {
        "object": "credit_summary",
        "total_granted": 10000,
        "total_used": 0,
        "total_available": 10000,
        "grants": {"object": "list", "data": [grant]},
    }
