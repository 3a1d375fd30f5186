"""A free TCP port on 127.0.0.1 for a server a test starts (Redis, moto, metrics, the fake GPU host)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; a server started right after binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
