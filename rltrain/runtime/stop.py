"""A job asked to stop (pre-emption, a time limit, `scancel --signal`): every rank stops at the
same point, after a checkpoint, and says so in a marker the launch script turns into a requeue.

A SIGTERM or SIGUSR1 only sets a flag on the rank that got it (a scheduler may signal some ranks
and not others, or the torchrun agent forwards it a little later); the loop asks `agreed()`, a
collective over the bridge, at two points of every step, so all ranks take the same decision:

    before a step's rollout   stop now: the last finished step is saved if it is not yet
    before a step's save      this step is saved, its weights are not synced, its row written

The marker `<run dir>/stopped.json` names the step and its checkpoint. `launch/slurm/
rltrain.sbatch` requeues the job when the marker belongs to it; any job started in the run
directory resumes from the checkpoint (`checkpoint.resume=auto`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rltrain.runtime.files import atomic_write_text

log = logging.getLogger("rltrain.stop")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
MARKER = "stopped.json"


class StopRequest:
    """This rank's flag, set by the stop signals once `install()` has run."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._logged = False

    def install(self) -> StopRequest:
        """Catch the stop signals (main thread only: Python runs signal handlers there)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signal is None:  # the first one counts; torchrun's agent may forward another
            self.signal = signal.Signals(signum).name

    def agreed(self, world: Any, where: str) -> str | None:
        """Collective: what asked any rank to stop (the same answer on every rank), or None."""
        asked = world.bridge.all_gather_object(self.signal, phase=f"stop check {where}")
        reason = next((a for a in asked if a is not None), None)
        if reason is not None and not self._logged:
            self._logged = True
            ranks = [r for r, a in enumerate(asked) if a is not None]
            log.warning("stop requested (%s on rank(s) %s): stopping %s", reason, ranks, where)
        return reason


def write_marker(run_dir: Path, step: int, checkpoint: Path | None, reason: str) -> Path:
    """What the launch script reads: the job that stopped, the step and its checkpoint."""
    path = run_dir / MARKER
    info = {
        "step": step,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "reason": reason,
        "job": os.environ.get("SLURM_JOB_ID"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    atomic_write_text(path, json.dumps(info) + "\n")
    return path


def clear_marker(run_dir: Path) -> None:
    """A run that starts is no longer stopped."""
    (run_dir / MARKER).unlink(missing_ok=True)
