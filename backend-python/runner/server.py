"""The uvicorn server for an app and its settings: one place for how the HTTP layer is configured
(main.py serves with it; tests serve with it too)."""

from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI

from runner.drain import ENDING_GRACE_S
from runner.read_timeout import header_deadline_protocol
from runner.settings import ServerSettings


def uvicorn_config(app: FastAPI, settings: ServerSettings) -> uvicorn.Config:
    timeout = settings.request_read_timeout
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=header_deadline_protocol(timeout) if timeout > 0 else "auto",
        # After the drain every request has ended: uvicorn's own wait for connections is only a backstop.
        timeout_graceful_shutdown=int(ENDING_GRACE_S),
        access_log=False,  # runner.request_log writes one line per finished request instead
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so a busy port is reported at once rather
    than after a load of minutes. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock
