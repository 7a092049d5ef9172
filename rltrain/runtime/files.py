"""Files that appear whole or not at all: atomic writes, directory publication, fsync, digests.

Every durable artefact of a run — the resolved config, checkpoints, weight versions, the
metrics and evaluation rows a resumed run sets aside — is written beside its final name, its bytes (for a
directory every file in it) are fsynced, it is renamed into place, and the rename is made
durable by fsyncing the parent directory. A reader sees the old artefact or the new one,
never half of one; a writer that fails leaves the old one untouched.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import xxhash


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file under `root`, then every directory (the entries that name them)."""
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fsync_file(p)
    for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(d)


def atomic_write_text(path: Path, text: str) -> None:
    """`path` holds `text` afterwards, or (on any failure) what it held before."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def step_rows(path: Path) -> list[tuple[int, str]]:
    """(step, line) of every row of a jsonl file of steps (metrics.jsonl, eval.jsonl); a torn last
    line (a job that died while appending) is left out."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append((int(json.loads(line).get("step", 0)), line))
        except (ValueError, TypeError, AttributeError):
            continue
    return rows


def append_line(path: Path, line: str) -> None:
    """`line` appended to `path` and synced: a row written is a row kept."""
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def set_rows_aside(path: Path, aside: Path, keep: Callable[[int], bool]) -> int:
    """The rows of the jsonl file `path` whose step `keep` refuses, appended to `aside` (synced)
    before `path` is rewritten without them (atomically): each row is in one file or the other,
    never lost, never in both once done. How many moved."""
    if not path.is_file():
        return 0
    rows = step_rows(path)
    moved = [line for step, line in rows if not keep(step)]
    if moved:
        append_line(aside, "\n".join(moved))
        atomic_write_text(path, "".join(line + "\n" for step, line in rows if keep(step)))
    return len(moved)


def replace_dir(tmp: Path, target: Path) -> None:
    """Rename the finished directory `tmp` (its files already fsynced) to `target`, replacing
    what was there, and make the rename durable."""
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def map_file(path: Path) -> mmap.mmap | None:
    """A read-only memory map of a file's bytes (None for an empty file), its pages mapped in one
    call rather than one fault each (MAP_POPULATE: faults are dear in a VM)."""
    with open(path, "rb") as fh:
        if not os.fstat(fh.fileno()).st_size:
            return None
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fh.fileno(), 0, flags=flags, prot=mmap.PROT_READ)


def file_digest(path: Path, bits: int = 64) -> str:
    """xxh3 (64 or 128 bits) of a file's bytes, hashed from a memory map (no copy into Python
    buffers). Weight versions record 64-bit digests, checkpoints 128-bit ones."""
    h = {64: xxhash.xxh3_64, 128: xxhash.xxh3_128}[bits]()
    m = map_file(path)
    if m is not None:
        with m:
            h.update(m)
    return h.hexdigest()


def make_readable(directory: Path) -> None:
    """Let every user read `directory` and its files (a temporary directory is made 0700 and
    temporary files 0600): what is published there is read by engines that may run as others."""
    directory.chmod(0o755)
    for f in directory.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)


def process_tempdir(prefix: str) -> Path:
    """A new temporary directory named for this process (`<prefix><pid>-*`), after removing those
    of processes that are gone (killed before they could remove their own)."""
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob(f"{prefix}*"):
        pid = old.name.removeprefix(prefix).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
