"""Loopback ports for the servers the tests start (uvicorn, redis-server, nginx, Ray Serve)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free loopback port below the ephemeral range. A port the OS hands out for `bind(0)` comes
    from that range, where any process's next outgoing connection or listener may take it before
    the server under test binds it (seen in CI: Ray's proxy failed to bind such a port while Ray's
    own processes were opening sockets). Below the range (and above Ray's worker ports) only an
    explicit bind can take it."""
    low, _ = _ephemeral_range()
    below = range(20000, low)  # Ray's workers take 10002-19999
    for port in random.sample(below, min(200, len(below))):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # no room below the range: the OS's choice
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
