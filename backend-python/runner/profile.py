"""Route-level counters behind `GET /albatross/profile` (collected when ALBATROSS_PROFILE=1), under
RWKV-Runner's field names."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields


def profiling_requested(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get("ALBATROSS_PROFILE", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(slots=True)
class RouteProfile:
    enabled: bool = False
    requests: int = 0
    stream_requests: int = 0
    tokens: int = 0
    stream_chunks: int = 0
    bytes: int = 0
    completion_wait_ms: float = 0.0  # awaiting the backend's next event
    disconnect_check_ms: float = 0.0  # await request.is_disconnected()
    json_dump_ms: float = 0.0  # building and encoding chunks
    yield_resume_ms: float = 0.0  # from yielding a chunk until the stream generator runs again (the send)
    request_wall_ms: float = 0.0  # from a request's first backend call to its end, summed over requests

    def snapshot(self) -> dict[str, object]:
        data = asdict(self)
        for name, value in data.items():
            if isinstance(value, float):
                data[name] = round(value, 3)
        return data

    def reset(self) -> None:
        for item in fields(self):
            if item.name != "enabled":
                setattr(self, item.name, type(getattr(self, item.name))())
