"""Start the server: `python backend-python/main.py --help` lists the flags and their env twins."""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

from runner.app import create_app
from runner.context import app_context
from runner.drain import ENDING_GRACE_S, DrainingServer
from runner.settings import settings_from_args


def main(argv: list[str] | None = None) -> None:
    settings = settings_from_args(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RWKV_V7_ON", "1")  # the official rwkv package reads this at import time
    app = create_app(settings)
    # After the drain every request has ended: uvicorn's own wait for connections is only a backstop.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level, timeout_graceful_shutdown=int(ENDING_GRACE_S))
    server = DrainingServer(config, app)

    def request_exit() -> None:
        server.should_exit = True

    app_context(app).request_exit = request_exit
    server.run()
    if not server.started:
        sys.exit(1)  # startup failed (e.g. --model-path could not be loaded)


if __name__ == "__main__":
    main()
