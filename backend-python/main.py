"""Start the server: `python backend-python/main.py --help` lists the flags, their defaults and env twins."""

from __future__ import annotations

import os
import sys

from runner.app import create_app, startup_model_problem
from runner.context import app_context
from runner.drain import DrainingServer
from runner.request_log import configure_logging
from runner.server import listening_socket, uvicorn_config
from runner.settings import settings_from_args


def main(argv: list[str] | None = None) -> None:
    settings = settings_from_args(argv)
    configure_logging(settings.log_level, settings.log_format)
    os.environ.setdefault("RWKV_V7_ON", "1")  # the official rwkv package reads this at import time
    app = create_app(settings)
    # What can be known before anything loads is checked first, each failure one line.
    problem = startup_model_problem(app_context(app))
    if problem is not None:
        sys.exit(f"error: {problem}")
    try:
        sock = listening_socket(settings.host, settings.port)
    except OSError as exc:
        sys.exit(f"error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc} (is another server running there? see --port)")
    server = DrainingServer(uvicorn_config(app, settings), app)

    def request_exit() -> None:
        server.should_exit = True

    app_context(app).request_exit = request_exit
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(1)  # startup failed (e.g. --model-path could not be loaded)


if __name__ == "__main__":
    main()
