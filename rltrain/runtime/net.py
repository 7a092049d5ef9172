"""Loopback ports for the servers and rendezvous a rank starts (engines, weight-update groups)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller's server may still lose it to a race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
