"""`GET /`: the built web GUI (frontend/dist) with --webui, else the runner's liveness answer."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from runner.settings import ServerSettings

log = logging.getLogger("runner.routes.static")


def webui_ready(settings: ServerSettings) -> bool:
    return (settings.webui_dir / "index.html").is_file()


def install(app: FastAPI, settings: ServerSettings) -> None:
    if settings.webui and webui_ready(settings):
        app.mount("/", StaticFiles(directory=settings.webui_dir, html=True), name="webui")
        return
    if settings.webui:
        log.warning("--webui: %s has no index.html (build it with `make frontend`); serving the API only", settings.webui_dir)

    async def root() -> dict[str, str]:
        return {"Hello": "World!"}

    app.add_api_route("/", root, methods=["GET"], include_in_schema=False)
