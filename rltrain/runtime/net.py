"""Loopback ports for the servers and rendezvous a rank starts (engines, weight-update groups); the
open-file limit their connections need."""

from __future__ import annotations

import resource
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller's server may still lose it to a race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
