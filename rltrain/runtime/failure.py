"""Where a rank failed, said when it fails and kept in the run directory for the next attempt.

`failing_in(rank, where)` (and the loop's PhaseClock, for a step's phases) logs `rank R failed in
WHERE: Error: message` the moment an error leaves a named part of the run, and names the error
with it (`name_failure`: the innermost part wins, a note on the exception says it under its
traceback). A rank whose job then ends on that error writes `<run dir>/failures/rank<R>.json`
(`record_failure`): where, when it was first seen, the error and its traceback.

The attempt torchrun starts after a failure reads them (`how_the_job_failed`: the earliest
error, and the ranks that recorded none): a restart with nothing left to run (every step
recorded, the failure came after the last one) ends with that error instead of succeeding over
it, and a restart refused for its history says it too. Rank 0 clears the records of earlier
jobs when a job starts, and those of the attempt before once a restart records a step
(`clear_failures`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from rltrain.runtime.bridge import restart_attempt
from rltrain.runtime.files import atomic_write_text

log = logging.getLogger("rltrain.failure")

FAILURES = "failures"  # <run dir>/failures/rank<R>.json
_WHERE = "_rltrain_failed_in"  # (where, time first seen), set on the exception


@dataclass(frozen=True)
class Failure:
    """One rank's error, as a failed attempt left it."""

    rank: int
    attempt: int
    where: str  # "phase sync of step 3", "the engine's shutdown at the end of the run, after step 3"
    error: str  # "RuntimeError: message"
    traceback: str
    time: float  # when it was first seen (time.time())

    def describe(self) -> str:
        seen = time.strftime("%H:%M:%S", time.localtime(self.time))
        return f"rank {self.rank} failed in {self.where} (attempt {self.attempt}, {seen}): {self.error}"


def name_failure(e: BaseException, rank: int, where: str) -> None:
    """Name `e` with where it happened and log it, unless a part inside already did."""
    if getattr(e, _WHERE, None) is not None:
        return
    message = f"rank {rank} failed in {where}: {type(e).__name__}: {e}"
    try:
        setattr(e, _WHERE, (where, time.time()))
        # What Python prints under the traceback (3.11: add_note; 3.10 keeps the list unprinted).
        e.__notes__ = [*getattr(e, "__notes__", []), message]
    except (AttributeError, TypeError):  # an exception type that takes no attributes
        pass
    log.error("%s", message)


def where_failed(e: BaseException) -> str | None:
    named = getattr(e, _WHERE, None)
    return named[0] if named is not None else None


@contextlib.contextmanager
def failing_in(rank: int, where: str) -> Iterator[None]:
    """Name (and log) an error leaving this part of the run; it goes on."""
    try:
        yield
    except BaseException as e:
        name_failure(e, rank, where)
        raise


def record_failure(run_dir: Path, rank: int, e: BaseException) -> Path | None:
    """Write this rank's error to `<run dir>/failures/rank<R>.json` (None if that failed too:
    said in the log, the error itself goes on)."""
    where, seen = getattr(e, _WHERE, None) or ("the job, outside its named parts", time.time())
    failure = Failure(
        rank,
        restart_attempt(),
        where,
        f"{type(e).__name__}: {e}",
        "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        seen,
    )
    path = run_dir / FAILURES / f"rank{rank}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(failure)) + "\n")
    except OSError as err:
        log.warning("rank %d: could not record its failure in %s: %s", rank, path, err)
        return None
    return path


def recorded_failures(run_dir: Path) -> list[Failure]:
    """The errors the newest failed attempt's ranks recorded, the earliest (the failure the
    others most likely followed from) first."""
    found = []
    for path in sorted((run_dir / FAILURES).glob("rank*.json")):
        try:
            found.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError) as err:
            log.warning("unreadable failure record %s: %s", path, err)
    newest = max((f.attempt for f in found), default=0)
    return sorted((f for f in found if f.attempt == newest), key=lambda f: f.time)


def how_the_job_failed(run_dir: Path, world_size: int) -> str:
    """What a restart says of the attempt before it: its first recorded error with the
    traceback, and the ranks that recorded none (killed by a signal, or crashed outside Python:
    theirs is often the failure the others' errors follow from)."""
    found = recorded_failures(run_dir)
    silent = sorted(set(range(world_size)) - {f.rank for f in found})
    said = []
    if silent:
        said.append(
            f"rank(s) {', '.join(map(str, silent))} recorded no error: killed (e.g. by the out-of-memory killer) "
            "or crashed outside Python; torchrun's report of the failed attempt, above, gives the exit code"
        )
    if found:
        first = found[0]
        said.append(
            f"the first error recorded{', perhaps a consequence' if silent else ''}: {first.describe()}\n"
            + first.traceback.rstrip()
        )
    return "; ".join(said)


def clear_failures(run_dir: Path) -> None:
    """Remove the records written before this process started (this job's own ranks may already
    have written theirs)."""
    started = psutil.Process().create_time()
    for path in (run_dir / FAILURES).glob("rank*.json"):
        try:
            stale = float(json.loads(path.read_text())["time"]) < started
        except (OSError, ValueError, TypeError, KeyError):
            stale = True  # unreadable: nothing to report from it
        if stale:
            path.unlink(missing_ok=True)
