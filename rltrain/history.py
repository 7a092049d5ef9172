"""What a run directory already holds, and where a job started in it begins.

A job continues the run it finds: `checkpoint.resume=auto` takes the newest checkpoint that
verifies and whose step the metrics recorded, and the metrics rows after it (their steps run
again) are moved to `metrics.dropped.jsonl`, never deleted. A job that would start at step 1
where there is history — metrics rows, or checkpoints it cannot use — refuses and says what to
set: torchrun's restarts, a requeue or a resubmission must never silently begin a run again.
`run.start_over=true` begins again on purpose; the old metrics and checkpoints are kept beside
theirs, renamed `*.before-<time>`. Pruning never removes the newest checkpoint of a recorded
step (rltrain/checkpoint.py), so once one is recorded every restart finds one to continue from.

A job whose every step is recorded has nothing to run, checkpoint or not (`Finished`). If it is
a torchrun restart, the attempt before it failed after its last step (at the end of the run):
it ends with that attempt's first error (`PreviousAttemptFailed`, from runtime/failure.py's
records), never with success over it or a refusal that hides it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from rltrain.checkpoint import candidates, find_resumable
from rltrain.config import Config
from rltrain.metrics import DROPPED, last_recorded_step
from rltrain.runtime.bridge import restart_attempt
from rltrain.runtime.failure import how_the_job_failed

log = logging.getLogger("rltrain.history")


class HistoryError(RuntimeError):
    """Starting here would throw a run's history away."""


class PreviousAttemptFailed(RuntimeError):
    """A torchrun restart found every step recorded: the attempt before it failed after its last
    step. The message is that attempt's first error; `status` the exit status it ends with."""

    status = 1  # a rank's exit status when an error ends it


@dataclass(frozen=True)
class Finished:
    """Every step this job runs is recorded (`step`: the last recorded one): nothing to run."""

    step: int


def last_step(cfg: Config) -> int:
    """The step this job ends after: loop.steps, or loop.stop_after where it is set and earlier."""
    return min(cfg.loop.steps, cfg.loop.stop_after) if cfg.loop.stop_after else cfg.loop.steps


def nothing_to_run(cfg: Config, done: int, world_size: int) -> None:
    """Say so; a restart raises how the attempt before it failed (every rank: the same exit)."""
    log.info("nothing to run: step %d of %d is done (run.start_over=true runs again)", done, last_step(cfg))
    if restart_attempt() == 0:
        return
    raise PreviousAttemptFailed(
        f"restart {restart_attempt()} of this job has nothing left to run, but the job failed after step "
        f"{done} was recorded: {how_the_job_failed(cfg.run_dir, world_size)}"
    )


@dataclass
class History:
    metrics: Path
    recorded: int  # the last step with a metrics row (0: none)
    checkpoints: list[Path]  # every step_* directory, complete or not
    resumable: Path | None  # what checkpoint.resume=auto continues from

    @classmethod
    def read(cls, cfg: Config, checkpoint_root: Path) -> History:
        metrics = cfg.run_dir / "metrics.jsonl"
        recorded = last_recorded_step(metrics)  # None: no metrics file
        found = candidates(checkpoint_root) if checkpoint_root.is_dir() else []
        resumable = None
        if found and cfg.checkpoint.resume == "auto":
            # A checkpoint is saved mid-step, its metrics row written at the step's end: a job
            # that died in between left a checkpoint of an unrecorded step, which runs again.
            resumable = find_resumable(checkpoint_root, recorded)
        return cls(metrics, recorded or 0, list(found), resumable)

    @property
    def empty(self) -> bool:
        return self.recorded == 0 and not self.checkpoints


def begin(cfg: Config, checkpoint_root: Path) -> Path | Finished | None:
    """Rank 0, before anything starts: the checkpoint to continue from (None: step 1; Finished:
    every step recorded, no checkpoint needed), after refusing a start that would lose history
    or moving the old run aside (run.start_over)."""
    history = History.read(cfg, checkpoint_root)
    if history.empty:
        return None
    if cfg.run.start_over:
        _move_aside(history, checkpoint_root)
        return None
    if cfg.checkpoint.resume not in ("auto", "none"):
        return None  # a named checkpoint: the user chose where the run continues
    if history.resumable is not None:
        return history.resumable
    if cfg.checkpoint.resume == "auto" and history.recorded >= last_step(cfg):
        return Finished(history.recorded)
    what = []
    if history.recorded:
        what.append(f"{history.metrics} records steps up to {history.recorded}")
    if history.checkpoints:
        what.append(
            f"{checkpoint_root} has {len(history.checkpoints)} checkpoint(s)"
            + (" but none this job can use (see the warnings above)" if cfg.checkpoint.resume == "auto" else "")
        )
    why = (
        "checkpoint.resume=none"
        if cfg.checkpoint.resume == "none"
        else f"no verified checkpoint of a recorded step (checkpoint.interval={cfg.checkpoint.interval})"
    )
    raise HistoryError(
        f"{' and '.join(what)}, and this job would start again at step 1 ({why}), throwing that "
        f"history away. To continue it, set checkpoint.resume=<a step_* directory>; to begin again "
        f"and keep the old files beside (renamed *.before-<time>), set run.start_over=true; or choose "
        f"another run.dir / run.name. Set checkpoint.interval so that restarts can continue a run."
    )


def _move_aside(history: History, checkpoint_root: Path) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in (history.metrics, history.metrics.with_name(DROPPED), checkpoint_root):
        if path.exists():
            old = path.with_name(f"{path.name}.before-{stamp}")
            path.rename(old)
            log.warning("run.start_over=true: %s moved to %s", path, old)
