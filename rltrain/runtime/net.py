"""Loopback ports for the servers and rendezvous a rank starts (engines, weight-update groups); the
open-file limit their connections need."""

from __future__ import annotations

import random
import resource
import socket
from pathlib import Path

# Ports picked from below the kernel's ephemeral range, this many of them at most.
SPAN = 12000


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller's server may still lose it to a race), drawn
    at random from below the kernel's ephemeral range: a port the kernel hands out (bind to 0) is
    one that every outgoing connection draws from too, and a rollout opens one per trajectory, so
    one of them could take it before the caller's server listens (EADDRINUSE; seen in CI, where
    the tests' HTTP clients run beside the rendezvous stores). Where the range cannot be read
    or nothing below it binds, the kernel's choice."""
    low = _ephemeral_low()
    if low is not None and low > 1024:
        draw = random.Random()  # (its own: a seeded global `random` would repeat ports across ranks)
        for _ in range(64):
            port = draw.randrange(max(1024, low - SPAN), low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), or None."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def allow_open_files(count: int) -> int:
    """Raise this process's soft limit on open files to at least `count` where the hard limit
    allows (a rollout's connections, one per trajectory in flight, and a server's, one per client
    connection); returns the soft limit now. Never lowers it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = count if hard == resource.RLIM_INFINITY else min(count, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft
