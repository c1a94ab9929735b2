"""Server-sent events: `data: <json>\\n\\n` per event, `data: [DONE]\\n\\n` last.

Streams serve many clients at once, so per-token work is kept to one `json.dumps` of the text:
`EventTemplate` serialises a chunk once with a placeholder and splices each delta in.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from runner.errors import error_payload

SSE_HEADERS: dict[str, str] = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"
_PLACEHOLDER = "\u0000albatross-slot\u0000"


def dumps(payload: Any) -> str:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def event_bytes(payload: Any) -> bytes:
    return ("data: " + dumps(payload) + "\n\n").encode()


def error_event(status_code: int, message: str, request_id: str | None = None) -> bytes:
    return event_bytes(error_payload(status_code, message, request_id=request_id))


class EventTemplate:
    """An event whose one varying string is spliced in: `render(text)` == `event_bytes(payload with
    slot() replaced by text)`, without serialising the rest of the payload again."""

    __slots__ = ("prefix", "suffix")

    @staticmethod
    def slot() -> str:
        return _PLACEHOLDER

    def __init__(self, payload: Any) -> None:
        rendered = "data: " + dumps(payload) + "\n\n"
        prefix, found, suffix = rendered.partition(dumps(_PLACEHOLDER))
        if not found or _PLACEHOLDER in suffix:
            raise ValueError("the payload must hold EventTemplate.slot() exactly once, as a string value")
        self.prefix = prefix.encode()
        self.suffix = suffix.encode()

    def render(self, text: str) -> bytes:
        return self.prefix + json.dumps(text, ensure_ascii=False).encode() + self.suffix


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
