"""A real read-only filesystem for storage-fault tests: a tmpfs mounted at a test's directory,
remounted read-only mid-test. Mounting needs root with CAP_SYS_ADMIN; without it the test is
skipped and says why (permission bits are no substitute: root, which CI may run as, ignores them)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int = 256) -> Iterator[Callable[[], None]]:
    """Mount a tmpfs at `path` for the block; yields `read_only()`, which remounts it read-only."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {r.stderr.strip()}")

    def read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)

    try:
        yield read_only
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
